"""Raft peer transport over ZMQ (``raft.transport = "zmq"``): one ROUTER in, one DEALER out per peer.

Each node binds a single ROUTER. To reach peer P it keeps a DEALER connected to P's ROUTER whose
identity is its own node id, so P sees who sent every frame and can check it against ``Message.frm``.
One msgpack frame per message (``shared.raft.codec``).

Raft tolerates lost messages (heartbeats and retries repair everything), so the transport never
waits: sends are non-blocking, a full queue (SNDHWM) or a peer that is not connected (IMMEDIATE)
drops the message and counts it. ZMQ reconnects to restarted peers on its own (RECONNECT_IVL) and
ROUTER_HANDOVER lets a restarted peer's new connection take over its identity at once.

Inbound frames are drained in batches (one wake-up of the event loop may deliver hundreds of
messages), so the driver can step them all and produce one ``Ready`` — one fsync — for the lot.
The ROUTER is watched with ``loop.add_reader`` on its ZMQ FD and drained with non-blocking reads
(``shared.zmq_drain``, shared with the services' RPC): the same mechanism ``zmq.asyncio`` uses,
minus one Future and one task switch per message, which profiling showed to be the largest Python
cost per hop (the context is a ``zmq.asyncio.Context`` so the application can share it).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from shared.raft.codec import encode_message
from shared.raft.transport import (
    DEFAULT_OPTIONS,
    OnMessages,
    RejectLog,
    SnapshotCheck,
    TransportOptions,
    TransportStats,
    hand_over,
    vet_message,
)
from shared.raft.types import Message
from shared.zmq_drain import DrainingSocket


class ZmqTransport:
    """The ZMQ ``shared.raft.transport.Transport``."""

    def __init__(
        self,
        node_id: str,
        bind_address: str,
        on_messages: OnMessages,
        *,
        options: TransportOptions = DEFAULT_OPTIONS,
        context: zmq.asyncio.Context | None = None,
        logger: Any = None,
        check_snapshot: SnapshotCheck | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        self.node_id = node_id
        self._identity = node_id.encode()
        self._bind_address = bind_address
        self._on_messages = on_messages
        self._opts = options
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._log = logger if logger is not None else structlog.get_logger("raft.transport")
        self._router: DrainingSocket | None = None
        self._batch: list[Message] = []  # accepted in the current wake-up, handed over at its end
        self._peers: dict[str, tuple[str, zmq.Socket[bytes]]] = {}
        self.address = bind_address  # the concrete endpoint once bound (port resolved)
        self.stats = TransportStats()
        self._reject = RejectLog(self.stats, self._log)
        self._check_snapshot = check_snapshot
        # Holds the port until the ROUTER binds it (PeerConfig.listener); ZMQ cannot adopt a socket.
        self._listener = listener

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind the ROUTER and start receiving; returns the bound endpoint (``:*``/``:0`` resolved)."""
        router: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, self._opts.rcvhwm)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        address = self._bind_address
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        try:
            router.bind(address)
        except zmq.ZMQError:
            router.close(linger=0)
            raise
        self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = DrainingSocket(
            router,
            self._on_frames,
            name=f"raft:{self.node_id}",
            on_drained=self._hand_over_batch,
            max_batch=self._opts.max_batch,
            logger=self._log,
        )
        self._router.start()  # also delivers anything queued before the reader was armed
        return self.address

    def close(self) -> None:
        """Stop receiving and close every socket with linger 0 (pending sends are dropped)."""
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        for _, sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        if self._own_context:
            self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ peers

    def set_peer(self, node_id: str, address: str) -> None:
        """Add a peer, or move it to a new address; idempotent."""
        if node_id == self.node_id:
            return
        current = self._peers.get(node_id)
        if current is not None:
            if current[0] == address:
                return
            current[1].close(linger=0)
        sock: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._opts.sndhwm)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, self._opts.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, self._opts.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._opts.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._opts.heartbeat_timeout_ms)
        sock.connect(address)
        self._peers[node_id] = (address, sock)
        self._log.info("raft.transport.peer_set", peer=node_id, address=address)

    def remove_peer(self, node_id: str) -> None:
        entry = self._peers.pop(node_id, None)
        if entry is not None:
            entry[1].close(linger=0)
            self._log.info("raft.transport.peer_removed", peer=node_id)

    def peers(self) -> dict[str, str]:
        return {pid: addr for pid, (addr, _) in self._peers.items()}

    # ------------------------------------------------------------------ sending

    def send(self, msg: Message) -> bool:
        """Queue one message without blocking; False (and counted) if it had to be dropped."""
        entry = self._peers.get(msg.to)
        if entry is None:
            self.stats.dropped_unknown_peer += 1
            return False
        try:
            entry[1].send(encode_message(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.stats.dropped_full += 1
            return False
        self.stats.sent += 1
        return True

    def send_all(self, msgs: Iterable[Message]) -> None:
        for m in msgs:
            self.send(m)

    # ------------------------------------------------------------------ receiving

    def _on_frames(self, frames: list[bytes]) -> None:
        self._accept(frames, self._batch)

    def _hand_over_batch(self) -> None:
        """End of one wake-up's drain (at most ``max_batch`` frames; the rest come on the next loop
        turn, so the Ready loop gets its share): hand everything accepted over in one call."""
        batch, self._batch = self._batch, []
        hand_over(batch, self.stats, self._on_messages, self._log)

    def _accept(self, frames: list[bytes], batch: list[Message]) -> None:
        if len(frames) != 2:
            self._reject(frames[0] if frames else b"", f"expected 2 frames, got {len(frames)}")
            return
        msg = vet_message(self.node_id, frames[0], frames[1], self._reject, self._check_snapshot)
        if msg is not None:
            batch.append(msg)
