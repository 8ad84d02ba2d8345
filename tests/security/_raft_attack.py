"""What an attacker on the network sends to a replica's Raft port: the forged InstallSnapshot whose
namespace makes the replica ``exec`` code, garbage frames, and clients that speak the wire format
in the clear or over TLS with whatever certificate they have."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from pathlib import Path

import msgpack

from shared.raft.codec import encode_message
from shared.raft.driver import SNAPSHOT_ENVELOPE_VERSION
from shared.raft.tcp_transport import frame, hello_frame
from shared.raft.tls import ALPN_ENCRYPTED, ALPN_LOOPBACK_PLAIN, LinkTls, MemberIdentity
from shared.raft.types import ConfState, Message, MessageType, Snapshot, SnapshotMeta


def exec_payload(marker: Path) -> str:
    """Code that leaves ``marker`` behind if it runs (as an 'import statement' of the snapshot)."""
    return f"open({str(marker)!r}, 'w').close()"


def replica_snapshot(namespace_records: dict[str, list[object]]) -> bytes:
    """A replica's application snapshot (``ReplicaCore._take_snapshot``'s format)."""
    namespace = msgpack.packb(
        {"fps": {}, "records": namespace_records, "groups": [], "next": 0, "gr": []}, use_bin_type=True
    )
    book = {"voters": ["r1", "r2", "r3"], "elections": {}, "done": {}, "awaiting_state": None, "running": []}
    return msgpack.packb({"v": 1, "book": book, "ns": namespace}, use_bin_type=True)


def snapshot_message(to: str, frm: str, data: bytes, *, term: int = 10_000) -> Message:
    """An InstallSnapshot far ahead of anything the group has: a follower installs it at once."""
    meta = SnapshotMeta(index=1_000_000, term=term, conf=ConfState(voters=("r1", "r2", "r3")))
    return Message(MessageType.SNAPSHOT, to, frm, term, snapshot=Snapshot(meta, data))


def forged_snapshot(to: str, frm: str, marker: Path) -> bytes:
    """The attack of issue #14: a well-formed snapshot whose namespace 'imports' ``marker``'s code."""
    app = replica_snapshot({"pwned": ["i", exec_payload(marker)]})
    data = msgpack.packb([SNAPSHOT_ENVELOPE_VERSION, {}, app], use_bin_type=True)
    return encode_message(snapshot_message(to, frm, data))


def raft_host_port(address: str) -> tuple[str, int]:
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def closed_by_peer(sock: socket.socket | ssl.SSLSocket, timeout: float = 5.0) -> bool:
    """Whether the peer closed the connection (EOF, reset or a TLS alert) within ``timeout``."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    return False


def send_in_the_clear(address: str, hello_id: str, payloads: list[bytes]) -> bool:
    """A plain TCP client: a hello naming ``hello_id``, then ``payloads`` as frames; whether the
    replica closed the connection on it."""
    with socket.create_connection(raft_host_port(address), timeout=5) as sock:
        with contextlib.suppress(OSError):  # the replica may close while we still write
            sock.sendall(hello_frame(hello_id) + b"".join(frame(p) for p in payloads))
        return closed_by_peer(sock)


def attacker_context(identity: MemberIdentity | None, *, clear: bool = False) -> ssl.SSLContext:
    """An attacker's TLS client: presents ``identity``'s certificate (none: no certificate) and
    does not care whom it reaches; ``clear``: offers the loopback links' clear after the
    handshake, as a member does."""
    if identity is not None:
        tls = LinkTls.from_identity(identity)
        ctx = tls.client_loopback if clear and tls.client_loopback is not None else tls.client
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.set_alpn_protocols([ALPN_LOOPBACK_PLAIN] if clear else [ALPN_ENCRYPTED])
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def send_over_tls(
    address: str,
    identity: MemberIdentity | None,
    hello_id: str,
    payloads: list[bytes],
    *,
    linger: float = 0.0,
    clear: bool = False,
) -> bool:
    """A TLS client with ``identity``: a hello naming ``hello_id``, then ``payloads`` as frames;
    whether the replica closed the connection (during the handshake or after). ``clear``: the
    frames go in the clear once the handshake negotiated it (a loopback link), as a member's do."""
    raw = socket.create_connection(raft_host_port(address), timeout=5)
    try:
        try:
            sock = attacker_context(identity, clear=clear).wrap_socket(raw)
        except (ssl.SSLError, ConnectionError):
            return True  # refused during the handshake
        with sock:
            wire = b"".join([hello_frame(hello_id), *(frame(p) for p in payloads)])
            with contextlib.suppress(OSError):
                if clear:
                    assert sock.selected_alpn_protocol() == ALPN_LOOPBACK_PLAIN, (
                        "the clear was not negotiated"
                    )
                    with socket.socket(fileno=os.dup(sock.fileno())) as beneath:  # the same connection
                        beneath.sendall(wire)
                else:
                    sock.sendall(wire)
            if linger:  # a member's connection stays open: give the replica time to read it all
                return closed_by_peer(sock, timeout=linger)
            return closed_by_peer(sock)
    finally:
        raw.close()
