"""The arbiter's record of apps, jobs and their leases: pure bookkeeping, no I/O, no policy.

Every decision of who gets GPUs is the auction's (``shared/arbiter``); this records what was
submitted, what each lease holder reports, and how much GPU time each job has held (the time a
lease was held, times its GPUs; a GPU packed with another job, issue #18, is split between the
two by their shares: ``charged_gpus``), and says what the auction needs to know (``app_reports``). It is
a plain dict for the shell to persist (``to_dict`` / ``from_dict``), so a restarted arbiter loses
no job.

What the auction is told of a job's work (``app_reports``): what the job reports through the
job-side API once it has timed its steps; the total it reports, else the one its submitter
declared (``--iterations``, as Themis's apps declare their jobs); before its steps are timed it is
reported as one "iteration" per second it has run, and the core's crude estimates
(``ArbiterConfig.unknown_*``) stand in for what is unknown.
"""

from __future__ import annotations

import itertools
import shlex
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.arbiter import AppReport, JobReport
from shared.arbiter.lease import renews_a_start
from shared.messages import id_problem

QUEUED, RUNNING, FINISHED, FAILED, CANCELLED = "queued", "running", "finished", "failed", "cancelled"
#: progress states of a run that has reached a step boundary (before: "starting", or no report)
STEPPING_STATES = ("running", "paused", "stopped", "finished")
ENDED = (FINISHED, FAILED, CANCELLED)
DEFAULT_APP = "default"


class RegistryError(ValueError):
    """A request the registry refuses (unknown job, bad sizes); ``str`` says why."""


@dataclass
class JobRecord:
    job_id: str
    app_id: str
    name: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    gpus: int
    max_gpus: int
    submitted_at: float
    declared_iterations: int | None = None
    state: str = QUEUED
    iterations_done: int = 0
    iterations_total: int | None = None
    seconds_per_iteration: float | None = None
    uses_api: bool = False
    run_seconds: float = 0.0  # process time on leases, over all runs
    gpu_seconds: float = 0.0  # GPUs x seconds leased, over all leases (a packed GPU: its share)
    runs: int = 0
    host: str | None = None
    device_ids: list[int] = field(default_factory=list)
    pid: int | None = None
    lease_granted_at: float | None = None
    lease_expires_at: float | None = None
    accounted_at: float | None = None
    ended_at: float | None = None
    returncode: int | None = None
    leases_held: int = 0
    last_host: str | None = None  # where its output log is
    suspended: bool = False  # a cell revoked its lease: not charged, and its lease clock stopped
    stepped: bool = False  # this run has reached a step boundary (its host's reports say so)
    starts_lost: int = 0  # leases in a row that ended before their run reached a step boundary
    # packed on a GPU with another job (issue #18): its host's report (with whom, share, GPUs)
    packing: dict[str, Any] | None = None

    @property
    def leased(self) -> bool:
        return self.host is not None

    def describe(self) -> dict[str, Any]:
        """What ``tandem job show`` / ``list --json`` print (the environment left out)."""
        out = asdict(self)
        out.pop("env")
        out["command"] = shlex.join(self.argv)
        return out


def command_name(argv: list[str]) -> str:
    """A job's default name: its script (``python train.py --lr 0.1`` -> train.py), its module
    (``python -m pkg.train`` -> pkg.train), else its program; never a trailing argument's value."""
    script = next((a for a in argv[1:] if a.endswith((".py", ".sh", ".ipynb"))), None)
    if script is not None:
        return script.rsplit("/", 1)[-1]
    if "-m" in argv[1:-1]:
        return argv[argv.index("-m", 1) + 1]
    return argv[0].rsplit("/", 1)[-1]


def _share(record: JobRecord) -> float:
    """The share of its GPUs a job runs at (its host's report; 100 unless packed and squeezed)."""
    share = (record.packing or {}).get("share")
    return float(share) if isinstance(share, int | float) and share > 0 else 100.0


class Registry:
    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self._ids = itertools.count(1)

    # ---- requests -------------------------------------------------------------------------------

    def submit(self, body: dict[str, Any], now: float, largest_host_gpus: int | None = None) -> JobRecord:
        """``largest_host_gpus``: the most GPUs any host of the cluster has reported (None: none
        reported yet). A job is one process on one host, so one that needs more would wait
        forever in the queue: it is refused at once instead."""
        argv = [str(a) for a in body["argv"]]
        if not argv:
            raise RegistryError("nothing to run: give the command after `--`, e.g. -- python train.py")
        app_id = str(body.get("app") or DEFAULT_APP)
        if (problem := id_problem("app", app_id)) is not None:
            raise RegistryError(problem)
        gpus = int(body.get("gpus", 1))
        max_gpus = int(body.get("max_gpus", gpus))
        if gpus < 1:
            raise RegistryError(f"--gpus must be at least 1, got {gpus}")
        if max_gpus < gpus:
            raise RegistryError(f"--max-gpus ({max_gpus}) must be at least --gpus ({gpus})")
        if largest_host_gpus is not None and gpus > largest_host_gpus:
            raise RegistryError(
                f"--gpus {gpus} can never be granted: a job runs as one process on one host, and "
                f"the largest host of this cluster has {largest_host_gpus} GPUs"
            )
        job_id = f"{app_id}.{next(self._ids)}"
        while job_id in self.jobs:
            job_id = f"{app_id}.{next(self._ids)}"
        declared = body.get("iterations")
        if declared is not None and int(declared) < 1:
            raise RegistryError(f"--iterations must be at least 1, got {declared}")
        name = str(body.get("name") or command_name(argv))
        record = JobRecord(
            job_id, app_id, name, argv, str(body["cwd"]), dict(body["env"]), gpus, max_gpus, now,
            declared_iterations=None if declared is None else int(declared),
        )  # fmt: skip
        self.jobs[job_id] = record
        return record

    def get(self, job_id: str) -> JobRecord:
        record = self.jobs.get(job_id)
        if record is None:
            known = ", ".join(sorted(self.jobs)[-5:]) or "none"
            raise RegistryError(f"no job {job_id!r} (recent jobs: {known}; see `tandem job list`)")
        return record

    def cancel(self, job_id: str, now: float) -> JobRecord:
        """The job ends for good; the caller ends its lease (if ``host`` was set before)."""
        record = self.get(job_id)
        if record.state in ENDED:
            raise RegistryError(f"job {job_id} has already ended ({record.state})")
        self._close_lease(record, now)
        record.state, record.ended_at = CANCELLED, now
        return record

    # ---- leases ---------------------------------------------------------------------------------

    def lease_started(
        self, job_id: str, *, host: str, device_ids: list[int], pid: int | None, now: float, expires_at: float
    ) -> None:
        record = self.get(job_id)
        self._close_lease(record, now)  # a resize: the GPU time of the old size is counted
        record.state, record.host, record.device_ids, record.pid = RUNNING, host, list(device_ids), pid
        record.last_host = host
        record.lease_granted_at, record.lease_expires_at, record.accounted_at = now, expires_at, now
        record.stepped = False
        record.runs += 1
        record.leases_held += 1

    def lease_renewed(self, job_id: str, *, now: float, expires_at: float) -> None:
        record = self.get(job_id)
        self.account(now)
        record.lease_expires_at = expires_at
        record.leases_held += 1

    def lease_ended(self, job_id: str, now: float) -> None:
        """The lease is over and its GPUs free; the job waits for the next (unless it ended)."""
        record = self.get(job_id)
        self._close_lease(record, now)
        if record.state == RUNNING:
            record.state = QUEUED

    def _close_lease(self, record: JobRecord, now: float) -> None:
        self.account(now)  # its partner on a packed GPU is charged at the shared rate up to now
        record.packing = None
        if record.host is None:
            return
        record.starts_lost = 0 if record.stepped else record.starts_lost + 1
        record.host, record.device_ids, record.pid = None, [], None
        record.lease_granted_at = record.lease_expires_at = record.accounted_at = None
        record.suspended = False

    def account(self, now: float) -> None:
        """GPU time of every lease held, up to ``now``, at the rates of the leases as they are."""
        charged = self.charged_gpus()
        for record in self.jobs.values():
            self._account(record, now, charged.get(record.job_id, 0.0))

    def charged_gpus(self) -> dict[str, float]:
        """The GPUs each leased job is charged for now: each GPU it holds alone counts whole; a GPU
        two jobs are packed on (issue #18) is split between them in proportion to their shares
        (J_max at 100% beside a guest squeezed to 60%: 0.625 and 0.375; free competition, both at
        100%: half each), so the GPU's time is charged once, not to each job in full. A job whose
        lease a cell suspended is charged nothing, and leaves its GPU to its partner."""
        weights: dict[str, float] = {}
        occupants: dict[tuple[str, int], list[str]] = {}
        for record in self.jobs.values():
            if record.host is None or record.suspended:
                continue
            weights[record.job_id] = _share(record)
            for device in record.device_ids:
                occupants.setdefault((record.host, device), []).append(record.job_id)
        charged = dict.fromkeys(weights, 0.0)
        for jobs in occupants.values():
            total = sum(weights[j] for j in jobs)
            for job_id in jobs:
                charged[job_id] += weights[job_id] / total
        return charged

    @staticmethod
    def _account(record: JobRecord, now: float, gpus: float) -> None:
        if record.accounted_at is None or now <= record.accounted_at:
            return
        seconds = now - record.accounted_at
        if record.suspended:  # a cell holds its GPUs: the lease clock stops (as on the host)
            if record.lease_expires_at is not None:
                record.lease_expires_at += seconds
            record.accounted_at = now
            return
        record.gpu_seconds += seconds * gpus
        record.run_seconds += seconds
        record.accounted_at = now

    def expired(self, now: float) -> list[JobRecord]:
        return [r for r in self.jobs.values() if r.lease_expires_at is not None and r.lease_expires_at <= now]

    @staticmethod
    def still_starting(record: JobRecord, now: float, allowance_s: float) -> bool:
        """Whether ``record``'s expired lease is renewed, not auctioned: a run leased alone on its
        GPUs (not suspended by a cell, not packed), as ``shared.arbiter.lease.renews_a_start``
        decides."""
        return (
            record.host is not None
            and not record.suspended
            and record.packing is None
            and record.lease_granted_at is not None
            and renews_a_start(
                stepped=record.stepped,
                starts_lost=record.starts_lost,
                run_age_s=now - record.lease_granted_at,
                allowance_s=allowance_s,
            )
        )

    def leased(self) -> list[JobRecord]:
        return [r for r in self.jobs.values() if r.host is not None]

    # ---- what hosts report ----------------------------------------------------------------------

    def on_report(self, report: dict[str, Any], now: float) -> list[str]:
        """A host's ``agent.report``: progress of its jobs, and runs that ended (acknowledged by
        the returned ids). A job leased there but absent from the report lost its run."""
        host = str(report["host_id"])
        self.account(now)  # charged up to now at the old rates (shares, suspensions)
        seen: set[str] = set()
        ended: list[str] = []
        for entry in report["jobs"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("job_id"), str):
                continue
            job_id = entry["job_id"]
            seen.add(job_id)
            record = self.jobs.get(job_id)
            if record is None:
                ended.append(job_id)  # not ours (any more): let the host forget it
                continue
            progress = entry.get("progress") or {}
            self._progress(record, progress)
            if record.host == host:
                if entry.get("pid") == record.pid and progress.get("state") in STEPPING_STATES:
                    record.stepped = True  # this run's own report (not an earlier process's)
                packing = entry.get("packing")
                record.packing = packing if isinstance(packing, dict) else None
                record.suspended = bool(entry.get("suspended"))
            if not entry.get("running"):
                ended.append(job_id)
                self.run_ended(host, entry, now)
        for record in self.leased():
            granted = record.lease_granted_at or now
            if (
                record.host == host
                and record.job_id not in seen
                and granted < float(report.get("at", now)) - 1.0
            ):
                self.lease_ended(record.job_id, now)
        return ended

    def run_ended(self, host: str, entry: dict[str, Any], now: float) -> None:
        """A run of a job on ``host`` is over (its report entry says how): finished and failed
        jobs end, a stopped one waits for its next lease."""
        record = self.jobs.get(str(entry.get("job_id")))
        if record is None:
            return
        self._progress(record, entry.get("progress") or {})
        if record.host == host:
            self._close_lease(record, now)
        if record.state in ENDED or record.host is not None:  # over, or already running elsewhere
            return
        record.returncode = entry.get("returncode")
        outcome = entry.get("outcome")
        if outcome in (FINISHED, FAILED):
            record.state, record.ended_at = outcome, now
        else:
            record.state = QUEUED

    def _progress(self, record: JobRecord, progress: dict[str, Any]) -> None:
        done = progress.get("iterations_done")
        if not isinstance(done, int):
            return
        record.uses_api = True
        record.iterations_done = done
        total = progress.get("iterations_total")
        record.iterations_total = total if isinstance(total, int) else None
        spi = progress.get("seconds_per_iteration")
        if isinstance(spi, int | float) and spi > 0:
            record.seconds_per_iteration = float(spi)

    # ---- what the auction needs -----------------------------------------------------------------

    def active(self) -> list[JobRecord]:
        """Jobs that want GPUs: waiting or running."""
        return [r for r in self.jobs.values() if r.state in (QUEUED, RUNNING)]

    def app_reports(self, now: float, *, releasing: set[str]) -> list[AppReport]:
        """The auction's input: every app with a job that wants GPUs. A job in ``releasing``
        (its lease expired this round) holds nothing: its GPUs are in the offer."""
        apps: dict[str, list[JobRecord]] = {}
        for record in self.jobs.values():
            apps.setdefault(record.app_id, []).append(record)
        reports = []
        for app_id, records in sorted(apps.items()):
            live = [r for r in records if r.state in (QUEUED, RUNNING)]
            if not live:
                continue
            measured = [r.seconds_per_iteration for r in records if r.uses_api and r.seconds_per_iteration]
            spi_guess = statistics.median(measured) if measured else 1.0
            jobs = [
                self._job_report(
                    r, gpus=0 if r.job_id in releasing else len(r.device_ids), spi_guess=spi_guess
                )
                for r in live
            ]
            reports.append(
                AppReport(
                    app_id=app_id,
                    submitted_at=min(r.submitted_at for r in records),
                    jobs=jobs,
                    demand_max_gpus=sum(r.max_gpus for r in records),
                    gpu_seconds_used=sum(r.gpu_seconds for r in records),
                    gpus_releasing=sum(len(r.device_ids) for r in live if r.job_id in releasing),
                )
            )
        return reports

    @staticmethod
    def _job_report(r: JobRecord, *, gpus: int, spi_guess: float = 1.0) -> JobReport:
        """A job that has timed its steps reports iterations; one that has not (no API, or still
        starting: importing its libraries) reports the seconds it ran as iterations of
        ``spi_guess``: its app's median measured iteration time, which the core also assumes
        for it, else 1 s (``ArbiterConfig.unknown_seconds_per_iteration``), so that the app that
        ran longer is seen to have done more."""
        total = r.iterations_total if r.uses_api and r.iterations_total else r.declared_iterations
        if r.uses_api and r.seconds_per_iteration is not None:
            done, spi = r.iterations_done, r.seconds_per_iteration
        else:
            done, spi = int(r.run_seconds / spi_guess), None
            if total is not None:
                done = min(done, total)
        return JobReport(
            job_id=r.job_id,
            app_id=r.app_id,
            gpus=gpus,
            max_gpus=r.max_gpus,
            min_gpus=r.gpus,  # --gpus N is a lower bound
            host=r.host if gpus else None,
            iterations_done=done,
            iterations_total=total,
            seconds_per_iteration=spi,
        )

    def apps(self) -> dict[str, dict[str, Any]]:
        """Per app: GPU time held, GPUs held now, jobs by state."""
        out: dict[str, dict[str, Any]] = {}
        charged = self.charged_gpus()
        for record in self.jobs.values():
            app = out.setdefault(record.app_id, {"gpu_seconds": 0.0, "gpus_now": 0.0, "jobs": {}})
            app["gpu_seconds"] += record.gpu_seconds
            app["gpus_now"] = round(app["gpus_now"] + charged.get(record.job_id, 0.0), 3)
            app["jobs"][record.state] = app["jobs"].get(record.state, 0) + 1
        return out

    def start_iteration(self, record: JobRecord) -> int:
        """Where a new run of the job resumes (what it reported through the API)."""
        return record.iterations_done if record.uses_api else 0

    # ---- persistence ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"jobs": [asdict(r) for r in self.jobs.values()]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Registry:
        """A restarted arbiter: leases it knew of are kept (their hosts report them or not)."""
        registry = cls()
        for item in raw.get("jobs", []):
            record = JobRecord(**item)
            registry.jobs[record.job_id] = record
        numbers = [int(j.rsplit(".", 1)[-1]) for j in registry.jobs if j.rsplit(".", 1)[-1].isdigit()]
        registry._ids = itertools.count(max(numbers, default=0) + 1)
        return registry
