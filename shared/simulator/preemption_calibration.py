"""The loss FitGpp's open parameters are fitted by (``scripts/calibrate_preemption.py``): a point
of the search box as a workload, the baseline figures of its FIFO, LRTP and RAND runs, and their
weighted distance from the paper's.

Only BASELINE figures enter the loss (Table 1's FIFO, LRTP and RAND rows, Table 3's LRTP and RAND
preempted fractions, Table 2's LRTP and RAND re-scheduling intervals): FitGpp's are the target.
The error of a slowdown is ``log((ours - 1 + 0.05) / (paper - 1 + 0.05))`` (the excess over 1, so
1.17 vs 1.30 counts as it should), of a fraction or an interval ``log((ours + 0.002) / (paper +
0.002))``; the loss is the weighted sum of squares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shared.simulator.preemption_sim import (
    BASELINES,
    LOAD_MEASURES,
    PAPER_PREEMPTED_FRACTION,
    PAPER_RESCHEDULING_MIN,
    PAPER_SLOWDOWN,
    PLACEMENTS,
    Workload,
    percentiles,
    run_all,
)

# name, low, high: the continuous open parameters
PARAMS: tuple[tuple[str, float, float], ...] = (
    ("te_runtime_sd", 1.0, 8.0),  # min; TE execution time N(5, sd) up to 30
    ("be_runtime_sd", 5.0, 60.0),  # min; BE execution time N(30, sd) up to 24 h
    ("te_runtime_low", 0.0, 3.0),  # min; lower truncations (the trace kept jobs > 180 s)
    ("be_runtime_low", 0.0, 3.0),
    ("gp_sd", 0.5, 3.0),  # min; GP N(3, sd) in [0, 20]
    ("te_gpus_mean", 0.5, 8.0),  # GPU demand N(mean, cv * mean) in [1, 8]
    ("be_gpus_mean", 0.5, 8.0),
    ("demand_cv", 0.25, 1.5),  # sd / mean of every demand normal
    ("te_host_share", 0.02, 0.5),  # CPU mean = share * 32, RAM mean = share * 256 GB
    ("be_host_share", 0.02, 0.5),
)
CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("placement", PLACEMENTS),
    ("load_measure", LOAD_MEASURES),
)
DIMS = len(PARAMS) + len(CHOICES)

SLOWDOWN_WEIGHT = {"fifo": {"te": (1, 1, 1), "be": (1, 1, 1)}} | {
    p: {"te": (0, 0.5, 0.5), "be": (0.5, 0.5, 0.5)} for p in ("lrtp", "rand")
}
FRACTION_WEIGHT = 3.0
RESCHEDULING_WEIGHT = 0.25


def open_params(x: Sequence[float]) -> dict[str, Any]:
    """A point of the unit cube as the TOML tables ``Workload.from_open`` reads."""
    v = {name: low + (high - low) * float(u) for (name, low, high), u in zip(PARAMS, x, strict=False)}
    cat = {
        name: options[min(int(float(u) * len(options)), len(options) - 1)]
        for (name, options), u in zip(CHOICES, x[len(PARAMS) :], strict=True)
    }

    def demand(kind: str) -> dict[str, dict[str, float]]:
        share, gpus, cv = v[f"{kind}_host_share"], v[f"{kind}_gpus_mean"], v["demand_cv"]
        return {
            "cpus": {"mean": r3(share * 32), "sd": r3(cv * share * 32), "low": 1.0, "high": 32.0},
            "ram_gb": {"mean": r3(share * 256), "sd": r3(cv * share * 256), "low": 1.0, "high": 256.0},
            "gpus": {"mean": r3(gpus), "sd": r3(cv * gpus), "low": 1.0, "high": 8.0},
        }

    def runtime(kind: str) -> dict[str, dict[str, float]]:
        return {"runtime_min": {"sd": r3(v[f"{kind}_runtime_sd"]), "low": r3(v[f"{kind}_runtime_low"])}}

    return {
        "placement": cat["placement"],
        "load_measure": cat["load_measure"],
        "te": runtime("te") | demand("te"),
        "be": runtime("be") | demand("be"),
        "grace_period": {"sd": r3(v["gp_sd"]), "low": 0.0},
    }


def r3(x: float) -> float:
    return round(x, 3)


def figures(w: Workload, seeds: Sequence[int]) -> dict[str, float]:
    """The baseline figures the loss reads (and FitGpp's, for the record only when asked)."""
    te: dict[str, list[np.ndarray]] = {p: [] for p in BASELINES}
    be: dict[str, list[np.ndarray]] = {p: [] for p in BASELINES}
    resched: dict[str, list[np.ndarray]] = {p: [] for p in BASELINES}
    preempted = dict.fromkeys(BASELINES, 0)
    for seed in seeds:
        for name, r in run_all(w, seed=seed, policies=BASELINES).items():
            te[name].append(r.te_slowdown)
            be[name].append(r.be_slowdown)
            resched[name].append(r.rescheduling_min)
            preempted[name] += r.preempted_jobs
    out: dict[str, float] = {}
    for name in BASELINES:
        for kind, pool in (("te", te), ("be", be)):
            for q, val in zip((50, 95, 99), percentiles(np.concatenate(pool[name])), strict=True):
                out[f"{kind}_p{q}_{name}"] = round(val, 3)
        if name != "fifo":
            out[f"preempted_fraction_{name}"] = round(preempted[name] / (w.jobs * len(seeds)), 5)
            intervals = np.concatenate(resched[name])
            for q, val in zip((50, 75, 95, 99), percentiles(intervals, (50, 75, 95, 99)), strict=True):
                out[f"resched_p{q}_{name}"] = round(val, 2) if intervals.size else math.nan
    return out


def _err(ours: float, paper: float, floor: float) -> float:
    if not math.isfinite(ours):
        return 5.0
    return math.log((ours + floor) / (paper + floor))


def loss_terms(f: Mapping[str, float]) -> dict[str, float]:
    """Weighted squared error of every fitted baseline figure."""
    terms: dict[str, float] = {}
    for name, kinds in SLOWDOWN_WEIGHT.items():
        for kind, weights in kinds.items():
            for q, weight, paper in zip((50, 95, 99), weights, PAPER_SLOWDOWN[name][kind], strict=True):
                if weight:
                    key = f"{kind}_p{q}_{name}"
                    terms[key] = weight * _err(f[key] - 1, paper - 1, 0.05) ** 2
    for name in ("lrtp", "rand"):
        key = f"preempted_fraction_{name}"
        terms[key] = FRACTION_WEIGHT * _err(f[key], PAPER_PREEMPTED_FRACTION[name], 0.002) ** 2
        for q, paper in zip((50, 75, 95, 99), PAPER_RESCHEDULING_MIN[name], strict=True):
            if q != 75:
                key = f"resched_p{q}_{name}"
                terms[key] = RESCHEDULING_WEIGHT * _err(f[key], paper, 0.002) ** 2
    return terms


__all__ = ["CHOICES", "DIMS", "PARAMS", "figures", "loss_terms", "open_params"]
