"""Two hosts that checkpoint their jobs, and the checkpoint service they relay to: the harness of
tests/integration/test_checkpoint_and_stop.py and scripts/bench_checkpoint_service.py.

The service runs in the caller's event loop on its real CURVE socket (keys issued as `tandem up`
does); each host is a real ``BatchJobs`` (the local scheduler's job runner) with its own GPU
ledger and its own ``host.<id>`` key; jobs are real processes of ``examples/checkpointed_job.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import zmq.asyncio

from services.checkpoint_service.service import CheckpointService
from services.local_scheduler.batch_jobs import BatchJobs
from services.local_scheduler.checkpoints import ServiceLink, store_env
from shared.cluster_core.gpu_ledger import GpuLedger
from shared.config import Config, load_config
from shared.security import curve

JOB = Path(__file__).parents[2] / "examples" / "checkpointed_job.py"


class Host:
    def __init__(
        self, cfg: Config, host_id: str, ctx: zmq.asyncio.Context, *, pause_grace_s: float, gpus: int
    ) -> None:
        keys = curve.load_secret(cfg.keys_dir(), curve.host_principal(host_id))
        self.link = ServiceLink(ctx, cfg, host_id=host_id, host_keys=keys)
        self.link.connect()
        self.jobs = BatchJobs(
            GpuLedger(range(gpus)),
            host_id=host_id,
            state_dir=cfg.state_dir(),
            stop_grace_s=30.0,
            overdue_s=3600.0,
            keep_paused_s=0.0,
            cell_reserve=0,
            on_exit=lambda: None,
            checkpoints=self.link,
            checkpoint_env=store_env(cfg),
            pause_grace_s=pause_grace_s,
        )

    async def close(self) -> None:
        await self.jobs.close()
        await self.link.close()


@contextlib.asynccontextmanager
async def cluster(
    tmp_path: Path, *, pause_grace_s: float = 2.0, gpus: int = 2, overrides: dict[str, Any] | None = None
) -> AsyncIterator[tuple[CheckpointService, Host, Host]]:
    # TANDEM_STATE_DIR wins over cluster.state_dir: a session cluster's (set by an earlier test's
    # fixture) would take the jobs' files and keys, and the test would read its own dir in vain
    outer = os.environ.pop("TANDEM_STATE_DIR", None)
    try:
        async with _cluster(tmp_path / "state", pause_grace_s, gpus, overrides or {}) as parts:
            yield parts
    finally:
        if outer is not None:
            os.environ["TANDEM_STATE_DIR"] = outer


@contextlib.asynccontextmanager
async def _cluster(
    state_dir: Path, pause_grace_s: float, gpus: int, overrides: dict[str, Any]
) -> AsyncIterator[tuple[CheckpointService, Host, Host]]:
    cfg = load_config(
        overrides={"cluster.state_dir": str(state_dir), "checkpoint.commit_timeout_s": 5.0, **overrides}
    )
    curve.ensure_cluster_keys(cfg.keys_dir())
    for host_id in ("host-a", "host-b"):
        curve.issue(cfg.keys_dir(), curve.host_principal(host_id))
    service = CheckpointService(cfg)
    address = service.bind("tcp://127.0.0.1:0")
    stop = asyncio.Event()
    running = asyncio.ensure_future(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 30)
    cfg = load_config(overrides={**cfg.as_overrides(), "checkpoint.address": address})
    ctx = zmq.asyncio.Context()
    hosts = tuple(Host(cfg, h, ctx, pause_grace_s=pause_grace_s, gpus=gpus) for h in ("host-a", "host-b"))
    try:
        yield service, hosts[0], hosts[1]
    finally:
        await asyncio.gather(*(h.close() for h in hosts))
        ctx.destroy(linger=0)
        stop.set()
        await running


def grant(
    job_id: str, out: Path, cwd: Path, *, total: int, every: int, step_s: float = 0.03, width: int = 256
) -> dict[str, Any]:
    """``lease.grant``'s body for a run of ``examples/checkpointed_job.py``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, str(JOB), str(total), str(out), str(every), str(step_s), str(width)]
    job = {"job_id": job_id, "argv": argv, "cwd": str(cwd), "env": env, "start_iteration": 0}
    return {"job_id": job_id, "app_id": "app", "gpus": 1, "expires_at": time.time() + 3600, "job": job}
