"""Gimbal on one host (issue #18): the runtime monitor and coordinator of a packing set.

``BatchJobs`` packs a best-effort job on GPUs a running job (its J_max) holds alone, within §5.1's
constraints (``shared.policies.packing.packable_gpus``). Each set gets a ``Coordinator``: it runs
Algorithm 1 (``CoordinationSearch``, the pure policy) against live trials, applying each proposed
cap as the jobs' ``share`` file (the job-side API paces its steps to it: duty cycle and threads on
a CPU) and measuring each job's speed from its own progress reports (iterations over the report
clock) and its utilization from the process's CPU time, over ``trial_s``. The best configuration
found stays in force until the set changes. A cell that takes the GPU pauses the whole set through
the preemption path (squeezed to zero); the search then waits and starts over once every job of
the set runs again (the speeds it measured before no longer describe the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.local_scheduler.job_process import JobProcess
from shared.policies.packing import (
    FIRST_WINDOW,
    FULL,
    OBJECTIVES,
    CoordinationSearch,
    JobInfo,
    JobMeasurement,
    PackingConfig,
)
from tandem_job import PACKING_FILE, SHARE_FILE, write_atomically

log = structlog.get_logger("packing")

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CORES = os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class PackingSettings:
    """``[packing]`` of the config: off unless ``enabled``."""

    enabled: bool = False
    trial_s: float = 3.0  # one trial's measurement window (the paper: up to 60 s or 5 steps)
    settle_s: float = 0.5  # after a new cap, before measuring: the step in flight ends
    objective: str = "jct"
    min_gain: float = 0.03  # a trial must beat the best by this fraction (live trials are noisy)
    # end a search once no later trial can gain (``CoordinationSearch``; False: Algorithm 1's exit only)
    futile_exit: bool = True

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> PackingSettings:
        default = cls()  # (a slotted dataclass's class attributes are descriptors, not defaults)
        return cls(
            enabled=bool(section.get("enabled", default.enabled)),
            trial_s=float(section.get("trial_s", default.trial_s)),
            settle_s=float(section.get("settle_s", default.settle_s)),
            objective=str(section.get("objective", default.objective)),
            min_gain=float(section.get("min_gain", default.min_gain)),
            futile_exit=bool(section.get("futile_exit", default.futile_exit)),
        )


def write_share(process: JobProcess, percent: int) -> None:
    """Squeeze or swell a job: it reads the file at its next step boundary."""
    write_atomically(process.directory / SHARE_FILE, f"{int(percent)}\n")


def write_packing(process: JobProcess, jmax: str | None, partners: dict[str, Sequence[int]]) -> None:
    """Tell a job with whom it is packed and which of its GPUs they share (``tandem_job.packing``;
    a data-parallel job steals samples across its workers only while packed). ``partners`` empty:
    it runs alone again."""
    mine = set(process.device_ids)
    shared = sorted(mine & {d for devices in partners.values() for d in devices})
    info = {"jmax": jmax, "with": sorted(partners), "shared_device_ids": shared} if partners else {}
    write_atomically(process.directory / PACKING_FILE, json.dumps(info))


@dataclass(frozen=True, slots=True)
class Sample:
    iterations: int
    at: float  # the job's report clock (wall), when it had done ``iterations``
    cpu_s: float  # the process's CPU seconds when sampled
    wall: float


def sample(process: JobProcess) -> Sample | None:
    """What the monitor reads of a job now (None: no step report yet)."""
    progress = process.progress() or {}
    done, at = progress.get("iterations_done"), progress.get("updated_at")
    if not isinstance(done, int) or not isinstance(at, int | float):
        return None
    return Sample(done, float(at), _cpu_seconds(process.pid), time.time())


def _cpu_seconds(pid: int | None) -> float:
    """utime + stime of the job's process (Linux /proc; 0 elsewhere: utilization unknown)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def measurement(before: Sample, after: Sample) -> JobMeasurement | None:
    """Speed (iterations per second of the job's report clock) and CPU utilization of one trial."""
    span = after.at - before.at
    if span <= 0 or after.iterations <= before.iterations:
        return None
    wall = max(after.wall - before.wall, 1e-6)
    return JobMeasurement(
        throughput=(after.iterations - before.iterations) / span,
        utilization=min(1.0, max(0.0, (after.cpu_s - before.cpu_s) / wall / _CORES)),
    )


@dataclass
class Coordinator:
    """Algorithm 1 over one packing set, live. ``processes`` maps job id -> its process; J_max is
    the job with the most GPUs (``gpus``). ``running`` says whether every job of the set steps now
    (none paused by a cell, none exited)."""

    settings: PackingSettings
    processes: dict[str, JobProcess]
    gpus: dict[str, tuple[int, ...]]
    running: Callable[[], bool]
    solo: dict[str, float] = field(default_factory=dict)  # steps/s alone (J_max before it was packed)
    shares: dict[str, int] = field(default_factory=dict)
    trials: list[dict[str, Any]] = field(default_factory=list)
    searches: int = 0
    best: PackingConfig | None = None
    ended: str | None = None  # why the last search ended (``CoordinationSearch.ended``)
    _task: asyncio.Future[None] | None = None

    def start(self) -> None:
        for job_id in self.processes:
            self._set(job_id, FULL)
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _set(self, job_id: str, percent: int) -> None:
        self.shares[job_id] = percent
        with contextlib.suppress(OSError):  # the job's directory is gone: it exited
            write_share(self.processes[job_id], percent)

    async def _run(self) -> None:
        try:
            while True:
                await self._until_running()
                if await self._search():
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("packing_search_failed", jobs=sorted(self.processes))

    async def _until_running(self) -> None:
        while not (self.running() and all(sample(p) is not None for p in self.processes.values())):
            await asyncio.sleep(min(0.2, self.settings.trial_s))

    async def _search(self) -> bool:
        """One search to its end (True), or abandoned because the set stopped running (False)."""
        self.searches += 1
        first = {j: sample(p) for j, p in self.processes.items()}
        infos = [
            JobInfo(
                j,
                tuple(str(d) for d in self.gpus[j]),
                float(max(1, _remaining(p, first[j]))),
                solo_throughput=self.solo.get(j),
            )
            for j, p in self.processes.items()
        ]
        objective = OBJECTIVES[self.settings.objective]()
        # the duty cycle caps a share of the job's own speed: every cap below 100% binds (no
        # slack above a use to skip, that is a GPU notion), so the paper's literal 10% steps
        search = CoordinationSearch(
            infos,
            objective,
            skip_slack=False,
            min_gain=self.settings.min_gain,
            futile_exit=self.settings.futile_exit,
        )
        while (config := search.propose()) is not None:
            for job_id, cap in config.caps.items():
                self._set(job_id, cap)
            await asyncio.sleep(self.settings.settle_s)
            before = {j: sample(p) for j, p in self.processes.items()}
            await asyncio.sleep(self.settings.trial_s * FIRST_WINDOW)
            first = self._measured(before)
            # clearly worse after its first window: that window is the trial
            cut_short = first is not None and self.running() and search.interim(first)
            if not cut_short:
                await asyncio.sleep(self.settings.trial_s * (1 - FIRST_WINDOW))
            measured = first if cut_short else self._measured(before)
            if not self.running() or measured is None:
                self._reset()
                return False  # a job paused, stalled or finished mid-trial: not a measurement
            search.observe(measured)
            self.trials.append(
                {
                    "caps": dict(config.caps),
                    "cut_short": cut_short,
                    "throughput": {j: round(m.throughput, 3) for j, m in measured.items()},
                    "utilization": {j: round(m.utilization, 3) for j, m in measured.items()},
                    "objective": search.trials[-1].objective,
                }
            )
        self.best, self.ended = search.best(), search.ended
        for job_id, cap in self.best.caps.items():
            self._set(job_id, cap)
        log.info(
            "packing_search_done", trials=len(search.trials), best=dict(self.best.caps), ended=self.ended
        )
        return True

    def _measured(self, before: dict[str, Sample | None]) -> dict[str, JobMeasurement] | None:
        """Every job's speed and utilization since ``before`` (None: one has no new step)."""
        measured: dict[str, JobMeasurement] = {}
        for j, p in self.processes.items():
            b, a = before[j], sample(p)
            m = measurement(b, a) if b is not None and a is not None else None
            if m is None:
                return None
            measured[j] = m
        return measured

    def _reset(self) -> None:
        for job_id in self.processes:
            self._set(job_id, FULL)


def _remaining(process: JobProcess, at: Sample | None) -> int:
    total = (process.progress() or {}).get("iterations_total")
    done = at.iterations if at is not None else 0
    return int(total) - done if isinstance(total, int) else 10**6


def describe(shares: dict[str, int], partner: str | None, job_id: str, gpus: Sequence[int]) -> dict[str, Any]:
    """The ``packing`` entry of a job's report: with whom it shares which GPUs, at what share."""
    return {"with": partner, "share": shares.get(job_id, FULL), "device_ids": list(gpus)}
