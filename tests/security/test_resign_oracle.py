"""The global scheduler re-signed a request that carried a scheduler header field without checking
its signature: a bare DEALER on the scheduler's socket ran code in another user's kernel."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

from shared import messages
from shared.election_round import ROUND_FIELD
from shared.envelope import Envelope
from shared.jupyter_wire import json_part
from shared.security import curve

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


@pytest.mark.parametrize("principal", [None, curve.OPERATOR], ids=["no-key", "operator-key"])
def test_unsigned_request_with_a_scheduler_field_is_never_signed_or_run(
    tandem_cluster: ClusterHandle, tmp_path: Path, principal: str | None
) -> None:
    """Without a key the forger never gets past the handshake; with the operator's key (which may
    manage kernels but not run code in them) the request is refused by name. That the scheduler
    never signs what it did not verify is proved in tests/unit/test_jupyter_router_signatures."""
    marker = tmp_path / "owned"
    with tandem_kernel() as (km, kc):
        assert run(kc, "x = 1").status == "ok"
        sock = tandem_cluster.dealer("global-scheduler", principal)
        answers = []
        try:
            body = {
                "kernel_id": km.kernel_id,
                "channel": "shell",
                "frames": _forged_execute(f"open({str(marker)!r}, 'w').write('pwned')"),
            }
            sock.send(Envelope(messages.JUPYTER_REQUEST, body).encode())
            while sock.poll(1500):
                answers.append(msgpack.unpackb(sock.recv()))
        finally:
            sock.close()
        # the kernel's queue still moves, and the forged cell never ran
        assert run(kc, "print(x + 1)").stdout.strip() == "2"
        time.sleep(0.5)
        assert not marker.exists()
    assert [a for a in answers if a.get("type") == messages.JUPYTER_REPLY] == []
    log = tandem_cluster.log_text("global-scheduler")
    if principal is None:
        assert answers == []
        assert "peer_refused" in log
    else:
        assert [a["body"]["code"] for a in answers] == ["unauthorized"]
        assert "operator may not send jupyter.request" in answers[0]["body"]["reason"]
