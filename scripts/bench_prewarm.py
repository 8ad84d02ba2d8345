#!/usr/bin/env python
"""Benchmark replica start: cold (spawn ``python -m kernel_replica``) against warm (hand a
pre-warmed ``kernel_replica.warm`` runtime its launch arguments), measured in the same run.

One global scheduler and two real local schedulers run in this process: ``cold-host`` with no
pool (baseline) and ``warm-host`` with ``prewarm.policy = fixed`` (one runtime, ``--import`` torch
by default). Starts alternate between the two; each is the local scheduler's own ``replica.start``
handling, from the request to the replica's registration (its Jupyter sockets bound, its Raft
thread up), and the replica is stopped after. A warm start waits for the pool to be ready first,
so it measures the hand-over, not the warm-up (the warm-up time is reported too).

Prints ONE JSON line: ``cold_ms_p50``, ``warm_ms_p50``, ``speedup_p50`` (cold / warm), the
minimums, ``warmup_ms_p50`` and the settings.

Usage: ``python scripts/bench_prewarm.py [--starts 5] [--imports torch]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import messages
from shared.config import Config, load_config
from shared.envelope import Envelope
from shared.logs import configure_logging
from shared.raft.tls_ca import ClusterCA


def make_config(state_dir: Path, *, warm: bool, imports: list[str]) -> Config:
    return load_config(
        overrides={
            "cluster.state_dir": str(state_dir),
            "host.use_nvml": False,
            "host.gpus": 1,
            "log.level": "warning",
            "prewarm.policy": "fixed" if warm else "none",
            "prewarm.per_host": 1,
            "prewarm.interval_s": 0.2,
            "prewarm.imports": json.dumps(imports),
        }
    )


RAFT_CA = ClusterCA.create()


async def start_once(scheduler: Any, n: int) -> float:
    """One replica.start handled by ``scheduler``; seconds until it replied; the replica is stopped."""
    body = {
        "kernel_id": f"bench-{n}",
        "replica_id": "r1",
        "key": os.urandom(16).hex(),
        "resources": {"gpus": 1},
        "raft_identity": RAFT_CA.issue(f"bench-{n}", "r1").to_wire(),  # as the global scheduler's
    }
    started = time.perf_counter()
    answer = await scheduler._replica_start(Envelope(messages.REPLICA_START, body))
    seconds = time.perf_counter() - started
    if answer.type != messages.REPLY:
        raise RuntimeError(f"replica start failed: {answer.body}")
    await scheduler._replica_stop(
        Envelope(messages.REPLICA_STOP, {"kernel_id": body["kernel_id"], "replica_id": "r1"})
    )
    return seconds


async def wait_ready(pool: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pool.ready:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool did not fill")
        await asyncio.sleep(0.05)


async def bench(starts: int, imports: list[str]) -> dict[str, Any]:
    from services.global_scheduler.service import GlobalScheduler
    from services.local_scheduler.service import LocalScheduler
    from shared.security import curve

    with tempfile.TemporaryDirectory(prefix="bench-prewarm-") as tmp:
        state = Path(tmp)
        os.environ["TANDEM_STATE_DIR"] = str(state)
        stop = asyncio.Event()
        gs = GlobalScheduler(make_config(state, warm=False, imports=imports))
        address = gs.bind("tcp://127.0.0.1:0")
        for host_id in ("cold-host", "warm-host"):
            curve.issue(state / "keys", curve.host_principal(host_id))
        cold = LocalScheduler(
            make_config(state, warm=False, imports=imports), host_id="cold-host", scheduler_address=address
        )
        warm = LocalScheduler(
            make_config(state, warm=True, imports=imports), host_id="warm-host", scheduler_address=address
        )
        for ls in (cold, warm):
            ls.bind()
        services = [asyncio.ensure_future(s.run(stop)) for s in (gs, cold, warm)]
        cold_s: list[float] = []
        warm_s: list[float] = []
        try:
            await start_once(cold, -1)  # warm the file system caches for both sides alike
            for n in range(starts):
                cold_s.append(await start_once(cold, n))
                await wait_ready(warm.warm_pool)
                warm_s.append(await start_once(warm, n))
            await wait_ready(warm.warm_pool)
            warmup = list(warm.warm_pool.warmup_s)
        finally:
            stop.set()
            await asyncio.gather(*services, return_exceptions=True)
    cold_p50, warm_p50 = statistics.median(cold_s), statistics.median(warm_s)
    return {
        "bench": "prewarm",
        "starts": starts,
        "imports": imports,
        "cold_ms_p50": round(cold_p50 * 1000, 1),
        "warm_ms_p50": round(warm_p50 * 1000, 1),
        "speedup_p50": round(cold_p50 / warm_p50, 2),
        "cold_ms_min": round(min(cold_s) * 1000, 1),
        "warm_ms_min": round(min(warm_s) * 1000, 1),
        "warmup_ms_p50": round(statistics.median(warmup) * 1000, 1) if warmup else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument(
        "--imports", nargs="*", default=["torch"], help="modules the warm runtime imports ahead"
    )
    args = parser.parse_args()
    configure_logging("console", "warning")
    result = asyncio.run(bench(args.starts, args.imports))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
