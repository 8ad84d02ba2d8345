"""Interrupt, restart and shutdown of a tandem kernel through jupyter_client."""

from __future__ import annotations

import time

import pytest
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

pytestmark = pytest.mark.integration


def test_interrupt_busy_loop_keeps_namespace(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "kept = 'still here'").status == "ok"
        msg_id = kc.execute("while True: pass")
        time.sleep(1.0)
        started = time.monotonic()
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=5)
        elapsed = time.monotonic() - started
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert elapsed < 2.0, f"interrupt took {elapsed:.2f}s"
        cell = run(kc, "print(kept)")
        assert cell.status == "ok" and cell.stdout.strip() == "still here"


def test_restart_gives_a_fresh_working_kernel(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "before = 1").status == "ok"
        old_pids = set(tandem_cluster.replica_pids(km.kernel_id))
        km.restart_kernel()
        kc.wait_for_ready(timeout=60)
        cell = run(kc, "print('before' in dir())")
        assert cell.status == "ok" and cell.stdout.strip() == "False"
        new_pids = set(tandem_cluster.replica_pids(km.kernel_id))
        assert len(new_pids) == 3 and not (new_pids & old_pids)


def test_shutdown_stops_every_replica(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "1").status == "ok"
        kernel_id = km.kernel_id
        assert len(tandem_cluster.replica_pids(kernel_id)) == 3
        km.shutdown_kernel()
        assert not km.is_alive()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and tandem_cluster.replica_pids(kernel_id):
        time.sleep(0.2)
    assert tandem_cluster.replica_pids(kernel_id) == []
