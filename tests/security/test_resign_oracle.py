"""The global scheduler re-signed a request that carried a scheduler header field without checking
its signature: a bare DEALER on the scheduler's socket ran code in another user's kernel."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

from shared import messages
from shared.election_round import ROUND_FIELD
from shared.envelope import Envelope
from shared.jupyter_wire import json_part

pytestmark = pytest.mark.integration


def _forged_execute(code: str) -> list[bytes]:
    header = {
        "msg_id": "forged-1",
        "msg_type": "execute_request",
        "session": "attacker",
        "username": "attacker",
        "date": "",
        "version": "5.3",
        ROUND_FIELD: 1,  # the scheduler's own field: its presence made the scheduler re-sign
    }
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
    }
    return [b"0" * 64, json_part(header), b"{}", b"{}", json_part(content)]


def test_unsigned_request_with_a_scheduler_field_is_never_signed_or_run(
    tandem_cluster: ClusterHandle, tmp_path: Path
) -> None:
    marker = tmp_path / "owned"
    with tandem_kernel() as (km, kc):
        assert run(kc, "x = 1").status == "ok"
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(tandem_cluster.scheduler)
        try:
            body = {
                "kernel_id": km.kernel_id,
                "channel": "shell",
                "frames": _forged_execute(f"open({str(marker)!r}, 'w').write('pwned')"),
            }
            sock.send(Envelope(messages.JUPYTER_REQUEST, body).encode())
            time.sleep(1.0)
        finally:
            sock.close()
        # the kernel's queue still moves, and the forged cell never ran
        assert run(kc, "print(x + 1)").stdout.strip() == "2"
        time.sleep(0.5)
        assert not marker.exists()
    assert "bad signature" in tandem_cluster.log_text("global-scheduler")


def test_forged_frames_answer_nothing_signed(tandem_cluster: ClusterHandle) -> None:
    """No reply of any kind goes back to the forger's socket (nothing it could use as an oracle)."""
    with tandem_kernel() as (km, _kc):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(tandem_cluster.scheduler)
        try:
            body = {"kernel_id": km.kernel_id, "channel": "shell", "frames": _forged_execute("1")}
            sock.send(Envelope(messages.JUPYTER_REQUEST, body).encode())
            answers = []
            while sock.poll(1500):
                answers.append(msgpack.unpackb(sock.recv()))
        finally:
            sock.close()
    assert [a for a in answers if a.get("type") == messages.JUPYTER_REPLY] == []
