#!/usr/bin/env python
"""Run many seeds of the Raft fault-injection simulation outside the test suite.

Prints exactly one JSON line: ``seeds_run``, ``violations`` (failing seeds), ``wall_s``,
``failures`` (seed, first violation, the command that reproduces it) and aggregate stats.
Exit status 1 if any seed failed. Examples::

    python scripts/raft_torture.py --seeds 20000 --jobs 2
    python scripts/raft_torture.py --seeds 1 --start 1234          # replay one seed
    python scripts/raft_torture.py --seeds 1 --start 1234 --verbose
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.raft.simulation import Scenario, SimResult, reproduce_command, run_seed

MAX_FAILURES_LISTED = 20


def _run_range(start: int, count: int, chaos_ticks: int) -> tuple[list[SimResult], dict[str, int]]:
    failures: list[SimResult] = []
    stats: Counter[str] = Counter()
    for seed in range(start, start + count):
        result = run_seed(seed, Scenario.for_seed(seed, chaos_ticks=chaos_ticks))
        run_stats = dict(result.stats)
        leader_ticks = run_stats.pop("leader_after_heal_ticks", -1)
        stats.update(run_stats)
        stats["max_heal_ticks"] = max(stats["max_heal_ticks"], result.heal_ticks)
        stats["max_leader_after_heal_ticks"] = max(stats["max_leader_after_heal_ticks"], leader_ticks)
        if not result.ok:
            failures.append(result)
    return failures, dict(stats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, required=True, help="how many seeds to run")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--chaos-ticks", type=int, default=200, help="ticks of faults before healing")
    parser.add_argument("--verbose", action="store_true", help="print every violation to stderr")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be >= 1")

    started = time.perf_counter()
    jobs = min(args.jobs, args.seeds)
    chunk = -(-args.seeds // jobs)
    ranges = [
        (start, min(chunk, args.start + args.seeds - start))
        for start in range(args.start, args.start + args.seeds, chunk)
    ]
    failures: list[SimResult] = []
    stats: Counter[str] = Counter()
    if jobs == 1:
        outcomes = [_run_range(s, n, args.chaos_ticks) for s, n in ranges]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(
                pool.map(_run_range, *zip(*ranges, strict=True), [args.chaos_ticks] * len(ranges))
            )
    maxima = ("max_heal_ticks", "max_leader_after_heal_ticks")
    for part_failures, part_stats in outcomes:
        failures.extend(part_failures)
        peaks = {k: max(stats[k], part_stats.pop(k, 0)) for k in maxima}
        stats.update(part_stats)  # Counter.update adds: right for totals, not for maxima
        for key, peak in peaks.items():
            stats[key] = peak
    failures.sort(key=lambda r: r.seed)
    if args.verbose:
        for result in failures:
            for violation in result.violations:
                print(f"seed {result.seed}: {violation}", file=sys.stderr)
    command = reproduce_command
    report = {
        "seeds_run": args.seeds,
        "start": args.start,
        "chaos_ticks": args.chaos_ticks,
        "violations": len(failures),
        "wall_s": round(time.perf_counter() - started, 2),
        "failures": [
            {"seed": r.seed, "violation": r.violations[0], "reproduce": command(r.seed, args.chaos_ticks)}
            for r in failures[:MAX_FAILURES_LISTED]
        ],
        "stats": dict(sorted(stats.items())),
    }
    print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
