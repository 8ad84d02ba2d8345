"""A restarted gateway serves its kernels again (services/gateway/kernel_table.py, service.py)."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from _gateway_double import Harness
from jupyter_client import BlockingKernelClient
from test_gateway import client_for
from zmq.utils.monitor import recv_monitor_message

from services.gateway.kernel_table import (
    KernelEntry,
    KernelTableError,
    KernelTableFile,
    decode_table,
    encode_table,
)
from shared import messages
from shared.config import load_config
from shared.jupyter_wire import header_of

ENTRY = KernelEntry(
    "k1", "secret", "hmac-sha256", "127.0.0.1", {"shell": 1, "iopub": 2, "stdin": 3, "control": 4, "hb": 5}
)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def table_path() -> Path:
    return load_config(None, {}).state_dir() / "gateway" / "kernels.json"


def wait_until(predicate: object, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _wait_for_reconnect(monitor: zmq.Socket[bytes], timeout: float = 5.0) -> None:
    """Until a disconnect of the client's socket has been followed by a new ZMTP handshake."""
    deadline, disconnected = time.monotonic() + timeout, False
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and monitor.poll(left * 1000), "the client's socket did not reconnect"
        event = recv_monitor_message(monitor)["event"]
        disconnected = disconnected or event == zmq.EVENT_DISCONNECTED
        if disconnected and event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return


def test_a_restarted_gateway_serves_the_kernel_on_the_same_ports_with_its_key(harness: Harness) -> None:
    kernel_id, info = harness.start_kernel()
    client = client_for(info)
    try:
        assert client.execute_interactive("x = 1", timeout=5)["content"]["status"] == "ok"
        shell = client.shell_channel.socket
        monitor = shell.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            harness.restart_gateway()
            # ZMQ reconnects the same connection info by itself; a request sent before its I/O
            # thread has seen the old gateway go would be lost with the old connection (as for
            # any Jupyter client of a gateway that restarts), so wait for the new handshake
            _wait_for_reconnect(monitor)
        finally:
            shell.disable_monitor()
            monitor.close(linger=0)
        reply = client.execute_interactive("print(x)", timeout=10)
        assert reply["content"]["status"] == "ok"
        status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
        assert status["state"] == "alive" and status["alive"] is True
        wait_until(client.is_alive, "the heartbeat answered again")
    finally:
        client.stop_channels()
    assert stat.S_IMODE(table_path().stat().st_mode) == 0o600  # it holds the kernels' keys


def test_a_reply_to_a_cell_the_previous_gateway_forwarded_reaches_its_client(harness: Harness) -> None:
    _, info = harness.start_kernel()
    client = client_for(info)
    try:
        client.wait_for_ready(timeout=5)
        harness.scheduler.silent = True  # the cell is still running when the gateway dies
        msg_id = client.execute("slow()")
        cell = _request(harness, msg_id)
        harness.restart_gateway()
        asked = harness.scheduler.status_asked
        # the new gateway speaks to the scheduler once its clients had time to reconnect (as the
        # real scheduler, the double answers pushes only then: gateway_outbox.py)
        wait_until(lambda: harness.scheduler.status_asked > asked, "the new gateway's first word")
        harness.call(_play(harness, cell))
        reply = client.get_shell_msg(timeout=5)
        while reply["parent_header"]["msg_id"] != msg_id:  # a late kernel_info_reply of wait_for_ready
            reply = client.get_shell_msg(timeout=5)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()


def test_a_reply_whose_client_is_still_reconnecting_is_kept_until_it_is_back(harness: Harness) -> None:
    """ZMQ's ROUTER drops a message for a peer that is not connected: a reply played to a
    restarted gateway before its client reconnected would be lost and the client would wait
    forever (a loaded fresh-clone run took longer than the gateway's reconnect grace)."""
    kernel_id, info = harness.start_kernel()
    client = client_for(info)
    try:
        client.wait_for_ready(timeout=5)
        harness.scheduler.silent = True
        msg_id = client.execute("slow()")
        cell = _request(harness, msg_id)
        client.stop_channels()  # away while the gateway restarts and the reply comes
        harness.restart_gateway()
        asked = harness.scheduler.status_asked
        wait_until(lambda: harness.scheduler.status_asked > asked, "the new gateway's first word")
        harness.call(_play(harness, cell))
        endpoint = harness.gateway.kernels[kernel_id]
        wait_until(lambda: bool(endpoint._undelivered), "the reply kept for its client")
        back = BlockingKernelClient(session=client.session)  # the same identity on shell
        back.load_connection_info(client.get_connection_info())
        back.start_channels()
        try:
            reply = back.get_shell_msg(timeout=5)
            while reply["parent_header"]["msg_id"] != msg_id:  # a late kernel_info_reply of wait_for_ready
                reply = back.get_shell_msg(timeout=5)
            assert reply["content"]["status"] == "ok"
            wait_until(lambda: not endpoint._undelivered, "nothing left kept")
        finally:
            back.stop_channels()
    finally:
        client.stop_channels()


def _request(harness: Harness, msg_id: str) -> dict[str, Any]:
    """The scheduler double's copy of the cell's request, once it arrived (the kernel_info request
    of wait_for_ready is a shell request too, and may be the last one for a while under load)."""

    def found() -> dict[str, Any] | None:
        return next(
            (r for r in harness.scheduler.requests if header_of(r["frames"])["msg_id"] == msg_id), None
        )

    wait_until(lambda: found() is not None, "the cell")
    request = found()
    assert request is not None
    return request


async def _play(harness: Harness, body: dict[str, object]) -> None:
    harness.scheduler.play_kernel(b"gateway", body)  # type: ignore[arg-type]


def test_a_restored_kernel_the_scheduler_does_not_know_is_dead_and_leaves_the_table(harness: Harness) -> None:
    kernel_id, _ = harness.start_kernel()
    kept_id, _ = harness.start_kernel()
    harness.scheduler.unknown.add(kernel_id)  # it died with the whole cluster meanwhile
    harness.restart_gateway()

    def dead() -> bool:
        status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
        return bool(status["state"] == "dead")

    wait_until(dead, "the unknown kernel reported dead")
    wait_until(
        lambda: [k["kernel_id"] for k in json.loads(table_path().read_text())["kernels"]] == [kept_id],
        "the table to keep only the kernel the scheduler knows",
    )
    harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id}))  # still answered


def test_a_kernel_whose_ports_are_taken_is_reported_dead_with_the_reason(harness: Harness) -> None:
    import zmq

    kernel_id, info = harness.start_kernel()
    harness.call(harness.gateway.close())
    squatter = zmq.Context.instance().socket(zmq.ROUTER)

    def squat() -> bool:  # once the closed gateway's socket let the port go
        try:
            squatter.bind(f"tcp://127.0.0.1:{info['shell_port']}")
        except zmq.ZMQError:
            return False
        return True

    wait_until(squat, "the shell port free")
    try:
        harness.start_gateway_again()
        status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
        assert status["state"] == "dead" and str(info["shell_port"]) in status["reason"]
    finally:
        squatter.close(linger=0)


def test_a_kernel_shut_down_is_not_restored(harness: Harness) -> None:
    kernel_id, _ = harness.start_kernel()
    harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id}))
    harness.restart_gateway()
    assert kernel_id not in harness.gateway.kernels
    assert json.loads(table_path().read_text())["kernels"] == []


def test_the_table_round_trips_and_bad_entries_are_left_out_with_a_reason() -> None:
    assert decode_table(encode_table([ENTRY])) == ([ENTRY], [])
    body = json.loads(encode_table([ENTRY]))
    body["kernels"].append({**ENTRY.to_dict(), "kernel_id": "k2", "ports": {"shell": 70000}})
    body["kernels"].append(ENTRY.to_dict())
    entries, problems = decode_table(json.dumps(body).encode())
    assert entries == [ENTRY]
    assert len(problems) == 2 and "ports must name exactly" in problems[0] and "twice" in problems[1]
    with pytest.raises(KernelTableError, match="not JSON"):
        decode_table(b"{")
    with pytest.raises(KernelTableError, match="version"):
        decode_table(b'{"kernels": []}')


def test_an_unreadable_table_is_moved_aside_not_trusted(tmp_path: Path) -> None:
    table = KernelTableFile(tmp_path / "gateway" / "kernels.json")
    assert table.load() == []
    table.save([ENTRY])
    assert table.load() == [ENTRY]
    table.path.write_text("garbage")
    assert table.load() == []
    assert (tmp_path / "gateway" / "kernels.json.bad").read_text() == "garbage"
    assert stat.S_IMODE((tmp_path / "gateway").stat().st_mode) == 0o700
