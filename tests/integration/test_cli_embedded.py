"""The CLI against a running cluster, the demo notebook, and tandem up's no-orphans promise."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import requests
from _cluster import ClusterHandle, eventually, missing_services, start_cluster, stop_cluster
from _signals import signal_ours

from services.cli import run_notebook

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_status_json_shape(tandem_cluster: ClusterHandle) -> None:
    result = tandem_cluster.cli("status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    hosts = status["hosts"]
    assert [h["id"] for h in hosts] == ["host-0", "host-1", "host-2", "host-3"]
    for host in hosts:
        assert host["alive"] is True
        assert isinstance(host["gpus"], int) and isinstance(host["committed"], int)
        assert isinstance(host["cordoned"], bool)
        assert isinstance(host["subscription_ratio"], int | float)
    assert isinstance(status["kernels"], list)
    for kernel in status["kernels"]:
        assert {"id", "state", "replicas"} <= set(kernel)
    table = tandem_cluster.cli("status")
    assert table.returncode == 0 and "host-0" in table.stdout


def test_cordon_shows_in_status(tandem_cluster: ClusterHandle) -> None:
    assert tandem_cluster.cli("host", "cordon", "host-3").returncode == 0
    try:
        status = json.loads(tandem_cluster.cli("status", "--json").stdout)
        assert next(h for h in status["hosts"] if h["id"] == "host-3")["cordoned"] is True
    finally:
        assert tandem_cluster.cli("host", "uncordon", "host-3").returncode == 0
    bad = tandem_cluster.cli("host", "cordon", "no-such-host")
    assert bad.returncode != 0 and "no-such-host" in bad.stderr


def test_quickstart_notebook_runs(tandem_cluster: ClusterHandle, tmp_path: Path) -> None:
    report = run_notebook(ROOT / "examples" / "quickstart.ipynb", tmp_path / "out.ipynb", timeout=120)
    assert report["ok"], (report["error"], report["cells"])
    assert all(c["replica"] and c["host"] for c in report["cells"])


def test_tandem_up_leaves_no_orphans(tmp_path: Path) -> None:
    if missing_services():
        pytest.skip("cluster services not written yet")
    handle = start_cluster(tmp_path / "state", "--hosts", "3")
    pids = list(handle.info["processes"].values())
    assert (
        len(pids) == 9
    )  # arbiter, serving controller, checkpoint service, scheduler, gateway, 3 hosts, the HTTP API
    # a local scheduler dies hard: tandem up keeps running and still cleans up at the end
    assert signal_ours(handle.info["processes"]["host-2"], signal.SIGKILL)
    time.sleep(0.5)
    assert handle.process.poll() is None
    # the Kernel Gateway API dies hard: restarted on the same URL, the cluster goes on
    assert signal_ours(handle.info["processes"]["http-gateway"], signal.SIGKILL)
    cluster_file = tmp_path / "state" / "cluster.json"
    assert eventually(
        lambda: (
            json.loads(cluster_file.read_text())["processes"]["http-gateway"]
            != handle.info["processes"]["http-gateway"]
        ),
        timeout=60,
    ), (tmp_path / "state" / "tandem-up.out").read_text()[-3000:]
    url = handle.info["http"]
    handle.info = json.loads(cluster_file.read_text())
    assert handle.info["http"] == url
    token = (tmp_path / "state" / "keys" / "http.token").read_text().strip()
    answer = requests.get(
        f"{handle.info['http']}/api/kernelspecs", headers={"Authorization": f"token {token}"}, timeout=30
    )
    assert answer.status_code == 200
    assert handle.process.poll() is None
    survivors = stop_cluster(handle)
    assert survivors == []
    assert not (tmp_path / "state" / "cluster.json").exists()
    assert handle.process.returncode == 0
