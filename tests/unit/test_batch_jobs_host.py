"""A host's best-effort jobs (services/local_scheduler/batch_jobs.py) with real processes and a
real GPU ledger: start on leased GPUs at low priority, pause, resume, stop, no orphans."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from services.local_scheduler.batch_jobs import BatchJobs
from services.local_scheduler.job_process import CHRT
from shared.cluster_core.gpu_ledger import GpuLedger
from shared.rpc import RpcError

SCRIPT = """
import sys, time, tandem_job
with tandem_job.session(total=int(sys.argv[1])) as job:
    for step in job.steps():
        time.sleep(0.02)
    print("stopped" if job.stopped else "finished", job.done, flush=True)
"""
SCHED_IDLE = 5


def grant(job_id: str, argv: list[str], cwd: Path, *, gpus: int = 1, start: int = 0) -> dict[str, Any]:
    job = {"job_id": job_id, "argv": argv, "cwd": str(cwd), "env": dict(os.environ), "start_iteration": start}
    return {"job_id": job_id, "app_id": "a", "gpus": gpus, "expires_at": time.time() + 60, "job": job}


def stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def scenario(
    tmp_path: Path, body: Callable[[BatchJobs, GpuLedger, Path], Awaitable[None]], **kw: Any
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    async def main() -> None:
        ledger = GpuLedger([0, 1, 2])
        options = {"stop_grace_s": 5.0, "overdue_s": 30.0, "keep_paused_s": 0.0, "cell_reserve": 1, **kw}
        jobs = BatchJobs(ledger, host_id="h0", state_dir=tmp_path / "state", on_exit=lambda: None, **options)
        try:
            await body(jobs, ledger, script)
        finally:
            await jobs.close()

    asyncio.run(main())


def test_a_job_runs_on_its_leased_gpus_at_the_lowest_priority(tmp_path: Path) -> None:
    async def body(jobs: BatchJobs, ledger: GpuLedger, script: Path) -> None:
        answer = await jobs.grant(
            grant(
                "a.1",
                [
                    sys.executable,
                    "-c",
                    "import os,time; print(os.getcwd(), os.environ['CUDA_VISIBLE_DEVICES'], flush=True); time.sleep(30)",
                ],
                tmp_path,
            )
        )
        pid = answer["pid"]
        assert answer["device_ids"] == [1] and ledger.idle_device_ids() == (0, 2)  # 0: lowest, kept for cells
        assert jobs.report()["idle"] == [2] and jobs.report()["reserved"] == 1
        await until(lambda: (tmp_path / "state/jobs/a.1/output.log").read_text().count("\n") >= 2)
        fields = stat_fields(pid)  # the job itself, past its exec wrappers (setpriv, chrt, nice)
        assert int(fields[16]) == 19  # nice
        if CHRT is not None:
            assert int(fields[38]) == SCHED_IDLE
        assert f"{tmp_path} 1" in (tmp_path / "state/jobs/a.1/output.log").read_text()
        with pytest.raises(RpcError, match="kept for cells"):
            await jobs.grant(grant("a.2", [sys.executable, str(script), "10"], tmp_path, gpus=2))
        ended = await jobs.end("a.1", reason="cancelled")
        assert ended["outcome"] == "stopped" and not alive(pid)  # no step loop: SIGTERM at once
        assert ledger.idle_device_ids() == (0, 1, 2)

    scenario(tmp_path, body)


def test_a_stopped_job_resumes_from_what_it_reported(tmp_path: Path) -> None:
    async def body(jobs: BatchJobs, ledger: GpuLedger, script: Path) -> None:
        first = await jobs.grant(grant("a.1", [sys.executable, str(script), "100000"], tmp_path))
        progress = tmp_path / "state/jobs/a.1/h0/progress.json"
        await until(lambda: progress.exists() and '"running"' in progress.read_text())
        ended = await jobs.end("a.1", reason="expired")
        assert ended["outcome"] == "stopped" and ended["returncode"] == 0 and not alive(first["pid"])
        done = ended["progress"]["iterations_done"]
        assert done > 0 and ended["progress"]["state"] == "stopped"
        second = await jobs.grant(
            grant("a.1", [sys.executable, str(script), str(done + 3)], tmp_path, start=done)
        )
        assert second["pid"] != first["pid"]
        await until(lambda: jobs.report()["jobs"][0]["running"] is False)
        entry = jobs.report()["jobs"][0]
        assert entry["outcome"] == "finished" and entry["progress"]["iterations_done"] == done + 3
        assert ledger.leased_count == 0
        log = (tmp_path / "state/jobs/a.1/output.log").read_text()
        assert f"stopped {done}" in log and f"finished {done + 3}" in log

    scenario(tmp_path, body)


def test_a_paused_job_resumes_in_place_on_the_same_gpus(tmp_path: Path) -> None:
    async def body(jobs: BatchJobs, ledger: GpuLedger, script: Path) -> None:
        first = await jobs.grant(grant("a.1", [sys.executable, str(script), "100000"], tmp_path))
        progress = tmp_path / "state/jobs/a.1/h0/progress.json"
        await until(lambda: progress.exists() and '"running"' in progress.read_text())
        renewed = await jobs.grant(grant("a.1", [sys.executable, str(script), "100000"], tmp_path))
        assert renewed == {**first, "renewed": True}
        paused = await jobs.end("a.1", reason="expired")
        assert paused["outcome"] == "paused" and '"paused"' in progress.read_text()
        assert alive(first["pid"]) and ledger.leased_count == 0 and jobs.report()["jobs"] == []
        resumed = await jobs.grant(grant("a.1", [sys.executable, str(script), "100000"], tmp_path))
        assert resumed == {**first, "renewed": False}
        await until(lambda: '"running"' in progress.read_text())
        await jobs.end("a.1", reason="cancelled")
        assert not alive(first["pid"])

    scenario(tmp_path, body, keep_paused_s=60.0)


def test_a_job_that_cannot_pause_at_a_step_is_frozen_and_still_stops(tmp_path: Path) -> None:
    async def body(jobs: BatchJobs, ledger: GpuLedger, script: Path) -> None:
        answer = await jobs.grant(
            grant("a.1", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
        )
        assert (await jobs.end("a.1", reason="expired"))["outcome"] == "paused"
        await until(lambda: stat_fields(answer["pid"])[0] == "T")  # SIGSTOP
        await jobs.expire(time.time() + 120)  # kept too long: stopped
        await until(lambda: not alive(answer["pid"]), timeout=10)
        assert "a.1" not in jobs.runs

    scenario(tmp_path, body, keep_paused_s=60.0)


def test_shutdown_leaves_no_job_process(tmp_path: Path) -> None:
    pids: list[int] = []

    async def body(jobs: BatchJobs, ledger: GpuLedger, script: Path) -> None:
        for job_id in ("a.1", "a.2"):
            answer = await jobs.grant(grant(job_id, [sys.executable, str(script), "100000"], tmp_path))
            pids.append(answer["pid"])

    scenario(tmp_path, body)
    assert pids and not any(alive(pid) for pid in pids)
