"""Malformed envelopes and badly signed Jupyter messages are refused with a logged reason."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

from shared.jupyter_wire import DELIMITER, json_part

pytestmark = pytest.mark.integration

GARBAGE = [
    b"\xc1 not msgpack",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"v": 99, "type": "kernel.start", "id": "a", "body": {}}),
    msgpack.packb({"v": 1, "type": "no.such.type", "id": "b", "body": {}}),
    msgpack.packb({"v": 1, "type": "kernel.start", "id": "c", "body": {"kernel_id": 7}}),
    msgpack.packb(
        {
            "v": 1,
            "type": "jupyter.request",
            "id": "d",
            "body": {"kernel_id": "k", "channel": "x", "frames": []},
        }
    ),
]


def _send_garbage(cluster: ClusterHandle, service: str) -> list[dict]:
    sock = cluster.dealer(service)  # past the handshake (the operator's key): the envelopes are judged
    answers = []
    try:
        for payload in GARBAGE:
            sock.send(payload)
            if sock.poll(5000):
                answers.append(msgpack.unpackb(sock.recv()))
    finally:
        sock.close()
    return answers


@pytest.mark.parametrize("service", ["gateway", "global-scheduler"])
def test_malformed_envelopes_are_rejected_and_service_keeps_running(
    tandem_cluster: ClusterHandle, service: str
) -> None:
    answers = _send_garbage(tandem_cluster, service)
    assert len(answers) == len(GARBAGE)
    assert all(a["type"] == "error" and a["body"]["reason"] for a in answers), answers
    time.sleep(0.3)
    assert "rejected" in tandem_cluster.log_text(service)
    status = tandem_cluster.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    with tandem_kernel() as (_km, kc):
        assert run(kc, "1 + 1").status == "ok"


def test_badly_signed_jupyter_message_is_rejected(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (km, kc):
        info = km.get_connection_info()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://{info['ip']}:{info['shell_port']}")
        header = json_part(
            {
                "msg_id": "forged",
                "msg_type": "execute_request",
                "session": "s",
                "username": "u",
                "date": "",
                "version": "5.3",
            }
        )
        sock.send_multipart(
            [DELIMITER, b"f" * 64, header, b"{}", b"{}", json_part({"code": "import os; os._exit(1)"})]
        )
        sock.close(linger=2000)
        time.sleep(0.5)
        assert "invalid HMAC signature" in tandem_cluster.log_text("gateway")
        assert run(kc, "print('alive')").stdout.strip() == "alive"
