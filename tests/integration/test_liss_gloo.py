"""LISS on a real 2-rank gloo job: with one rank slowed (as a co-located job would), the faster
rank steals samples, yet every step's global batch and the trained parameters equal the unstolen
run's (float64, same seeds; equal up to summation order). Once on bare ranks, once through the
local scheduler's job runner, which packs a second job on one of the job's GPUs."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from _liss_worker import GLOBAL_BATCH, train

import tandem_job
from services.local_scheduler.batch_jobs import BatchJobs
from services.local_scheduler.packing import PackingSettings
from shared.cluster_core.gpu_ledger import GpuLedger


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(steal: bool, slow: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=train, args=(r, 2, _port_cache[steal], steal, slow, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return result


_port_cache: dict[bool, int] = {}


@pytest.mark.timeout(120)
def test_stealing_keeps_global_batches_and_trained_parameters() -> None:
    _port_cache[False] = _port()
    _port_cache[True] = _port()
    plain = _run(steal=False, slow=0.0)
    stolen = _run(steal=True, slow=0.004)
    assert stolen["moves"] >= 1
    assert any(c[0] > c[1] for c in stolen["counts"]), "the fast rank never took samples"
    assert all(sum(c) == GLOBAL_BATCH for c in stolen["counts"])
    assert stolen["seen"] == plain["seen"]
    for a, b in zip(stolen["params"], plain["params"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12)


SLEEPER = """
import time, tandem_job
with tandem_job.session(total=100_000) as job:
    for _ in job.steps():
        time.sleep(0.01)
"""


def _job(job_id: str, argv: list[str], cwd: Path, gpus: int, *, packed: bool = False) -> dict[str, Any]:
    job = {"job_id": job_id, "argv": argv, "cwd": str(cwd), "env": dict(os.environ)}
    return {"job_id": job_id, "app_id": job_id.split(".")[0], "gpus": gpus,
            "expires_at": time.time() + 300, "job": job, "packed": packed}  # fmt: skip


async def _until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_packed_data_parallel_job_in_the_job_runner_steals_and_trains_as_unpacked(tmp_path: Path) -> None:
    """The runner path: the same 2-GPU gloo job run by the local scheduler's job runner alone, then
    with a second job packed on one of its GPUs (the runner tells it so; that GPU's rank slows):
    packed, it steals samples; its global batches and trained parameters equal the unpacked run's."""
    script = Path(__file__).with_name("_liss_job.py")
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(SLEEPER)
    outs = {run: tmp_path / f"{run}.json" for run in ("alone", "packed")}
    gos = {run: tmp_path / f"{run}.go" for run in outs}
    dp = {run: [sys.executable, str(script), str(outs[run]), str(gos[run])] for run in outs}

    async def main() -> dict[str, dict[str, Any]]:
        jobs = BatchJobs(
            GpuLedger([0, 1, 2, 3]), host_id="h0", state_dir=tmp_path / "state", stop_grace_s=5.0,
            overdue_s=300.0, keep_paused_s=0.0, cell_reserve=0, on_exit=lambda: None,
            packing=PackingSettings(enabled=True, trial_s=0.5, settle_s=0.1),
        )  # fmt: skip
        try:
            # the two runs side by side on GPUs of their own: the guest first joins dp.2, then
            # dp.1 starts on the other two GPUs
            await jobs.grant(_job("dp.2", dp["packed"], tmp_path, 2))
            guest = await jobs.grant(_job("g.1", [sys.executable, str(sleeper)], tmp_path, 1, packed=True))
            await jobs.grant(_job("dp.1", dp["alone"], tmp_path, 2))
            assert jobs.runs["g.1"].packed_on == "dp.2"
            info = tandem_job.packing(jobs.runs["dp.2"].process.directory)
            assert info["with"] == ["g.1"] and info["shared_device_ids"] == guest["device_ids"]
            assert tandem_job.packing(jobs.runs["dp.1"].process.directory) == {}
            for go in gos.values():
                go.touch()
            await _until(
                lambda: all(o.exists() for o in outs.values()) and not {"dp.1", "dp.2"} & set(jobs.runs)
            )
            # the set dissolved when J_max ended: the guest is told it runs alone
            assert tandem_job.packing(jobs.runs["g.1"].process.directory) == {}
            return {run: json.loads(out.read_text()) for run, out in outs.items()}
        finally:
            await jobs.close()

    results = asyncio.run(main())
    alone, packed = results["alone"], results["packed"]
    assert not any(alone["stealing"]) and alone["moves"] == 0  # unpacked: the equal split
    assert all(packed["stealing"]) and packed["moves"] >= 1
    assert any(c[0] != c[1] for c in packed["counts"]), "no rank ever took samples"
    assert all(sum(c) == GLOBAL_BATCH for c in packed["counts"])
    assert packed["seen"] == alone["seen"]  # every global batch, step by step
    for a, b in zip(packed["params"], alone["params"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12)


@pytest.mark.timeout(120)
def test_a_data_parallel_job_stopped_by_the_runner_stops_every_rank_at_a_step_boundary(
    tmp_path: Path,
) -> None:
    """Rank 0 reads the stop word in the job-side step loop; ``DataParallelLiss.go`` carries it to
    the other ranks, so the whole job leaves at a boundary (exit code 0), not by a signal."""
    script = Path(__file__).with_name("_liss_job.py")
    out, go = tmp_path / "out.json", tmp_path / "go"

    async def main() -> dict[str, Any]:
        jobs = BatchJobs(
            GpuLedger([0, 1]), host_id="h0", state_dir=tmp_path / "state", stop_grace_s=10.0,
            overdue_s=300.0, keep_paused_s=0.0, cell_reserve=0, on_exit=lambda: None,
        )  # fmt: skip
        try:
            await jobs.grant(
                _job("dp.1", [sys.executable, str(script), str(out), str(go), "1000"], tmp_path, 2)
            )
            go.touch()
            run = jobs.runs["dp.1"]
            await _until(lambda: (run.process.progress() or {}).get("iterations_done", 0) >= 3)
            return await jobs.end("dp.1", reason="cancelled")
        finally:
            await jobs.close()

    entry = asyncio.run(main())
    assert entry["outcome"] == "stopped" and entry["returncode"] == 0, entry
    result = json.loads(out.read_text())
    assert result["stopped"] and 3 <= len(result["seen"]) < 1000 * 6
