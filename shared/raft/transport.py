"""What every Raft peer transport shares: the interface the driver uses, its options and counters,
the rate-limited log of rejected input, and the factory that picks an implementation by name.

Two implementations carry the same one-msgpack-message-per-frame wire contents
(``shared.raft.codec``): ``tcp`` (``shared.raft.tcp_transport``, the default) and ``zmq``
(``shared.raft.zmq_transport``). Both are fire-and-forget: a send never blocks or waits, and a
message a peer cannot take now is dropped and counted, which Raft's retries repair.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from shared.raft.codec import decode_message
from shared.raft.types import Message

TRANSPORT_KINDS = ("tcp", "zmq")
OnMessages = Callable[[list[Message]], None]


@dataclass(slots=True)
class TransportStats:
    sent: int = 0
    received: int = 0
    dropped_full: int = 0  # peer not connected, or too much already queued for it
    dropped_unknown_peer: int = 0  # no address known for the destination
    malformed: int = 0  # frames that failed to decode or lied about their sender


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
) -> Transport:
    """A transport of ``kind`` (one of ``TRANSPORT_KINDS``), not started yet."""
    if kind == "tcp":
        from shared.raft.tcp_transport import TcpTransport

        return TcpTransport(node_id, bind_address, on_messages, options=options, logger=logger)
    if kind == "zmq":
        from shared.raft.zmq_transport import ZmqTransport

        return ZmqTransport(node_id, bind_address, on_messages, options=options, logger=logger)
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

    def __init__(self, stats: TransportStats, logger: Any) -> None:
        self._stats = stats
        self._log = logger
        self._last: dict[bytes, tuple[float, int]] = {}  # sender -> (last logged, suppressed)

    def __call__(self, sender: bytes, reason: str) -> None:
        self._stats.malformed += 1
        now = time.monotonic()
        last, suppressed = self._last.get(sender, (0.0, 0))
        if now - last < 1.0:
            self._last[sender] = (last, suppressed + 1)
            return
        if len(self._last) > 1024:  # senders are attacker-chosen: keep the table bounded
            self._last.clear()
        self._last[sender] = (now, 0)
        self._log.warning(
            "raft.transport.malformed_frame",
            sender=sender.decode("utf-8", "replace"),
            reason=reason,
            suppressed_since_last=suppressed,
        )


def vet_message(node_id: str, sender: bytes, payload: bytes, reject: RejectLog) -> Message | None:
    """Decode one inbound frame from ``sender`` (its ZMQ identity or TCP hello) and check that it
    comes from whom it says and is meant for ``node_id``; a bad one is logged and dropped (None),
    never raised."""
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
