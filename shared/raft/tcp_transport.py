"""Raft peer transport over plain asyncio TCP (``raft.transport = "tcp"``, the default): one
listening socket in, one connection out per peer.

Why not ZMQ, the services' transport: through ZMQ every message crosses two more threads (the
sender's and the receiver's ZMQ I/O threads), and every frame sent or received releases the GIL,
which the replica's kernel thread is waiting to take back. On the 2-core development VM,
``scripts/bench_raft.py --no-fsync`` commits a leader's proposal in 0.13-0.14 ms (p50) over this
transport and in 0.29-0.31 ms over ZMQ (``--transport zmq``, alternating runs); a follower's in
0.26-0.28 ms against 0.41-0.46 ms. A cell commits two Raft rounds, about 19 messages among its
three replicas, and the second round is on the cell's critical path.

Wire: a connection opens with a hello frame (msgpack ``["tandem-raft", 1, sender id]``), then
carries frames of a 4-byte big-endian length and one msgpack Raft message (``shared.raft.codec``).
Connections are one-way: a node writes only on the connection it opened to a peer and reads only
on those it accepted, so every message's sender is its connection's hello, checked against
``Message.frm``. A frame that does not decode is dropped (counted; logged at most once a second
per sender); a connection whose hello or framing is wrong is closed, since nothing after it can be
trusted.

Sends never wait: a peer that is not connected, or that has ``max_buffered_bytes`` unsent
already, loses the message (counted in ``dropped_full``); Raft's heartbeats and retries repair
that. Each outbound link reconnects with backoff (``reconnect_ivl_ms`` doubling up to
``reconnect_ivl_max_ms``), so a restarted peer is reached again as soon as it listens. A peer
that died without closing its connections (host down, partition) is found by keepalive probes on
an idle connection and by ``TCP_USER_TIMEOUT`` on unacknowledged data (the ``heartbeat_*``
options).

What arrives is handed to the driver in batches: every message that came in one turn of the event
loop, in one call, so the driver steps them all into one ``Ready``.

With ``tls`` (a ``shared.raft.tls.LinkTls``; replicas always have one unless ``raft.tls`` is off)
every connection is mutual TLS 1.3 under the cluster's Raft CA, run by a ``TlsSession`` inside the
protocols below. An inbound connection is refused, and counted in ``refused``, when its handshake
fails (no certificate, another CA, not TLS at all), when the certificate is of another kernel, or
when its hello names another member than its certificate; until then nothing it sent is decoded.
An outbound link drops a connection whose certificate is not the member it meant to reach. A
connection whose two ends are loopback addresses (replicas on one machine) is authenticated the
same way, and then carries its frames in the clear, unless ``raft.encrypt_loopback`` is on
(``shared.raft.tls`` says why that is safe and how both ends agree).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterable
from functools import partial
from typing import Any

import msgpack
import structlog

from shared.raft.codec import encode_message
from shared.raft.tls import LinkTls, TlsFailure, TlsSession, is_loopback_connection
from shared.raft.transport import (
    DEFAULT_OPTIONS,
    OnMessages,
    RejectLog,
    SnapshotCheck,
    TransportOptions,
    TransportStats,
    hand_over,
    split_tcp_address,
    vet_message,
)
from shared.raft.types import Message

HELLO = "tandem-raft"
HELLO_VERSION = 1
MAX_HELLO_BYTES = 1024
MAX_FRAME_BYTES = 256 * 1024 * 1024  # as the codec: a larger length means a broken stream
_LENGTH = struct.Struct(">I")
_SMALL_FRAME = 64 * 1024  # below: one write of header + payload; above: no concatenation copy
HANDSHAKE_TIMEOUT_S = 10.0  # an accepted connection that has not sent its hello by then is closed


def frame(payload: bytes) -> bytes:
    """One length-prefixed frame (how tests and tools speak the wire format)."""
    return _LENGTH.pack(len(payload)) + payload


def hello_frame(node_id: str) -> bytes:
    return frame(msgpack.packb([HELLO, HELLO_VERSION, node_id]))


class TcpTransport:
    """The asyncio TCP ``shared.raft.transport.Transport``; every method runs on the loop that
    called ``start``."""

    def __init__(
        self,
        node_id: str,
        bind_address: str,
        on_messages: OnMessages,
        *,
        options: TransportOptions = DEFAULT_OPTIONS,
        logger: Any = None,
        tls: LinkTls | None = None,
        check_snapshot: SnapshotCheck | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        if tls is not None and tls.member != node_id:
            raise ValueError(f"the TLS identity is member {tls.member!r}, this node is {node_id!r}")
        self.node_id = node_id
        self._bind_address = bind_address
        self._on_messages = on_messages
        self._opts = options
        self._log = logger if logger is not None else structlog.get_logger("raft.transport")
        self.address = bind_address  # the concrete endpoint once bound (port resolved)
        self.stats = TransportStats()
        self._reject = RejectLog(self.stats, self._log)
        self._refuse = RejectLog(
            self.stats, self._log, counter="refused", event="raft.transport.peer_refused"
        )
        self._tls = tls
        self._check_snapshot = check_snapshot
        self._listener = listener  # bound to bind_address by whoever chose it (PeerConfig.listener)
        self._hello = hello_frame(node_id)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._inbound: set[_Inbound] = set()
        self._links: dict[str, _PeerLink] = {}
        self._batch: list[Message] = []  # accepted in this loop turn, handed over at its end
        self._handover_due = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Listen and start receiving; returns the bound endpoint (a ``:0`` port resolved)."""
        host, port = split_tcp_address(self._bind_address)
        self._loop = asyncio.get_running_loop()
        listener, self._listener = self._listener, None
        if listener is not None and listener.fileno() != -1:
            self._server = await self._loop.create_server(lambda: _Inbound(self), sock=listener)
        else:
            self._server = await self._loop.create_server(
                lambda: _Inbound(self), "0.0.0.0" if host == "*" else host, port, reuse_address=True
            )
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.address = f"tcp://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
        for link in self._links.values():  # peers set before start
            link.start(self._loop)
        return self.address

    def close(self) -> None:
        """Stop listening and drop every connection (pending sends are lost)."""
        self._closed = True
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in self._links.values():
            link.close()
        self._links.clear()
        for inbound in list(self._inbound):
            inbound.abort()
        self._inbound.clear()
        self._batch = []

    # ------------------------------------------------------------------ peers

    def set_peer(self, node_id: str, address: str) -> None:
        """Add a peer, or move it to a new address; idempotent."""
        if node_id == self.node_id or self._closed:
            return
        current = self._links.get(node_id)
        if current is not None:
            if current.address == address:
                return
            current.close()
        link = _PeerLink(self, node_id, address)
        self._links[node_id] = link
        if self._loop is not None:
            link.start(self._loop)
        self._log.info("raft.transport.peer_set", peer=node_id, address=address)

    def remove_peer(self, node_id: str) -> None:
        link = self._links.pop(node_id, None)
        if link is not None:
            link.close()
            self._log.info("raft.transport.peer_removed", peer=node_id)

    def peers(self) -> dict[str, str]:
        return {pid: link.address for pid, link in self._links.items()}

    # ------------------------------------------------------------------ sending

    def send(self, msg: Message) -> bool:
        """Queue one message without blocking; False (and counted) if it had to be dropped."""
        framed = self._framed(msg)
        if framed is None:
            return False
        link, frames = framed
        self._write(link, frames)
        return True

    def send_all(self, msgs: Iterable[Message]) -> None:
        """One Ready's messages: those to the same peer go out in one write (with TLS, in one
        record: a record per message cost each side a few microseconds of Python per message)."""
        per_link: dict[int, tuple[_PeerLink, list[bytes]]] = {}
        for msg in msgs:
            framed = self._framed(msg)
            if framed is not None:
                link, frames = framed
                per_link.setdefault(id(link), (link, []))[1].extend(frames)
        for link, frames in per_link.values():
            self._write(link, frames)

    def _framed(self, msg: Message) -> tuple[_PeerLink, list[bytes]] | None:
        link = self._links.get(msg.to)
        if link is None:
            self.stats.dropped_unknown_peer += 1
            return None
        out = link.transport
        if out is None or out.is_closing() or out.get_write_buffer_size() > self._opts.max_buffered_bytes:
            self.stats.dropped_full += 1
            return None
        payload = encode_message(msg)
        self.stats.sent += 1
        if len(payload) < _SMALL_FRAME:
            return link, [_LENGTH.pack(len(payload)) + payload]
        return link, [_LENGTH.pack(len(payload)), payload]

    @staticmethod
    def _write(link: _PeerLink, frames: list[bytes]) -> None:
        out, tls = link.transport, link.tls
        assert out is not None
        small = len(frames) == 1 or sum(map(len, frames)) < _SMALL_FRAME
        if tls is not None and not tls.plaintext:
            out.write(tls.encrypt(b"".join(frames)) if small else tls.encrypt(*frames))
        elif small:
            out.write(frames[0] if len(frames) == 1 else b"".join(frames))
        else:
            out.writelines(frames)

    # ------------------------------------------------------------------ receiving

    def _accept(self, sender: bytes, payload: bytes) -> None:
        if self._closed:
            return
        msg = vet_message(self.node_id, sender, payload, self._reject, self._check_snapshot)
        if msg is None:
            return
        self._batch.append(msg)
        if not self._handover_due and self._loop is not None:
            self._handover_due = True
            self._loop.call_soon(self._hand_over_batch)

    def _hand_over_batch(self) -> None:
        self._handover_due = False
        batch, self._batch = self._batch, []
        if not self._closed:
            hand_over(batch, self.stats, self._on_messages, self._log)


def _tune(transport: asyncio.BaseTransport, opts: TransportOptions) -> None:
    """No Nagle delay; find a dead peer (see the module docstring). Best effort per option."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    idle_s = max(1, opts.heartbeat_ivl_ms // 1000)
    probes = max(1, opts.heartbeat_timeout_ms // max(1, opts.heartbeat_ivl_ms))
    wanted = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), idle_s),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), idle_s),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), probes),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), opts.heartbeat_timeout_ms),
    ]
    for level, option, value in wanted:
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(level, option, value)


class _PeerLink:
    """The connection this node writes to one peer on, re-established with backoff while the
    peer is known. ``transport`` is set only while connected (TLS established and the peer's
    certificate checked, hello already written); ``tls`` is its session then, if any."""

    def __init__(self, owner: TcpTransport, peer_id: str, address: str) -> None:
        self._owner = owner
        self.peer_id = peer_id
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.tls: TlsSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None:
            self._task = loop.create_task(self._connect_forever(), name=f"raft-link-{self.peer_id}")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
            self.tls = None

    async def _connect_forever(self) -> None:
        owner, opts = self._owner, self._owner._opts
        try:
            host, port = split_tcp_address(self.address)
        except ValueError as exc:
            owner._log.error("raft.transport.bad_peer_address", peer=self.peer_id, error=str(exc))
            return
        loop = asyncio.get_running_loop()
        delay = opts.reconnect_ivl_ms / 1000
        while True:
            lost: asyncio.Future[None] = loop.create_future()
            protocol = _Outbound(lost)
            try:
                transport, _ = await loop.create_connection(partial(_same, protocol), host, port)
            except OSError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, opts.reconnect_ivl_max_ms / 1000)
                continue
            _tune(transport, opts)
            tls = protocol.tls = _session(owner._tls, transport, server_side=False)
            try:
                if tls is not None and not await self._secure(transport, protocol, tls):
                    transport.abort()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, opts.reconnect_ivl_max_ms / 1000)
                    continue
                transport.write(tls.encrypt(owner._hello) if tls is not None else owner._hello)
                self.transport, self.tls = transport, tls  # type: ignore[assignment]
                delay = opts.reconnect_ivl_ms / 1000
                await lost
            finally:
                self.transport = self.tls = None
                transport.abort()
            await asyncio.sleep(delay)  # the peer went away: do not spin while it restarts

    async def _secure(self, transport: asyncio.BaseTransport, protocol: _Outbound, tls: TlsSession) -> bool:
        """Run the TLS handshake and check that the peer is the member this link is for."""
        owner = self._owner
        assert owner._tls is not None
        transport.write(tls.start())  # type: ignore[attr-defined]
        try:
            await asyncio.wait_for(asyncio.shield(protocol.established), HANDSHAKE_TIMEOUT_S)
        except TlsFailure as exc:  # e.g. its certificate is not from our CA
            owner._refuse(self.peer_id.encode(), f"outbound to {self.address}: {exc}")
            return False
        except (OSError, TimeoutError):  # gone or restarting: reconnect as for a refused connect
            return False
        member, problem = owner._tls.peer_problem(tls.ssl_object, self.peer_id)
        if member is None:
            owner._refuse(self.peer_id.encode(), f"outbound to {self.address}: {problem}")
            return False
        return True


def _same(protocol: _Outbound) -> _Outbound:
    return protocol


def _session(
    tls: LinkTls | None, transport: asyncio.BaseTransport, *, server_side: bool
) -> TlsSession | None:
    """The TLS session of a new connection (None without TLS), which may negotiate the clear
    after its handshake when both ends of the connection are loopback addresses."""
    if tls is None:
        return None
    loopback = is_loopback_connection(
        transport.get_extra_info("sockname"), transport.get_extra_info("peername")
    )
    return tls.session(server_side=server_side, loopback=loopback)


class _Outbound(asyncio.Protocol):
    """The writing side of a link; the peer never writes back on it, except for its TLS
    handshake and session messages, which ``tls`` (set once connected, before the handshake
    starts) consumes."""

    def __init__(self, lost: asyncio.Future[None]) -> None:
        self._lost = lost
        self.tls: TlsSession | None = None
        self._transport: asyncio.Transport | None = None
        self.established: asyncio.Future[None] = lost.get_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        tls = self.tls
        if tls is None:
            return
        try:
            tls.receive(data)  # no application data comes this way
        except TlsFailure as exc:
            if not self.established.done():
                self.established.set_exception(exc)
                self.established.exception()  # marked retrieved: the waiter may have given up
            if self._transport is not None:
                self._transport.abort()
            return
        out = tls.pending()
        if out and self._transport is not None:
            self._transport.write(out)
        if tls.established and not self.established.done():
            self.established.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.established.done():
            self.established.set_exception(ConnectionResetError("closed during the TLS handshake"))
            self.established.exception()  # marked retrieved: the waiter may have given up
        if not self._lost.done():
            self._lost.set_result(None)


class _Inbound(asyncio.Protocol):
    """One accepted connection: a hello naming the sender, then length-prefixed messages."""

    def __init__(self, owner: TcpTransport) -> None:
        self._owner = owner
        self._buf = bytearray()
        self._sender: bytes | None = None
        self._transport: asyncio.Transport | None = None
        self._tls: TlsSession | None = None  # set when connected: it depends on the addresses
        self._certified: str | None = None  # the member the peer's certificate names
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        _tune(transport, self._owner._opts)
        self._tls = _session(self._owner._tls, transport, server_side=True)
        self._owner._inbound.add(self)
        if self._owner._loop is not None:
            self._deadline = self._owner._loop.call_later(HANDSHAKE_TIMEOUT_S, self._too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._inbound.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _too_slow(self) -> None:
        if self._sender is None:
            self._refuse(
                f"no {'TLS handshake and ' if self._tls else ''}hello within {HANDSHAKE_TIMEOUT_S:g}s"
            )

    def data_received(self, data: bytes) -> None:
        tls = self._tls
        if tls is not None:
            try:
                data = tls.receive(data)
            except TlsFailure as exc:
                alert = tls.pending()  # tell the peer why (its TLS error names the alert)
                if alert and self._transport is not None:
                    self._transport.write(alert)
                self._refuse(str(exc), flush=True)
                return
            out = tls.pending()
            if out and self._transport is not None:
                self._transport.write(out)
            if self._certified is None:
                if not tls.established:
                    return
                member, problem = self._owner._tls.peer_problem(tls.ssl_object)  # type: ignore[union-attr]
                if member is None:
                    self._refuse(problem)
                    return
                self._certified = member
            if not data:
                return
        buf = self._buf
        buf += data
        offset, end_of_data = 0, len(buf)
        while end_of_data - offset >= 4:
            (length,) = _LENGTH.unpack_from(buf, offset)
            limit = MAX_FRAME_BYTES if self._sender is not None else MAX_HELLO_BYTES
            if length > limit:
                self._fail(f"frame length {length} exceeds the {limit}-byte limit")
                return
            end = offset + 4 + length
            if end > end_of_data:
                break
            payload = bytes(buf[offset + 4 : end])
            offset = end
            if self._sender is None:
                if not self._take_hello(payload):
                    return
            else:
                self._owner._accept(self._sender, payload)
        if offset:
            del buf[:offset]

    def _take_hello(self, payload: bytes) -> bool:
        try:
            hello = msgpack.unpackb(payload, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            self._fail(f"hello is not msgpack: {type(exc).__name__}")
            return False
        if (
            type(hello) is not list
            or len(hello) != 3
            or hello[0] != HELLO
            or hello[1] != HELLO_VERSION
            or type(hello[2]) is not str
            or not hello[2]
        ):
            self._fail(f"expected a hello [{HELLO!r}, {HELLO_VERSION}, sender id], got {hello!r:.80}")
            return False
        if self._tls is not None and hello[2] != self._certified:
            self._refuse(f"hello claims member {hello[2]!r:.80} but the certificate is {self._certified!r}")
            return False
        self._sender = hello[2].encode()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        return True

    def _fail(self, reason: str) -> None:
        """A broken stream: nothing after this point can be framed, so the connection goes."""
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        self._owner._reject(self._sender or str(peer).encode(), reason)
        self._buf.clear()
        self.abort()

    def _refuse(self, reason: str, *, flush: bool = False) -> None:
        """Not a member of this group (or not who it claims): closed, nothing it sent decoded;
        ``flush``: after what we already wrote (a TLS alert) has gone."""
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        self._owner._refuse(str(peer).encode(), reason)
        self._buf.clear()
        if flush and self._transport is not None:
            self._transport.pause_reading()
            self._transport.close()
        else:
            self.abort()
