"""A/B of ``scripts/bench_latency.py`` between two revisions, run alternately on this machine.

A single latency run is not comparable with one taken an hour later on these shared machines (the
same code measured 4.3 and 6.8 ms p50 within two hours); runs of A and B taken in turns, each with
its own stock-ipykernel baseline, are. Each revision is checked out in a temporary git worktree
(``.`` means this checkout as it is, uncommitted changes included) and runs with this
interpreter; the replicas and services it starts run that worktree's code.

Prints one JSON line: per revision the ``ratio_p50`` and ``tandem_p50_ms`` of every round and
their medians, and ``ratio_change`` (B's median ratio minus A's; negative is faster).

Usage: ``python scripts/bench_ab.py REV_A REV_B [--rounds 3] [--cells 300] [--set KEY=VALUE]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def checkout(rev: str, parent: Path) -> Iterator[Path]:
    """A directory holding ``rev``'s tree (this checkout for ``.``), removed afterwards."""
    if rev == ".":
        yield ROOT
        return
    path = parent / rev.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            check=False, capture_output=True,
        )  # fmt: skip


def one_run(tree: Path, cells: int, overrides: list[str]) -> dict[str, Any]:
    command = [sys.executable, "scripts/bench_latency.py", "--cells", str(cells)]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"bench_latency failed in {tree} (exit {done.returncode}): {done.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio_p50"] for r in runs]
    p50s = [r["tandem_p50_ms"] for r in runs]
    return {
        "ratio_p50": ratios,
        "ratio_p50_median": round(statistics.median(ratios), 3),
        "tandem_p50_ms": p50s,
        "tandem_p50_ms_median": round(statistics.median(p50s), 3),
        "ipykernel_p50_ms_median": round(statistics.median(r["ipykernel_p50_ms"] for r in runs), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev_a", help="a git revision, or . for this checkout as it is")
    parser.add_argument("rev_b", help="a git revision, or . for this checkout as it is")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for both sides")
    args = parser.parse_args(argv)
    if args.rev_a == args.rev_b:
        parser.error("give two different revisions")
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    with (
        tempfile.TemporaryDirectory(prefix="tandem-ab-") as tmp,
        checkout(args.rev_a, Path(tmp)) as tree_a,
        checkout(args.rev_b, Path(tmp)) as tree_b,
    ):
        for _ in range(args.rounds):
            runs["a"].append(one_run(tree_a, args.cells, args.set))
            runs["b"].append(one_run(tree_b, args.cells, args.set))
    a, b = summary(runs["a"]), summary(runs["b"])
    result = {
        "bench": "latency_ab",
        "cells": args.cells,
        "rounds": args.rounds,
        "a": {"rev": args.rev_a, **a},
        "b": {"rev": args.rev_b, **b},
        "ratio_change": round(b["ratio_p50_median"] - a["ratio_p50_median"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
