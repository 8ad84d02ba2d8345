"""Idle culling on a real cluster (kernel.cull_idle_s): an idle kernel is shut down, its replicas
stopped and its client told it stopped; a kernel running a cell is spared (cull_busy false)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, eventually, running_cluster
from _kernels import tandem_kernel

pytestmark = pytest.mark.integration
# long enough for the busy kernel's start, wait_for_ready and execute (each counts as activity) on
# a loaded machine; its cell (3x) outlives the 2x wait below
CULL_IDLE_S = 3.0


@pytest.fixture(scope="module")
def culling_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    settings = {
        "kernel.cull_idle_s": CULL_IDLE_S,
        "kernel.cull_interval_s": 0.5,
        "kernel.cull_connected": "true",
    }
    flags = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    with running_cluster(
        tmp_path_factory.mktemp("culling-state"), "--hosts", "3", *flags, *WITHOUT_HTTP_API
    ) as handle:
        yield handle


def test_an_idle_kernel_is_culled_and_a_busy_one_only_once_its_cell_ended(
    culling_cluster: ClusterHandle,
) -> None:
    cluster = culling_cluster
    with tandem_kernel() as (idle_km, _idle_kc), tandem_kernel() as (busy_km, busy_kc):
        idle_id, busy_id = idle_km.kernel_id, busy_km.kernel_id
        msg_id = busy_kc.execute(f"import time; time.sleep({3 * CULL_IDLE_S})")
        cell_started = time.monotonic()

        assert eventually(lambda: not cluster.replica_pids(idle_id), timeout=CULL_IDLE_S + 10)
        assert eventually(lambda: not idle_km.is_alive(), timeout=10)  # the client sees it stopped
        restarter = idle_km._restarter
        assert restarter is None or restarter.restart_limit == 0  # and will not restart it
        culled = [line for line in cluster.log_text("gateway").splitlines() if "kernel_culled" in line]
        assert any(idle_id in line and "without activity" in line for line in culled), culled
        assert idle_id not in {k["id"] for k in cluster.status()["kernels"]}

        time.sleep(max(0.0, cell_started + 2 * CULL_IDLE_S - time.monotonic()))
        assert busy_km.is_alive() and len(cluster.replica_pids(busy_id)) == 3  # busy: spared
        reply = busy_kc.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
        assert eventually(lambda: not cluster.replica_pids(busy_id), timeout=CULL_IDLE_S + 10)
