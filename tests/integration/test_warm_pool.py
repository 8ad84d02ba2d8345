"""Pre-warmed replica runtimes on a real embedded cluster: each local scheduler keeps one warm
``kernel_replica.warm`` process (``prewarm.policy = fixed``), a kernel start hands it its replica
and the pool refills; ``tandem status --json`` shows the pools and the warm start times.

Hibernation on the same cluster (kernel.hibernate_after_s): an idle kernel's namespace goes to the
data store and its three replica processes stop; the next cell resumes it on hosts placement
picks, with the same values, while the client waits (its request is held, not failed), also
after a restart of the global scheduler; its replicas are forked from each host's runtime template
(prewarm.template), which imported the module its image names (numpy) first. A kernel of this module left idle for
HIBERNATE_AFTER_S hibernates: its next cell still works, it only takes the warm runtimes again."""

from __future__ import annotations

import ast
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, eventually, running_cluster
from _kernels import run, tandem_kernel
from _signals import signal_ours

from shared import messages

pytestmark = pytest.mark.integration

WAIT_S = 90.0
HIBERNATE_AFTER_S = 4.0


@pytest.fixture(scope="module")
def warm_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    state_dir = tmp_path_factory.mktemp("warm-state")
    with running_cluster(
        state_dir,
        "--hosts", "3", "--gpus-per-host", "1",
        "--set", "prewarm.policy=fixed", "--set", "prewarm.per_host=1",
        "--set", "prewarm.interval_s=0.3", "--set", "prewarm.imports=[]", "--set", "prewarm.template=true",
        "--set", f"kernel.hibernate_after_s={HIBERNATE_AFTER_S}", "--set", "kernel.hibernate_interval_s=0.5",
        *WITHOUT_HTTP_API,
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
        # hosts report their pools with their heartbeats: the status may not show the take yet
        seen: list[dict[str, Any]] = [warm_cluster.status()]

        def taken_by_all() -> bool:
            seen.append(warm_cluster.status())
            report = seen[-1]
            warm_starts = report["metrics"]["replica_start_ms"].get("warm", {}).get("count")
            return sum(h["warm_pool"]["taken"] for h in report["hosts"]) == 3 and warm_starts == 3

        assert eventually(taken_by_all, timeout=10.0), [h["warm_pool"] for h in seen[-1]["hosts"]]
        after = seen[-1]
        # the serving controller decided the pools (one per host, cluster-wide) and was asked
        # for a runtime before each replica start
        serving = after["serving"]
        assert serving["policy"] == "fixed" and [h["target"] for h in serving["hosts"]] == [1, 1, 1]
        assert serving["grants"] + serving["cold"] >= 3
        assert after["metrics"]["replica_start_ms"]["warm"]["count"] == 3
        refilled = wait_until_pools_ready(warm_cluster)  # a fresh warm runtime behind each one taken
        assert sum(h["warm_pool"]["taken"] for h in refilled["hosts"]) == 3
        assert run(kc, "z * 2").results == ["10"]  # the warm-started replicas keep working


def _state(cluster: ClusterHandle, kernel_id: str) -> str:
    return str(cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})["state"])


def test_an_idle_kernel_hibernates_and_its_next_cell_finds_its_namespace(
    warm_cluster: ClusterHandle,
) -> None:
    cluster = warm_cluster
    wait_until_pools_ready(cluster)
    with tandem_kernel() as (km, kc):
        kernel_id = km.kernel_id  # its replicas took the warm runtimes: the pools refill meanwhile
        setup = "import numpy as np\nx = 41\narr = np.arange(1_000_000, dtype=np.float64)\nx * 2"
        first = run(kc, setup)
        assert first.status == "ok"
        before = set(cluster.scheduled_replica_pids(kernel_id))
        assert len(before) == 3

        assert eventually(lambda: _state(cluster, kernel_id) == "hibernated", timeout=HIBERNATE_AFTER_S + 20)
        assert eventually(lambda: not any(_alive(pid) for pid in before), timeout=10)  # processes gone
        assert km.is_alive()  # the client sees a live kernel (heartbeats answered), not a dead one
        rows = {row["id"]: row for row in _kernel_list(cluster)}
        assert rows[kernel_id]["state"] == "hibernated"
        assert rows[kernel_id]["replicas"] == []  # nothing subscribed, nothing placed
        assert "hibernated" in cluster.cli("status").stdout
        # no host reports a kernel without replicas: a restarted scheduler knows it from its file
        cluster_file = cluster.state_dir / "cluster.json"
        old_pid = json.loads(cluster_file.read_text())["processes"]["global-scheduler"]
        assert signal_ours(old_pid, signal.SIGKILL)
        assert eventually(lambda: _scheduler_pid(cluster_file) not in (None, old_pid), timeout=30)
        assert eventually(lambda: _state_or_none(cluster, kernel_id) == "hibernated", timeout=30)
        wait_until_pools_ready(cluster)

        # the output history too (``_`` was '' after a resume)
        cell = run(kc, "print(x + 1, float(arr.sum()), arr.dtype, arr.shape, _, Out[len(Out)])", timeout=60)
        assert cell.status == "ok", cell.errors
        assert cell.stdout.split() == [
            "42",
            str(float(sum(range(1_000_000)))),
            "float64",
            "(1000000,)",
            "82",
            "82",
        ]
        # numbered on from where it stopped (In [2]), not from 1 as a fresh kernel
        assert cell.reply["content"]["execution_count"] == first.reply["content"]["execution_count"] + 1
        after = set(cluster.scheduled_replica_pids(kernel_id))
        assert len(after) == 3 and not after & before  # three new replica processes
        # restore-based start: forked from the hosts' runtime templates (the image needs numpy,
        # which the warm runtimes do not import; the templates imported it before forking)
        assert all(b"kernel_replica.template" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in after)
        forks = [
            line
            for path in cluster.log_dir.glob("*.log")
            for line in path.read_text(errors="replace").splitlines()
            if "replica_forked_from_template" in line and kernel_id in line
        ]
        assert len(forks) == 3 and all("numpy" in line for line in forks), forks
        status = cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
        assert status["state"] == "running" and status["hibernation"]["resumes"] == 1
        assert status["hibernation"]["last_resume_s"] < 10.0, status["hibernation"]
        log = cluster.log_text("global-scheduler")
        assert "kernel_hibernated" in log and "kernel_resumed" in log

        # and the resumed kernel keeps working as any other: a new value, replicated as usual
        assert run(kc, "y = x * 2").status == "ok"
        assert run(kc, "print(y)").stdout.strip() == "82"


def _scheduler_pid(cluster_file: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads(cluster_file.read_text())["processes"]["global-scheduler"])
    return None


def _state_or_none(cluster: ClusterHandle, kernel_id: str) -> str | None:
    with contextlib.suppress(Exception):  # the new scheduler may not answer yet
        return _state(cluster, kernel_id)
    return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kernel_list(cluster: ClusterHandle) -> list[dict[str, object]]:
    result = cluster.cli("kernel", "list", "--json")
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))
