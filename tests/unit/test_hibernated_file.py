"""Hibernated kernels outlive a scheduler restart (services/global_scheduler/hibernated_file.py):
no host reports a kernel without replicas, so the scheduler keeps them on disk and a new scheduler
process adopts them, hibernated, ready to resume on their next request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.global_scheduler.hibernated_file import FIELDS, HibernatedFile, forget_hibernated
from shared.config import load_config
from shared.envelope import Envelope

IMAGE = {"key": "objects/ab/cd", "digest": "abcd", "size": 146, "checksum": "x"}


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield tmp_path
    loop.close()


def _scheduler(state_dir: Path) -> Any:
    from services.global_scheduler.service import GlobalScheduler

    return GlobalScheduler(load_config(overrides={"cluster.state_dir": str(state_dir)}))


def _close(gs: Any) -> None:
    gs._server._sock.close(linger=0)
    gs._ctx.destroy(linger=0)


def test_a_restarted_scheduler_adopts_the_hibernated_kernels(state_dir: Path) -> None:
    from services.global_scheduler.cluster_state import KernelRecord
    from services.global_scheduler.jupyter_router import KernelRouter
    from shared.cluster_core.lifecycle import HIBERNATED
    from shared.resources import Resources

    first = _scheduler(state_dir)
    kernel = KernelRecord("k1", "secret", "hmac-sha256", Resources(gpus=1), KernelRouter("k1", b"secret", "hmac-sha256", quorum=2), state=HIBERNATED)  # fmt: skip
    kernel.image, kernel.image_bytes, kernel.hibernated_at, kernel.generation = IMAGE, 146, 1000.0, 1
    first.state.kernels["k1"] = kernel
    first._save_hibernated()
    _close(first)

    second = _scheduler(state_dir)
    try:
        adopted = second.state.kernels["k1"]
        status = second.state.kernel_status(adopted)
        assert status["state"] == "hibernated" and status["replicas"] == []
        assert adopted.image == IMAGE and adopted.generation == 1 and adopted.key == "secret"
        report = second._hibernation_report()  # one GPU, three replicas' subscriptions given back
        assert report["hibernated"] == 1 and report["gpu_hours_freed"] > 3 * 1000
        # shut down while hibernated: stopped at once, and no longer on disk
        answer = asyncio.get_event_loop().run_until_complete(
            second._on_kernel_shutdown(b"gateway", Envelope("kernel.shutdown", {"kernel_id": "k1"}))
        )
        assert answer.body["state"] == "stopped"
        assert HibernatedFile(state_dir / "scheduler" / "hibernated.json").load() == []
    finally:
        _close(second)


def test_entries_missing_a_field_or_an_unreadable_file_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / "hibernated.json"
    whole = dict.fromkeys(FIELDS, 0)
    HibernatedFile(path).save([whole, {"kernel_id": "half"}])
    assert HibernatedFile(path).load() == [whole]
    path.write_text("{not json")
    assert HibernatedFile(path).load() == []
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_new_cluster_forgets_them(tmp_path: Path) -> None:
    HibernatedFile(tmp_path / "scheduler" / "hibernated.json").save([])
    forget_hibernated(tmp_path)
    assert not (tmp_path / "scheduler" / "hibernated.json").exists()
