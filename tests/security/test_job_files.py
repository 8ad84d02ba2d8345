"""A batch job against the host that runs it, through the files the host reads in its directory.

A job holds no key, but it writes ``progress.json`` and ``checkpoint.json`` for its host to read,
and it can replace ``output.log``. The host read them with plain ``open`` on the event loop that
serves every replica on it: a FIFO there froze that local scheduler for good (the scheduler then
declared the host dead and moved its replicas away), and a ``checkpoint.json`` holding ``[]``
killed the relay with a TypeError, after which the job's end never gave its GPUs back. Now the
host opens only regular files, without following symlinks and without blocking, reads at most
1 MiB, checks the announcement's shape, and releases a job's GPUs whatever became of its relay.
(A job runs as the host's user, so this is about the host staying up whatever a job leaves in
its directory, not a privilege boundary: README, Security.)"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from _cluster import ClusterHandle
from test_batch_jobs import job_list, tandem

from services.local_scheduler.batch_jobs import announced_image
from services.local_scheduler.job_process import read_job_file

FIFOS = """
import os, pathlib, time
run_dir = pathlib.Path(os.environ["TANDEM_JOB_DIR"])
for path in (run_dir / "progress.json", run_dir / "checkpoint.json", run_dir.parent / "output.log"):
    path.unlink(missing_ok=True)
    os.mkfifo(path)
time.sleep(600)
"""
NOT_AN_ANNOUNCEMENT = """
import os, pathlib, time
(pathlib.Path(os.environ["TANDEM_JOB_DIR"]) / "checkpoint.json").write_text("[]")
time.sleep(0.5)
"""


def _submit(cluster: ClusterHandle, app: str, script: str) -> str:
    submitted = tandem(cluster, "job", "submit", "--app", app, "--gpus", "1", "--", "python", "-c", script)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().splitlines()[-1]


def _job(cluster: ClusterHandle, job_id: str) -> dict[str, Any]:
    return next(j for j in job_list(cluster) if j["job_id"] == job_id)


def _wait_for_job(
    cluster: ClusterHandle, job_id: str, states: set[str], timeout: float = 90.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(cluster, job_id)
        if job["state"] in states:
            return job
        time.sleep(0.3)
    pytest.fail(f"job {job_id} never reached {states}: {job}")


def _unaccounted_gpus(status: dict[str, Any]) -> dict[str, int]:
    """Per host, GPUs that are neither a cell's, a job's, free nor kept for cells."""
    hosts = ((status.get("batch") or {}).get("usage") or {}).get("hosts") or {}
    return {
        host: use["gpus"] - sum(use[k] for k in ("cells", "be", "free", "reserved"))
        for host, use in hosts.items()
        if use["gpus"] != sum(use[k] for k in ("cells", "be", "free", "reserved"))
    }


def test_an_announcement_speaks_for_its_own_job_only_and_must_have_the_agents_shape() -> None:
    ref = {"backend": "local", "key": "k", "digest": "0" * 64, "size": 1, "checksum": "c"}
    relayed = announced_image(json.dumps({"manifest": ref, "written": [], "job_id": "other.1"}).encode())
    assert relayed == {"manifest": ref, "written": []}  # the host adds the id of the job it runs
    for junk in (b"[]", b'"x"', b"{}", b'{"manifest": 1}', b'{"manifest": {}, "written": [1]}', b"\xff"):
        with pytest.raises(ValueError):
            announced_image(junk)


def test_only_a_small_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 2_000_000)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to("/dev/zero")
    with pytest.raises(ValueError):
        read_job_file(tmp_path / "big")
    for name in ("fifo", "link"):
        with pytest.raises(OSError):
            read_job_file(tmp_path / name)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_files_a_job_leaves_in_its_directory_neither_freeze_its_host_nor_keep_its_gpus(
    tandem_cluster: ClusterHandle,
) -> None:
    fifos = _submit(tandem_cluster, "fifos", FIFOS)
    broken = _submit(tandem_cluster, "notimage", NOT_AN_ANNOUNCEMENT)
    host = _wait_for_job(tandem_cluster, fifos, {"running"})["host"]
    time.sleep(1.0)  # its FIFOs made, and looked at by the relay and the progress reports

    logs = tandem(tandem_cluster, "job", "logs", fifos, timeout=30)
    assert logs.returncode != 0 and "not a regular file" in logs.stderr, logs.stderr
    deadline = time.monotonic() + 5.0  # five heartbeat intervals: a frozen host is dead by then
    while time.monotonic() < deadline:
        hosts = {h["id"]: h for h in tandem_cluster.status()["hosts"]}
        assert hosts[host]["alive"], f"{host} stopped answering with the job's FIFOs in its directory"
        time.sleep(0.5)

    assert _wait_for_job(tandem_cluster, broken, {"finished", "failed"})["state"] == "finished"
    cancelled = tandem(tandem_cluster, "job", "cancel", fifos, timeout=60)
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.dumps(_job(tandem_cluster, fifos)["state"]) == '"cancelled"'
    tandem_cluster.wait_for_status(
        lambda s: not _unaccounted_gpus(s), "every GPU of both jobs back with its host", timeout=20
    )
