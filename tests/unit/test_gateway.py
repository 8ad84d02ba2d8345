"""The gateway against a test double of the global scheduler, with a real Jupyter client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from _gateway_double import KEY, Harness
from jupyter_client import BlockingKernelClient

from shared import messages
from shared.envelope import Envelope
from shared.jupyter_wire import DELIMITER, Signer, header_of, json_part
from shared.rpc import RpcError


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def client_for(info: dict[str, Any]) -> BlockingKernelClient:
    client = BlockingKernelClient()
    client.load_connection_info(
        {
            k: info[k]
            for k in (
                "ip",
                "transport",
                "shell_port",
                "iopub_port",
                "stdin_port",
                "control_port",
                "hb_port",
                "key",
                "signature_scheme",
            )
        }
    )
    client.start_channels()
    return client


def test_kernel_start_answers_connection_info(harness: Harness) -> None:
    kernel_id, info = harness.start_kernel()
    assert info["key"] == KEY
    assert info["transport"] == "tcp"
    assert len({info[f"{c}_port"] for c in ("shell", "iopub", "stdin", "control", "hb")}) == 5
    assert harness.scheduler.started == [kernel_id]


def test_execute_round_trip_routes_reply_and_publishes_iopub(harness: Harness) -> None:
    _, info = harness.start_kernel()
    client = client_for(info)
    try:
        client.wait_for_ready(timeout=10)
        outputs: list[str] = []
        reply = client.execute_interactive(
            "x = 1", timeout=10, output_hook=lambda m: outputs.append(m["content"].get("text", ""))
        )
        assert reply["content"]["status"] == "ok"
        tandem = reply["metadata"]["tandem"]
        assert tandem["replica_id"] == "r2"
        assert isinstance(tandem["gateway_received_at"], float)
        assert tandem["interactivity_delay_ms"] >= 0
        assert "ran x = 1\n" in outputs
    finally:
        client.stop_channels()


def test_two_clients_get_their_own_replies(harness: Harness) -> None:
    _, info = harness.start_kernel()
    first, second = client_for(info), client_for(info)
    try:
        first.wait_for_ready(timeout=10)
        second.wait_for_ready(timeout=10)
        id1 = first.execute("a = 1")
        id2 = second.execute("b = 2")
        assert second.get_shell_msg(timeout=5)["parent_header"]["msg_id"] == id2
        assert first.get_shell_msg(timeout=5)["parent_header"]["msg_id"] == id1
    finally:
        first.stop_channels()
        second.stop_channels()


def test_a_burst_of_pipelined_requests_is_all_answered_in_order(harness: Harness) -> None:
    """Requests keep arriving on the shell socket while replies go out on it: none is lost or
    reordered (the edge-trigger case itself is pinned down in test_zmq_drain)."""
    _, info = harness.start_kernel()
    client = client_for(info)
    try:
        client.wait_for_ready(timeout=10)
        sent = [client.execute(f"x = {i}") for i in range(200)]
        replies = [client.get_shell_msg(timeout=10)["parent_header"]["msg_id"] for _ in sent]
        assert replies == sent
    finally:
        client.stop_channels()


def test_badly_signed_and_malformed_messages_are_rejected_and_gateway_keeps_running(harness: Harness) -> None:
    kernel_id, info = harness.start_kernel()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{info['shell_port']}")
    header = json_part(
        {
            "msg_id": "evil",
            "msg_type": "execute_request",
            "session": "s",
            "username": "u",
            "date": "",
            "version": "5.3",
        }
    )
    sock.send_multipart([DELIMITER, b"0" * 64, header, b"{}", b"{}", b'{"code": "1"}'])  # wrong signature
    sock.send_multipart([b"no delimiter at all"])
    good = Signer(KEY.encode())
    parts = [b"not json", b"{}", b"{}", b"{}"]
    sock.send_multipart([DELIMITER, good.sign(parts), *parts])  # signed but unparseable header
    sock.close(linger=2000)
    deadline = time.time() + 5
    status: dict[str, Any] = {}
    while time.time() < deadline:
        status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
        if status["rejected"] >= 3:
            break
        time.sleep(0.05)
    assert status["rejected"] == 3
    assert not harness.scheduler.requests  # nothing reached the scheduler
    client = client_for(info)
    try:
        assert client.execute_interactive("y = 2", timeout=10)["content"]["status"] == "ok"
    finally:
        client.stop_channels()


def test_malformed_api_envelopes_are_rejected_with_a_reason(harness: Harness) -> None:
    assert harness.call(harness.raw_api(b"\xc1garbage"))["type"] == "error"
    bad = msgpack.packb({"v": 1, "type": "kernel.start", "id": "x", "body": {"kernel_id": 5}})
    answer = harness.call(harness.raw_api(bad))
    assert answer["type"] == "error" and "kernel_id" in answer["body"]["reason"]
    with pytest.raises(RpcError, match=r"operator may not send cluster\.status"):
        harness.call(harness.api(messages.CLUSTER_STATUS, {}))
    kernel_id, _ = harness.start_kernel()  # still serving
    assert (
        harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body["state"] == "alive"
    )


def test_heartbeat_stops_when_kernel_dies(harness: Harness) -> None:
    kernel_id, info = harness.start_kernel()
    ctx = zmq.Context.instance()
    hb = ctx.socket(zmq.REQ)
    hb.setsockopt(zmq.LINGER, 0)
    hb.connect(f"tcp://127.0.0.1:{info['hb_port']}")
    hb.send(b"ping")
    assert hb.poll(3000) and hb.recv() == b"ping"
    harness.scheduler.dead = True  # the liveness poll picks it up
    deadline = time.time() + 5
    while time.time() < deadline:
        if (
            harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body["state"]
            == "dead"
        ):
            break
        time.sleep(0.05)
    hb.send(b"ping")
    assert not hb.poll(1000)
    hb.close()


def test_kernel_dead_push_marks_kernel_dead(harness: Harness) -> None:
    kernel_id, _ = harness.start_kernel()
    dead = Envelope(messages.KERNEL_DEAD, {"kernel_id": kernel_id, "reason": "2 replicas lost"})

    async def push() -> None:  # sockets belong to the harness's loop thread
        harness.scheduler.server.send(b"gateway", dead)

    harness.call(push())
    deadline = time.time() + 5
    body: dict[str, Any] = {}
    while time.time() < deadline:
        body = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
        if body["state"] == "dead":
            break
        time.sleep(0.05)
    assert body["state"] == "dead" and body["reason"] == "2 replicas lost"


def test_restart_keeps_ports_and_shutdown_forgets_kernel(harness: Harness) -> None:
    kernel_id, info = harness.start_kernel()
    harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id, "restart": True}))
    again = harness.call(
        harness.api(messages.KERNEL_START, {"kernel_id": kernel_id, "key": KEY, "resources": {}})
    ).body
    assert again["shell_port"] == info["shell_port"]
    harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id}))
    status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
    assert status["state"] == "stopped" and "alive" not in status  # sockets closed, state remembered
    assert [s["kernel_id"] for s in harness.scheduler.shutdowns] == [kernel_id, kernel_id]


def test_interrupt_api_sends_signed_interrupt_request(harness: Harness) -> None:
    kernel_id, _ = harness.start_kernel()
    harness.call(harness.api(messages.KERNEL_INTERRUPT, {"kernel_id": kernel_id}))
    deadline = time.time() + 5
    while time.time() < deadline and not harness.scheduler.requests:
        time.sleep(0.02)
    request = harness.scheduler.requests[-1]
    assert request["channel"] == "control"
    frames = request["frames"]
    assert header_of(frames)["msg_type"] == "interrupt_request"
    assert Signer(KEY.encode()).verify(frames[0], frames[1:5])


def test_failed_start_is_an_error_answer_and_the_kernel_is_dead(harness: Harness) -> None:
    body = {"kernel_id": "unplaceable-1", "key": KEY, "resources": {"gpus": 9}}
    with pytest.raises(RpcError, match="no 3 hosts with room"):
        harness.call(harness.api(messages.KERNEL_START, body))
    status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": "unplaceable-1"})).body
    assert status["state"] == "dead" and "no 3 hosts" in status["reason"]
    assert [s["kernel_id"] for s in harness.scheduler.shutdowns] == ["unplaceable-1"]  # told to clean up


def kernel_listed(harness: Harness, kernel_id: str) -> dict[str, Any]:
    kernels = harness.call(harness.api(messages.KERNEL_LIST, {})).body["kernels"]
    return next(k for k in kernels if k["id"] == kernel_id)


def wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_kernel_list_counts_connected_clients_and_follows_busy_idle(harness: Harness) -> None:
    kernel_id, info = harness.start_kernel()
    assert kernel_listed(harness, kernel_id)["connections"] == 0
    client = client_for(info)
    try:
        client.wait_for_ready(timeout=10)
        assert wait_until(lambda: kernel_listed(harness, kernel_id)["connections"] == 1)
        before = kernel_listed(harness, kernel_id)["last_activity"]
        assert client.execute_interactive("x = 1", timeout=10)["content"]["status"] == "ok"
        listed = kernel_listed(harness, kernel_id)
        assert listed["execution_state"] == "idle" and listed["last_activity"] > before
        assert listed["state"] == "alive" and listed["ports"]["shell"] == info["shell_port"]
    finally:
        client.stop_channels()
    assert wait_until(lambda: kernel_listed(harness, kernel_id)["connections"] == 0)


@pytest.fixture
def culling_harness() -> Iterator[Harness]:
    h = Harness(**{"kernel.cull_idle_s": "0.5", "kernel.cull_interval_s": "0.1"})
    yield h
    h.close()


def test_an_idle_kernel_is_culled_but_not_while_a_client_is_connected(culling_harness: Harness) -> None:
    harness = culling_harness
    kernel_id, info = harness.start_kernel()
    client = client_for(info)
    try:
        client.wait_for_ready(timeout=10)
        time.sleep(1.0)  # twice cull_idle_s with a client connected: kept
        assert kernel_listed(harness, kernel_id)["state"] == "alive"
    finally:
        client.stop_channels()
    assert wait_until(lambda: kernel_listed(harness, kernel_id)["state"] == "stopped")
    status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
    assert status["stopped_by"] == "culler" and "without activity" in status["reason"]
    assert [s["kernel_id"] for s in harness.scheduler.shutdowns] == [kernel_id]  # replicas stopped
    assert "ports" not in kernel_listed(harness, kernel_id)  # its sockets are closed


def test_ports_kept_for_a_restart_are_released_when_no_start_follows() -> None:
    harness = Harness(**{"gateway.restart_ports_kept_s": "0.6"})
    restart = {"restart": True}
    try:
        kernel_id, info = harness.start_kernel()
        for _ in range(2):  # the first restart's deadline must not cut the second one short
            harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id, **restart}))
            time.sleep(0.4)
            assert kernel_listed(harness, kernel_id)["ports"]["shell"] == info["shell_port"]
            again = harness.call(
                harness.api(messages.KERNEL_START, {"kernel_id": kernel_id, "key": KEY, "resources": {}})
            ).body
            assert again["shell_port"] == info["shell_port"]
        harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id, **restart}))
        assert wait_until(lambda: "ports" not in kernel_listed(harness, kernel_id))
    finally:
        harness.close()


def test_a_kernel_stopped_by_the_operator_says_so(harness: Harness) -> None:
    kernel_id, _ = harness.start_kernel()
    harness.call(harness.api(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id, "by": "operator"}))
    status = harness.call(harness.api(messages.KERNEL_STATUS, {"kernel_id": kernel_id})).body
    assert (status["state"], status["stopped_by"], status["reason"]) == (
        "stopped",
        "operator",
        "stopped by the operator",
    )


def test_a_cell_waiting_for_its_executor_keeps_the_kernel_from_being_culled() -> None:
    harness = Harness(
        **{"kernel.cull_idle_s": "0.3", "kernel.cull_interval_s": "0.1", "kernel.cull_connected": "true"}
    )
    try:
        kernel_id, info = harness.start_kernel()
        harness.scheduler.silent = True  # the cell is forwarded, the kernel has not said "busy" yet
        client = client_for(info)
        try:
            client.execute("slow_to_start()")
            time.sleep(1.0)
            assert kernel_listed(harness, kernel_id)["state"] == "alive"
        finally:
            client.stop_channels()
    finally:
        harness.close()
