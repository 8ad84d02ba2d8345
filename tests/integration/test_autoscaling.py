"""Autoscaling on a real embedded cluster (`tandem up --hosts 3 --max-hosts 6`), metrics in
``tandem status --json`` and on the scheduler's Prometheus ``/metrics``.

Hosts have one virtual GPU and a subscription-ratio watermark of 1/3, so each host holds one
replica of a one-GPU kernel: the first kernel fills the three initial hosts, the second can only
start if the autoscaler adds three hosts, a third finds the cluster at ``--max-hosts``. Short
autoscale timers keep the scale-in after the second kernel's shutdown within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import (
    FAST_AUTOSCALING,
    WITHOUT_HTTP_API,
    ClusterHandle,
    running_cluster,
    start_cluster,
    stop_cluster,
)
from _kernels import run, tandem_kernel
from _signals import signal_ours
from jupyter_client import BlockingKernelClient

from services.embedded import EmbeddedCluster
from shared import messages
from shared.rpc import RpcError

pytestmark = pytest.mark.integration

SCALE_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def scaling_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    state_dir = tmp_path_factory.mktemp("autoscale-state")
    with running_cluster(
        state_dir,
        "--hosts", "3", "--max-hosts", "6", "--gpus-per-host", "1", *FAST_AUTOSCALING,
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle
    assert not processes_of(handle.scheduler), "hosts the autoscaler added outlived the cluster"


def processes_of(scheduler_address: str) -> list[int]:
    """Live processes whose command line names this scheduler (its local schedulers)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            named = scheduler_address.encode() in Path(f"/proc/{entry}/cmdline").read_bytes()
            if named and Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def notebook(scaling_cluster: ClusterHandle) -> Iterator[BlockingKernelClient]:
    """A kernel started through the gateway; its replicas fill the three initial hosts."""
    with tandem_kernel() as (_km, kc):
        yield kc


def start_kernel(cluster: ClusterHandle, kernel_id: str) -> dict[str, Any]:
    body = {"kernel_id": kernel_id, "key": uuid.uuid4().hex, "resources": {"gpus": 1}}
    return cluster.ask_scheduler(messages.KERNEL_START, body, timeout=SCALE_TIMEOUT_S)


def host_ids(report: dict[str, Any]) -> list[str]:
    return sorted(h["id"] for h in report["hosts"] if h["alive"])


def test_placement_that_cannot_fit_scales_out_then_idle_hosts_scale_in(
    scaling_cluster: ClusterHandle, notebook: BlockingKernelClient
) -> None:
    cluster, kc = scaling_cluster, notebook
    before = cluster.status()
    assert host_ids(before) == ["host-0", "host-1", "host-2"]
    assert before["autoscale"]["enabled"] is True and before["autoscale"]["max_hosts"] == 6
    cell = run(kc, "x = 6 * 7\nx")
    assert cell.status == "ok" and cell.results == ["42"]

    second = f"scaled-{uuid.uuid4().hex[:8]}"
    started = start_kernel(cluster, second)  # cannot fit: waits for the hosts it asked for
    new_hosts = {r["host"] for r in started["replicas"]}
    assert new_hosts == {"host-3", "host-4", "host-5"}, started
    grown = cluster.status()
    assert host_ids(grown) == [f"host-{i}" for i in range(6)]
    scale_outs = [e for e in grown["scale_events"] if e["kind"] == "scale_out"]
    assert scale_outs and scale_outs[0]["kernel"] == second and len(scale_outs[0]["hosts"]) == 3
    assert all(h["provisioned_by_autoscaler"] == (h["id"] in new_hosts) for h in grown["hosts"])

    with pytest.raises(RpcError) as refused:  # at --max-hosts: a clear refusal, not a hang
        start_kernel(cluster, f"too-many-{uuid.uuid4().hex[:8]}")
    assert refused.value.code == "no_capacity" and "max_hosts=6" in refused.value.reason

    cluster.ask_scheduler(messages.KERNEL_SHUTDOWN, {"kernel_id": second}, timeout=30)
    shrunk = cluster.wait_for_status(
        lambda s: len(host_ids(s)) == 3, "scale-in to the 3 initial hosts", SCALE_TIMEOUT_S
    )
    assert host_ids(shrunk) == ["host-0", "host-1", "host-2"]  # never below the initial hosts
    released = {h for e in shrunk["scale_events"] if e["kind"] == "scale_in" for h in e["hosts"]}
    assert released == new_hosts
    assert shrunk["cluster"]["scale_in_hosts"] == 3 and shrunk["cluster"]["scale_out_hosts"] == 3
    table = cluster.cli("status").stdout
    assert "autoscaling: 3..6 hosts" in table and "scale_in host-" in table
    assert run(kc, "x + 1").results == ["43"]  # the kernel on the initial hosts is untouched


def test_status_json_reports_cells_and_cluster_metrics(
    scaling_cluster: ClusterHandle, notebook: BlockingKernelClient
) -> None:
    for n in range(3):
        assert run(notebook, f"y = {n}").status == "ok"
    report = scaling_cluster.status()
    for host in report["hosts"]:
        assert {"id", "gpus", "committed", "subscribed", "cordoned", "warm_pool"} <= set(host)
    for kernel in report["kernels"]:
        assert {"id", "last_executor", "replicas"} <= set(kernel)
    cluster = report["cluster"]
    assert cluster["provisioned_gpus"] == 3 and cluster["hosts"] == 3
    assert {"committed_gpus", "subscription_ratio", "migrations", "scale_events"} <= set(cluster)
    metrics = report["metrics"]
    assert metrics["cells_total"] >= 3
    assert metrics["interactivity_delay_ms"]["count"] >= 3
    assert metrics["task_completion_ms"]["count"] >= 3
    assert metrics["immediate_commit_ratio"] == 1.0  # idle one-GPU hosts: every cell bound at once
    cell = report["cells"][-1]
    assert cell["executor"] and cell["host"] and cell["immediate"] is True
    assert "route_ms" in cell["steps_ms"] and cell["interactivity_delay_ms"] <= cell["task_completion_ms"]
    # elect_ms and run_ms need the executor's "elected" notice before the reply, which travels
    # another socket: on a loaded machine a trivial cell's reply can come first (then the record
    # has no election time of its own), so a few more cells until one shows the whole split
    for n in range(5):
        if any({"route_ms", "elect_ms", "run_ms"} <= set(c["steps_ms"]) for c in report["cells"]):
            break
        assert run(notebook, f"y = {n}").status == "ok"
        report = scaling_cluster.status()
    assert any({"route_ms", "elect_ms", "run_ms"} <= set(c["steps_ms"]) for c in report["cells"]), report[
        "cells"
    ]
    # the executor's own step times follow its reply (replica.event cell_timings)
    report = scaling_cluster.wait_for_status(
        lambda s: s["cells"] and s["cells"][-1]["replica_steps_ms"], "the replica's steps", SCALE_TIMEOUT_S
    )
    steps = report["cells"][-1]["replica_steps_ms"]
    assert {"decide_ms", "elect_ms", "bind_ms", "run_ms", "replied_ms"} <= set(steps)
    assert report["metrics"]["replica_steps_ms"]["run_ms"]["count"] >= 1
    assert report["metrics"]["cell_timings_dropped"] == 0


def test_prometheus_metrics_are_scrapable(
    scaling_cluster: ClusterHandle, notebook: BlockingKernelClient
) -> None:
    assert run(notebook, "1 + 1").results == ["2"]
    # its executor's step times come after the reply: scrape once they reached the scheduler
    report = scaling_cluster.wait_for_status(
        lambda s: s["cells"] and s["cells"][-1]["replica_steps_ms"], "the replica's steps", SCALE_TIMEOUT_S
    )
    url = report["metrics"]["prometheus_url"]
    assert url and url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["tandem_provisioned_gpus"] == 3.0
    assert samples["tandem_hosts"] == 3.0
    assert "tandem_subscription_ratio" in samples and "tandem_migrations_total" in samples
    assert samples["tandem_scale_out_hosts_total"] == report["cluster"]["scale_out_hosts"]
    assert samples["tandem_cell_interactivity_delay_seconds_count"] >= 1.0
    assert samples['tandem_cell_step_seconds_count{step="run"}'] >= 1.0
    assert samples['tandem_cell_replica_step_seconds_count{step="run"}'] >= 1.0  # the executor's own
    assert samples['tandem_cells_total{committed_immediately="true"}'] >= 1.0


def test_periodic_check_adds_hosts_for_the_scaling_buffer(tmp_path: Path) -> None:
    """f·ΣC plus the buffer wants 4 hosts of an idle 3-host cluster: the periodic check adds one
    (no kernel involved), and it stays, since the target is now met."""
    handle = start_cluster(
        tmp_path / "state",
        "--hosts", "3", "--max-hosts", "4", "--gpus-per-host", "1",
        "--set", "autoscale.buffer_hosts=4", "--set", "autoscale.interval_s=0.3",
        "--set", "autoscale.scale_in_idle_s=0.5", "--metrics-port", "0", *WITHOUT_HTTP_API,
    )  # fmt: skip
    try:
        report = handle.wait_for_status(lambda s: len(host_ids(s)) == 4, "a buffer host", SCALE_TIMEOUT_S)
        (event,) = [e for e in report["scale_events"] if e["kind"] == "scale_out"]
        assert event["hosts"] == ["host-3"] and "buffer" in event["reason"] and "kernel" not in event
        assert report["metrics"]["prometheus_url"] is None  # --metrics-port 0: no exporter
        time.sleep(1.5)  # several checks later: still 4 (the buffer is the target, not a surplus)
        assert host_ids(handle.status()) == ["host-0", "host-1", "host-2", "host-3"]
    finally:
        assert not stop_cluster(handle)
        assert not processes_of(handle.scheduler), "the buffer host outlived the cluster"


def test_hosts_added_by_a_scheduler_are_adopted_by_its_restarted_successor(
    scaling_cluster: ClusterHandle, notebook: BlockingKernelClient
) -> None:
    cluster = scaling_cluster
    if not hasattr(EmbeddedCluster, "restart_scheduler"):
        pytest.skip("tandem up does not restart the global scheduler")
    second = f"grow-{uuid.uuid4().hex[:8]}"  # the notebook kernel fills the initial hosts
    added = {r["host"] for r in start_kernel(cluster, second)["replicas"]}
    assert len(added) == 3 and not added & {"host-0", "host-1", "host-2"}
    processes = json.loads((cluster.state_dir / "cluster.json").read_text())["processes"]
    assert signal_ours(processes["global-scheduler"], signal.SIGKILL)
    back = cluster.wait_for_status(
        lambda s: len(host_ids(s)) == 6 and any(k["id"] == second for k in s["kernels"]),
        "the restarted scheduler seeing all six hosts and the kernel on the added ones",
        SCALE_TIMEOUT_S,
    )
    assert {h["id"] for h in back["hosts"] if h["provisioned_by_autoscaler"]} == added  # adopted
    cluster.ask_scheduler(messages.KERNEL_SHUTDOWN, {"kernel_id": second}, timeout=30)
    shrunk = cluster.wait_for_status(
        lambda s: len(host_ids(s)) == 3, "the adopted hosts released when idle", SCALE_TIMEOUT_S
    )
    assert not {h["id"] for h in shrunk["hosts"]} & added
