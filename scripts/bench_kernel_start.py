#!/usr/bin/env python
"""Benchmark kernel start as a Jupyter client sees it: ``KernelManager.start_kernel()`` to the
first ``execute_reply``, for a Tandem kernel (three replicas) without and with pre-warmed
runtimes, against a stock ipykernel (``python3``) in the same run.

Two embedded clusters run one after the other (``tandem up``, 4 hosts): ``prewarm.policy = none``,
then ``fixed`` with one runtime per host (``--imports``, torch by default, as the default config).
In both phases a stock ipykernel start follows each Tandem start, so the two share the machine's
load. A pre-warmed round first waits until every host's pool is full again: it measures the
hand-over, not the warm-up. Kernels are shut down between rounds (not timed). A third cluster
runs with no pool and ``prewarm.template = true``: every replica starts as a fork of its host's
runtime template (kernel_replica/template.py, which imported the same modules), back to back, as
nothing needs refilling; one untimed start first waits for the templates' imports.

Prints ONE JSON line: ``tandem_start_p50_s``, ``tandem_prewarm_start_p50_s``,
``tandem_template_start_p50_s``, ``ipykernel_start_p50_s``, their minimums, ``rounds`` and the
settings.

Usage: ``python scripts/bench_kernel_start.py [--rounds 5] [--imports torch]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jupyter_client import KernelManager  # noqa: E402

from services.cluster_file import ask_sync  # noqa: E402
from services.kernelspec import install_private  # noqa: E402
from shared import messages  # noqa: E402
from shared.security import curve  # noqa: E402

HOSTS = 4
READY_TIMEOUT_S = 180.0


def start_to_first_reply(kernel_name: str) -> float:
    """Seconds from ``start_kernel()`` to the reply of the first cell; the kernel is then stopped."""
    km = KernelManager(kernel_name=kernel_name)
    started = time.perf_counter()
    km.start_kernel(stderr=subprocess.DEVNULL)  # a stock kernel's start-up warnings (no effect on Tandem's)
    kc = km.client()
    kc.start_channels()
    try:
        msg_id = kc.execute("1 + 1")
        while True:
            reply = kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        seconds = time.perf_counter() - started
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{kernel_name}: first cell failed: {reply['content']}")
        return seconds
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@contextlib.contextmanager
def cluster(state_dir: Path, *settings: str) -> Iterator[dict[str, Any]]:
    """``tandem up`` with ``--set`` ``settings`` until the block ends; its cluster.json."""
    argv = [sys.executable, "-m", "services.cli", "up", "--state-dir", str(state_dir), "--hosts", str(HOSTS)]
    for setting in settings:
        argv += ["--set", setting]
    out = open(state_dir.parent / f"{state_dir.name}.out", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        cluster_file = state_dir / "cluster.json"
        while not cluster_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem up did not come up; see {out.name}")
            time.sleep(0.1)
        os.environ["TANDEM_STATE_DIR"] = str(state_dir)
        yield json.loads(cluster_file.read_text())
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        out.close()


def wait_for_full_pools(info: dict[str, Any], state_dir: Path) -> None:
    credentials = curve.client_curve(state_dir / "keys", curve.OPERATOR, curve.SCHEDULER)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = ask_sync(info["scheduler"], messages.CLUSTER_STATUS, {}, credentials=credentials, timeout=5)
        pools = [h.get("warm_pool") or {} for h in status["hosts"]]
        if len(pools) >= HOSTS and all(p.get("warm", 0) >= 1 for p in pools):
            return
        time.sleep(0.1)
    raise RuntimeError("the warm pools did not fill")


def bench(rounds: int, imports: list[str]) -> dict[str, Any]:
    tandem: list[float] = []
    prewarmed: list[float] = []
    forked: list[float] = []
    stock: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-kernel-start-") as tmp:
        install_private(Path(tmp) / "prefix")
        with cluster(Path(tmp) / "cold", "prewarm.policy=none"):
            start_to_first_reply("tandem")  # file system caches, alike for both phases
            start_to_first_reply("python3")
            for _ in range(rounds):
                tandem.append(start_to_first_reply("tandem"))
                stock.append(start_to_first_reply("python3"))
        state = Path(tmp) / "warm"
        settings = ("prewarm.policy=fixed", "prewarm.per_host=1", "prewarm.interval_s=0.2")
        with cluster(state, *settings, f"prewarm.imports={json.dumps(imports)}") as info:
            for _ in range(rounds):
                wait_for_full_pools(info, state)
                prewarmed.append(start_to_first_reply("tandem"))
                stock.append(start_to_first_reply("python3"))
        settings = ("prewarm.policy=none", "prewarm.template=true")
        with cluster(Path(tmp) / "template", *settings, f"prewarm.imports={json.dumps(imports)}"):
            start_to_first_reply("tandem")  # waits for the templates' imports
            for _ in range(rounds):
                forked.append(start_to_first_reply("tandem"))
                stock.append(start_to_first_reply("python3"))
    return {
        "bench": "kernel_start",
        "rounds": rounds,
        "hosts": HOSTS,
        "prewarm_imports": imports,
        "tandem_start_p50_s": round(statistics.median(tandem), 3),
        "tandem_prewarm_start_p50_s": round(statistics.median(prewarmed), 3),
        "tandem_template_start_p50_s": round(statistics.median(forked), 3),
        "ipykernel_start_p50_s": round(statistics.median(stock), 3),
        "tandem_start_min_s": round(min(tandem), 3),
        "tandem_prewarm_start_min_s": round(min(prewarmed), 3),
        "tandem_template_start_min_s": round(min(forked), 3),
        "ipykernel_start_min_s": round(min(stock), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--imports", nargs="*", default=["torch"], help="modules a warm runtime imports ahead"
    )
    args = parser.parse_args()
    print(json.dumps(bench(args.rounds, args.imports)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
