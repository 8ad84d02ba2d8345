"""Checkpoint-and-stop (issue #17): a real training job process leaves one host with the image of
its last step, the checkpoint service records it, and the job resumes on another host from it,
ending bitwise equal to a run that was never interrupted.

The checkpoint service runs in this process on its real CURVE socket (keys issued as `tandem up`
does); each host is a real ``BatchJobs`` (the local scheduler's job runner) with its own GPU
ledger and its own ``host.<id>`` key on the link to the service; the job is a real OS process
(``examples/checkpointed_job.py``) writing to a real local data store.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from _checkpoint_hosts import JOB, Host, cluster, grant

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOTAL = 40
EVERY = 5


def _job_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("checkpointed_job", JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uninterrupted_digest(steps: int) -> str:
    """The same job run to ``steps`` in one go, without Tandem (this process, one torch thread;
    the tests run it on a thread while the job runs, so its imports overlap the job's)."""
    job = _job_module()
    import torch

    threads = torch.get_num_threads()
    try:
        state = job.build()
        for _ in range(steps):
            job.train_step(state)
        return str(job.final_digest(state))
    finally:
        torch.set_num_threads(threads)


async def until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def done(host: Host, job_id: str) -> int:
    run = host.jobs.runs.get(job_id)
    return int(((run.process.progress() if run else None) or {}).get("iterations_done") or 0)


def test_a_job_checkpointed_and_stopped_on_one_host_resumes_bitwise_on_another(tmp_path: Path) -> None:
    out = tmp_path / "digest.txt"

    async def scenario() -> tuple[dict[str, float], str]:
        reference = asyncio.ensure_future(asyncio.to_thread(uninterrupted_digest, TOTAL))
        async with cluster(tmp_path) as (service, a, b):
            await a.jobs.grant(grant("job-1", out, tmp_path, total=TOTAL, every=EVERY))
            # past a concurrent image or two, and a few steps beyond the last one
            await until(lambda: done(a, "job-1") >= 2 * EVERY + 2)
            asked = time.monotonic()
            ended = await a.jobs.end("job-1", reason="moved")  # must leave: checkpoint-and-stop
            release_s = time.monotonic() - asked
            assert ended["outcome"] == "stopped" and list(a.jobs.ledger.idle_device_ids()) == [0, 1]
            stopped_at = int(ended["progress"]["iterations_done"])
            latest = service.book.latest("job-1")
            assert latest is not None and ended["checkpoint_step"] == latest.step
            steps_lost = stopped_at - latest.step
            assert steps_lost == 0, "checkpoint-and-stop loses no step"
            assert TOTAL > latest.step > 2 * EVERY

            restarted = time.monotonic()
            await b.jobs.grant(grant("job-1", out, tmp_path, total=TOTAL, every=EVERY))
            run = b.jobs.runs["job-1"]
            assert run.restored_step == latest.step and run.process.spec.start_iteration == latest.step
            await asyncio.wait_for(run.process.exited.wait(), 60)
            assert run.process.returncode == 0, (tmp_path / "state/jobs/job-1/output.log").read_text()
            progress = run.process.progress() or {}
            assert progress["restored_step"] == latest.step and progress["iterations_done"] == TOTAL
            assert run.checkpoint_step is not None and run.checkpoint_step > latest.step  # it went on
            # finished: its host has the service forget its images, and their objects are deleted
            await until(lambda: service.book.latest("job-1") is None and not service.book.stored)
            assert service.deleted_objects > 0
            figures = {
                "release_s": release_s,
                "checkpoint_stop_s": float(ended["progress"]["checkpoint_stop_s"]),
                "restore_s": float(progress["restore_s"]),
                "restart_to_exit_s": time.monotonic() - restarted,
                "steps_lost": float(steps_lost),
                "restored_step": float(latest.step),
                "commit_ms_p50": float(service.status()["commit_ms_p50"]),
            }
            return figures, await reference

    figures, expected = asyncio.run(scenario())
    assert out.read_text() == expected
    log = (tmp_path / "state/jobs/job-1/output.log").read_text()
    assert f"finished at {TOTAL}, restored from {int(figures['restored_step'])}\n" in log
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


def test_a_cell_rewinds_a_long_step_job_with_an_image_and_it_resumes_bitwise_elsewhere(
    tmp_path: Path,
) -> None:
    """A job whose steps outlast the cell's pause grace would be frozen holding its GPU memory;
    with an image at the service it is killed at once instead, and restarts from that image on
    another host, losing at most the steps since it (one checkpoint interval)."""
    out = tmp_path / "digest.txt"
    total, every, step_s = 16, 3, 0.25

    async def scenario() -> tuple[int, float, str]:
        reference = asyncio.ensure_future(asyncio.to_thread(uninterrupted_digest, total))
        async with cluster(tmp_path, pause_grace_s=0.1) as (service, a, b):
            await a.jobs.grant(grant("job-2", out, tmp_path, total=total, every=every, step_s=step_s))
            run = a.jobs.runs["job-2"]
            await until(lambda: run.checkpoint_step is not None and done(a, "job-2") >= every + 2)
            assert run.release_plan(a.jobs.pause_grace_s).mode == "rewind"
            reached = done(a, "job-2")
            a.jobs.revoke_for_cell("kernel", "r1", "cell-1", 2)  # the cell has both GPUs now
            assert run.pausing is not None
            await asyncio.wait_for(run.pausing, 10)
            assert run.killed_s is not None
            await until(lambda: "job-2" not in a.jobs.runs)
            latest = service.book.latest("job-2")
            assert latest is not None
            lost = reached - latest.step
            assert 0 <= lost <= every + 1  # at most one interval (+ the step running when killed)
            await b.jobs.grant(grant("job-2", out, tmp_path, total=total, every=every, step_s=0.0))
            resumed = b.jobs.runs["job-2"]
            assert resumed.restored_step == latest.step
            await asyncio.wait_for(resumed.process.exited.wait(), 60)
            assert resumed.process.returncode == 0
            return lost, run.killed_s, await reference

    lost, killed_s, expected = asyncio.run(scenario())
    assert out.read_text() == expected
    print(json.dumps({"steps_lost_on_rewind": lost, "rewind_release_s": round(killed_s, 4)}))


def test_the_service_never_points_a_job_at_an_incomplete_or_older_image(tmp_path: Path) -> None:
    """A manifest naming a pack the store lacks (an agent killed mid-write, a lost object) is
    refused and the job's latest image stays the last complete one; so is an older step."""
    from shared.checkpoint.manifest import Manifest, PieceLocation, TensorRecord
    from shared.rpc import RpcError

    async def scenario() -> None:
        async with cluster(tmp_path) as (service, a, _):
            store = service.store
            assert store is not None

            async def image(step: int, *, drop_pack: bool) -> dict[str, object]:
                pack = await store.put(bytes([step]) * 64)
                meta = await store.put(f"meta {step}".encode())
                record = TensorRecord("w", "float32", (16,), 64, ("f",), (PieceLocation(0, 0, 64),))
                manifest = Manifest("job-3", step, 64, (pack,), meta, (record,))
                ref = await store.put(manifest.to_json())
                if drop_pack:
                    await store.delete(pack)
                return {"manifest": ref.to_dict(), "written": [pack.digest]}

            complete = await image(5, drop_pack=False)
            assert (await a.link.commit("job-3", complete))["step"] == 5
            with pytest.raises(RpcError, match="incomplete"):
                await a.link.commit("job-3", await image(9, drop_pack=True))
            with pytest.raises(RpcError, match="older"):
                await a.link.commit("job-3", await image(3, drop_pack=False))
            latest = await a.link.latest("job-3")
            assert latest is not None and latest["step"] == 5 and latest["manifest"] == complete["manifest"]

    asyncio.run(scenario())


def test_packs_of_a_capture_killed_mid_way_are_collected_and_the_latest_image_stays(tmp_path: Path) -> None:
    """A job killed (SIGKILL) while a capture is storing its packs leaves objects no commit will
    name. The job journals every object as the store answers; once the process is gone its host
    hands the journal to the service, which deletes what no kept image needs when the protection
    ends, and keeps every object of the job's latest image."""
    from shared.datastore import ObjectRef
    from tandem_job.checkpoints import ANNOUNCE_FILE, JOURNAL_FILE

    async def scenario() -> tuple[int, int]:
        overrides = {"checkpoint.protect_s": 0.5, "checkpoint.collect_interval_s": 0.1}
        async with cluster(tmp_path, overrides=overrides) as (service, a, _):
            store = service.store
            assert store is not None

            async def stored(digest: str) -> bool:
                return await store.exists(ObjectRef(store.backend, store.key_for(digest), digest, 0, ""))

            # every step an image of ~12 MiB (3 packs, then the meta and the manifest)
            job = grant(
                "job-4", tmp_path / "unused", tmp_path, total=100_000, every=1, step_s=0.0, width=8192
            )
            await a.jobs.grant(job)
            run = a.jobs.runs["job-4"]
            journal, announced = run.process.directory / JOURNAL_FILE, run.process.directory / ANNOUNCE_FILE
            await until(lambda: announced.exists())
            # kill once the journal holds two objects the last announcement does not account for
            # (its packs, its manifest; its meta is the one more): a capture is mid-way
            while True:
                announcement = json.loads(announced.read_text())
                accounted = {*announcement["written"], announcement["manifest"]["digest"]}
                if len(set(journal.read_text().split()) - accounted) >= 2:
                    break
                await asyncio.sleep(0.005)
            run.process.kill_now()
            journaled = set(journal.read_text().split())
            await asyncio.wait_for(run.process.exited.wait(), 30)
            await until(lambda: not journal.exists())  # relayed to the service
            latest = service.book.latest("job-4")
            assert latest is not None
            orphans = journaled - latest.digests
            assert orphans, "the kill landed between captures"
            deadline = time.monotonic() + 30
            while any([await stored(d) for d in orphans]):
                assert time.monotonic() < deadline, "orphaned packs were not collected"
                await asyncio.sleep(0.05)
            assert all([await stored(d) for d in latest.digests])
            assert service.book.latest("job-4") == latest
            return len(orphans), len(latest.digests)

    orphans, kept = asyncio.run(scenario())
    print(json.dumps({"orphans_collected": orphans, "latest_image_objects_kept": kept}))
