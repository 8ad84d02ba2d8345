"""The ``tandem`` CLI's flag-to-config mapping, its errors, and the embedded cluster's helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _signals import signal_ours

from services import cli
from services.cluster_file import ClusterNotRunning, read_cluster
from services.embedded import descendants, registered_hosts


def test_every_up_flag_maps_to_a_config_key(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(
        ["up", "--hosts", "2", "--gpus-per-host", "4", "--state-dir", str(tmp_path), "--log-format", "json",
         "--set", "scheduler.request_timeout_s=3"]
    )  # fmt: skip
    cfg = cli.config_from_args(args)
    assert cfg.get("cluster.hosts") == 2
    assert cfg.get("host.gpus") == 4
    assert cfg.get("cluster.state_dir") == str(tmp_path)
    assert cfg.get("log.format") == "json"
    assert cfg.get("scheduler.request_timeout_s") == 3.0


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[cluster]\nhosts = 7\n[host]\ngpus = 2\n")
    args = cli.build_parser().parse_args(["up", "--config", str(config), "--hosts", "3"])
    cfg = cli.config_from_args(args)
    assert (cfg.get("cluster.hosts"), cfg.get("host.gpus")) == (3, 2)


def test_local_toml_is_the_defaults() -> None:
    from shared.config import DEFAULTS, load_config

    root = Path(__file__).resolve().parents[2]
    assert load_config(root / "configs" / "local.toml").as_dict() == DEFAULTS


def test_unknown_key_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--set", "cluster.nope=1"]) == 2
    assert "unknown configuration key 'cluster.nope'" in capsys.readouterr().err


def test_up_with_a_simulator_only_policy_refuses_naming_tandem_sim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["up", "--state-dir", str(tmp_path), "--set", "scheduler.policy=batch"])
    assert code == 2
    err = capsys.readouterr().err
    assert "scheduler.policy = 'batch' runs only in the simulator" in err and "tandem sim" in err
    assert not (tmp_path / "cluster.json").exists()


def test_status_without_a_cluster_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", "--state-dir", str(tmp_path)]) == 2
    assert "no Tandem cluster is running" in capsys.readouterr().err


def test_a_notebook_that_cannot_be_read_is_named_with_the_reason_before_any_kernel_starts(
    tmp_path: Path,
) -> None:
    with pytest.raises(cli.NotebookUnreadable, match=r"cannot read the notebook .*missing\.ipynb"):
        cli.run_notebook(tmp_path / "missing.ipynb", None)
    (tmp_path / "broken.ipynb").write_text('{"cells": [}')
    with pytest.raises(cli.NotebookUnreadable, match=r"broken\.ipynb is not a Jupyter notebook"):
        cli.run_notebook(tmp_path / "broken.ipynb", None)
    (tmp_path / "other.ipynb").write_text('{"a": 1}')
    with pytest.raises(cli.NotebookUnreadable, match=r"other\.ipynb is not a Jupyter notebook"):
        cli.run_notebook(tmp_path / "other.ipynb", None)


def test_stale_cluster_file_is_not_running(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "cluster.json").write_text(
        json.dumps({"gateway": "tcp://x:1", "scheduler": "tcp://x:2", "pid": dead.pid})
    )
    with pytest.raises(ClusterNotRunning, match="not running"):
        read_cluster(tmp_path)


def test_kernelspec_install_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["kernelspec", "install", "--prefix", str(tmp_path)]) == 0
    spec = json.loads((tmp_path / "share" / "jupyter" / "kernels" / "tandem" / "kernel.json").read_text())
    assert spec["display_name"] == "Tandem (replicated)"


def test_registered_hosts_reads_cluster_status() -> None:
    status = {"hosts": [{"id": "host-0", "alive": True}, {"id": "host-1", "alive": False}, {"id": "host-2"}]}
    assert registered_hosts(status) == ["host-0", "host-2"]


def test_descendants_finds_grandchildren() -> None:
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"])  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        found: list[int] = []
        while time.monotonic() < deadline and len(found) < 2:
            found = descendants(os.getpid())
            time.sleep(0.05)
        assert parent.pid in found and len(found) >= 2
    finally:
        for pid in reversed(descendants(parent.pid)):
            signal_ours(pid, 9)
        parent.kill()
        parent.wait()
