"""A signed execute_request whose content is ``{}``, ``[]`` or not JSON was never answered: it
stalled the kernel's queue ~10.5 s and leaked a GPU reservation until the kernel stopped."""

from __future__ import annotations

import time
import uuid

import pytest
import zmq
from _cluster import ClusterHandle, eventually
from _kernels import run, tandem_kernel
from jupyter_client.session import Session

from shared.jupyter_wire import json_part

pytestmark = pytest.mark.integration

CONTENTS = [b"{}", b"[]", b"not json", b'{"code": 7}', b'"just a string"']


def _send_raw(sock: zmq.Socket, session: Session, content: bytes) -> str:
    """A request signed with the kernel's key whose content is exactly ``content``."""
    msg_id = uuid.uuid4().hex
    header = json_part(
        {"msg_id": msg_id, "msg_type": "execute_request", "session": session.session, "username": "u",
         "date": "", "version": "5.3"}
    )  # fmt: skip
    parts = [header, b"{}", b"{}", content]
    sock.send_multipart([b"<IDS|MSG>", session.sign(parts), *parts])
    return msg_id


def test_malformed_signed_requests_get_an_error_reply_at_once_and_reserve_nothing(
    tandem_cluster: ClusterHandle,
) -> None:
    with tandem_kernel() as (km, kc):
        assert run(kc, "n = 41").status == "ok"
        info = km.get_connection_info()
        session = Session(key=km.session.key, signature_scheme=info["signature_scheme"])
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{info['ip']}:{info['shell_port']}")
        try:
            started = time.monotonic()
            sent = [_send_raw(sock, session, content) for content in CONTENTS * 4]
            replies: dict[str, dict] = {}
            while len(replies) < len(sent) and sock.poll(10_000):
                _idents, msg = session.feed_identities(sock.recv_multipart())
                reply = session.deserialize(msg)
                replies[reply["parent_header"]["msg_id"]] = reply
            elapsed = time.monotonic() - started
        finally:
            sock.close()
        assert set(replies) == set(sent), f"{len(sent) - len(replies)} requests never answered"
        assert all(
            r["content"]["status"] == "error" and r["content"]["ename"] == "BadRequest"
            for r in replies.values()
        )
        assert elapsed < 5.0  # at once, not after the ~10 s request timeout
        # the queue did not stall and the namespace is intact
        assert run(kc, "print(n + 1)").stdout.strip() == "42"
    # the last cell's GPU is released after its reply (a loaded fresh-clone run read it bound)
    released = eventually(
        lambda: all(h.get("committed", 0) == 0 for h in tandem_cluster.status()["hosts"]), timeout=20
    )
    assert released, tandem_cluster.status()["hosts"]
