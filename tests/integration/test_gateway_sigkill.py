"""SIGKILL of the gateway loses no kernel: ``tandem up`` restarts it, clients keep their ports."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import CellResult, run, tandem_kernel
from _signals import signal_ours

from shared import messages

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    state_dir = tmp_path_factory.mktemp("gateway-restart")
    with running_cluster(state_dir, "--hosts", "3", *WITHOUT_HTTP_API) as handle:
        yield handle
    # every process of it, restarted gateways and replicas included, is gone
    assert not processes_with_state_dir(state_dir), processes_with_state_dir(state_dir)


def processes_with_state_dir(state_dir: Path) -> list[int]:
    """Live processes started for this cluster (``tandem up`` hands its state dir to all)."""
    marker = f"TANDEM_STATE_DIR={state_dir}\0".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(entry) == os.getpid() or marker not in Path(f"/proc/{entry}/environ").read_bytes():
                continue
            if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry))
        except OSError:
            continue
    return found


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def gateway_pid(cluster: ClusterHandle) -> int:
    return int(json.loads((cluster.state_dir / "cluster.json").read_text())["processes"]["gateway"])


def kill_gateway_and_wait_for_its_successor(cluster: ClusterHandle) -> int:
    old = gateway_pid(cluster)
    assert signal_ours(old, signal.SIGKILL)

    def restarted() -> bool:
        try:
            if gateway_pid(cluster) == old:
                return False
            cluster.ask_gateway(messages.KERNEL_STATUS, {"kernel_id": "none"}, timeout=1.0)
        except Exception as exc:  # not answering yet, or answering "unknown kernel": it is up
            return "unknown kernel" in str(exc)
        return True

    wait_for(restarted, "tandem up to restart the gateway on the same address")
    assert not Path(f"/proc/{old}").exists() or "Z" in Path(f"/proc/{old}/stat").read_text().split()[2]
    return old


def test_a_killed_gateway_comes_back_and_the_next_cell_sees_the_old_variables(cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        first = run(kc, "x = 41", timeout=60)
        assert first.status == "ok", first.reply["content"]
        kill_gateway_and_wait_for_its_successor(cluster)
        after = run(kc, "print(x + 1)", timeout=60)  # same client, same connection file
        assert after.status == "ok", after.reply["content"]
        assert after.stdout == "42\n"
        assert km.is_alive()
        with tandem_kernel() as (_, fresh):  # a kernel started after the restart
            cell = run(fresh, "print(6 * 7)", timeout=60)
            assert cell.status == "ok" and cell.stdout == "42\n", cell.reply["content"]
        again = run(kc, "x += 1; print(x)", timeout=60)
        assert again.status == "ok" and again.stdout == "42\n", again.reply["content"]
    assert "kernel_restored" in cluster.log_text("gateway")
    assert processes_with_state_dir(cluster.state_dir)  # what the fixture's orphan check looks for


def test_a_cell_running_when_the_gateway_dies_runs_once_and_its_client_gets_the_reply(
    cluster: ClusterHandle, tmp_path: Path
) -> None:
    ran = tmp_path / "ran.txt"
    with tandem_kernel() as (_, kc):
        assert run(kc, "import os, time", timeout=60).status == "ok"
        code = f"time.sleep(4)\nos.system('echo ran >> {ran}')\nprint('done')"
        answers: queue.Queue[CellResult | BaseException] = queue.Queue()

        def in_flight() -> None:
            try:
                answers.put(run(kc, code, timeout=90))
            except BaseException as exc:  # the assertion below names it
                answers.put(exc)

        threading.Thread(target=in_flight, daemon=True).start()
        time.sleep(1.5)  # the cell is running on its executor
        kill_gateway_and_wait_for_its_successor(cluster)
        answer = answers.get(timeout=120)
        assert isinstance(answer, CellResult), answer
        assert answer.status == "ok", answer.reply["content"]
        assert answer.stdout == "done\n"
        time.sleep(1.0)
        assert ran.read_text() == "ran\n"  # once: nothing was sent again
        after = run(kc, "print('next')", timeout=60)
        assert after.status == "ok" and after.stdout == "next\n", after.reply["content"]


def test_a_cell_that_finishes_while_no_gateway_runs_still_answers_its_client(
    cluster: ClusterHandle, tmp_path: Path
) -> None:
    """The scheduler keeps what it could not push (gateway_outbox.py) until a gateway is back."""
    ran = tmp_path / "ran.txt"
    with tandem_kernel() as (_, kc):
        assert run(kc, "import os, time", timeout=60).status == "ok"
        code = f"time.sleep(2)\nos.system('echo ran >> {ran}')\nprint('done')"
        answers: queue.Queue[CellResult | BaseException] = queue.Queue()

        def in_flight() -> None:
            try:
                answers.put(run(kc, code, timeout=90))
            except BaseException as exc:  # the assertion below names it
                answers.put(exc)

        threading.Thread(target=in_flight, daemon=True).start()
        time.sleep(1.0)  # the cell is running on its executor
        cluster.process.send_signal(signal.SIGSTOP)  # tandem up cannot restart the gateway yet
        try:
            assert signal_ours(gateway_pid(cluster), signal.SIGKILL)
            wait_for(ran.exists, "the cell to finish while no gateway runs")
            time.sleep(1.0)  # its reply and outputs reach the scheduler, which keeps them
        finally:
            cluster.process.send_signal(signal.SIGCONT)
        answer = answers.get(timeout=120)
        assert isinstance(answer, CellResult), answer
        assert answer.status == "ok", answer.reply["content"]
        assert answer.stdout == "done\n"
        assert ran.read_text() == "ran\n"
    assert "gateway_pushes_delivered" in cluster.log_text("global-scheduler")
