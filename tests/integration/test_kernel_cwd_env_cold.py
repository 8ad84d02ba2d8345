"""A Tandem kernel starts where a stock ipykernel would (#19), on cold-started replicas:
papermill's ``cwd`` (it starts the kernel from there), ``KERNEL_WORKING_DIR`` (used where it
exists, as jupyter_server's ``cwd_for_path`` walks up), and a ``cwd`` the hosts lack fails the
start with its name, as ``Popen(cwd=...)`` would. (Pre-warmed runtimes and a drained replica:
test_kernel_cwd_env.py.)"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from _cluster import ROOT, ClusterHandle
from _kernels import run, tandem_kernel

pytestmark = pytest.mark.integration


def test_papermill_runs_a_notebook_in_its_cwd(tandem_cluster: ClusterHandle, tmp_path: Path) -> None:
    import papermill

    (tmp_path / "input.txt").write_text("from the notebook's folder\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(open('input.txt').read().strip())")]
    nbformat.write(nb, tmp_path / "in.ipynb")
    papermill.execute_notebook(
        str(tmp_path / "in.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="tandem", cwd=str(tmp_path)
    )
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert out.cells[0].outputs[0]["text"].strip() == "from the notebook's folder"


def test_kernel_working_dir_is_where_the_kernel_starts_and_a_missing_one_is_not_fatal(
    tandem_cluster: ClusterHandle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNEL_WORKING_DIR", str(tmp_path))
    with tandem_kernel() as (km, kc):
        assert run(kc, "import os; print(os.getcwd())").stdout.strip() == str(tmp_path)
        assert tandem_cluster.replica_cwds(km.kernel_id) == [str(tmp_path)] * 3
    # like jupyter_server's cwd_for_path: a folder only the front end has is no reason to fail
    monkeypatch.setenv("KERNEL_WORKING_DIR", str(tmp_path / "only-on-the-laptop"))
    with tandem_kernel() as (km, kc):
        assert run(kc, "print(1 + 1)").stdout.strip() == "2"
        assert tandem_cluster.replica_cwds(km.kernel_id) == [str(ROOT)] * 3  # the hosts' own


def test_a_cwd_the_hosts_lack_fails_the_start_and_says_which(
    tandem_cluster: ClusterHandle, tmp_path: Path
) -> None:
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="tandem")
    missing = tmp_path / "absent"
    with pytest.raises(RuntimeError, match=f"working directory {missing} does not exist"):
        km.start_kernel(cwd=str(missing))
