"""Pure metric helpers shared by the simulator and the live load test.

One definition of each number the paper reports (percentiles, CDFs, GPU-hours, provisioned vs
oracle GPUs, immediate-commit fraction), so a simulated figure and a measured one are computed the
same way. Intervals are ``(start_s, end_s, weight)`` triples: weight is GPUs, hosts, replicas...
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Interval = tuple[float, float, float]
FloatArray = npt.NDArray[np.float64]


def percentiles(values: npt.ArrayLike, qs: Sequence[float] = (50, 75, 90, 95, 99)) -> dict[float, float]:
    """{q: value} with linear interpolation between order statistics (numpy's default)."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    if arr.size == 0:
        raise ValueError("percentiles of an empty sample")
    if any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles must be in [0, 100], got {list(qs)}")
    return {float(q): float(v) for q, v in zip(qs, np.percentile(arr, list(qs)), strict=True)}


def cdf_points(values: npt.ArrayLike, max_points: int | None = None) -> tuple[FloatArray, FloatArray]:
    """The empirical CDF as (sorted x, P(X <= x)); thinned to ``max_points`` for plotting."""
    x = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if x.size == 0:
        return x, np.empty(0)
    y = np.arange(1, x.size + 1, dtype=np.float64) / x.size
    if max_points is not None and x.size > max_points:
        if max_points < 2:
            raise ValueError("max_points must be >= 2")
        keep = np.unique(np.linspace(0, x.size - 1, max_points).round().astype(np.int64))
        x, y = x[keep], y[keep]
    return x, y


def _columns(intervals: Iterable[Interval]) -> tuple[FloatArray, FloatArray, FloatArray]:
    arr = np.asarray(
        list(intervals) if not isinstance(intervals, np.ndarray) else intervals, dtype=np.float64
    )
    if arr.size == 0:
        e = np.empty(0)
        return e, e, e
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"intervals must be (start, end, weight) triples, got shape {arr.shape}")
    start, end, w = arr[:, 0], arr[:, 1], arr[:, 2]
    bad = ~(np.isfinite(start) & np.isfinite(end) & np.isfinite(w)) | (end < start)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"interval #{i} {tuple(arr[i])} is not finite or ends before it starts")
    return start, end, w


def weighted_hours(intervals: Iterable[Interval]) -> float:
    """Sum of weight x duration in hours: GPU-hours for (start, end, gpus) intervals."""
    start, end, w = _columns(intervals)
    return float(np.sum((end - start) * w) / 3600.0)


gpu_hours = weighted_hours


def level_on_grid(intervals: Iterable[Interval], grid: npt.ArrayLike) -> FloatArray:
    """Sum of weights of intervals active at each grid time (start <= t < end): a step curve.

    Sort-and-search, O((n + m) log n), so a 90-day trace on a minute grid stays fast.
    """
    start, end, w = _columns(intervals)
    t = np.asarray(grid, dtype=np.float64)
    if start.size == 0:
        return np.zeros(t.shape)
    so = np.argsort(start, kind="stable")
    eo = np.argsort(end, kind="stable")
    started = np.concatenate(([0.0], np.cumsum(w[so])))[np.searchsorted(start[so], t, side="right")]
    ended = np.concatenate(([0.0], np.cumsum(w[eo])))[np.searchsorted(end[eo], t, side="right")]
    return started - ended


def step_integral_hours(grid: npt.ArrayLike, level: npt.ArrayLike) -> float:
    """Integral of a left-continuous step curve sampled on ``grid`` (level[i] holds on [t_i, t_i+1)), in hours."""
    t = np.asarray(grid, dtype=np.float64)
    y = np.asarray(level, dtype=np.float64)
    if t.shape != y.shape:
        raise ValueError(f"grid and level differ in shape: {t.shape} vs {y.shape}")
    if t.size < 2:
        return 0.0
    if np.any(np.diff(t) <= 0):
        raise ValueError("grid must be strictly increasing")
    return float(np.sum(y[:-1] * np.diff(t)) / 3600.0)


@dataclass(frozen=True)
class ProvisionedVsOracle:
    """Figure 8's curves: GPUs provisioned by a policy vs GPUs active trainings need ("oracle")."""

    grid_s: FloatArray
    provisioned: FloatArray
    oracle: FloatArray
    reservation: FloatArray | None
    provisioned_gpu_hours: float
    oracle_gpu_hours: float
    over_provisioned_gpu_hours: float  # orange region: provisioned above oracle
    saved_vs_reservation_gpu_hours: float | None  # green region: reservation minus provisioned


def provisioned_vs_oracle(
    grid: npt.ArrayLike,
    provisioned: Iterable[Interval],
    training: Iterable[Interval],
    reservation: Iterable[Interval] | None = None,
) -> ProvisionedVsOracle:
    """Sample the three curves of Figure 8 on ``grid`` and integrate the shaded regions."""
    t = np.asarray(grid, dtype=np.float64)
    prov = level_on_grid(provisioned, t)
    orac = level_on_grid(training, t)
    res = level_on_grid(reservation, t) if reservation is not None else None
    return ProvisionedVsOracle(
        grid_s=t,
        provisioned=prov,
        oracle=orac,
        reservation=res,
        provisioned_gpu_hours=step_integral_hours(t, prov),
        oracle_gpu_hours=step_integral_hours(t, orac),
        over_provisioned_gpu_hours=step_integral_hours(t, np.maximum(prov - orac, 0.0)),
        saved_vs_reservation_gpu_hours=step_integral_hours(t, res - prov) if res is not None else None,
    )


def immediate_commit_fraction(committed_immediately: Iterable[bool]) -> float:
    """Share of execute requests whose GPUs were committed on arrival (paper: 89.6%)."""
    flags = np.fromiter((bool(f) for f in committed_immediately), dtype=bool)
    if flags.size == 0:
        raise ValueError("immediate-commit fraction of no requests")
    return float(flags.mean())


def immediate_fraction_from_delays(delays_s: npt.ArrayLike, tolerance_s: float = 0.0) -> float:
    """The same from interactivity delays: a request counts as immediate if waited <= ``tolerance_s``."""
    d = np.asarray(delays_s, dtype=np.float64).ravel()
    if d.size == 0:
        raise ValueError("immediate-commit fraction of no requests")
    return float(np.mean(d <= tolerance_s))
