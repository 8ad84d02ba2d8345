#!/usr/bin/env python
"""Preemption benchmark (issue #17), simulation half: FitGpp's synthetic experiment (§4.2) with
FIFO, LRTP, RAND and FitGpp on Tandem's policy objects (``shared.policies.preemption``).

Prints ONE JSON line: ``te_slowdown_p50/p95/p99_<policy>``, ``be_slowdown_p50/p95/p99_<policy>``
and ``preempted_fraction_<policy>`` (jobs preempted at least once / all jobs) for fifo, lrtp, rand
and fitgpp, the sim scale, the load FIFO kept, and ``wall_s``. Slowdowns pool every seed's jobs
(the paper pools eight workloads of 2^16 jobs). Targets: fitgpp TE p95 <= 1.15 with BE p50 <=
3.28, and ``preempted_fraction_fitgpp`` <= 0.1 x lrtp's.

The live half (``revoke_p50_ms``, ``revoke_p99_ms``, ``cell_delay_p99_ms_with_be`` /
``_without_be``) needs live leases on an embedded cluster and is not measured here yet.

``--variant`` swaps in a sensitivity variant of the parameters the paper leaves open
(``shared.simulator.preemption_sim.VARIANTS``), to diagnose a result, not to report one.

Usage: ``python scripts/bench_preemption.py [--quick] [--seeds 8] [--jobs 65536] [--variant default]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.policies.preemption import POLICY_NAMES
from shared.simulator.preemption_sim import VARIANTS, percentiles, run_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2^13 jobs, one seed (a few seconds)")
    parser.add_argument("--seeds", type=int, default=None, help="workloads to pool (default 8; quick 1)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per workload (default 2^16; quick 2^13)")
    parser.add_argument("--s", type=float, default=None, help="FitGpp's s (default 4.0)")
    parser.add_argument(
        "--variant",
        choices=sorted(VARIANTS),
        default="default",
        help="open-parameter sensitivity (diagnosis only)",
    )
    args = parser.parse_args()
    seeds = args.seeds or (1 if args.quick else 8)
    w = VARIANTS[args.variant].scaled(args.jobs or (2**13 if args.quick else 2**16))
    if args.s is not None:
        w = replace(w, s=args.s)

    started = time.perf_counter()
    te: dict[str, list[np.ndarray]] = {p: [] for p in POLICY_NAMES}
    be: dict[str, list[np.ndarray]] = {p: [] for p in POLICY_NAMES}
    preempted = dict.fromkeys(POLICY_NAMES, 0)
    preemptions = dict.fromkeys(POLICY_NAMES, 0)
    over_budget = dict.fromkeys(POLICY_NAMES, 0)
    resched: dict[str, list[np.ndarray]] = {p: [] for p in POLICY_NAMES}
    loads: list[float] = []
    for seed in range(1, seeds + 1):
        for name, r in run_all(w, seed=seed, policies=POLICY_NAMES).items():
            te[name].append(r.te_slowdown)
            be[name].append(r.be_slowdown)
            preempted[name] += r.preempted_jobs
            preemptions[name] += r.preemptions
            over_budget[name] += r.over_budget_preemptions
            resched[name].append(r.rescheduling_min)
            if name == "fifo":
                loads.append(r.load)

    total_jobs = w.jobs * seeds
    out: dict[str, object] = {
        "sim_variant": args.variant,
        "sim_nodes": w.nodes,
        "sim_gpus_per_node": w.node_gpus,
        "sim_jobs_per_seed": w.jobs,
        "sim_seeds": seeds,
        "sim_te_fraction": w.te_fraction,
        "sim_s": w.s,
        "sim_max_preemptions": w.max_preemptions,
        "fifo_load": round(float(np.mean(loads)), 3),
    }
    for name in POLICY_NAMES:
        for kind, pools in (("te", te), ("be", be)):
            for q, v in zip((50, 95, 99), percentiles(np.concatenate(pools[name])), strict=True):
                out[f"{kind}_slowdown_p{q}_{name}"] = round(v, 3)
        out[f"preempted_fraction_{name}"] = round(preempted[name] / total_jobs, 5)
        out[f"preemptions_{name}"] = preemptions[name]
        out[f"over_budget_preemptions_{name}"] = over_budget[name]
        if name != "fifo":
            p50, p95 = percentiles(np.concatenate(resched[name]), (50, 95))
            out[f"rescheduling_p50_min_{name}"] = round(p50, 2)
            out[f"rescheduling_p95_min_{name}"] = round(p95, 2)
    lrtp = preempted["lrtp"]
    out["preempted_ratio_fitgpp_to_lrtp"] = round(preempted["fitgpp"] / lrtp, 4) if lrtp else None
    out["target_te_p95_fitgpp_met"] = bool(out["te_slowdown_p95_fitgpp"] <= 1.15)  # type: ignore[operator]
    out["target_be_p50_fitgpp_met"] = bool(out["be_slowdown_p50_fitgpp"] <= 3.28)  # type: ignore[operator]
    out["target_preempted_fraction_met"] = bool(lrtp and preempted["fitgpp"] <= 0.1 * lrtp)
    out["wall_s"] = round(time.perf_counter() - started, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
