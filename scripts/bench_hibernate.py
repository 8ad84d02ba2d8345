#!/usr/bin/env python
"""Benchmark hibernation as a Jupyter client sees it: how long the first cell after a hibernation
waits (the resume), for a small namespace and for a 500 MB one, against the same kernel's cold
start (``start_kernel()`` to the first reply) in the same run, and the memory a hibernated kernel
gives back (the resident memory of its three replica processes before they stop).

One embedded cluster (``tandem up``, 4 hosts, one warm runtime per host as a serving setup keeps
them; ``--imports`` what they import ahead, none by default). Each round starts a kernel (timed:
the cold start), fills its namespace (``x = 41``, and for the large rounds a 500 MB float64
array of random values, which compresses to nothing), measures its replicas' RSS, hibernates it
through the gateway's ``kernel.hibernate`` (what the policy does after kernel.hibernate_after_s;
timed: hibernate_s), waits until the warm pools are full again, then times ``print(x + 1, ...)``
from send to reply, and checks the values came back. Kernels are shut down between rounds.
Torch rounds do the same for a notebook that ran ``import torch`` (its resume imports it again).

The same rounds run twice in one invocation: on a cluster resuming into warm runtimes (the
top-level figures), and on one with ``prewarm.template = true`` (under ``template``): each host's
runtime template (kernel_replica/template.py, a fork server) forks the resumed replicas after
importing the modules the kernel's image names (restore-based fast start).

Prints ONE JSON line: ``resume_small_p50_s``, ``resume_500mb_p50_s``, ``resume_torch_p50_s``,
``cold_start_p50_s``, ``memory_freed_mb_per_kernel`` (small and 500 MB), ``hibernate_*_p50_s``,
the same under ``template``, rounds and settings.
Targets (issue 20): small resume <= 2 s, 500 MB resume <= 10 s.

Usage: ``python scripts/bench_hibernate.py [--rounds 5] [--large-rounds 3] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernel_start import HOSTS, cluster, wait_for_full_pools  # noqa: E402
from jupyter_client import BlockingKernelClient, KernelManager  # noqa: E402

from services.cluster_file import ask_sync  # noqa: E402
from services.kernelspec import install_private  # noqa: E402
from shared import messages  # noqa: E402
from shared.security import curve  # noqa: E402

LARGE_MB = 500
SMALL_SETUP = "x = 41"
# random, so neither pickling nor the store can make it smaller than it is
LARGE_SETUP = (
    "import numpy as np\nx = 41\n"
    f"big = np.random.default_rng(7).random({LARGE_MB * 1024 * 1024 // 8})\nbig_sum = float(big.sum())"
)
SMALL_CHECK = ("print(x + 1)", "42")
# a notebook that imported torch: its resume imports torch again (the image names it)
TORCH_SETUP = "import torch\nx = 41\nt = torch.arange(4)"
TORCH_CHECK = ("print(x + 1, int(t.sum()))", "42 6")
LARGE_CHECK = ("print(x + 1, float(big.sum()) == big_sum, big.nbytes >> 20)", f"42 True {LARGE_MB}")


def execute(kc: BlockingKernelClient, code: str, timeout: float = 300.0) -> tuple[float, str]:
    """Seconds from send to the execute_reply, and what the cell printed; RuntimeError if it failed."""
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    started = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    seconds = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell failed: {reply['content'].get('ename')}: {reply['content'].get('evalue')}")
    return seconds, "".join(out).strip()


def rss_mb(pids: list[int]) -> float:
    total_kb = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024


def one_round(info: dict[str, Any], state: Path, setup: str, check: tuple[str, str]) -> dict[str, float]:
    sched = curve.client_curve(state / "keys", curve.OPERATOR, curve.SCHEDULER)
    gate = curve.client_curve(state / "keys", curve.OPERATOR, curve.GATEWAY)
    wait_for_full_pools(info, state)
    km = KernelManager(kernel_name="tandem")
    started = time.perf_counter()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        execute(kc, "1 + 1")
        cold = time.perf_counter() - started
        execute(kc, setup)
        status = ask_sync(
            info["scheduler"], messages.KERNEL_STATUS, {"kernel_id": km.kernel_id}, credentials=sched
        )
        pids = [int(r["pid"]) for r in status["replicas"] if r["alive"]]
        rss = rss_mb(pids)
        began = time.perf_counter()
        ask_sync(
            info["gateway"],
            messages.KERNEL_HIBERNATE,
            {"kernel_id": km.kernel_id},
            credentials=gate,
            timeout=120,
        )
        hibernate = time.perf_counter() - began
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in pids):  # their memory is back once they exited
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica processes {pids} still run after the hibernation")
            time.sleep(0.05)
        wait_for_full_pools(info, state)
        resume, printed = execute(kc, check[0])
        if printed != check[1]:
            raise RuntimeError(f"resumed namespace differs: printed {printed!r}, expected {check[1]!r}")
        return {"cold_start_s": cold, "rss_mb": rss, "hibernate_s": hibernate, "resume_s": resume}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def p50(rounds: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rounds), 3)


def arm(
    tmp: Path,
    name: str,
    extra: tuple[str, ...],
    rounds: int,
    large_rounds: int,
    torch_rounds: int,
    imports: list[str],
) -> dict[str, Any]:
    """One cluster's rounds: small, 500 MB, and torch namespaces, in that order."""
    state = tmp / name
    settings = ("prewarm.policy=fixed", "prewarm.per_host=1", "prewarm.interval_s=0.2", *extra)
    with cluster(state, *settings, f"prewarm.imports={json.dumps(imports)}") as info:
        small = [one_round(info, state, SMALL_SETUP, SMALL_CHECK) for _ in range(rounds)]
        large = [one_round(info, state, LARGE_SETUP, LARGE_CHECK) for _ in range(large_rounds)]
        torch = [one_round(info, state, TORCH_SETUP, TORCH_CHECK) for _ in range(torch_rounds)]
    result = figures(small, large)
    if torch:
        result["resume_torch_p50_s"] = p50(torch, "resume_s")
        result["resume_torch_s"] = [round(r["resume_s"], 3) for r in torch]
    return result


def bench(rounds: int, large_rounds: int, imports: list[str], torch_rounds: int = 0) -> dict[str, Any]:
    """The warm-pool cluster (the figures at the top level), then with ``prewarm.template`` on
    (restore-based start: resumes fork from each host's runtime template, which imports the
    modules the image names first) under ``template``, in the same run."""
    with tempfile.TemporaryDirectory(prefix="bench-hibernate-") as tmp:
        install_private(Path(tmp) / "prefix")
        pool = arm(Path(tmp), "pool", (), rounds, large_rounds, torch_rounds, imports)
        template = arm(
            Path(tmp), "template", ("prewarm.template=true",), rounds, large_rounds, torch_rounds, imports
        )
    return {
        "bench": "hibernate",
        "rounds": rounds,
        "large_rounds": large_rounds,
        "torch_rounds": torch_rounds,
        "large_mb": LARGE_MB,
        "hosts": HOSTS,
        "prewarm_imports": imports,
        **pool,
        "template": template,
    }


def figures(small: list[dict[str, float]], large: list[dict[str, float]]) -> dict[str, Any]:
    every = small + large
    result: dict[str, Any] = {
        "resume_small_p50_s": p50(small, "resume_s"),
        "resume_small_max_s": round(max(r["resume_s"] for r in small), 3),
        "cold_start_p50_s": p50(every, "cold_start_s"),
        "hibernate_small_p50_s": p50(small, "hibernate_s"),
        "memory_freed_mb_per_kernel": p50(small, "rss_mb"),
    }
    if large:
        result |= {
            "resume_500mb_p50_s": p50(large, "resume_s"),
            "resume_500mb_max_s": round(max(r["resume_s"] for r in large), 3),
            "hibernate_500mb_p50_s": p50(large, "hibernate_s"),
            "memory_freed_mb_per_kernel_500mb": p50(large, "rss_mb"),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds with a small namespace")
    parser.add_argument("--large-rounds", type=int, default=3, help=f"rounds with a {LARGE_MB} MB namespace")
    parser.add_argument(
        "--torch-rounds", type=int, default=3, help="rounds with a notebook that imported torch"
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 small rounds, 1 large, 2 torch (a loaded machine)"
    )
    parser.add_argument("--imports", nargs="*", default=[], help="modules a warm runtime imports ahead")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.large_rounds, args.torch_rounds = 2, 1, 2
    print(json.dumps(bench(args.rounds, args.large_rounds, args.imports, args.torch_rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
