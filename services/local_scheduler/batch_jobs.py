"""This host's best-effort jobs: the leases the arbiter granted here and the processes on them.

The arbiter decides who runs where (``lease.grant`` / ``lease.end``); this module carries that out
on the host's ``GpuLedger`` and reports back what the jobs say about themselves (``agent.report``).
A cell is never blocked by a job: a cell that finds too few idle GPUs *revokes* leases
(``revoke_for_cell``; the victims are the global scheduler's FitGpp choice, made with the
executor, or this host's when that is stale): the leases are suspended and the GPUs bound to the
cell in one ledger step, the lease clock stops (``RevocableLease``), and the job pauses at its
next step boundary (SIGSTOP if it cannot) while the cell already runs; its measured time to pause
is the grace period FitGpp scores it by. When the cell releases the GPUs the job gets the same
devices back and resumes, if its lease has not expired. Two safety nets: a lease the arbiter let
run past its expiry by ``overdue_s`` (the arbiter is gone) is ended here, so a GPU never stays
leased for good; and ``cell_reserve`` idle GPUs (default 0 since cells revoke) can still be kept
out of every lease.

When a lease ends the job stops at a step boundary, or, with ``keep_paused_s`` > 0, pauses there
(a job that cannot, not using the job-side API or still starting, is frozen by SIGSTOP): its
process waits, its GPUs go back to the ledger, and a
next lease of the same GPUs on this host resumes it in place (no new process, no re-import of its
libraries). A next lease of other GPUs (``CUDA_VISIBLE_DEVICES`` is read once per process), the
keep time running out, or a cancel stop it; it then resumes from the iterations it reported, in a
new process. Why stopping is the default: a paused process keeps its GPU memory, which a cell
committed to that GPU may need (on virtual GPUs, or once checkpoints move that memory aside, a
paused job costs nothing).

Packing (issue #18, Gimbal; ``[packing] enabled``, off by default): a grant marked ``packed`` puts
the job on GPUs a running job holds alone, at most two jobs per GPU, a smaller job only beside the
largest of its set (§5.1, ``packable_gpus``), never on a GPU a cell holds. The ledger keeps the
GPUs leased to that J_max; the guest is bound to them through it: a cell that revokes J_max's GPUs
pauses its guests too (both squeezed to zero), they resume together, and a guest whose J_max ends
takes over the lease of its GPUs. A ``Coordinator`` per set (``services.local_scheduler.packing``)
searches the shares with Algorithm 1 over live trials. ``report`` lists the GPUs a guest could
take (``packable``); each job's entry says with whom it shares and at what share (``packing``).
Jobs' images (issue #17, docs/preemption.md): with a checkpoint service configured, a job on
``tandem_job.checkpoints`` checkpoints concurrently and, on the stop word, commits the image of
its stop boundary and exits (checkpoint-and-stop); this host relays each image it announces to the
service and frees its GPUs only once the last one is relayed; a new process of a job starts from
its latest image, on whichever host. A cell rewinds (kills) instead of pausing a job whose steps
outlast the pause grace when the service holds an image of it (``release_plan``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.local_scheduler.checkpoints import CheckpointLink
from services.local_scheduler.job_process import (
    LOG_FILE,
    JobProcess,
    JobSpec,
    job_dir,
    open_job_file,
    read_job_file,
)
from services.local_scheduler.packing import (
    Coordinator,
    PackingSettings,
    describe,
    write_packing,
    write_share,
)
from shared.cluster_core.gpu_ledger import Commit, GpuLedger, LedgerError
from shared.policies.packing import FULL, Placement, packable_gpus
from shared.policies.preemption import (
    REWIND,
    FitGpp,
    LeasedJob,
    ReleaseFacts,
    ReleasePlan,
    RevocableLease,
    gpu_candidate,
    release_plan,
)
from shared.resources import Resources
from shared.rpc import RpcError, RpcTimeout
from tandem_job.checkpoints import ANNOUNCE_FILE, ENV_IMAGE, JOURNAL_FILE

log = structlog.get_logger("batch_jobs")

LOG_CHUNK_BYTES = 65_536
# at service shutdown a job gets at most this long to reach a step boundary (then SIGTERM,
# SIGKILL): the whole stop must fit in the service's own shutdown grace (shared/runner.py)
SHUTDOWN_STOP_GRACE_S = 3.0
PAUSABLE_REASONS = ("expired",)  # a cancel, a move to another host, a shutdown stop the job
RELAY_POLL_S = 0.05  # how often a job's checkpoint announcement file is looked at


def announced_image(raw: bytes) -> dict[str, Any]:
    """A job's ``checkpoint.json`` as the commit relays it; ValueError unless it has the shape
    ``tandem_job.checkpoints`` writes (the job writes the file: its content is not trusted)."""
    announcement = json.loads(raw)
    if not isinstance(announcement, dict) or not isinstance(announcement.get("manifest"), dict):
        raise ValueError("checkpoint.json is not an announcement (a map with a manifest map)")
    written = announcement.get("written", [])
    if not isinstance(written, list) or not all(isinstance(d, str) for d in written):
        raise ValueError("checkpoint.json: written must be a list of digests")
    return {"manifest": announcement["manifest"], "written": written}


@dataclass
class Run:
    """A job's process on this host, with its lease (None while it is paused)."""

    job_id: str
    app_id: str
    process: JobProcess
    expires_at: float | None
    paused_at: float | None = None
    # revoked by a cell: the lease clock (monotonic) stopped, and the key of the cell holding its GPUs
    suspension: tuple[RevocableLease, tuple[str, str, str]] | None = None
    pausing: asyncio.Future[None] | None = None
    grace_period_s: float | None = None  # measured: pause asked -> paused
    killed_s: float | None = None  # measured: SIGKILL -> gone, at its last rewind
    preemptions: int = 0
    packed_on: str | None = None  # packed beside this job (its J_max), on GPUs it leases
    solo_rate: float | None = None  # steps/s it ran at alone, before its first guest came
    relay: asyncio.Future[None] | None = None  # relays the job's committed images to the service
    checkpoint_step: int | None = None  # the latest image the checkpoint service has recorded
    restored_step: int | None = None  # the image this run started from

    @property
    def leased(self) -> bool:
        return self.expires_at is not None

    def release_plan(self, pause_grace_s: float) -> ReleasePlan:
        """How a cell would take its GPUs, and how long that takes (FitGpp's GP), from what was
        measured: its pauses and rewinds here, its own step time, its image at the service."""
        step_s = (self.process.progress() or {}).get("seconds_per_iteration")
        facts = ReleaseFacts(
            paused_s=self.grace_period_s,
            step_s=float(step_s) if isinstance(step_s, int | float) else None,
            killed_s=self.killed_s,
            image_step=self.checkpoint_step,
        )
        return release_plan(facts, pause_grace_s=pause_grace_s)

    def as_leased_job(self, pause_grace_s: float) -> LeasedJob:
        gp = self.release_plan(pause_grace_s).grace_period_s
        return LeasedJob(self.job_id, tuple(self.process.device_ids), gp, self.preemptions)


class BatchJobs:
    def __init__(
        self,
        ledger: GpuLedger,
        *,
        host_id: str,
        state_dir: Path,
        stop_grace_s: float,
        overdue_s: float,
        keep_paused_s: float,
        cell_reserve: int,
        on_exit: Callable[[], None],
        fitgpp_s: float = 4.0,
        max_preemptions: int = 1,
        pause_grace_s: float = 2.0,
        packing: PackingSettings | None = None,
        checkpoints: CheckpointLink | None = None,
        checkpoint_env: dict[str, str] | None = None,
    ) -> None:
        """``checkpoints``: the checkpoint service (None: jobs are not checkpointed by Tandem);
        ``checkpoint_env``: what a job needs to reach the data store its images go to."""
        self.ledger = ledger
        self.host_id = host_id
        self.state_dir = state_dir
        self.stop_grace_s = stop_grace_s
        self.overdue_s = overdue_s
        self.keep_paused_s = keep_paused_s
        self.cell_reserve = cell_reserve
        self.policy = FitGpp(s=fitgpp_s, max_preemptions=max_preemptions)
        self.pause_grace_s = pause_grace_s
        self.checkpoints = checkpoints
        self.checkpoint_env = dict(checkpoint_env or {}) if checkpoints is not None else {}
        self._on_exit = on_exit
        self.runs: dict[str, Run] = {}
        # ended runs not yet acknowledged by the arbiter: job_id -> report entry
        self._ended: dict[str, dict[str, Any]] = {}
        self._lock = asyncio.Lock()  # grants and ends change the ledger one at a time
        self._reapers: set[asyncio.Future[None]] = set()
        self.packing = packing or PackingSettings()
        self.sets: dict[str, Coordinator] = {}  # J_max's job id -> the coordinator of its set
        self._closing = False  # close() began: no new process may start

    # ---- from the arbiter ----------------------------------------------------------------------

    async def grant(self, body: dict[str, Any]) -> dict[str, Any]:
        """Run a job on ``gpus`` leased GPUs: renew its lease, resume it, or start it."""
        spec = JobSpec.from_wire(body["job"])
        gpus, expires_at = int(body["gpus"]), float(body["expires_at"])
        self._refuse_if_closing()
        async with self._lock:
            run = self.runs.get(spec.job_id)
            if (
                run is not None
                and run.packed_on is not None
                and run.leased
                and len(run.process.device_ids) == gpus
            ):
                run.expires_at = expires_at  # renewed where it is packed (no lease of its own)
                return self._granted(run, renewed=True)
            if body.get("packed") and self.packing.enabled:
                if run is not None:
                    await self._stop(run, reason="replaced")
                return await self._start_packed(spec, gpus, expires_at, str(body.get("app_id", "")))
            if run is not None and run.suspension is not None and len(run.process.device_ids) == gpus:
                self._suspend(run, run.suspension[1], expires_at)  # renewed while a cell holds its GPUs
                return self._granted(run, renewed=True)
            if run is not None and run.leased and len(run.process.device_ids) == gpus:
                run.expires_at = expires_at  # renewed: the job runs on, on the same GPUs
                held = self.ledger.end_lease(spec.job_id)
                self.ledger.lease(spec.job_id, gpus, expires_at, device_ids=held)
                return self._granted(run, renewed=True)
            self._check_reserve(gpus)
            if run is not None and not run.leased and len(run.process.device_ids) == gpus:
                try:
                    self.ledger.lease(spec.job_id, gpus, expires_at, device_ids=run.process.device_ids)
                except LedgerError:
                    pass  # its GPUs are taken: a new process on others
                else:
                    run.expires_at, run.paused_at = expires_at, None
                    run.process.resume()
                    return self._granted(run, renewed=False)
            if run is not None:
                await self._stop(run, reason="replaced")
            try:
                leasable = self.leasable()[:gpus]  # cells commit the lowest ids: leases take others
                device_ids = list(self.ledger.lease(spec.job_id, gpus, expires_at, device_ids=leasable))
            except LedgerError as exc:
                raise RpcError(f"host {self.host_id}: {exc}", "no_gpus") from None
            spec, restored_step = await self._from_latest_image(spec)
            if self._closing:  # shutdown began while the service answered: no process after close()
                self.ledger.end_lease(spec.job_id)
                self._refuse_if_closing()
            try:
                run = await self._launch(
                    spec, device_ids, expires_at, str(body.get("app_id", "")), restored_step
                )
            except RpcError:
                self.ledger.end_lease(spec.job_id)
                raise
            return self._granted(run, renewed=False)

    async def _launch(
        self, spec: JobSpec, device_ids: list[int], expires_at: float, app_id: str, restored_step: int | None
    ) -> Run:
        process = JobProcess(
            spec, directory=job_dir(self.state_dir, spec.job_id), device_ids=device_ids, host_id=self.host_id
        )
        try:
            await process.start()
        except OSError as exc:
            raise RpcError(f"job {spec.job_id} could not start: {exc}", "start_failed") from None
        run = Run(spec.job_id, app_id, process, expires_at)
        run.restored_step = run.checkpoint_step = restored_step
        if self.checkpoints is not None:
            run.relay = asyncio.ensure_future(self._relay(run))
        self.runs[spec.job_id] = run
        self._ended.pop(spec.job_id, None)
        reaper = asyncio.ensure_future(self._reap(run))
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        return run

    # ---- packing (issue #18) ------------------------------------------------------------------

    def placement(self) -> Placement:
        """The BE jobs on this host's GPUs now (leased, suspended or packed; not paused ones)."""
        return Placement(
            {
                r.job_id: tuple(str(d) for d in r.process.device_ids)
                for r in self.runs.values()
                if r.leased or r.suspension is not None
            }
        )

    def packable(self, gpus: int = 1) -> list[int]:
        """GPUs a job of ``gpus`` workers could be packed on now (each J_max's first option)."""
        if not self.packing.enabled:
            return []
        cells = [str(d) for c in self.ledger.commits() for d in c.device_ids]
        suspended = [r.job_id for r in self.runs.values() if r.suspension is not None or not r.leased]
        found: list[int] = []
        for partner, devices in packable_gpus(gpus, self.placement(), cells):
            if partner is not None and partner not in suspended:
                found.extend(int(d) for d in devices)
        return sorted(set(found))

    async def _start_packed(self, spec: JobSpec, gpus: int, expires_at: float, app_id: str) -> dict[str, Any]:
        spec, restored_step = await self._from_latest_image(spec)  # before the look: it awaits
        self._refuse_if_closing()
        cells = [str(d) for c in self.ledger.commits() for d in c.device_ids]
        options = [
            (partner, devices)
            for partner, devices in packable_gpus(gpus, self.placement(), cells)
            if partner is not None and self.runs[partner].leased
        ]
        if not options:
            raise RpcError(f"host {self.host_id}: no GPU to pack {gpus} workers on", "no_gpus")
        partner, devices = options[0]
        run = await self._launch(spec, [int(d) for d in devices], expires_at, app_id, restored_step)
        run.packed_on = partner
        self._regroup(partner)
        log.info(
            "job_packed", job=spec.job_id, host=self.host_id, jmax=partner, device_ids=run.process.device_ids
        )
        return self._granted(run, renewed=False)

    def guests(self, jmax: str) -> list[Run]:
        return [r for r in self.runs.values() if r.packed_on == jmax]

    def _regroup(self, jmax: str) -> None:
        """The set around ``jmax`` formed or changed: a new search (Algorithm 1 starts over)."""
        old = self.sets.pop(jmax, None)
        if old is not None:
            old.stop()
        host = self.runs.get(jmax)
        members = ([host] if host is not None else []) + self.guests(jmax)
        if host is None or len(members) < 2:
            for r in members:
                with contextlib.suppress(OSError):
                    write_share(r.process, FULL)  # alone again: full speed
                    write_packing(r.process, None, {})
            return
        if old is None and host.solo_rate is None:  # J_max ran alone until now: its speed alone
            spi = (host.process.progress() or {}).get("seconds_per_iteration")
            if isinstance(spi, int | float) and spi > 0:
                host.solo_rate = 1.0 / spi
        for r in members:
            partners = {o.job_id: o.process.device_ids for o in members if o is not r}
            with contextlib.suppress(OSError):  # its directory is gone: it exited
                write_packing(r.process, jmax, partners)
        coordinator = Coordinator(
            self.packing,
            {r.job_id: r.process for r in members},
            {r.job_id: tuple(r.process.device_ids) for r in members},
            lambda: all(r.leased and not r.process.exited.is_set() for r in members),
            solo={r.job_id: r.solo_rate for r in members if r.solo_rate is not None},
        )
        self.sets[jmax] = coordinator
        coordinator.start()

    def _unpack(self, run: Run) -> None:
        """``run`` leaves this host: its guests take over its GPUs' lease, or it leaves its J_max."""
        if run.packed_on is not None:
            jmax, run.packed_on = run.packed_on, None
            self._regroup(jmax)
            return
        guests = self.guests(run.job_id)
        coordinator = self.sets.pop(run.job_id, None)
        if coordinator is not None:
            coordinator.stop()
        for guest in guests:
            guest.packed_on = None
            if guest.leased:
                try:
                    self.ledger.lease(
                        guest.job_id, len(guest.process.device_ids), guest.expires_at or time.time(),
                        device_ids=guest.process.device_ids,
                    )  # fmt: skip
                except LedgerError:
                    log.warning("packed_job_orphaned", job=guest.job_id, host=self.host_id)
            self._regroup(guest.job_id)  # alone again: its share back to 100%

    async def _from_latest_image(self, spec: JobSpec) -> tuple[JobSpec, int | None]:
        """A new process of a job restarts from its latest committed image, wherever it was taken
        (its step, and the image for ``tandem_job.checkpoints`` to restore). A service that does
        not answer leaves the job to start from its reported iterations, without an image."""
        if self.checkpoints is None:
            return spec, None
        env = {**spec.env, **self.checkpoint_env}
        env.pop(ENV_IMAGE, None)
        try:
            latest = await self.checkpoints.latest(spec.job_id)
        except (RpcError, RpcTimeout) as exc:
            log.warning("checkpoint_latest_failed", job=spec.job_id, host=self.host_id, reason=str(exc))
            latest = None
        if latest is None:
            return dataclasses.replace(spec, env=env), None
        env[ENV_IMAGE] = json.dumps(latest["manifest"])
        step = int(latest["step"])
        log.info(
            "job_restoring", job=spec.job_id, host=self.host_id, step=step, reported=spec.start_iteration
        )
        return dataclasses.replace(spec, env=env, start_iteration=step), step

    async def _relay(self, run: Run) -> None:
        """Relay each image the job announces (``checkpoint.json``) to the checkpoint service,
        until the process has exited and its last announcement is relayed."""
        assert self.checkpoints is not None
        path = run.process.directory / ANNOUNCE_FILE
        seen: tuple[int, int] | None = None
        while True:
            exited = run.process.exited.is_set()
            try:
                st = path.stat()
                current: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
            except OSError:
                current = None
            if current is not None and current != seen:
                try:
                    announcement = announced_image(read_job_file(path))
                    answer = await self.checkpoints.commit(run.job_id, announcement)
                    run.checkpoint_step = int(answer["step"])
                    seen = current
                except (OSError, ValueError, KeyError) as exc:
                    log.warning("checkpoint_announcement_unreadable", job=run.job_id, reason=str(exc))
                    seen = current
                except RpcError as exc:  # refused (stale, incomplete): the job's next image may do
                    log.warning(
                        "checkpoint_commit_refused", job=run.job_id, host=self.host_id, reason=exc.reason
                    )
                    seen = current
                except RpcTimeout:  # the service is away: retried at the next look
                    log.warning("checkpoint_commit_timed_out", job=run.job_id, host=self.host_id)
            if exited:
                await self._relay_journal(run)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.process.exited.wait(), RELAY_POLL_S)

    async def _relay_journal(self, run: Run) -> None:
        """The process has exited: hand the service every object its agent stored (journaled as
        the store answered), so the packs of a capture killed mid-way are collected once their
        protection ends; those a kept image names stay. Relayed once: the journal goes."""
        assert self.checkpoints is not None
        path = run.process.directory / JOURNAL_FILE
        try:
            digests = sorted({line for line in read_job_file(path).decode(errors="replace").split() if line})
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:  # a FIFO, a link, an oversized file: not relayed
            log.warning("checkpoint_journal_unreadable", job=run.job_id, host=self.host_id, reason=str(exc))
            path.unlink(missing_ok=True)
            return
        if digests:
            try:
                await self.checkpoints.written(run.job_id, digests)
            except (RpcError, RpcTimeout) as exc:  # left for the next run of the job to relay
                log.warning(
                    "checkpoint_journal_not_relayed", job=run.job_id, host=self.host_id, reason=str(exc)
                )
                return
        path.unlink(missing_ok=True)

    async def _forget_images(self, run: Run) -> None:
        """The job finished or was cancelled: nothing will restart from its images."""
        if self.checkpoints is None or run.checkpoint_step is None:
            return
        try:
            await self.checkpoints.forget(run.job_id)
        except (RpcError, RpcTimeout) as exc:
            log.warning("checkpoint_forget_failed", job=run.job_id, host=self.host_id, reason=str(exc))

    async def _relayed(self, run: Run) -> None:
        """The job's last image is with the service before its GPUs go (bounded by the service's timeout)."""
        if run.relay is None:
            return
        try:
            await asyncio.shield(run.relay)
        except Exception as exc:  # its GPUs are released whatever became of its images
            log.error("checkpoint_relay_failed", job=run.job_id, host=self.host_id, reason=repr(exc))

    def _refuse_if_closing(self) -> None:
        if self._closing:
            raise RpcError(f"host {self.host_id} is shutting down", "no_gpus")

    def _check_reserve(self, gpus: int) -> None:
        idle = len(self.ledger.idle_device_ids())
        if idle - gpus < self.cell_reserve:
            raise RpcError(
                f"host {self.host_id}: {gpus} GPUs asked, {idle} idle of which {self.cell_reserve} are kept for cells",
                "no_gpus",
            )

    def leasable(self) -> list[int]:
        """Idle GPUs beyond the cells' reserve (the lowest ids are kept: cells commit those first)."""
        return list(self.ledger.idle_device_ids()[self.cell_reserve :])

    @staticmethod
    def _granted(run: Run, *, renewed: bool) -> dict[str, Any]:
        return {"device_ids": run.process.device_ids, "pid": run.process.pid, "renewed": renewed}

    async def end(self, job_id: str, *, reason: str) -> dict[str, Any]:
        """The lease is over: the job pauses (see the module docstring) or stops at a step
        boundary, and its GPUs are free; its last report."""
        async with self._lock:
            run = self.runs.get(job_id)
            if run is None:
                return self._ended.get(job_id) or {"job_id": job_id, "outcome": "absent", "running": False}
            log.info("lease_ending", job=job_id, host=self.host_id, reason=reason)
            if run.suspension is not None and reason in PAUSABLE_REASONS and self.keep_paused_s > 0:
                self.ledger.drop_suspended(job_id)  # a cell holds its GPUs: it stays paused
                run.suspension = None
                self._unpack(run)  # its guests come back on GPUs of their own
                return {**self._describe(run), "running": False, "outcome": "paused"}
            pausable = (
                run.leased and reason in PAUSABLE_REASONS and self.keep_paused_s > 0 and run.packed_on is None
            )  # a packed job stops: its GPUs are its J_max's
            if pausable and await run.process.pause(self.stop_grace_s):
                self.ledger.end_lease(job_id)
                self._unpack(run)  # its guests take over the lease of its GPUs
                run.expires_at, run.paused_at = None, time.time()
                return {**self._describe(run), "running": False, "outcome": "paused"}
            return await self._stop(run, reason=reason)

    async def _stop(self, run: Run, *, reason: str) -> dict[str, Any]:
        log.info("job_stopping", job=run.job_id, host=self.host_id, reason=reason)
        started = time.monotonic()
        await run.process.stop(self.stop_grace_s)
        await self._relayed(run)
        if reason == "cancelled":
            await self._forget_images(run)
        log.info("job_released", job=run.job_id, host=self.host_id, reason=reason,
                 seconds=round(time.monotonic() - started, 4), checkpoint_step=run.checkpoint_step)  # fmt: skip
        return self._release(run)

    async def _reap(self, run: Run) -> None:
        """A job that exits on its own (finished, failed) gives its GPUs back at once."""
        await run.process.exited.wait()
        await self._relayed(run)
        if self.runs.get(run.job_id) is run:
            self._release(run)
            self._on_exit()
        if run.process.outcome() == "finished":
            await self._forget_images(run)

    def _release(self, run: Run) -> dict[str, Any]:
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
            if run.leased:
                self.ledger.end_lease(run.job_id)
            self.ledger.drop_suspended(run.job_id)
            run.suspension = None
            self._unpack(run)  # its GPUs are free in the ledger now: its guests take them over
        entry = self._describe(run)
        self._ended[run.job_id] = entry
        return entry

    async def expire(self, now: float) -> None:
        """Leases the arbiter left running ``overdue_s`` past their expiry (the safety net), and
        paused jobs kept ``keep_paused_s``, are stopped; suspended jobs whose cell is gone by a
        path that did not say so resume."""
        self.cells_released()
        for run in list(self.runs.values()):
            if run.leased and now > (run.expires_at or now) + self.overdue_s:
                await self.end(run.job_id, reason="overdue")
            elif (
                run.suspension is None
                and run.paused_at is not None
                and now > run.paused_at + self.keep_paused_s
            ):
                async with self._lock:
                    if self.runs.get(run.job_id) is run and not run.leased and run.suspension is None:
                        await self._stop(run, reason="paused_too_long")

    async def logs(self, job_id: str, offset: int, limit: int = LOG_CHUNK_BYTES) -> dict[str, Any]:
        """Bytes of the job's output from ``offset`` (negative: from the end); kept across runs."""
        path = job_dir(self.state_dir, job_id) / LOG_FILE
        try:
            with os.fdopen(open_job_file(path), "rb") as f:  # the job can write in its dir
                size = f.seek(0, os.SEEK_END)
                start = max(size + offset, 0) if offset < 0 else min(offset, size)
                f.seek(start)
                data = f.read(min(limit, LOG_CHUNK_BYTES))
        except FileNotFoundError:
            raise RpcError(f"job {job_id} has no output on host {self.host_id}", "not_found") from None
        except OSError as exc:
            raise RpcError(f"job {job_id}'s output on host {self.host_id}: {exc}", "unavailable") from None
        return {"data": data, "offset": start + len(data), "size": size}

    # ---- revocation: a cell takes leased GPUs (FitGpp on this host) ---------------------------

    def leased_jobs(self) -> list[LeasedJob]:
        """The jobs a cell may revoke here (with their measured GP): what the heartbeat reports."""
        return [
            r.as_leased_job(self.pause_grace_s)
            for r in self.runs.values()
            if r.leased and r.packed_on is None
        ]

    def revoke_for_cell(
        self, kernel_id: str, replica_id: str, msg_id: str, gpus: int, *, victims: Sequence[str] = ()
    ) -> Commit:
        """Too few idle GPUs for a cell: the leases of ``victims`` (the global scheduler's FitGpp
        choice, made with the executor) are suspended and the GPUs committed to the cell in one
        ledger step (so the cell starts now); each victim pauses in the background (step
        boundary, else SIGSTOP). Without victims, or when they no longer free enough (this host's
        jobs changed since its last heartbeat), FitGpp chooses here, among this host's jobs.
        LedgerError when even every job's GPUs would not do."""
        leased = {j.job_id: j for j in self.leased_jobs()}
        idle = len(self.ledger.idle_device_ids())
        chosen = [self._host_of(j) for j in dict.fromkeys(victims)]
        chosen = [j for j in dict.fromkeys(chosen) if j in leased]
        reason = "the global scheduler's FitGpp choice"
        if not chosen or idle + sum(leased[j].gpus for j in chosen) < gpus:
            decision = self.policy.decide(
                Resources(gpus=gpus), [gpu_candidate(self.host_id, self.ledger.total, idle, leased.values())]
            )
            if decision.blocked or not decision.victims:
                raise LedgerError(f"needs {gpus} GPUs and no leased job here frees them ({decision.reason})")
            chosen, reason = [v.job_id for v in decision.victims], decision.reason
        commit, _ = self.ledger.revoke(kernel_id, replica_id, msg_id, gpus, chosen)
        log.info(
            "lease_revoked", host=self.host_id, kernel=kernel_id, msg_id=msg_id, victims=chosen, reason=reason
        )
        # a packed job's GPUs are its J_max's: the cell takes them from both (squeezed to zero)
        victims = chosen + [g.job_id for j in chosen for g in self.guests(j) if g.leased]
        for job_id in victims:
            run = self.runs[job_id]
            run.preemptions += 1
            self._suspend(run, (kernel_id, replica_id, msg_id), run.expires_at or time.time())
            run.expires_at, run.paused_at = None, time.time()
            if run.release_plan(self.pause_grace_s).mode == REWIND:
                run.pausing = asyncio.ensure_future(self._rewind(run))
            else:
                run.pausing = asyncio.ensure_future(self._pause_measured(run))
        return commit

    def _host_of(self, job_id: str) -> str:
        """The job whose lease holds ``job_id``'s GPUs: its J_max when packed, else itself."""
        run = self.runs.get(job_id)
        return run.packed_on if run is not None and run.packed_on is not None else job_id

    async def _rewind(self, run: Run) -> None:
        """Its steps are longer than the pause grace and the service holds an image of it: killed
        now, so its GPU memory goes too; its lease ends with the process (the reaper), and the
        arbiter restarts it later, from that image, here or elsewhere."""
        started = time.monotonic()
        run.process.kill_now()
        await run.process.exited.wait()
        run.killed_s = time.monotonic() - started
        log.info("job_rewound", job=run.job_id, host=self.host_id, killed_s=run.killed_s,
                 image_step=run.checkpoint_step)  # fmt: skip

    def _suspend(self, run: Run, cell: tuple[str, str, str], expires_at: float) -> None:
        """Stop ``run``'s lease clock with ``expires_at - now`` of its term left."""
        now = time.monotonic()
        lease = RevocableLease(run.job_id, run.app_id, max(expires_at - time.time(), 1e-3), now)
        lease.suspend("/".join(cell), now)
        run.suspension = (lease, cell)

    async def _pause_measured(self, run: Run) -> None:
        started = time.monotonic()
        if await run.process.pause(self.pause_grace_s):
            run.grace_period_s = time.monotonic() - started
            log.info("job_preempted", job=run.job_id, host=self.host_id, grace_period_s=run.grace_period_s,
                     frozen=run.process.frozen)  # fmt: skip

    def cells_released(self) -> None:
        """A cell gave GPUs back: each suspended job whose cell no longer holds them gets its own
        devices back and resumes, if its lease (clock stopped meanwhile) has not expired."""
        held = {(c.kernel_id, c.replica_id, c.msg_id) for c in self.ledger.commits()}
        # J_max first: its guests resume on the lease it gets back
        for run in sorted(self.runs.values(), key=lambda r: r.packed_on is not None):
            if run.suspension is None or run.suspension[1] in held:
                continue
            lease, cell = run.suspension
            now = time.monotonic()
            if not lease.resume("/".join(cell), now):
                self.ledger.drop_suspended(run.job_id)  # expired: it stays paused, the arbiter ends it
                run.suspension = None
                continue
            expires_at = time.time() + lease.remaining_s(now)
            try:
                if run.packed_on is not None:
                    if not self.runs[run.packed_on].leased:
                        raise LedgerError(f"{run.packed_on} holds its GPUs and is not back")
                elif run.job_id in self.ledger.suspended():
                    self.ledger.resume_lease(run.job_id, expires_at)
                else:  # packed, and its J_max ended meanwhile: the GPUs are its own now
                    self.ledger.lease(
                        run.job_id, len(run.process.device_ids), expires_at, device_ids=run.process.device_ids
                    )
            except LedgerError:  # a device went to the replica's next cell: wait for that one
                lease.suspend("/".join(cell), now)
                continue
            run.suspension, run.expires_at, run.paused_at = None, expires_at, None
            resumer = asyncio.ensure_future(self._resume_after_pause(run))
            self._reapers.add(resumer)
            resumer.add_done_callback(self._reapers.discard)

    async def _resume_after_pause(self, run: Run) -> None:
        """A pause still on its way would freeze the job again: resume only once it is done."""
        if run.pausing is not None:
            await asyncio.shield(run.pausing)
        if self.runs.get(run.job_id) is run and run.leased:
            run.process.resume()

    # ---- to the arbiter -------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The body of ``agent.report``: this host's GPUs (``idle``: those it may lease) and its
        leased jobs' progress (paused runs hold no GPU and no lease: the arbiter has their last
        report)."""
        return {
            "host_id": self.host_id,
            "gpus": self.ledger.total,
            "idle": self.leasable(),
            "reserved": min(self.cell_reserve, len(self.ledger.idle_device_ids())),
            "committed": self.ledger.committed_count,
            "packable": self.packable(),
            "jobs": [self._describe(r) for r in self.runs.values() if r.leased or r.suspension is not None]
            + list(self._ended.values()),
            "at": time.time(),
        }

    def acknowledged(self, job_ids: list[str]) -> None:
        """The arbiter has recorded these ended runs: no need to report them again."""
        for job_id in job_ids:
            self._ended.pop(job_id, None)

    def _describe(self, run: Run) -> dict[str, Any]:
        process = run.process
        running = not process.exited.is_set()
        return {
            "job_id": run.job_id,
            "app_id": run.app_id,
            "device_ids": process.device_ids,
            "expires_at": run.expires_at,
            "pid": process.pid,
            "running": running,
            "outcome": None if running else process.outcome(),
            "returncode": process.returncode,
            "progress": process.progress() or {},
            "suspended": run.suspension is not None,
            "preemptions": run.preemptions,
            "grace_period_s": run.grace_period_s,
            "packing": self._packing_of(run),
            "checkpoint_step": run.checkpoint_step,
            "restored_step": run.restored_step,
        }

    def _packing_of(self, run: Run) -> dict[str, Any] | None:
        """With whom ``run`` shares its GPUs and at what share (None: it has them alone)."""
        jmax = run.packed_on or run.job_id
        coordinator = self.sets.get(jmax)
        if coordinator is None or run.job_id not in coordinator.processes:
            return None
        partners = sorted(j for j in coordinator.processes if j != run.job_id)
        entry = describe(coordinator.shares, ",".join(partners), run.job_id, run.process.device_ids)
        entry.update(
            jmax=jmax,
            trials=len(coordinator.trials),
            searches=coordinator.searches,
            search_ended=coordinator.ended,
        )
        return entry

    async def close(self) -> None:
        """Service shutdown: every job stops (at a step boundary if it can); no orphans."""
        self._closing = True
        runs = list(self.runs.values())
        if runs:
            log.info("stopping_jobs", host=self.host_id, count=len(runs))
        grace = min(self.stop_grace_s, SHUTDOWN_STOP_GRACE_S)
        await asyncio.gather(*(r.process.stop(grace) for r in runs), return_exceptions=True)
        relays = [asyncio.ensure_future(self._relayed(r)) for r in runs if r.relay is not None]
        if relays:  # images of jobs stopped by the shutdown (a host drained), within the grace
            _, late = await asyncio.wait(relays, timeout=SHUTDOWN_STOP_GRACE_S)
            for relay in late:
                relay.cancel()
        for run in runs:
            if run.relay is not None:
                run.relay.cancel()
            self._release(run)
        for coordinator in self.sets.values():
            coordinator.stop()
        for reaper in list(self._reapers):
            reaper.cancel()
