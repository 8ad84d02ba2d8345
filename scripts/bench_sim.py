#!/usr/bin/env python
"""Simulator speed: wall and CPU seconds per policy on a D-day synthetic trace and on the 17.5-hour excerpt.

The target (issue #6) is <= 60 s wall per policy for 90 days on a 2-core machine. Wall time on a
shared machine is inflated by other work, so CPU seconds are reported too, and each policy's CPU
time as a ratio to the baseline measured in the same run: the reservation policy, whose decisions
are trivial, so its time is the event loop's own cost.

Prints ONE JSON line. Usage: ``python scripts/bench_sim.py [--days 90] [--seed 1]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.simulator.cli import run_sim
from shared.simulator.engine import POLICY_NAMES
from shared.workload.idlt import DAY, EXCERPT_HOURS, excerpt_17_5h, generate


def measure(trace: object, window_s: float, seed: int) -> dict[str, dict[str, float]]:
    results, _ = run_sim(trace, list(POLICY_NAMES), seed=seed, window_end_s=window_s, progress=False)  # type: ignore[arg-type]
    base = max(results["reservation"].cpu_s, 1e-9)
    return {
        name: {
            "wall_s": round(r.wall_s, 3),
            "cpu_s": round(r.cpu_s, 3),
            "cpu_vs_reservation": round(r.cpu_s / base, 2),
        }
        for name, r in results.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = generate(args.days, args.seed)
    gen_s = time.perf_counter() - t0
    long_run = measure(trace, args.days * DAY, args.seed)
    excerpt = measure(excerpt_17_5h(args.seed), EXCERPT_HOURS * 3600, args.seed)
    report = {
        "bench": "sim",
        "days": args.days,
        "sessions": len(trace.sessions),
        "tasks": trace.n_tasks,
        "generate_s": round(gen_s, 3),
        "per_policy": long_run,
        "excerpt_17_5h": excerpt,
        "max_wall_s": max(v["wall_s"] for v in long_run.values()),
        "target_wall_s": 60.0,
    }
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
