"""A reference point for finish-time fairness: ideal egalitarian processor sharing (fluid).

Why. Themis's rho = T_sh / T_id with T_id = B * N_avg / min(R, demand) is the finish time in a
1/N_avg share of the cluster. If at every instant each active app got R / N(t) GPUs (or all it
can use, when that is less, the rest going to the others), an app whose own parallelism never
binds would run B = R * integral(1 / N) dt >= R * T^2 / integral(N) dt (Jensen), so T <= T_id:
rho <= 1. Only an app's own stragglers (its last jobs cannot use its share) and its demand cap
push rho above 1 under such sharing. The bench reports this policy's max rho next to the real
ones: a scheduler's max rho cannot be far below it on the same trace, which bounds how much any
policy can improve on a baseline that is already close to it.

The model. Fluid: GPUs are divisible, no placement slowdown, no leases, no rounds. Between
events (an arrival, a job's end) rates are constant: the R GPUs are water-filled across active
apps up to each app's usable parallelism (sum of its unfinished jobs' ``max_gpus``), and an app's
share is water-filled across its unfinished jobs up to each job's ``max_gpus``. rho is measured
as the simulator measures it (N_avg and R over the app's life). Successive-halving apps are
treated as plain apps of their phase-1 jobs (their budget B is kept), so use it on plain traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shared.workload.be_model import BeWorkload


def water_fill(total: float, caps: Sequence[float]) -> list[float]:
    """Split ``total`` equally, no one above its cap, what a capped one leaves going to the rest."""
    out = [0.0] * len(caps)
    left = total
    order = sorted(range(len(caps)), key=lambda i: caps[i])
    for k, i in enumerate(order):
        share = left / (len(order) - k)
        out[i] = min(caps[i], share)
        left -= out[i]
    return out


def fluid_ps_rho(workload: BeWorkload, gpus: int) -> dict[str, float]:
    """Each app's rho under ideal egalitarian processor sharing of ``gpus`` GPUs."""
    apps = sorted(workload.apps, key=lambda a: (a.submitted_at, a.app_id))
    remaining: dict[str, np.ndarray] = {}
    caps: dict[str, np.ndarray] = {}
    area: dict[str, float] = {}
    rho: dict[str, float] = {}
    by_id = {a.app_id: a for a in apps}
    now = apps[0].submitted_at if apps else 0.0
    i = 0
    while i < len(apps) or remaining:
        while i < len(apps) and apps[i].submitted_at <= now:
            a = apps[i]
            remaining[a.app_id] = np.array([j.work_gpu_s for j in a.jobs], dtype=float)
            caps[a.app_id] = np.array([j.max_gpus for j in a.jobs], dtype=float)
            area[a.app_id] = 0.0
            i += 1
        ids = sorted(remaining)
        usable = [float(caps[a][remaining[a] > 0].sum()) for a in ids]
        shares = water_fill(float(gpus), usable)
        rates: dict[str, np.ndarray] = {}
        horizon = apps[i].submitted_at - now if i < len(apps) else math.inf
        for a, share in zip(ids, shares, strict=True):
            live = remaining[a] > 0
            r = np.zeros_like(remaining[a])
            r[live] = water_fill(share, caps[a][live].tolist())
            rates[a] = r
            moving = r > 0
            if moving.any():
                horizon = min(horizon, float((remaining[a][moving] / r[moving]).min()))
        if math.isinf(horizon):
            break  # no GPU (gpus == 0): nothing can finish
        n = len(ids)
        now += horizon
        for a in ids:
            remaining[a] = np.maximum(0.0, remaining[a] - rates[a] * horizon)
            remaining[a][remaining[a] < 1e-6] = 0.0
            area[a] += n * horizon
        for a in ids:
            if not (remaining[a] > 0).any():
                spec = by_id[a]
                life = now - spec.submitted_at
                n_avg = max(1.0, area[a] / life) if life > 0 else 1.0
                t_id = spec.budget_gpu_s * n_avg / min(float(gpus), float(spec.demand_max_gpus))
                rho[a] = life / t_id
                del remaining[a], caps[a]
    return rho
