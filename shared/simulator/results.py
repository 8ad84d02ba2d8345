"""From a ``SimResult`` to the paper's figures: delays, GPU-hours, billing, re-execution savings.

Every number goes through the shared definitions in ``shared.workload.metrics`` and
``shared.workload.billing``, the same ones the live load test uses, so a simulated figure and a
measured one are computed alike. ``gpu_hours`` counts the GPUs of the servers the provider paid
for (Figure 8's "provisioned", the basis of the provider's cost); ``allocated_gpu_hours`` counts
GPUs bound to runtimes (reserved for a session, or committed to a cell from its dispatch to its end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.simulator.engine import SimResult
from shared.workload.billing import Rates, Usage, UsageKind, summarize
from shared.workload.metrics import immediate_commit_fraction, level_on_grid, percentiles, weighted_hours
from shared.workload.model import Trace

FloatArray = npt.NDArray[np.float64]


def _pct(values: FloatArray) -> dict[float, float]:
    return percentiles(values, (50, 90, 99)) if values.size else dict.fromkeys((50.0, 90.0, 99.0), math.nan)


def _r(value: float, digits: int) -> float | None:
    """Rounded for the report; None where there is no value (no cells ran, no revenue)."""
    return None if value is None or math.isnan(value) else round(float(value), digits)


def reexecution_events(trace: Trace, after_h: float) -> tuple[FloatArray, FloatArray]:
    """(time, GPU-hours) of each re-execution idle reclamation would force (Figure 13).

    A session idle longer than ``after_h`` between the end of one task and the next submit loses
    its kernel; without replicated, persisted state the user re-runs the GPU cells that built the
    lost state before going on: those executed since the kernel last (re)started, i.e. since the
    session began or since the previous reclamation, at their recorded durations. (Re-running
    *every* earlier execution would count a training cell run 100 times 100 times over; this is the
    conservative reading.) NotebookOS keeps the state, so this is GPU time it saves.
    """
    if trace.n_tasks < 2:
        return np.empty(0), np.empty(0)
    order = np.lexsort((trace.task_submit_s, trace.task_session))
    sess = trace.task_session[order]
    submit = trace.task_submit_s[order]
    end = trace.task_end_s[order]
    gpu_s = trace.task_duration_s[order] * trace.task_gpus[order]
    first = np.r_[True, sess[1:] != sess[:-1]]
    gap = np.r_[0.0, submit[1:] - end[:-1]]
    hit = ~first & (gap > after_h * 3600.0)
    segment = np.cumsum(first | hit) - 1  # tasks between two kernel (re)starts
    per_segment = np.bincount(segment, weights=gpu_s)
    return submit[hit], per_segment[segment[hit] - 1] / 3600.0


@dataclass(frozen=True)
class Summary:
    """One policy's headline numbers (the ``--json`` object) plus the curves the plots draw."""

    numbers: dict[str, Any]
    delays_s: FloatArray
    tct_s: FloatArray


def clip(intervals: FloatArray, window_end_s: float | None) -> FloatArray:
    """(start, end, w) intervals cut at ``window_end_s`` (None: unchanged)."""
    if window_end_s is None or intervals.size == 0:
        return intervals
    out = intervals[intervals[:, 0] < window_end_s].copy()
    out[:, 1] = np.minimum(out[:, 1], window_end_s)
    return out


def summarize_run(
    r: SimResult, reservation: SimResult | None = None, window_end_s: float | None = None
) -> Summary:
    """Delays and TCTs of every cell; GPU-hours and billing inside [0, ``window_end_s``].

    A synthetic trace of D days keeps running after day D only to let trainings that started
    before it finish; the paper's figures are over the trace's span, hence the window.
    """
    tr = r.trace
    p = r.params
    ran = ~np.isnan(r.exec_start_s)
    delays = (r.exec_start_s - tr.task_submit_s)[ran]
    tct = (r.end_s_task - tr.task_submit_s)[ran]
    gpus = tr.task_gpus.astype(np.float64)
    training = clip(np.c_[r.exec_start_s[ran], r.exec_end_s[ran], gpus[ran]], window_end_s)
    exec_gpu_h = weighted_hours(training)
    exec_h = weighted_hours(np.c_[training[:, :2], np.ones(len(training))])
    if r.policy == "reservation":
        allocated = weighted_hours(clip(r.reserved_intervals, window_end_s))
    else:
        allocated = weighted_hours(clip(np.c_[r.commit_s[ran], r.end_s_task[ran], gpus[ran]], window_end_s))
    hosts = clip(r.host_intervals, window_end_s)
    provisioned = weighted_hours(hosts)
    rates: Rates = p.rates()
    usages: list[Usage] = []
    if r.policy == "reservation":
        usages.append(Usage(0.0, 3600.0, UsageKind.RESERVED, allocated))
    else:
        usages.append(Usage(0.0, 3600.0, UsageKind.TRAINING, exec_gpu_h))
    if r.policy == "notebookos":
        standby_h = max(weighted_hours(clip(r.replica_intervals, window_end_s)) - exec_h, 0.0)
        usages.append(Usage(0.0, 3600.0, UsageKind.STANDBY, standby_h))
    servers = [(a, b, 1.0) for a, b, _g in hosts.tolist()]
    bill = summarize(usages, servers, rates)
    d, t = _pct(delays), _pct(tct)
    numbers: dict[str, Any] = {
        "sessions": len(tr.sessions),
        "tasks": tr.n_tasks,
        "cells_run": int(ran.sum()),
        "cells_failed": r.cells_failed,
        "horizon_h": round(r.end_s / 3600.0, 3),
        "window_h": round((window_end_s if window_end_s is not None else r.end_s) / 3600.0, 3),
        "wall_s": round(r.wall_s, 3),
        "cpu_s": round(r.cpu_s, 3),
        "gpu_hours": round(provisioned, 4),
        "allocated_gpu_hours": round(allocated, 4),
        "oracle_gpu_hours": round(weighted_hours(clip(tr.task_intervals(), window_end_s)), 4),
        "gpu_hours_saved_vs_reservation": None,
        "interactivity_delay_p50_s": _r(d[50.0], 4),
        "interactivity_delay_p90_s": _r(d[90.0], 4),
        "interactivity_delay_p99_s": _r(d[99.0], 4),
        "interactivity_delay_mean_s": round(float(delays.mean()), 4) if delays.size else None,
        "immediate_commit_fraction": round(immediate_commit_fraction(r.immediate), 4) if tr.n_tasks else None,
        "tct_p50_s": _r(t[50.0], 3),
        "tct_p90_s": _r(t[90.0], 3),
        "tct_p99_s": _r(t[99.0], 3),
        "migrations": len(r.migration_s),
        "scale_outs": len(r.scale_out_s),
        "scale_ins": len(r.scale_in_s),
        "max_hosts": int(level_on_grid(_unit(r.host_intervals), _edges(r)).max())
        if len(r.host_intervals)
        else 0,
        "provider_cost": round(bill.cost, 2),
        "revenue": round(bill.revenue, 2),
        "profit_margin": _r(bill.margin, 4),
        "provider_cost_reduction_vs_reservation": None,
    }
    if r.subscription.size:
        numbers["subscription_ratio_mean"] = round(float(r.subscription[:, 1].mean()), 4)
        numbers["subscription_ratio_max"] = round(float(r.subscription[:, 1].max()), 4)
    if r.policy == "notebookos":
        numbers["reexecution_gpu_hours_saved"] = {
            f"{h:g}h": round(float(reexecution_events(tr, h)[1].sum()), 2) for h in p.reclaim_after_h
        }
    if p.hibernate_after_s > 0:
        numbers.update(hibernation_numbers(r, window_end_s))
    if reservation is not None:
        res_hosts = clip(reservation.host_intervals, window_end_s)
        res_prov = weighted_hours(res_hosts)
        res_cost = summarize([], [(a, b, 1.0) for a, b, _g in res_hosts.tolist()], rates).cost
        numbers["gpu_hours_saved_vs_reservation"] = round(res_prov - provisioned, 4)
        numbers["provider_cost_reduction_vs_reservation"] = (
            round(1.0 - bill.cost / res_cost, 4) if res_cost > 0 else None
        )
    return Summary(numbers, delays, tct)


def hibernation_numbers(r: SimResult, window_end_s: float | None) -> dict[str, Any]:
    """What hibernation freed (kernel-hours without replicas, their memory, the GPU subscriptions
    of their replicas) and what it cost (the waits of the cells that resumed a kernel)."""
    p = r.params
    hibernated = clip(r.hibernated_intervals, window_end_s)
    kernel_h = weighted_hours(np.c_[hibernated[:, :2], np.ones(len(hibernated))])
    resumes = np.array(r.resume_delays_s)
    q = _pct(resumes)
    return {
        "hibernations": len(r.hibernated_intervals),
        "hibernated_kernel_hours": round(kernel_h, 3),
        "hibernation_memory_gb_hours_freed": round(kernel_h * p.kernel_memory_mb / 1024.0, 3),
        "hibernation_subscribed_gpu_hours_freed": round(
            weighted_hours(hibernated) * p.replicas_per_kernel, 3
        ),
        "resumes": int(resumes.size),
        "resume_delay_p50_s": _r(q[50.0], 3),
        "resume_delay_p99_s": _r(q[99.0], 3),
        "resume_delay_mean_s": round(float(resumes.mean()), 3) if resumes.size else None,
    }


def _unit(intervals: FloatArray) -> FloatArray:
    out = intervals.copy()
    out[:, 2] = 1.0
    return out


def _edges(r: SimResult) -> FloatArray:
    """Every host interval's start: where the host count can reach its maximum."""
    return np.unique(r.host_intervals[:, 0])


def timeline_grid(results: list[SimResult], window_end_s: float | None = None) -> FloatArray:
    end = window_end_s if window_end_s is not None else max((r.end_s for r in results), default=0.0)
    step = results[0].params.timeline_step_s if results else 60.0
    return np.arange(0.0, max(end, step) + step, step)


def gpu_timelines(r: SimResult, grid: FloatArray) -> dict[str, FloatArray]:
    """Provisioned, allocated and oracle GPUs on ``grid`` (Figure 8's curves)."""
    tr = r.trace
    ran = ~np.isnan(r.exec_start_s)
    gpus = tr.task_gpus.astype(np.float64)
    if r.policy == "reservation":
        allocated = level_on_grid(r.reserved_intervals, grid)
    else:
        allocated = level_on_grid(np.c_[r.commit_s[ran], r.end_s_task[ran], gpus[ran]], grid)
    return {
        "provisioned": level_on_grid(r.host_intervals, grid),
        "allocated": allocated,
        "oracle": level_on_grid(tr.task_intervals(), grid),
    }


def cumulative_billing(r: SimResult, grid: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(provider cost, revenue) accrued by each grid time (Figure 12(a)), at the shared rates."""
    rates = r.params.rates()
    tr = r.trace
    ran = ~np.isnan(r.exec_start_s)
    gpus = tr.task_gpus.astype(np.float64)
    dt_h = np.diff(grid, append=grid[-1]) / 3600.0
    cost_rate = level_on_grid(_unit(r.host_intervals), grid) * rates.vm_rate_per_hour
    if r.policy == "reservation":
        revenue_rate = level_on_grid(r.reserved_intervals, grid) * rates.price_per_hour(UsageKind.RESERVED, 1)
    else:
        training = np.c_[r.exec_start_s[ran], r.exec_end_s[ran], gpus[ran]]
        revenue_rate = level_on_grid(training, grid) * rates.price_per_hour(UsageKind.TRAINING, 1)
        if r.policy == "notebookos":
            executing = level_on_grid(np.c_[training[:, :2], np.ones(len(training))], grid)
            standby = np.maximum(level_on_grid(r.replica_intervals, grid) - executing, 0.0)
            revenue_rate = revenue_rate + standby * rates.price_per_hour(UsageKind.STANDBY, 1)
    return np.cumsum(cost_rate * dt_h), np.cumsum(revenue_rate * dt_h)
