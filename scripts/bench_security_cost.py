"""What encryption and authentication cost a trivial cell, measured so that no side of the A/B is
favoured: ``bench_ab.py REV REV --without-security a`` and ``... b`` in turn, pooled.

Why not one ``bench_ab.py --without-security a``: an A/A run (the same revision on both sides)
is not centred on zero. On the 2-core development VM, five A/A runs of 40 x 50 cells all had
side B faster (per-round p50 change, median of each run: -0.08 to -0.20 ms) and cheaper (CPU
-0.2 ms per cell, in the replicas), so a cost measured with the secure code always on side B came
out ~0.1 ms low. Stripping A in one run and B in the next and averaging cancels whatever favours
a side: a run stripping A measures cost + bias, one stripping B cost - bias.

Prints one JSON line: ``cost_p50_ms`` (the median over every paired round of the secure side's
p50 minus the stripped side's), ``cost_mean_ms`` with its standard error, ``cost_per_run`` (each
run's median), ``side_bias_ms`` (what side B gained over A in these runs, half the difference of
the two kinds of run), and ``cpu_cost_ms_per_cell_by_role`` (secure minus stripped, averaged).

``--set raft.encrypt_loopback=true`` measures the Raft links encrypted as between hosts (the
embedded cluster's replicas share one machine, so by default their links carry the clear after
the TLS handshake authenticated the peer: ``shared/raft/tls.py``).

Usage: ``python scripts/bench_security_cost.py [REV] [--pairs 3] [--rounds 40] [--block 50]
[--strip all|curve|raft-tls] [--set KEY=VALUE]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ab import SIDES, STRIP_PARTS, run


def secure_minus_stripped(result: dict[str, Any]) -> tuple[list[float], dict[str, float]]:
    """Per-round p50 cost and per-role CPU cost of one ``bench_ab`` run, signed so that both
    kinds of run say what security costs."""
    sign = 1.0 if result["without_security"] == "a" else -1.0
    costs = [sign * change for change in result["paired"]["p50_change_per_round"]]
    a, b = result["a"]["cpu_ms_per_cell_by_role"], result["b"]["cpu_ms_per_cell_by_role"]
    cpu = {role: sign * (b.get(role, 0.0) - a.get(role, 0.0)) for role in sorted(set(a) | set(b))}
    return costs, cpu


def pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the module docstring, from runs that stripped each side equally often."""
    every: list[float] = []
    per_run: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu: dict[str, list[float]] = {}
    for result in results:
        costs, by_role = secure_minus_stripped(result)
        every += costs
        per_run[result["without_security"]].append(statistics.mean(costs))
        for role, value in by_role.items():
            cpu.setdefault(role, []).append(value)
    bias = (
        (statistics.mean(per_run["a"]) - statistics.mean(per_run["b"])) / 2 if all(per_run.values()) else None
    )
    return {
        "cost_p50_ms": round(statistics.median(every), 3),
        "cost_mean_ms": round(statistics.mean(every), 3),
        "cost_mean_se_ms": round(statistics.stdev(every) / len(every) ** 0.5, 3) if len(every) > 1 else None,
        "cost_per_run": [
            {
                "stripped": r["without_security"],
                "median_ms": round(statistics.median(secure_minus_stripped(r)[0]), 3),
            }
            for r in results
        ],
        "side_bias_ms": None if bias is None else round(bias, 3),
        "rounds_pooled": len(every),
        "cpu_cost_ms_per_cell_by_role": {role: round(statistics.mean(v), 3) for role, v in cpu.items()},
        "cpu_cost_ms_per_cell": round(sum(statistics.mean(v) for v in cpu.values()), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev", nargs="?", default="HEAD", help="a git revision, or . for this checkout")
    parser.add_argument("--pairs", type=int, default=3, help="runs stripping A, and as many stripping B")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--strip", choices=STRIP_PARTS, default="all")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a configuration override for both sides' clusters (raft.encrypt_loopback=true: "
        "the Raft links encrypted as between hosts)",
    )
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    results = [
        run(
            args.rev,
            args.rev,
            rounds=args.rounds,
            block=args.block,
            overrides=args.overrides,
            without_security=side,
            strip=args.strip,
        )
        for _ in range(args.pairs)
        for side in SIDES
    ]
    figures = {
        "bench": "security_cost",
        "rev": args.rev,
        "strip": args.strip,
        "overrides": args.overrides,
        "pairs": args.pairs,
    }
    print(json.dumps(figures | pooled(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
