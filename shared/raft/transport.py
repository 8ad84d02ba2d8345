"""What every Raft peer transport shares: the interface the driver uses, its options and counters,
the rate-limited log of rejected input, and the factory that picks an implementation by name.

Two implementations carry the same one-msgpack-message-per-frame wire contents
(``shared.raft.codec``): ``tcp`` (``shared.raft.tcp_transport``, the default) and ``zmq``
(``shared.raft.zmq_transport``). Both are fire-and-forget: a send never blocks or waits, and a
message a peer cannot take now is dropped and counted, which Raft's retries repair.

Only ``tcp`` authenticates its peers (mutual TLS, ``shared.raft.tls``): ``open_transport`` refuses
to open ``zmq`` with a TLS identity rather than run a replica's links unauthenticated.

Everything a peer sends is checked here before the Raft core sees it (``vet_message``): a frame
that does not decode, lies about its sender, or carries a snapshot the application cannot read
(``check_snapshot``) is dropped and counted, never raised into the node.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shared.raft.codec import decode_message
from shared.raft.types import Message, MessageType

if TYPE_CHECKING:
    from shared.raft.tls import LinkTls

TRANSPORT_KINDS = ("tcp", "zmq")
OnMessages = Callable[[list[Message]], None]
# Raises ValueError naming the problem when snapshot data could not be restored (no side effects).
SnapshotCheck = Callable[[bytes], None]


@dataclass(slots=True)
class TransportStats:
    sent: int = 0
    received: int = 0
    dropped_full: int = 0  # peer not connected, or too much already queued for it
    dropped_unknown_peer: int = 0  # no address known for the destination
    malformed: int = 0  # frames that failed to decode, lied about their sender, or bad snapshots
    refused: int = 0  # connections refused: TLS failed, another kernel's certificate, a false hello


@dataclass(frozen=True, slots=True)
class TransportOptions:
    sndhwm: int = 10_000  # zmq: messages queued per peer before sends are dropped
    rcvhwm: int = 100_000  # zmq
    max_buffered_bytes: int = 64 * 1024 * 1024  # tcp: unsent bytes per peer before sends are dropped
    reconnect_ivl_ms: int = 20
    reconnect_ivl_max_ms: int = 500
    # A silently dead connection is found within about this long: ZMTP heartbeats (zmq); keepalive
    # probes and TCP_USER_TIMEOUT on unacknowledged data (tcp).
    heartbeat_ivl_ms: int = 500
    heartbeat_timeout_ms: int = 2_000
    max_batch: int = 4_096  # most frames delivered per wake-up, so one busy peer cannot starve the loop


DEFAULT_OPTIONS = TransportOptions()


class Transport(Protocol):
    """Moves ``Message``s between this node and its peers; knows nothing of Raft semantics.
    ``on_messages`` (given at construction) receives what arrived, in batches."""

    node_id: str
    address: str  # the concrete endpoint once started (a ":0" port resolved)
    stats: TransportStats

    async def start(self) -> str:
        """Bind and start receiving; returns the bound endpoint."""
        ...

    def close(self) -> None:
        """Stop receiving and drop every connection (pending sends are lost)."""
        ...

    def set_peer(self, node_id: str, address: str) -> None:
        """Add a peer, or move it to a new address; idempotent."""
        ...

    def remove_peer(self, node_id: str) -> None: ...

    def peers(self) -> dict[str, str]: ...

    def send(self, msg: Message) -> bool:
        """Queue one message without blocking; False (and counted) if it had to be dropped."""
        ...

    def send_all(self, msgs: Iterable[Message]) -> None: ...


def open_transport(
    kind: str,
    node_id: str,
    bind_address: str,
    on_messages: OnMessages,
    *,
    options: TransportOptions = DEFAULT_OPTIONS,
    logger: Any = None,
    tls: LinkTls | None = None,
    check_snapshot: SnapshotCheck | None = None,
    listener: socket.socket | None = None,
) -> Transport:
    """A transport of ``kind`` (one of ``TRANSPORT_KINDS``), not started yet; with ``tls``, one
    that admits only members of the same group (``tcp`` only)."""
    if kind == "tcp":
        from shared.raft.tcp_transport import TcpTransport

        return TcpTransport(
            node_id,
            bind_address,
            on_messages,
            options=options,
            logger=logger,
            tls=tls,
            check_snapshot=check_snapshot,
            listener=listener,
        )
    if kind == "zmq":
        if tls is not None:
            raise ValueError(
                'the zmq Raft transport cannot authenticate its peers: use raft.transport = "tcp" '
                "(TLS), or turn authentication off with raft.tls = false on a trusted network only"
            )
        from shared.raft.zmq_transport import ZmqTransport

        return ZmqTransport(
            node_id,
            bind_address,
            on_messages,
            options=options,
            logger=logger,
            check_snapshot=check_snapshot,
            listener=listener,
        )
    raise ValueError(f"unknown Raft transport {kind!r}: expected one of {', '.join(TRANSPORT_KINDS)}")


def split_tcp_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (``*`` for any interface) -> (host, port); ValueError naming the problem."""
    if not address.startswith("tcp://"):
        raise ValueError(f"Raft address {address!r} must look like tcp://HOST:PORT")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"Raft address {address!r} must look like tcp://HOST:PORT")
    return host.strip("[]"), int(port)


class RejectLog:
    """Counts and logs bad input: at most one line per sender per second, so a flood of garbage
    cannot flood the log too (each line says how many were suppressed since the last one)."""

    def __init__(
        self,
        stats: TransportStats,
        logger: Any,
        *,
        counter: str = "malformed",
        event: str = "raft.transport.malformed_frame",
    ) -> None:
        self._stats = stats
        self._log = logger
        self._counter = counter
        self._event = event
        self._last: dict[bytes, tuple[float, int]] = {}  # sender -> (last logged, suppressed)

    def __call__(self, sender: bytes, reason: str) -> None:
        total = getattr(self._stats, self._counter) + 1
        setattr(self._stats, self._counter, total)
        now = time.monotonic()
        last, suppressed = self._last.get(sender, (0.0, 0))
        if now - last < 1.0:
            self._last[sender] = (last, suppressed + 1)
            return
        if len(self._last) > 1024:  # senders are attacker-chosen: keep the table bounded
            self._last.clear()
        self._last[sender] = (now, 0)
        self._log.warning(
            self._event,
            sender=sender.decode("utf-8", "replace"),
            reason=reason,
            suppressed_since_last=suppressed,
            total=total,
        )


def vet_message(
    node_id: str,
    sender: bytes,
    payload: bytes,
    reject: RejectLog,
    check_snapshot: SnapshotCheck | None = None,
) -> Message | None:
    """Decode one inbound frame from ``sender`` (its ZMQ identity or TCP hello) and check that it
    comes from whom it says and is meant for ``node_id``, and that a snapshot it carries can be
    restored (``check_snapshot``); a bad one is logged and dropped (None), never raised."""
    try:
        msg = decode_message(payload)
    except ValueError as exc:
        reject(sender, str(exc))
        return None
    if msg.frm.encode() != sender:
        reject(sender, f"frm {msg.frm!r} does not match the sender's identity")
        return None
    if msg.to != node_id:
        reject(sender, f"addressed to {msg.to!r}, not to this node")
        return None
    if msg.snapshot is not None and check_snapshot is not None:
        try:
            check_snapshot(msg.snapshot.data)
        except Exception as exc:  # whatever the application's parser raises: the frame goes
            reject(sender, f"{MessageType(msg.type).name} carries a snapshot that cannot be restored: {exc}")
            return None
    return msg


def hand_over(batch: list[Message], stats: TransportStats, on_messages: OnMessages, log: Any) -> None:
    """Give the driver one wake-up's messages in one call; its failure is logged, not raised
    into the event loop's reader."""
    if batch:
        stats.received += len(batch)
        try:
            on_messages(batch)
        except Exception:
            log.exception("raft.transport.handler_failed", batch=len(batch))
