"""A notebook keeps its variables when the executor changes, and survives losing one replica."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import run, tandem_kernel
from _signals import signal_ours

pytestmark = pytest.mark.integration


def _executor_pid(kc) -> int:  # type: ignore[no-untyped-def]
    cell = run(kc, "import os; print(os.getpid())")
    assert cell.status == "ok", cell.errors
    return int(cell.stdout.strip())


def test_variables_survive_cordon_of_the_executors_host(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (_km, kc):
        first = run(kc, "x = 41")
        assert first.status == "ok"
        host = first.tandem.get("host_id")
        replica = first.tandem.get("replica_id")
        assert host, f"execute_reply metadata.tandem lacks host_id: {first.tandem}"
        cordon = tandem_cluster.cli("host", "cordon", host)
        assert cordon.returncode == 0, cordon.stderr
        try:
            second = run(kc, "x += 1; print(x)")
            assert second.status == "ok", second.errors
            assert second.stdout.strip() == "42"
            assert second.tandem.get("host_id") != host
            assert second.tandem.get("replica_id") != replica
        finally:
            assert tandem_cluster.cli("host", "uncordon", host).returncode == 0


def test_variables_survive_killing_the_executor(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (_km, kc):
        assert run(kc, "data = {'a': [1, 2, 3]}").status == "ok"
        executor = _executor_pid(kc)
        assert signal_ours(executor, signal.SIGKILL)
        time.sleep(0.5)
        cell = run(kc, "data['a'].append(4); print(sum(data['a']), os.getpid())", timeout=30)
        assert cell.status == "ok", cell.errors
        total, pid = cell.stdout.split()
        assert total == "10"
        assert int(pid) != executor


def _replicas(cluster: ClusterHandle, kernel_id: str) -> dict[int, dict[str, Any]]:
    """The scheduler's view of a kernel's replicas, by pid."""
    status = cluster.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    kernel = next(k for k in json.loads(status.stdout)["kernels"] if k["id"] == kernel_id)
    return {int(r["pid"]): r for r in kernel["replicas"] if r["pid"] is not None}  # None: starting


def _wait_until_scheduler_sees_exit(cluster: ClusterHandle, kernel_id: str, pid: int) -> None:
    deadline = time.monotonic() + 10
    while _replicas(cluster, kernel_id).get(pid, {"alive": False})["alive"]:  # gone: replaced
        assert time.monotonic() < deadline, f"the scheduler did not notice replica {pid} exiting"
        time.sleep(0.05)


def _wait_for_live_replicas(cluster: ClusterHandle, kernel_id: str, count: int) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + 60
    while True:
        replicas = {pid: r for pid, r in _replicas(cluster, kernel_id).items() if r["alive"]}
        if len(replicas) == count:
            return replicas
        assert time.monotonic() < deadline, f"expected {count} live replicas, have {replicas}"
        time.sleep(0.2)


def test_one_replica_lost_cells_still_run_and_it_is_replaced_two_lost_are_restarted_in_place(
    tandem_cluster: ClusterHandle,
) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "y = 1").status == "ok"
        pids = tandem_cluster.replica_pids(km.kernel_id)
        assert len(pids) == 3, pids
        executor = _executor_pid(kc)
        standby = next(p for p in pids if p != executor)
        assert signal_ours(standby, signal.SIGKILL)
        # The loss itself is what this test is about; a cell racing the scheduler's notice of the
        # exit is test_cell_sent_right_after_a_replica_dies_still_runs.
        _wait_until_scheduler_sees_exit(tandem_cluster, km.kernel_id, standby)
        for _ in range(3):
            cell = run(kc, "y += 1")
            assert cell.status == "ok", cell.reply["content"]
        # The scheduler replaces the dead replica on another host; the newcomer has the state.
        replicas = _wait_for_live_replicas(tandem_cluster, km.kernel_id, 3)
        assert standby not in replicas
        assert run(kc, "print(y)").stdout.strip() == "4"
        # Two of three lost at once on live hosts: below a quorum, but their logs are on disk, so
        # they are restarted in place rather than the kernel declared dead; the namespace stays.
        for pid in list(replicas)[:2]:
            assert signal_ours(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            cell = run(kc, "y += 1; print(y)", timeout=30)
            if cell.status == "ok" or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # a cell sent before the quorum is back may fail: it did not run
        assert cell.status == "ok", cell.reply["content"]
        assert cell.stdout.strip() == "5"
        assert km.is_alive()


def test_two_cells_in_a_row_that_crash_their_executor_leave_the_kernel_with_its_variables(
    tandem_cluster: ClusterHandle,
) -> None:
    """A segfaulting extension or an ``os._exit`` kills the executor; the next executor runs the
    next crashing cell before the first is replaced: below a quorum for a moment. The dead
    replicas are restarted in place (the crashing cells are never run again) and the kernel goes
    on. Before, the kernel was declared dead and its namespace lost."""
    with tandem_kernel() as (km, kc):
        assert run(kc, "kept = 41").status == "ok"
        for _ in range(2):
            crashed = run(kc, "import os; os._exit(1)", timeout=30)
            assert crashed.status == "error", crashed.reply["content"]
            assert crashed.reply["content"]["ename"] in ("ExecutorLost", "ReplicaLost"), crashed.reply[
                "content"
            ]
        after = run(kc, "kept += 1; print(kept)", timeout=30)
        assert after.status == "ok", after.reply["content"]
        assert after.stdout.strip() == "42"
        assert km.is_alive()
        # the first crash's replacement was placed while the second's restart ran: never beside it
        replicas = _wait_for_live_replicas(tandem_cluster, km.kernel_id, 3)
        hosts = [r["host"] for r in replicas.values()]
        assert len(set(hosts)) == 3, replicas


def _three_hosts(tmp_path: Path, setting: str) -> Iterator[ClusterHandle]:
    with running_cluster(tmp_path / "state", "--hosts", "3", "--set", setting, *WITHOUT_HTTP_API) as handle:
        yield handle


@pytest.fixture
def cluster_with_no_spare_host(tmp_path: Path, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    yield from _three_hosts(tmp_path, "scheduler.migration_deadline_s=2")


def test_a_lost_replica_no_other_host_can_take_is_restarted_on_its_own_host(
    cluster_with_no_spare_host: ClusterHandle,
) -> None:
    """Three hosts, three replicas: a replacement has nowhere to go. Once it gives up, the lost
    replica is restarted in place rather than the kernel left one replica short."""
    with tandem_kernel() as (km, kc):
        assert run(kc, "v = 7").status == "ok"
        executor = _executor_pid(kc)
        before = _replicas(cluster_with_no_spare_host, km.kernel_id)
        standby = next(p for p in before if p != executor)
        assert signal_ours(standby, signal.SIGKILL)
        _wait_until_scheduler_sees_exit(cluster_with_no_spare_host, km.kernel_id, standby)
        replicas = _wait_for_live_replicas(cluster_with_no_spare_host, km.kernel_id, 3)
        assert standby not in replicas
        assert {r["id"]: r["host"] for r in replicas.values()} == {
            r["id"]: r["host"] for r in before.values()
        }
        cell = run(kc, "v += 1; print(v)")
        assert cell.status == "ok" and cell.stdout.strip() == "8", cell.reply["content"]


@pytest.fixture
def cluster_without_restarts_in_place(tmp_path: Path, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    yield from _three_hosts(tmp_path, "scheduler.restart_in_place_limit=0")


def test_a_kernel_below_quorum_with_no_restart_left_fails_fast_and_is_dead(
    cluster_without_restarts_in_place: ClusterHandle,
) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "y = 1").status == "ok"
        pids = cluster_without_restarts_in_place.replica_pids(km.kernel_id)
        for pid in pids[:2]:
            assert signal_ours(pid, signal.SIGKILL)
        started = time.monotonic()
        failed = run(kc, "y += 1", timeout=15)
        assert time.monotonic() - started < 10
        assert failed.status == "error"
        message = (
            failed.reply["content"].get("ename", "") + failed.reply["content"].get("evalue", "")
        ).lower()
        assert "replica" in message or "dead" in message or "executor" in message, failed.reply["content"]
        # jupyter_client sees a dead kernel (no silent auto-restart) ...
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and km.is_alive():
            time.sleep(0.2)
        assert not km.is_alive()
        # ... and an explicit restart gives a fresh, working kernel
        km.restart_kernel()
        kc.wait_for_ready(timeout=60)
        fresh = run(kc, "print('y' in dir())")
        assert fresh.status == "ok" and fresh.stdout.strip() == "False"


def test_cell_sent_right_after_a_replica_dies_still_runs(tandem_cluster: ClusterHandle) -> None:
    """A replica crashing just before a cell arrives must not fail the cell (2 of 3 are alive).
    The scheduler prefers the Raft leader as executor candidate, so the leader is the standby
    killed; the race is won or lost by timing, hence a few kernels."""
    for _ in range(3):
        with tandem_kernel() as (km, kc):
            assert run(kc, "z = 1").status == "ok"
            executor = _executor_pid(kc)
            replicas = _replicas(tandem_cluster, km.kernel_id)
            standbys = [pid for pid in replicas if pid != executor]
            victim = next((p for p in standbys if replicas[p]["role"] == "leader"), standbys[0])
            assert signal_ours(victim, signal.SIGKILL)
            cell = run(kc, "z += 1; print(z)", timeout=30)
            assert cell.status == "ok", cell.reply["content"]
            assert cell.stdout.strip() == "2"


@pytest.fixture
def unreplaced_cluster(tmp_path: Path, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    """Dead replicas are not replaced here, so nothing but the scheduler's notice of the death
    (not a membership change) can end the standbys' wait for a dead executor's DONE."""
    yield from _three_hosts(tmp_path, "scheduler.replace_dead_replicas=false")


def test_next_cell_runs_at_once_when_the_executor_dies_with_its_cell(
    unreplaced_cluster: ClusterHandle,
) -> None:
    """The executor's process dies inside a cell, or just as the cell ends (the race is
    timing's: before or after its DONE and STATE reach the others, before or after its reply):
    the standbys hear of it from the scheduler and give that cell up at once, so the next cell
    runs well before the executor-silence timeout (10 s) instead of waiting it out. The client
    gets the cell's outcome from the Raft log, so what it hears matches what the next cell sees:
    a cell killed inside its code is an ``ExecutorLost`` error and leaves no changes; one killed
    as it ended either committed (its own reply, its changes kept) or not (``ExecutorLost``)."""
    endings = {
        "inside the cell": "import os, signal\nlost = 2\nos.kill(os.getpid(), signal.SIGKILL)",
        "after its reply": "import os, signal, threading\nlost = 2\n"
        "threading.Timer(0.002, os.kill, (os.getpid(), signal.SIGKILL)).start()",
    }
    for ending, code in endings.items():
        with tandem_kernel() as (_km, kc):
            assert run(kc, "kept = 1").status == "ok"
            dying = run(kc, code, timeout=30)
            after = run(kc, "print(kept, 'lost' in dir())", timeout=8)
            assert after.status == "ok", (ending, dying.reply["content"], after.reply["content"])
            assert after.stdout.split()[0] == "1", ending
            kept = after.stdout.split()[1] == "True"
            if ending == "inside the cell":  # it never finished: its changes are gone
                assert not kept
            assert (dying.status == "ok") == kept, (ending, dying.reply["content"], after.stdout)
            if not kept:
                assert dying.reply["content"]["ename"] == "ExecutorLost", (ending, dying.reply["content"])
