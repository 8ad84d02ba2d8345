"""Two real job processes packed on one virtual GPU by the local scheduler's job runner (issue #18):
the second job is granted ``packed`` beside the first (its J_max) on the same device, the
coordinator's Algorithm 1 squeezes and swells them through their share files (the jobs see the
shares at their step boundaries), a cell that takes the GPU pauses both, and both resume and finish
with exactly the result of an unpacked run; the guest takes the GPU's lease over when its J_max
ends."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.local_scheduler.batch_jobs import BatchJobs
from services.local_scheduler.packing import PackingSettings
from shared.cluster_core.gpu_ledger import GpuLedger

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# each step: an SGD step of y = 3x over 50 samples and ~3-10 ms of arithmetic folded into a checksum
# (what the test recomputes cheaply), then 10 ms more (a quiet machine ran all 300 steps of a.1 in
# 1 s, before the search's first squeeze); it records the share it ran at and the time it ended
SCRIPT = """
import json, os, sys, time, tandem_job
total, out = int(sys.argv[1]), sys.argv[2]
w, check, steps = 0.0, 0, []
with tandem_job.session(total=total) as job:
    for step in job.steps():
        w = sgd(w, step)
        check = (check + sum(i * i for i in range(BURN + step))) % 1_000_003
        time.sleep(0.01)  # a step lasts >= 10 ms on any machine: the search gets its trials in
        steps.append((time.time(), job.share))
with open(out + ".part", "w") as f:
    json.dump({"w": w, "check": check, "done": job.done, "stopped": job.stopped, "steps": steps}, f)
os.replace(out + ".part", out)  # whole or absent: the test reads it once it exists
"""
SGD = """
def sgd(w, step):
    for i in range(50):
        x = ((step * 50 + i) % 97) / 97
        w -= 0.01 * (w * x - 3 * x) * x
    return w
"""
BURN = 60_000
STEPS = {"a.1": 300, "a.2": 450}  # a.1 (J_max) ends first: a.2 takes its lease over


def expected(total: int) -> tuple[float, int]:
    """What an unpacked run computes: the same steps in one process, nothing skipped or repeated."""
    scope: dict[str, Any] = {}
    exec(SGD, scope)
    w, check = 0.0, 0
    for step in range(total):
        w = scope["sgd"](w, step)
        n = BURN + step  # sum of i*i for i < n
        check = (check + (n - 1) * n * (2 * n - 1) // 6) % 1_000_003
    return w, check


def grant(job_id: str, script: Path, out: Path, *, packed: bool) -> dict[str, Any]:
    argv = [sys.executable, str(script), str(STEPS[job_id]), str(out)]
    job = {"job_id": job_id, "argv": argv, "cwd": str(script.parent), "env": dict(os.environ)}
    return {
        "job_id": job_id,
        "app_id": "a",
        "gpus": 1,
        "expires_at": time.time() + 120,
        "job": job,
        "packed": packed,
    }


async def until(predicate: Callable[[], bool], timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def test_two_jobs_packed_on_one_gpu_are_coordinated_paused_by_a_cell_and_finish_right(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SGD + SCRIPT.replace("BURN", str(BURN)))
    outs = {j: tmp_path / f"{j}.json" for j in STEPS}
    # without the "nothing to gain" exit: on an idle machine each job has a core to itself, J_max
    # runs at its solo speed beside its guest and the search would rightly end before a squeeze
    settings = PackingSettings(enabled=True, trial_s=0.6, settle_s=0.2, futile_exit=False)

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, float]]:
        ledger = GpuLedger([0])
        jobs = BatchJobs(
            ledger, host_id="h0", state_dir=tmp_path / "state", stop_grace_s=5.0, overdue_s=60.0,
            keep_paused_s=0.0, cell_reserve=0, on_exit=lambda: None, packing=settings, pause_grace_s=3.0,
        )  # fmt: skip
        try:
            assert jobs.packable() == []  # nothing runs: nothing to pack beside
            first = await jobs.grant(grant("a.1", script, outs["a.1"], packed=False))
            assert jobs.packable() == [0]  # a.1 holds GPU 0 alone: a job may join it
            second = await jobs.grant(grant("a.2", script, outs["a.2"], packed=True))
            assert first["device_ids"] == second["device_ids"] == [0]
            assert jobs.packable() == []  # two workers on GPU 0: full
            assert ledger.leased_snapshot() == {"a.1": [0]}  # one lease; a.2 rides on it
            coordinator = jobs.sets["a.1"]
            entry = {e["job_id"]: e for e in jobs.report()["jobs"]}["a.2"]
            assert entry["packing"]["with"] == "a.1" and entry["packing"]["jmax"] == "a.1"

            # the search squeezes someone below 100% (a trial), while both run
            await until(lambda: any(min(t["caps"].values()) < 100 for t in coordinator.trials))
            # a cell takes the GPU: both pause (squeezed to zero), the cell holds it alone
            commit = jobs.revoke_for_cell("k", "r", "m1", 1)
            assert commit.device_ids == (0,)
            runs = dict(jobs.runs)
            await until(lambda: all(r.pausing is not None and r.pausing.done() for r in runs.values()))
            paused_at = {j: (r.process.progress() or {}).get("iterations_done") for j, r in runs.items()}
            assert all((r.process.progress() or {}).get("state") == "paused" for r in runs.values())
            assert jobs.packable() == []  # never packed on a cell's GPU
            pause = {"start": time.time()}
            await asyncio.sleep(0.5)
            assert {
                j: (r.process.progress() or {}).get("iterations_done") for j, r in runs.items()
            } == paused_at
            ledger.release("k", "r", "m1")
            jobs.cells_released()
            pause["end"] = time.time()
            assert ledger.leased_snapshot() == {"a.1": [0]}
            await until(lambda: outs["a.1"].exists() and "a.1" not in jobs.runs, timeout=60.0)
            if "a.2" in jobs.runs:  # J_max ended: its guest holds GPU 0 alone, at full speed
                assert ledger.leased_snapshot() == {"a.2": [0]}
                assert jobs.runs["a.2"].packed_on is None and not jobs.sets
            await until(lambda: all(o.exists() for o in outs.values()), timeout=60.0)
            return list(coordinator.trials), {j: json.loads(o.read_text()) for j, o in outs.items()}, pause
        finally:
            await jobs.close()

    trials, results, pause = asyncio.run(main())
    for job_id, total in STEPS.items():
        result = results[job_id]
        assert result["done"] == total and not result["stopped"]
        # bit for bit: packing changes when a step runs, never what it computes
        assert (result["w"], result["check"]) == expected(total)
        assert not [t for t, _ in result["steps"] if pause["start"] + 0.05 < t < pause["end"]]
    squeezed = {j for t in trials for j, cap in t["caps"].items() if cap < 100}
    assert squeezed, trials
    # the job saw its squeeze at a step boundary (the share it stepped at)
    assert any(share < 100 for j in squeezed for _, share in results[j]["steps"])
    assert all(t["throughput"][j] > 0 for t in trials for j in STEPS)
