"""State files were world-readable: the Raft WAL and snapshots (every replicated variable,
pickled), the data store, the input history, the logs. Every directory under a cluster's state
dir is now 0700 and every file 0600, whatever the umask of whoever started it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import running_cluster
from _kernels import run, tandem_kernel

from shared.private_files import open_private, private_dir, write_private

pytestmark = pytest.mark.integration


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
    with running_cluster(state, "--set", "raft.snapshot_every=8") as cluster, tandem_kernel() as (_km, kc):
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
        loose = _loose(cluster.state_dir)
    assert not loose, "\n".join(loose)


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
