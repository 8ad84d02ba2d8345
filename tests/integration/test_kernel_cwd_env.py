"""A Tandem kernel starts where and with what a stock ipykernel would (#19), on pre-warmed
runtimes: nbclient's ``cwd`` and ``env`` reach every replica, and a replica that moves to another
host (a drain) starts there too. (Cold starts, papermill and ``KERNEL_WORKING_DIR``:
test_kernel_cwd_env_cold.py.)

One cluster of 4 hosts with one pre-warmed runtime per host: a kernel's three replicas take warm
runtimes (the cwd is applied when a runtime is claimed), the replica a drain re-places another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, eventually, running_cluster
from _kernels import run
from nbclient import NotebookClient

from shared import messages

pytestmark = pytest.mark.integration

PREWARM = (
    "--hosts", "4",
    "--set", "prewarm.policy=fixed", "--set", "prewarm.per_host=1",
    "--set", "prewarm.interval_s=0.3", "--set", "prewarm.imports=[]",
    *WITHOUT_HTTP_API,
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    with running_cluster(tmp_path_factory.mktemp("tandem-cwd"), *PREWARM) as handle:
        assert eventually(lambda: _warm(handle) >= 4, timeout=60), "the warm pools never filled"
        yield handle


def _warm(handle: ClusterHandle) -> int:
    hosts = handle.ask_scheduler(messages.CLUSTER_STATUS, {})["hosts"]
    return sum(int((h.get("warm_pool") or {}).get("warm", 0)) for h in hosts)


def _warm_started(handle: ClusterHandle, kernel_id: str) -> list[bool]:
    return [
        b"kernel_replica.warm" in Path(f"/proc/{pid}/cmdline").read_bytes()
        for pid in handle.scheduled_replica_pids(kernel_id)
    ]


def test_nbclient_cwd_and_env_reach_every_replica_and_relative_paths_resolve_there(
    cluster: ClusterHandle, tmp_path: Path
) -> None:
    notebook_dir = tmp_path / "project" / "notebooks"
    (notebook_dir / "data").mkdir(parents=True)
    (notebook_dir / "data" / "values.csv").write_text("a,b\n1,2\n")
    (notebook_dir / "helpers.py").write_text("ANSWER = 42\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import os; print(os.getcwd())"),
        nbformat.v4.new_code_cell("print(open('data/values.csv').read().splitlines()[1])"),
        nbformat.v4.new_code_cell("%%file out.txt\nwritten by the kernel"),
        nbformat.v4.new_code_cell("import helpers; print(helpers.ANSWER)"),
        nbformat.v4.new_code_cell("print(os.environ.get('KERNEL_FOO'), os.environ.get('MY_SETTING'))"),
    ]
    client = NotebookClient(
        nb,
        kernel_name="tandem",
        timeout=60,
        resources={"metadata": {"path": str(notebook_dir)}},  # papermill's cwd arrives like this
    )
    env = {**os.environ, "KERNEL_FOO": "bar", "MY_SETTING": "on"}
    with client.setup_kernel(env=env):
        kernel_id = client.km.kernel_id
        assert cluster.replica_cwds(kernel_id) == [str(notebook_dir)] * 3
        assert _warm_started(cluster, kernel_id) == [True] * 3  # the cwd was applied when claimed
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
    outputs = ["".join(o.get("text", "") for o in cell.outputs).strip() for cell in nb.cells]
    assert outputs[0] == str(notebook_dir)
    assert outputs[1] == "1,2"
    assert (notebook_dir / "out.txt").read_text().strip() == "written by the kernel"
    assert outputs[3] == "42"
    assert outputs[4] == "bar on"


def test_a_replica_moved_by_a_drain_starts_in_the_kernels_directory(
    cluster: ClusterHandle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNEL_MOVED", "yes")
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="tandem")
    km.start_kernel(cwd=str(tmp_path))
    try:
        kernel_id = km.kernel_id
        before = _replica_hosts(cluster, kernel_id)
        host = sorted(before)[0]
        drained = cluster.cli("host", "drain", host, timeout=120)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        (moved_to,) = _replica_hosts(cluster, kernel_id) - before
        assert eventually(lambda: len(cluster.scheduled_replica_pids(kernel_id)) == 3, timeout=30)
        assert cluster.replica_cwds(kernel_id) == [str(tmp_path)] * 3
        kc = km.client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            with cluster.only_host_open(moved_to):
                assert run(
                    kc, "import os; print(os.getcwd(), os.environ['KERNEL_MOVED'])"
                ).stdout.split() == [
                    str(tmp_path),
                    "yes",
                ]
        finally:
            kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
        cluster.cordon(host, False)


def _replica_hosts(cluster: ClusterHandle, kernel_id: str) -> set[str]:
    status = cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
    return {r["host"] for r in status["replicas"] if r["alive"]}
