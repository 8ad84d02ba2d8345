"""Hibernation on a real cluster (kernel.hibernate_after_s): an idle kernel's namespace goes to the
data store and its three replica processes stop; the next cell resumes it on hosts placement
picks, with the same values, while the client waits (its request is held, not failed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import ClusterHandle, eventually, running_cluster
from _kernels import run, tandem_kernel

from shared import messages

pytestmark = pytest.mark.integration
HIBERNATE_AFTER_S = 2.0


@pytest.fixture(scope="module")
def hibernating_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    settings = {"kernel.hibernate_after_s": HIBERNATE_AFTER_S, "kernel.hibernate_interval_s": 0.5}
    flags = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    with running_cluster(tmp_path_factory.mktemp("hibernation-state"), "--hosts", "3", *flags) as handle:
        yield handle


def _state(cluster: ClusterHandle, kernel_id: str) -> str:
    return str(cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})["state"])


def test_an_idle_kernel_hibernates_and_its_next_cell_finds_its_namespace(
    hibernating_cluster: ClusterHandle,
) -> None:
    cluster = hibernating_cluster
    with tandem_kernel() as (km, kc):
        kernel_id = km.kernel_id
        setup = "import numpy as np\nx = 41\narr = np.arange(1_000_000, dtype=np.float64)"
        assert run(kc, setup).status == "ok"
        before = set(cluster.scheduled_replica_pids(kernel_id))
        assert len(before) == 3

        assert eventually(lambda: _state(cluster, kernel_id) == "hibernated", timeout=HIBERNATE_AFTER_S + 15)
        assert eventually(lambda: not any(_alive(pid) for pid in before), timeout=10)  # processes gone
        assert km.is_alive()  # the client sees a live kernel (heartbeats answered), not a dead one
        rows = {row["id"]: row for row in _kernel_list(cluster)}
        assert rows[kernel_id]["state"] == "hibernated"
        assert rows[kernel_id]["replicas"] == []  # nothing subscribed, nothing placed
        assert "hibernated" in cluster.cli("status").stdout

        cell = run(kc, "print(x + 1, float(arr.sum()), arr.dtype, arr.shape)", timeout=60)
        assert cell.status == "ok", cell.errors
        assert cell.stdout.split() == ["42", str(float(sum(range(1_000_000)))), "float64", "(1000000,)"]
        after = set(cluster.scheduled_replica_pids(kernel_id))
        assert len(after) == 3 and not after & before  # three new replica processes
        status = cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
        assert status["state"] == "running" and status["hibernation"]["resumes"] == 1
        log = cluster.log_text("global-scheduler")
        assert "kernel_hibernated" in log and "kernel_resumed" in log

        # and the resumed kernel keeps working as any other: a new value, replicated as usual
        assert run(kc, "y = x * 2").status == "ok"
        assert run(kc, "print(y)").stdout.strip() == "82"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kernel_list(cluster: ClusterHandle) -> list[dict[str, object]]:
    import json

    result = cluster.cli("kernel", "list", "--json")
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))
