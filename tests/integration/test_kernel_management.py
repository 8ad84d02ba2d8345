"""`tandem kernel list/stop`, `tandem status --all` and `tandem run --allow-errors` against a real
embedded cluster, with output free of ANSI escapes in a pipe."""

from __future__ import annotations

import json
import time
from pathlib import Path

import nbformat
import pytest
from _cluster import ClusterHandle, eventually
from _kernels import run, tandem_kernel

pytestmark = pytest.mark.integration


def kernels_listed(cluster: ClusterHandle, *flags: str) -> list[dict[str, object]]:
    result = cluster.cli("kernel", "list", "--json", *flags)
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))


def test_kernel_list_shows_the_kernel_and_kernel_stop_ends_it(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "1").status == "ok"
        kernel_id = km.kernel_id
        [row] = [k for k in kernels_listed(tandem_cluster) if k["id"] == kernel_id]
        assert (row["name"], row["state"], row["execution_state"]) == ("tandem", "running", "idle")
        assert len(row["replicas"]) == 3 and row["executor"] in {r["id"] for r in row["replicas"]}
        assert row["connections"] == 1 and time.time() - float(row["last_activity"]) < 30
        table = tandem_cluster.cli("kernel", "list")
        assert table.returncode == 0 and kernel_id[:8] in table.stdout and "\x1b" not in table.stdout

        stopped = tandem_cluster.cli("kernel", "stop", kernel_id)
        assert stopped.returncode == 0 and f"{kernel_id}: stopped" in stopped.stdout, stopped.stderr
        assert eventually(lambda: not tandem_cluster.replica_pids(kernel_id), timeout=15)
        assert eventually(lambda: not km.is_alive(), timeout=10)
        restarter = km._restarter
        assert restarter is None or restarter.restart_limit == 0  # the client will not bring it back
    assert kernel_id not in {k["id"] for k in kernels_listed(tandem_cluster)}
    assert kernel_id not in {k["id"] for k in tandem_cluster.status()["kernels"]}
    everything = tandem_cluster.cli("status", "--json", "--all")
    kept = {k["id"]: k["state"] for k in json.loads(everything.stdout)["kernels"]}
    assert kept[kernel_id] == "stopped"

    unknown = tandem_cluster.cli("kernel", "stop", "no-such-kernel")
    assert unknown.returncode == 1 and "'no-such-kernel'" in unknown.stderr


def test_run_allow_errors_runs_every_cell_and_still_fails(
    tandem_cluster: ClusterHandle, tmp_path: Path
) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(c) for c in ("x = 1", "1 / 0", "print('after', x)")]
    path, out = tmp_path / "errors.ipynb", tmp_path / "out.ipynb"
    nbformat.write(notebook, path)
    result = tandem_cluster.cli("run", str(path), "-o", str(out), "--allow-errors", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cell 1 failed" in result.stdout and "\x1b" not in result.stdout + result.stderr
    cells = nbformat.read(out, as_version=4).cells
    assert cells[1].outputs[0]["ename"] == "ZeroDivisionError"
    assert cells[2].outputs[0]["text"] == "after 1\n"
