"""A held cell whose migration finds no host scales out for it (NotebookOS §3.4.2), on a real
embedded cluster (`tandem up --hosts 3 --max-hosts 4`, one GPU per host).

Four one-GPU kernels share the three initial hosts; three of them run cells that hold their GPUs
until a flag file appears, so the fourth kernel's cell has no replica that can run it and no host
to migrate to. The scheduler's core asks the autoscaler for a host reserved for that cell; the
cell waits for it past ``scheduler.migration_deadline_s`` (1.5 s here) and runs once its replica
has moved there. The periodic check is set not to add hosts on its own (f = 1, no buffer host), so
the host that comes is the one the held cell asked for.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import run, tandem_kernel
from test_migration import BackgroundCell, busy_hosts, settle, wait_for

pytestmark = pytest.mark.integration

# below what a new host takes to register (process start, imports, heartbeat: 2-3 s here) plus the
# 1 s settle before the first migration, so the wait below must outlive it (3 s was flaky: a host
# registered in 2.6 s once)
MIGRATION_DEADLINE_S = 1.5


@pytest.fixture(scope="module")
def growing_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    state_dir = tmp_path_factory.mktemp("held-scale-out")
    with running_cluster(
        state_dir,
        "--hosts", "3", "--max-hosts", "4", "--gpus-per-host", "1",
        "--set", "autoscale.scaling_factor=1.0",
        "--set", "autoscale.buffer_hosts=0",
        "--set", "autoscale.interval_s=0.5",
        "--set", "autoscale.scale_out_timeout_s=90",
        "--set", f"scheduler.migration_deadline_s={MIGRATION_DEADLINE_S}",
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle


def test_a_held_cell_with_no_host_scales_out_and_runs_on_the_new_host(
    growing_cluster: ClusterHandle, tmp_path: Path
) -> None:
    cluster = growing_cluster
    with contextlib.ExitStack() as stack:
        books = [stack.enter_context(tandem_kernel()) for _ in range(4)]
        for _km, kc in books:
            settle(cluster, heartbeat_s=1.0)  # the default interval: see MIGRATION_DEADLINE_S
            assert run(kc, "value = 1", timeout=60).status == "ok"
        settle(cluster, heartbeat_s=1.0)
        busy = [BackgroundCell(kc, tmp_path / f"release-{n}") for n, (_km, kc) in enumerate(books[:3])]
        try:
            wait_for(lambda: len(busy_hosts(cluster)) == 3, "every initial host's GPU busy")
            km, kc = books[3]
            started = time.monotonic()
            cell = run(kc, "print('ran', value)", timeout=150)
            waited = time.monotonic() - started
            assert cell.status == "ok", cell.reply["content"]
            assert "ran 1" in cell.stdout  # the moved replica kept the kernel's state
            assert waited > MIGRATION_DEADLINE_S  # it outlived the migration deadline, waiting for the host
            report = cluster.status()
            scale_outs = [e for e in report["scale_events"] if e["kind"] == "scale_out"]
            assert [e["kernel"] for e in scale_outs] == [f"{km.kernel_id}/held"], scale_outs
            new_host = scale_outs[0]["hosts"][0]
            kernel = next(k for k in report["kernels"] if k["id"] == km.kernel_id)
            assert kernel["last_migration"]["to"] == new_host
        finally:
            results = [c.release() for c in busy]
        assert all(r.status == "ok" for r in results), [r.reply["content"] for r in results]
