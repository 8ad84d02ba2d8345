"""State files were world-readable: the Raft WAL and snapshots (every replicated variable,
pickled), the data store, the input history, the logs. Every directory under a cluster's state
dir is now 0700 and every file 0600, whatever the umask of whoever started it: also what came
later, a batch job's directory (its output, control and progress files), the arbiter's registry
(the job's command and environment), a hibernated kernel's record and image, and the HTTP
API's kernel records (their keys)."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from _cluster import ClusterHandle, eventually, running_cluster
from _kernels import run, tandem_kernel
from test_batch_jobs import tandem

from shared.private_files import MAX_SOCKET_PATH, open_private, private_dir, write_private

pytestmark = pytest.mark.integration

JOB = "import tandem_job\nwith tandem_job.session(total=3) as job:\n    for step in job.steps(): pass"


def _loose(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) a group member or another user could read,
    write or enter, with its mode."""
    loose = []
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if st.st_mode & 0o077:
            loose.append(f"{stat.filemode(st.st_mode)} {path.relative_to(root.parent)}")
    return loose


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """The umask of a typical shell (022), inherited by ``tandem up`` and all it starts."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_state_dir_of_a_cluster_that_ran_a_kernel_is_private(
    tmp_path: Path, tandem_kernelspec: Path, permissive_umask: None
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)  # the operator's (an existing open one is warned about, not changed)
    config = ("--set", "raft.snapshot_every=8", "--set", "arbiter.round_s=0.5")
    with running_cluster(state, *config) as cluster, tandem_kernel() as (km, kc):
        submitted = tandem(cluster, "job", "submit", "--app", "modes", "--", sys.executable, "-c", JOB)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip().splitlines()[-1]
        api, token = str(cluster.info["http"]), (state / "keys" / "http.token").read_text().strip()
        started = requests.post(
            f"{api}/api/kernels",
            json={"name": "tandem"},
            headers={"Authorization": f"token {token}"},
            timeout=120,
        )
        assert started.status_code == 201, started.text
        for cell in (
            "import numpy as np\nsecret = 'hunter2'",
            "weights = np.arange(400_000.0)",  # 3.2 MB: into the data store
            *(f"step = {i}" for i in range(12)),  # past raft.snapshot_every: snapshots on disk
            "print(len(secret), weights[-1])",
        ):
            assert run(kc, cell).status == "ok", cell
        replica_dirs = list(cluster.state_dir.glob("hosts/*/*/r*"))
        assert replica_dirs and list(cluster.state_dir.glob("hosts/*/*/r*/raft/snap-*"))
        assert list(cluster.state_dir.glob("datastore/objects/*/*/*"))
        assert list(cluster.state_dir.glob("hosts/*/*/r*/history.sqlite"))
        hibernated = cluster.cli("kernel", "hibernate", km.kernel_id)
        assert hibernated.returncode == 0, hibernated.stderr + hibernated.stdout
        assert eventually(lambda: _job_state(cluster, job_id) == "finished", timeout=60)
        assert list(cluster.state_dir.glob(f"jobs/{job_id}/*/progress.json"))
        assert list(cluster.state_dir.glob("arbiter/*")) and list(cluster.state_dir.glob("http/sessions/*"))
        assert (cluster.state_dir / "scheduler" / "hibernated.json").exists()
        socket_path = cluster.state_dir / "run" / "scheduler.sock"  # the scheduler's ipc endpoint
        assert socket_path.is_socket() or len(str(socket_path)) > MAX_SOCKET_PATH
        loose = _loose(cluster.state_dir)
    assert not loose, "\n".join(loose)


def _job_state(cluster: ClusterHandle, job_id: str) -> str:
    listed = cluster.cli("job", "list", "--json")
    return next((j["state"] for j in json.loads(listed.stdout) if j["job_id"] == job_id), "")


def test_private_helpers_narrow_what_exists_and_create_private(
    tmp_path: Path, permissive_umask: None
) -> None:
    made = private_dir(tmp_path / "a" / "b")
    assert (
        stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700 and stat.S_IMODE(made.stat().st_mode) == 0o700
    )
    opened = tmp_path / "opened"
    opened.mkdir(mode=0o755)
    os.chmod(opened, 0o1755)  # as jupyter_client leaves a connection file's directory
    private_dir(opened)
    assert stat.S_IMODE(opened.stat().st_mode) == 0o1700
    old = tmp_path / "old.log"
    old.write_text("")
    os.chmod(old, 0o644)
    os.close(open_private(old, os.O_WRONLY | os.O_APPEND))
    write_private(tmp_path / "new", "x")
    assert stat.S_IMODE(old.stat().st_mode) == stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o600
