"""Mixed runs: IDLT notebooks plus best-effort (BE) training apps on the same cluster.

Coupling. The notebook simulation (``Simulator``, the cluster core's decisions untouched) runs
first and records, through ``Simulator(gpu_recorder=...)``, each live host's GPU count and how
many of its GPUs are committed to cells, whenever either changes. The BE simulator then replays
that as its ``GpuTimeline``: the BE-usable GPUs at time t are the uncommitted GPUs of the hosts
alive at t. This one-way coupling rests on two assumptions of this issue, both stated in the docs:

* **Cells always win and BE never delays a cell.** A cell that arrives on a GPU leased to BE takes
  it; the lease ends at that instant (``run_be`` cuts it within the round) and the BE job loses its
  progress since its last completed step. Preemption cost to the cell (the FitGpp issue) and
  checkpoints (the checkpoint issue) come later, so the notebook run does not depend on BE and
  its delays are those of notebookos alone.
* **The autoscaler does not count BE demand.** Hosts are scaled for cells only; BE uses what cells
  leave idle and never causes a scale-out (nor blocks a scale-in: a host released while BE holds
  GPUs on it ends those leases like a cell would).

Devices. The core's ledgers count committed GPUs per host; a host with c of its G GPUs committed
offers devices c..G-1 to BE (cells take the lowest-numbered devices). Only the count matters to
both simulators, so this labelling changes no figure.

Utilization. ``provisioned_gpu_utilization`` = (cell GPU-time + BE GPU-time) / provisioned
GPU-time inside the window: cells count from commit to end (as ``allocated_gpu_hours``), BE
counts the GPU-time its jobs ran (leased GPUs a job could not use, e.g. after it finished within
a round, are idle), provisioned counts every host the provider paid for, from its request.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.arbiter import GpuSlot
from shared.simulator.be import BeRunResult, BeSimParams, run_be
from shared.workload.be_model import BeWorkload
from shared.workload.themis_workload import ThemisWorkloadParams, generate_themis_workload

#: Themis §6.1's simulated cluster: Workload 1's 85 apps are sized for 256 GPUs.
THEMIS_CLUSTER_GPUS = 256
THEMIS_APPS = 85


@dataclass
class CommittedRecorder:
    """``Simulator(gpu_recorder=...)``'s sink: (time, host, GPUs, committed) in time order."""

    events: list[tuple[float, str, int, int]] = field(default_factory=list)

    def __call__(self, now: float, host_id: str, gpus: int, committed: int) -> None:
        self.events.append((now, host_id, gpus, committed))

    def timeline(self) -> CellTimeline:
        return CellTimeline(self.events)


class CellTimeline:
    """The BE-usable GPUs over time (a ``GpuTimeline``): uncommitted devices of live hosts.

    ``at`` replays the events forward with a cursor (the BE simulator asks in time order; an
    earlier time restarts the replay), so a long run costs one pass over the events."""

    def __init__(self, events: list[tuple[float, str, int, int]]) -> None:
        self.events = sorted(events, key=lambda e: e[0])
        self.times = sorted({e[0] for e in self.events})
        self._reset()

    def _reset(self) -> None:
        self._pos = 0
        self._state: dict[str, tuple[int, int]] = {}
        self._slots: frozenset[GpuSlot] | None = frozenset()

    def state_at(self, now: float) -> dict[str, tuple[int, int]]:
        """Host -> (GPUs, committed) at ``now`` (events at ``now`` applied)."""
        if self._pos and self.events[self._pos - 1][0] > now:
            self._reset()
        while self._pos < len(self.events) and self.events[self._pos][0] <= now:
            _, host, gpus, committed = self.events[self._pos]
            if gpus:
                self._state[host] = (gpus, committed)
            else:
                self._state.pop(host, None)
            self._pos += 1
            self._slots = None
        return self._state

    def at(self, now: float) -> frozenset[GpuSlot]:
        state = self.state_at(now)
        if self._slots is None:
            self._slots = frozenset(GpuSlot(h, d) for h, (g, c) in state.items() for d in range(c, g))
        return self._slots

    def next_change(self, now: float) -> float:
        i = bisect.bisect_right(self.times, now)
        return self.times[i] if i < len(self.times) else math.inf

    def integrals(self, end: float) -> tuple[float, float]:
        """(committed GPU-seconds, BE-usable GPU-seconds) over [0, ``end``)."""
        state: dict[str, tuple[int, int]] = {}
        committed = usable = 0.0
        last = 0.0
        for t, host, gpus, c in self.events:
            t = min(t, end)
            dt = t - last
            if dt > 0:
                committed += dt * sum(v[1] for v in state.values())
                usable += dt * sum(v[0] - v[1] for v in state.values())
                last = t
            if gpus:
                state[host] = (gpus, c)
            else:
                state.pop(host, None)
        if end > last:
            committed += (end - last) * sum(v[1] for v in state.values())
            usable += (end - last) * sum(v[0] - v[1] for v in state.values())
        return committed, usable


def be_workload_for(
    usable_gpu_s: float, window_s: float, *, load: float, seed: int
) -> tuple[BeWorkload, float]:
    """Themis Workload 1 scaled to this cluster: apps in proportion to the mean BE-usable GPUs
    (85 apps for 256 GPUs, at least 4), arrivals uniform over the first 3/4 of the window, task
    lengths scaled so the BE work is ``load`` times the BE-usable GPU-time (load > 1: more work
    than idle GPUs, as the issue's "idle GPUs run BE" wants). Returns it and the task scale."""
    mean_gpus = usable_gpu_s / window_s if window_s > 0 else 0.0
    n_apps = max(4, round(THEMIS_APPS * mean_gpus / THEMIS_CLUSTER_GPUS))
    base = ThemisWorkloadParams(n_apps=n_apps, arrival_span_s=0.75 * window_s, seed=seed)
    unit = generate_themis_workload(base).work_gpu_hours * 3600.0
    scale = load * usable_gpu_s / unit if unit > 0 else 1.0
    return generate_themis_workload(
        ThemisWorkloadParams(n_apps=n_apps, arrival_span_s=0.75 * window_s, work_scale=scale, seed=seed)
    ), scale


@dataclass(frozen=True)
class MixedResult:
    """A mixed run's BE side and its accounting over the window."""

    be: BeRunResult
    workload: BeWorkload
    window_s: float
    cell_gpu_s: float
    usable_gpu_s: float

    def numbers(self, provisioned_gpu_h: float) -> dict[str, Any]:
        be_gpu_s = self.be.gpu_seconds_allocated
        peak: dict[str, float] = {}
        for app in self.be.apps:
            series = self.be.rho_series.get(app.app_id, [])
            peak[app.app_id] = round(max([app.rho, *(r for _, r in series)]), 4)
        provisioned_s = provisioned_gpu_h * 3600.0
        return {
            "provisioned_gpu_utilization": round((self.cell_gpu_s + be_gpu_s) / provisioned_s, 4)
            if provisioned_s
            else None,
            "cell_gpu_hours": round(self.cell_gpu_s / 3600.0, 4),
            "be_gpu_hours": round(be_gpu_s / 3600.0, 4),
            "be_usable_gpu_hours": round(self.usable_gpu_s / 3600.0, 4),
            "idle_gpu_hours": round(provisioned_gpu_h - (self.cell_gpu_s + be_gpu_s) / 3600.0, 4),
            "be_lost_gpu_hours": round(self.be.lost_gpu_seconds / 3600.0, 4),
            "be_leases_cut_by_cells": self.be.cuts,
            "be_apps": len(self.workload.apps),
            "be_jobs": self.workload.n_jobs,
            "be_apps_finished": sum(1 for a in self.be.apps if a.finished_at is not None),
            "be_work_gpu_hours": round(self.workload.work_gpu_hours, 2),
            "be_max_rho": round(self.be.max_rho, 4) if self.be.apps else None,
            "be_rho_by_app": {a.app_id: round(a.rho, 4) for a in self.be.apps},
            "be_peak_estimated_rho_by_app": peak,
            "be_auction_p50_ms": round(self.be.auction_percentile_ms(0.5), 2),
            "be_wall_s": round(self.be.wall_s, 2),
        }


def run_be_on_cells(
    recorder: CommittedRecorder,
    window_s: float,
    *,
    load: float = 1.5,
    policy: str = "themis",
    seed: int = 0,
    params: BeSimParams | None = None,
    observer: Callable[[float, frozenset[GpuSlot]], None] | None = None,
) -> MixedResult:
    """Run BE apps (Workload-1-like, scaled to the cluster) on the GPUs the recorded notebook run
    left uncommitted, up to ``window_s``."""
    timeline = recorder.timeline()
    cell_s, usable_s = timeline.integrals(window_s)
    workload, scale = be_workload_for(usable_s, window_s, load=load, seed=seed)
    p = params or BeSimParams(seed=seed, time_scale=scale)
    p = dataclasses.replace(p, max_time_s=min(p.max_time_s, window_s))
    be = run_be(workload, policy, params=p, timeline=timeline, observer=observer)
    return MixedResult(be, workload, window_s, cell_s, usable_s)
