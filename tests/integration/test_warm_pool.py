"""Pre-warmed replica runtimes on a real embedded cluster: each local scheduler keeps one warm
``kernel_replica.warm`` process (``prewarm.policy = fixed``), a kernel start hands it its replica
and the pool refills; ``tandem status --json`` shows the pools and the warm start times."""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import ClusterHandle, running_cluster
from _kernels import run, tandem_kernel

pytestmark = pytest.mark.integration

WAIT_S = 90.0


@pytest.fixture(scope="module")
def warm_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    state_dir = tmp_path_factory.mktemp("warm-state")
    with running_cluster(
        state_dir,
        "--hosts", "3", "--gpus-per-host", "1",
        "--set", "prewarm.policy=fixed", "--set", "prewarm.per_host=1",
        "--set", "prewarm.interval_s=0.3", "--set", "prewarm.imports=[]",
    ) as handle:  # fmt: skip
        yield handle


def wait_until_pools_ready(cluster: ClusterHandle) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        report = cluster.status()
        if all(h["warm_pool"].get("warm") == 1 for h in report["hosts"]) and len(report["hosts"]) == 3:
            return report
        time.sleep(0.3)
    pytest.fail(f"warm pools did not fill: {[h['warm_pool'] for h in report['hosts']]}")


def test_replica_start_takes_a_warm_runtime_and_the_pool_refills(warm_cluster: ClusterHandle) -> None:
    before = wait_until_pools_ready(warm_cluster)
    assert all(h["warm_pool"]["target"] == 1 for h in before["hosts"])
    with tandem_kernel() as (_km, kc):
        code = "import os\nz = 5\n(os.environ['TANDEM_HOST_ID'], b'kernel_replica.warm' in open('/proc/self/cmdline', 'rb').read())"
        cell = run(kc, code)
        assert cell.status == "ok", cell.errors
        host, warm_started = ast.literal_eval(cell.results[0])
        assert host.startswith("host-") and warm_started is True
        after = warm_cluster.status()
        assert sum(h["warm_pool"]["taken"] for h in after["hosts"]) == 3
        assert after["metrics"]["replica_start_ms"]["warm"]["count"] == 3
        refilled = wait_until_pools_ready(warm_cluster)  # a fresh warm runtime behind each one taken
        assert sum(h["warm_pool"]["taken"] for h in refilled["hosts"]) == 3
        assert run(kc, "z * 2").results == ["10"]  # the warm-started replicas keep working
