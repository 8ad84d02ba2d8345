"""Restart in place: the connected client keeps its ports and finds a fresh namespace; and an
interrupted cell's traceback ends in user code, not in Tandem's own frames."""

from __future__ import annotations

import threading
import time

import pytest
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

from services.cli import strip_ansi

pytestmark = pytest.mark.integration
PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def test_restart_keeps_the_ports_and_the_connected_client_gets_a_fresh_namespace(
    tandem_cluster: ClusterHandle,
) -> None:
    with tandem_kernel() as (km, kc):
        before = km.get_connection_info()
        for now in (True, False):
            assert run(kc, "kept = 1").status == "ok"
            old_pids = set(tandem_cluster.replica_pids(km.kernel_id))
            km.restart_kernel(now=now)
            assert {p: km.get_connection_info()[p] for p in PORTS} == {p: before[p] for p in PORTS}
            cell = run(kc, "print('kept' in dir())", timeout=20)  # the same client, not reconnected
            assert cell.status == "ok" and cell.stdout.strip() == "False", cell.reply
            assert cell.seconds < 10, f"first cell after restart(now={now}) took {cell.seconds:.1f}s"
            new_pids = set(tandem_cluster.replica_pids(km.kernel_id))
            assert len(new_pids) == 3 and not new_pids & old_pids  # three fresh replica processes


def test_an_interrupted_cell_shows_only_user_frames(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "import time").status == "ok"
        timer = threading.Timer(1.5, km.interrupt_kernel)
        timer.start()
        cell = run(kc, "time.sleep(10)")
        timer.join()
        [error] = cell.errors
        assert error["ename"] == "KeyboardInterrupt"
        text = strip_ansi("\n".join(error["traceback"]))
        assert "time.sleep(10)" in text and "kernel_replica" not in text, text


def test_exit_ends_the_whole_kernel_and_a_restart_finds_a_fresh_namespace(
    tandem_cluster: ClusterHandle,
) -> None:
    """A kernel process ends on ``exit()``. Only the executor replica used to: the next cell ran on
    a standby and found every variable of the notebook that had asked to exit."""
    with tandem_kernel() as (km, kc):
        assert run(kc, "kept = 1").status == "ok"
        cell = run(kc, "exit()")
        assert cell.status == "ok"
        assert cell.reply["content"]["payload"] == [{"source": "ask_exit", "keepkernel": False}]
        deadline = time.monotonic() + 15
        while km.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not km.is_alive(), "the kernel outlived exit()"
        while tandem_cluster.replica_pids(km.kernel_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tandem_cluster.replica_pids(km.kernel_id) == []
        km.restart_kernel(now=True)  # what Jupyter Server's restarter does when a kernel ends
        after = run(kc, "print('kept' in dir())", timeout=30)
        assert after.status == "ok" and after.stdout.strip() == "False", after.reply


def test_exit_keeping_the_kernel_leaves_it_running(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "kept = 1").status == "ok"
        cell = run(kc, "exit(keep_kernel=True)")
        assert cell.reply["content"]["payload"] == [{"source": "ask_exit", "keepkernel": True}]
        time.sleep(1.0)
        assert km.is_alive()
        assert run(kc, "print(kept)").stdout.strip() == "1"
