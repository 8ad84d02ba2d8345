"""This host's best-effort jobs: the leases the arbiter granted here and the processes on them.

The arbiter decides who runs where (``lease.grant`` / ``lease.end``); this module carries that out
on the host's ``GpuLedger`` (a leased GPU is never committed to a cell, and a lease takes only
GPUs no cell holds) and reports back what the jobs say about themselves (``agent.report``). It
makes no choice of its own beyond one safety net: a lease the arbiter let run past its expiry by
``overdue_s`` (the arbiter is gone) is ended here, so a GPU never stays leased for good.

Why a job is stopped, not paused, when its lease ends: a stopped process frees its GPU memory, and
its next lease may be on other GPUs or another host (``CUDA_VISIBLE_DEVICES`` is read once per
process); the job-side API resumes it from the iterations it reported.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.local_scheduler.gpu_ledger import GpuLedger, LedgerError
from services.local_scheduler.job_process import JobProcess, JobSpec, job_dir
from shared.rpc import RpcError

log = structlog.get_logger("batch_jobs")

LOG_CHUNK_BYTES = 65_536


@dataclass
class HostLease:
    job_id: str
    app_id: str
    device_ids: list[int]
    expires_at: float
    process: JobProcess


class BatchJobs:
    def __init__(
        self,
        ledger: GpuLedger,
        *,
        host_id: str,
        state_dir: Path,
        stop_grace_s: float,
        overdue_s: float,
        on_exit: Callable[[], None],
    ) -> None:
        self.ledger = ledger
        self.host_id = host_id
        self.state_dir = state_dir
        self.stop_grace_s = stop_grace_s
        self.overdue_s = overdue_s
        self._on_exit = on_exit
        self.leases: dict[str, HostLease] = {}
        # ended runs not yet acknowledged by the arbiter: job_id -> report entry
        self._ended: dict[str, dict[str, Any]] = {}
        self._lock = asyncio.Lock()  # grants and ends change the ledger one at a time
        self._reapers: set[asyncio.Future[None]] = set()

    # ---- from the arbiter ----------------------------------------------------------------------

    async def grant(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start (or extend) a job on ``gpus`` leased GPUs; the device ids it runs on."""
        spec = JobSpec.from_wire(body["job"])
        gpus, expires_at = int(body["gpus"]), float(body["expires_at"])
        async with self._lock:
            held = self.leases.get(spec.job_id)
            if held is not None and len(held.device_ids) == gpus and not held.process.exited.is_set():
                held.expires_at = expires_at  # renewed: the job runs on
                self.ledger.extend_lease(spec.job_id, expires_at)
                return {"device_ids": held.device_ids, "pid": held.process.pid, "renewed": True}
            if held is not None:
                await self._end(held, reason="resized")
            try:
                device_ids = list(self.ledger.lease(spec.job_id, gpus, expires_at))
            except LedgerError as exc:
                raise RpcError(f"host {self.host_id}: {exc}", "no_gpus") from None
            process = JobProcess(
                spec,
                directory=job_dir(self.state_dir, spec.job_id),
                device_ids=device_ids,
                host_id=self.host_id,
            )
            try:
                await process.start()
            except OSError as exc:
                self.ledger.end_lease(spec.job_id)
                raise RpcError(f"job {spec.job_id} could not start: {exc}", "start_failed") from None
            lease = HostLease(spec.job_id, str(body.get("app_id", "")), device_ids, expires_at, process)
            self.leases[spec.job_id] = lease
            self._ended.pop(spec.job_id, None)
            reaper = asyncio.ensure_future(self._reap(lease))
            self._reapers.add(reaper)
            reaper.add_done_callback(self._reapers.discard)
            return {"device_ids": device_ids, "pid": process.pid, "renewed": False}

    async def end(self, job_id: str, *, reason: str) -> dict[str, Any]:
        """Stop the job at a step boundary and free its GPUs; its last report."""
        async with self._lock:
            lease = self.leases.get(job_id)
            if lease is None:
                return self._ended.get(job_id) or {"job_id": job_id, "outcome": "absent"}
            return await self._end(lease, reason=reason)

    async def _end(self, lease: HostLease, *, reason: str) -> dict[str, Any]:
        log.info("lease_ending", job=lease.job_id, host=self.host_id, reason=reason)
        await lease.process.stop(self.stop_grace_s)
        return self._release(lease)

    async def _reap(self, lease: HostLease) -> None:
        """A job that exits on its own (finished, failed) gives its GPUs back at once."""
        await lease.process.exited.wait()
        if self.leases.get(lease.job_id) is lease:
            self._release(lease)
            self._on_exit()

    def _release(self, lease: HostLease) -> dict[str, Any]:
        if self.leases.get(lease.job_id) is lease:
            del self.leases[lease.job_id]
            self.ledger.end_lease(lease.job_id)
        entry = self._describe(lease)
        self._ended[lease.job_id] = entry
        return entry

    async def expire_overdue(self, now: float) -> None:
        """The safety net: leases the arbiter left running ``overdue_s`` past their expiry."""
        for lease in [x for x in self.leases.values() if now > x.expires_at + self.overdue_s]:
            await self.end(lease.job_id, reason="overdue")

    def logs(self, job_id: str, offset: int, limit: int = LOG_CHUNK_BYTES) -> dict[str, Any]:
        """Bytes of the job's output from ``offset`` (its log is kept across its runs)."""
        path = job_dir(self.state_dir, job_id) / "output.log"
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = size + offset if offset < 0 else min(offset, size)
                f.seek(max(start, 0))
                data = f.read(min(limit, LOG_CHUNK_BYTES))
        except FileNotFoundError:
            raise RpcError(f"job {job_id} has no output on host {self.host_id}", "not_found") from None
        return {"data": data, "offset": max(start, 0) + len(data), "size": size}

    # ---- to the arbiter -------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The body of ``agent.report``: this host's GPUs and its jobs' progress."""
        return {
            "host_id": self.host_id,
            "gpus": self.ledger.total,
            "idle": list(self.ledger.idle_device_ids()),
            "committed": self.ledger.committed_count,
            "jobs": [self._describe(x) for x in self.leases.values()] + list(self._ended.values()),
            "at": time.time(),
        }

    def acknowledged(self, job_ids: list[str]) -> None:
        """The arbiter has recorded these ended runs: no need to report them again."""
        for job_id in job_ids:
            if job_id not in self.leases:
                self._ended.pop(job_id, None)

    def _describe(self, lease: HostLease) -> dict[str, Any]:
        process = lease.process
        progress = process.progress() or {}
        running = not process.exited.is_set()
        return {
            "job_id": lease.job_id,
            "app_id": lease.app_id,
            "device_ids": lease.device_ids,
            "expires_at": lease.expires_at,
            "pid": process.pid,
            "running": running,
            "outcome": None if running else process.outcome(),
            "returncode": process.returncode,
            "progress": progress,
        }

    async def close(self) -> None:
        """Service shutdown: every job stops (at a step boundary if it can); no orphans."""
        leases = list(self.leases.values())
        if leases:
            log.info("stopping_jobs", host=self.host_id, count=len(leases))
        await asyncio.gather(*(x.process.stop(self.stop_grace_s) for x in leases), return_exceptions=True)
        for lease in leases:
            self._release(lease)
        for reaper in list(self._reapers):
            reaper.cancel()
