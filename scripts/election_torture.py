#!/usr/bin/env python
"""Run many seeds of the executor-election fault-injection simulation outside the test suite.

Prints exactly one JSON line: ``seeds_run``, ``violations`` (failing seeds), ``wall_s``,
``seeds_per_s``, ``failures`` (seed, first violation, the command that reproduces it) and
aggregate stats (kernel_replica/election_simulation.py says what is simulated and checked).
Exit status 1 if any seed failed. Examples::

    python scripts/election_torture.py --seeds 20000 --jobs 2
    python scripts/election_torture.py --seeds 1 --start 1234 --verbose   # replay one seed, with its trace
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

from kernel_replica.election_simulation import (
    DEFAULT_CHAOS_S,
    Scenario,
    SimResult,
    reproduce_command,
    run_seed,
)

MAX_FAILURES_LISTED = 20


def _run_range(
    start: int, count: int, chaos_s: float, verbose: bool
) -> tuple[list[SimResult], dict[str, int]]:
    failures: list[SimResult] = []
    stats: Counter[str] = Counter()
    for seed in range(start, start + count):
        result = run_seed(seed, Scenario.for_seed(seed, chaos_s=chaos_s), verbose=verbose)
        stats.update(result.stats)
        stats["sim_s"] += round(result.sim_s)
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
    parser.add_argument("--chaos-s", type=float, default=DEFAULT_CHAOS_S, help="simulated seconds of faults")
    parser.add_argument("--verbose", action="store_true", help="print each failing seed's trace to stderr")
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
    verbose = args.verbose and args.seeds <= 10  # traces only for a replay, not for a sweep
    if jobs == 1:
        outcomes = [_run_range(s, n, args.chaos_s, verbose) for s, n in ranges]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(
                pool.map(
                    _run_range,
                    *zip(*ranges, strict=True),
                    [args.chaos_s] * len(ranges),
                    [verbose] * len(ranges),
                )
            )
    failures: list[SimResult] = []
    stats: Counter[str] = Counter()
    for part_failures, part_stats in outcomes:
        failures.extend(part_failures)
        stats.update(part_stats)
    failures.sort(key=lambda r: r.seed)
    wall_s = time.perf_counter() - started
    if args.verbose:
        for result in failures:
            for line in result.trace:
                print(f"seed {result.seed} {line}", file=sys.stderr)
            for violation in result.violations:
                print(f"seed {result.seed}: {violation}", file=sys.stderr)
    report = {
        "seeds_run": args.seeds,
        "start": args.start,
        "chaos_s": args.chaos_s,
        "violations": len(failures),
        "wall_s": round(wall_s, 2),
        "seeds_per_s": round(args.seeds / wall_s, 1),
        "jobs": jobs,
        "failures": [
            {
                "seed": r.seed,
                "violation": r.violations[0],
                "reproduce": reproduce_command(r.seed, args.chaos_s),
            }
            for r in failures[:MAX_FAILURES_LISTED]
        ],
        "stats": dict(sorted(stats.items())),
    }
    print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
