"""The arbiter's asyncio shell: best-effort jobs on the GPUs no cell holds (issue #16).

Hosts (their local schedulers, Themis's agents) connect with their host keys and report every
``arbiter.report_interval_s``: their idle GPUs, and their jobs' progress. The operator (CLI)
submits, lists and cancels jobs. Every ``arbiter.round_s`` a round runs: leases that expired give
their GPUs back to the offer, the pure core (``shared.arbiter``) auctions the offer, and the shell
carries out its leases: a lease for a job that keeps as many GPUs on the same host is a renewal
(the job runs on), so is the lease of a job that lost a start while its run has not reached
its first step boundary (``shared.arbiter.lease.renews_a_start``, for at most
``arbiter.startup_allowance_s``), every other expired
lease is ended (the job stops at a step boundary) before the new ones are granted (the host
starts the job). The shell decides nothing itself: before
that, equal leases are only traded between jobs so that each stays on the host its process is on
(``shared/arbiter/affinity.py``, pure; no count or layout changes).

The job registry is a JSON file (0600) under ``<state_dir>/arbiter``, written after each change
of a job and after each round: a restarted arbiter knows every job and lease it had.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Sequence
from typing import Any

import structlog

from services.arbiter.metrics import arbiter_exporter
from services.arbiter.registry import JobRecord, Registry, RegistryError
from services.arbiter.usage import UsageMeter
from shared import messages
from shared.arbiter import ArbiterConfig, CapacityMeter, GpuSlot, Lease
from shared.arbiter.affinity import keep_jobs_in_place
from shared.arbiter.baselines import make_policy
from shared.arbiter.slots import host_counts
from shared.config import Config
from shared.envelope import Envelope
from shared.private_files import replace_private
from shared.rpc import ClusterServerShell, OutboundRequests, RpcError, RpcTimeout
from shared.runner import cancel_and_wait
from shared.security import curve
from shared.security.authorization import arbiter_refusal, host_identity_refusal
from shared.snapshot_metrics import SnapshotExporter

log = structlog.get_logger("arbiter")

LEASE_EVENTS_KEPT = 1000
REQUEST_SLACK_S = 10.0  # beyond a job's stop grace, for a host's answer to lease.end/grant


class ArbiterService(ClusterServerShell):
    server_key = curve.ARBITER

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        section = cfg["arbiter"]
        self.round_s = float(section["round_s"])
        self.stop_grace_s = float(section["stop_grace_s"])
        self.startup_allowance_s = float(section["startup_allowance_s"])
        self.core = make_policy(
            str(section["policy"]),
            ArbiterConfig(
                fairness_knob=float(section["fairness_knob"]),
                lease_s=float(section["lease_s"]),
                leftovers_to_bidders=bool(section["leftovers_to_bidders"]),
                seed=int(section["seed"]),
                single_host_jobs=True,  # a live job is one process: its GPUs on one host
            ),
        )
        report_s = float(section["report_interval_s"])
        self.usage = UsageMeter(stale_s=max(3 * report_s, 3.0))
        self.capacity = CapacityMeter()  # T_id's R, fed at each auction
        self._path = cfg.state_dir() / "arbiter" / "registry.json"
        self.registry = self._load()
        self.rho: dict[str, float] = {}
        self.rounds = 0
        self.last_round: dict[str, Any] = {}
        self.lease_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=LEASE_EVENTS_KEPT)
        self._listen(cfg.keys_dir(), self._handle, name="arbiter", authorize=self._authorize, mandatory=True)
        self._outbound = OutboundRequests(self._server)
        self._exporter: SnapshotExporter | None = None
        self._round_lock = asyncio.Lock()  # a cancel's lease.end and a round never interleave
        self.lease_s = float(section["lease_s"])
        # per host, the GPUs a job could be packed on (issue #18; hosts with packing off say none)
        self.packable: dict[str, list[int]] = {}

    # ---- lifecycle ------------------------------------------------------------------------------

    def _load(self) -> Registry:
        try:
            return Registry.from_dict(json.loads(self._path.read_text()))
        except FileNotFoundError:
            return Registry()

    def _save(self) -> None:
        replace_private(self._path, json.dumps(self.registry.to_dict()))

    async def run(self, stop: asyncio.Event) -> None:
        self._server.start()
        self._start_exporter()
        rounds = asyncio.ensure_future(self._rounds())
        log.info("started", address=self.address, jobs=len(self.registry.jobs), round_s=self.round_s)
        try:
            await stop.wait()
        finally:
            await cancel_and_wait([rounds])
            if self._exporter is not None:
                self._exporter.stop()
            self._outbound.cancel_all()
            self._save()
            await self._server.close()
            if self._authority is not None:
                self._authority.release()
            self._ctx.destroy(linger=0)
            log.info("stopped")

    def _start_exporter(self) -> None:
        if (
            int(self.cfg.get("metrics.prometheus_port")) == 0
            or int(self.cfg.get("arbiter.prometheus_port")) < 0
        ):
            return
        exporter = arbiter_exporter(self.status, asyncio.get_running_loop())
        try:
            exporter.start(
                str(self.cfg.get("metrics.prometheus_address")), int(self.cfg.get("arbiter.prometheus_port"))
            )
        except OSError as exc:
            log.error("metrics_unavailable", reason=str(exc))
            return
        self._exporter = exporter
        log.info("metrics_listening", url=exporter.url)

    # ---- messages -------------------------------------------------------------------------------

    def _authorize(self, principal: str, identity: bytes, env: Envelope) -> str | None:
        return host_identity_refusal(principal, identity) or arbiter_refusal(principal, env.type, env.body)

    def _handle(self, identity: bytes, env: Envelope) -> Any:
        body, now = env.body, time.time()
        if env.type in (messages.REPLY, messages.ERROR):
            self._outbound.on_answer(env, identity)
            return None
        try:
            if env.type == messages.AGENT_REPORT:
                self.usage.observe(body, now)
                self.packable[str(body["host_id"])] = [int(d) for d in body.get("packable") or []]
                return env.reply({"ack": self.registry.on_report(body, now)})
            if env.type == messages.JOB_SUBMIT:
                largest = max((u.gpus for u in self.usage.hosts.values()), default=None)
                record = self.registry.submit(body, now, largest_host_gpus=largest)
                self._save()
                log.info("job_submitted", job=record.job_id, app=record.app_id, argv=record.argv)
                return env.reply(record.describe())
            if env.type == messages.JOB_LIST:
                return env.reply({"jobs": [r.describe() for r in self.registry.jobs.values()]})
            if env.type == messages.JOB_SHOW:
                return env.reply(self.registry.get(body["job_id"]).describe())
            if env.type == messages.JOB_CANCEL:
                return self._cancel(env)
            if env.type == messages.JOB_LOGS:
                return self._logs(env)
            if env.type == messages.ARBITER_STATUS:
                return env.reply(self.status())
        except RegistryError as exc:
            return env.error(str(exc), code="bad_request")
        return env.error(f"the arbiter does not handle {env.type!r}", code="unsupported")

    async def _cancel(self, env: Envelope) -> Envelope:
        job_id = env.body["job_id"]
        async with self._round_lock:
            record = self.registry.get(job_id)
            # where it runs, and where it last ran (a process paused there: arbiter.keep_paused_s)
            hosts = sorted({h for h in (record.host, record.last_host) if h is not None})
            self.registry.cancel(job_id, time.time())
            self._save()
            await asyncio.gather(*(self._ask_end(host, job_id, "cancelled") for host in hosts))
        log.info("job_cancelled", job=job_id, hosts=hosts)
        return env.reply(self.registry.get(job_id).describe())

    async def _logs(self, env: Envelope) -> Envelope:
        record = self.registry.get(env.body["job_id"])
        host = record.host or record.last_host
        if host is None:
            raise RpcError(f"job {record.job_id} has not run yet: no output", "not_found")
        body = {"job_id": record.job_id, "offset": int(env.body.get("offset", 0))}
        answer = await self._outbound.request(host.encode(), Envelope(messages.JOB_LOGS, body), timeout=10.0)
        return env.reply(answer.body)

    # ---- rounds ---------------------------------------------------------------------------------

    async def _rounds(self) -> None:
        while True:
            await asyncio.sleep(self.round_s)
            try:
                async with self._round_lock:
                    await self.run_round(time.time())
            except Exception:
                log.exception("round_failed")

    async def run_round(self, now: float) -> None:
        """One auction over the idle GPUs and those of expired leases; its leases carried out."""
        self.registry.account(now)
        expiring, starting = [], []
        for record in self.registry.expired(now):
            starting_now = self.registry.still_starting(record, now, self.startup_allowance_s)
            (starting if starting_now else expiring).append(record)
        releasing = {r.job_id for r in expiring}
        leased = {
            GpuSlot(r.host, d) for r in self.registry.leased() if r.host is not None for d in r.device_ids
        }
        idle = {GpuSlot(h, d) for h, use in self.usage.live(now).items() for d in use.idle}
        offer = (idle - leased) | {GpuSlot(r.host, d) for r in expiring if r.host for d in r.device_ids}
        apps = self.registry.app_reports(now, releasing=releasing)
        if not apps:
            return  # no job wants a GPU: nothing to auction
        capacity = self.capacity.observe(now, self.usage.usable(now))
        outcome = self.core.auction(now, apps, sorted(offer), capacity)
        self.rounds += 1
        self.rho = dict(outcome.rho_by_app)
        self.last_round = {
            "at": now,
            "offered_gpus": len(offer),
            "bidders": outcome.bidders,
            "won_by_app": outcome.won_by_app,
            "c_by_app": outcome.c_by_app,
            "leftover_gpus": outcome.leftover_gpus,
            "auction_ms": round(outcome.auction_ms, 3),
        }
        # equal leases traded so that jobs stay on the hosts their processes are on
        home = {r.job_id: r.host or r.last_host for r in self.registry.active() if r.host or r.last_host}
        leases = keep_jobs_in_place(outcome.leases, home)
        grants = {lease.job_id: lease for lease in leases}
        live = set(self.usage.live(now))
        packed = packed_leases(
            self.registry.active(), grants, {h: d for h, d in self.packable.items() if h in live},
            releasing, now, self.lease_s,
        )  # fmt: skip
        grants.update({lease.job_id: lease for lease in packed})
        packed_ids = {lease.job_id for lease in packed}
        renewing = {  # runs still starting keep their GPUs (a grant that grows one renews it too)
            r.job_id: Lease(
                r.app_id, r.job_id, tuple(GpuSlot(r.host, d) for d in r.device_ids), now, now + self.lease_s
            )
            for r in starting
            if r.host is not None and r.job_id not in grants
        }
        if grants or expiring or renewing:
            log.info(
                "round",
                rho={a: round(r, 4) for a, r in self.rho.items()},
                offered=len(offer),
                bidders=outcome.bidders,
                won=outcome.won_by_app,
                expiring=sorted(releasing),
                starting=sorted(renewing),
            )
        ending = []
        for record in expiring:
            lease = grants.get(record.job_id)
            if lease is not None and _placement(lease) == (record.host, len(record.device_ids)):
                continue  # renewed below: the job runs on
            ending.append(record)
        await asyncio.gather(*(self._ask_end(r.host, r.job_id, "expired") for r in ending if r.host))
        await asyncio.gather(
            *(self._grant(lease, releasing, packed=lease.job_id in packed_ids) for lease in grants.values()),
            *(self._grant(lease, releasing | {job_id}) for job_id, lease in renewing.items()),
        )
        self._save()

    async def _ask_end(self, host: str, job_id: str, reason: str) -> None:
        body = {"job_id": job_id, "reason": reason}
        try:
            answer = await self._outbound.request(
                host.encode(), Envelope(messages.LEASE_END, body), timeout=self.stop_grace_s + REQUEST_SLACK_S
            )
            self.registry.run_ended(host, {**answer.body, "job_id": job_id}, time.time())
        except (RpcError, RpcTimeout) as exc:  # the host is gone: its own safety net ends the run
            log.warning("lease_end_failed", job=job_id, host=host, reason=str(exc))
            self.registry.lease_ended(job_id, time.time())
        self._event("ended", job_id, host, reason=reason)

    async def _grant(self, lease: Lease, releasing: set[str], *, packed: bool = False) -> None:
        """Carry out one lease: its GPUs are added to what the job holds on to (a renewal, or a
        larger share of the same host), else the job starts there; ``packed``: beside the job
        that holds them (the host chooses which, within §5.1)."""
        host, gpus = _placement(lease)
        record = self.registry.get(lease.job_id)
        keeps = record.host is not None and record.job_id not in releasing
        if host is None or (keeps and record.host != host):
            # a job is one process on one host: its GPUs cannot span hosts
            log.warning("lease_spans_hosts", job=lease.job_id, slots=[list(s) for s in lease.slots])
            return
        if keeps and not packed:
            gpus += len(record.device_ids)
        elif record.last_host not in (None, host):
            # a job paused on another host (``arbiter.keep_paused_s``) stops there first
            await self._ask_end(record.last_host, record.job_id, "moved")
        job = {
            "job_id": record.job_id,
            "argv": record.argv,
            "cwd": record.cwd,
            "env": record.env,
            "start_iteration": self.registry.start_iteration(record),
        }
        body = {
            "job_id": record.job_id,
            "app_id": record.app_id,
            "gpus": gpus,
            "expires_at": lease.expires_at,
            "job": job,
            "packed": packed,
        }
        try:
            answer = await self._outbound.request(
                host.encode(),
                Envelope(messages.LEASE_GRANT, body),
                timeout=self.stop_grace_s + REQUEST_SLACK_S,
            )
        except (RpcError, RpcTimeout) as exc:
            log.warning("lease_grant_failed", job=record.job_id, host=host, reason=str(exc))
            if record.host is not None:  # a renewal the host refused: the run is over
                await self._ask_end(record.host, record.job_id, "renewal_failed")
            return
        now = time.time()
        if answer.body.get("renewed") and record.host == host:
            self.registry.lease_renewed(record.job_id, now=now, expires_at=lease.expires_at)
            self._event("renewed", record.job_id, host, gpus=gpus)
            return
        self.registry.lease_started(
            record.job_id,
            host=host,
            device_ids=[int(d) for d in answer.body.get("device_ids", [])],
            pid=answer.body.get("pid"),
            now=now,
            expires_at=lease.expires_at,
        )
        self._event("granted", record.job_id, host, gpus=gpus)

    def _event(self, event: str, job_id: str, host: str, **detail: Any) -> None:
        record = self.registry.jobs.get(job_id)
        entry = {"at": time.time(), "event": event, "job_id": job_id, "host": host, **detail}
        if record is not None:
            entry.update(app_id=record.app_id, device_ids=list(record.device_ids))
        self.lease_events.append(entry)
        log.info("lease_" + event, **{k: v for k, v in entry.items() if k not in ("at", "event")})

    # ---- status ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``arbiter.status``: per app rho and GPU time, GPUs by use, the last round, lease events."""
        now = time.time()
        self.registry.account(now)
        apps = self.registry.apps()
        for app_id, app in apps.items():
            app["rho"] = self.rho.get(app_id)
            app["gpu_seconds"] = round(app["gpu_seconds"], 3)
        return {
            "apps": apps,
            "usage": {**self.usage.report(now), "be_capacity_gpus": round(self.capacity.average(now), 3)},
            "rounds": self.rounds,
            "last_round": self.last_round,
            "lease_events": list(self.lease_events)[-200:],
            "prometheus_url": self._exporter.url if self._exporter is not None else None,
        }


def packed_leases(
    active: Sequence[JobRecord],
    grants: dict[str, Lease],
    packable: dict[str, list[int]],
    releasing: set[str],
    now: float,
    lease_s: float,
) -> list[Lease]:
    """Gimbal's packing after the auction (issue #18): a job the auction left waiting goes on GPUs
    a host says it could pack it on (beside a running job, §5.1); a packed job whose lease ends and
    that won nothing is renewed where it is packed. Jobs that asked for fewer GPUs first (they fit
    beside more jobs); each packable GPU takes one job."""
    free = {host: list(devices) for host, devices in packable.items()}
    leases: list[Lease] = []
    for record in sorted(active, key=lambda r: (r.gpus, r.submitted_at, r.job_id)):
        if record.job_id in grants:
            continue
        if record.host is not None:
            if record.job_id in releasing and record.packing is not None and not record.suspended:
                slots = tuple(GpuSlot(record.host, d) for d in record.device_ids)
                leases.append(Lease(record.app_id, record.job_id, slots, now, now + lease_s))
            continue
        host = next((h for h in sorted(free) if len(free[h]) >= record.gpus), None)
        if host is None:
            continue
        taken, free[host] = free[host][: record.gpus], free[host][record.gpus :]
        slots = tuple(GpuSlot(host, d) for d in taken)
        leases.append(Lease(record.app_id, record.job_id, slots, now, now + lease_s))
    return leases


def _placement(lease: Lease) -> tuple[str | None, int]:
    """(host, GPUs) of a lease; host None when its GPUs span hosts (a job is one process)."""
    counts = host_counts(lease.slots)
    if len(counts) != 1:
        return None, len(lease.slots)
    ((host, gpus),) = counts.items()
    return host, gpus
