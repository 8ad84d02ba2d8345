"""Receive from a ZMQ socket by draining it from an ``add_reader`` callback: no Future per message.

Why: ``zmq.asyncio`` pays for every received message with a Future, a task wake-up and enum flag
arithmetic on the socket's event state, and for every send with another Future; on the Jupyter
hot path (gateway, schedulers) that was the largest Python cost per hop. A ``DrainingSocket`` holds
a plain (blocking-API) zmq socket instead: the event loop watches the socket's ``ZMQ_FD`` and the
callback reads with ``NOBLOCK`` until ``zmq.Again``, handing each message to a plain function in
arrival order. Sends are plain ``NOBLOCK`` sends.

ZMQ's FD is edge-triggered and shared by reads and writes: it signals only when the socket's
command mailbox receives something, and *any* call that processes that mailbox (a recv, a send,
reading ``EVENTS``) can consume the signal. So this class keeps two rules:

- a wake-up always drains until ``zmq.Again`` (or, at the batch limit, comes back on the next
  loop turn so one busy peer cannot starve the loop);
- after a send made outside a drain, it reads ``EVENTS``; if a message is waiting, a drain is
  scheduled, because the FD may never fire for it again.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import zmq
import zmq.asyncio

MessageHandler = Callable[[list[bytes]], None]
# For a CURVE server: the message and the principal its connection authenticated as (ZAP User-Id)
AuthenticatedHandler = Callable[[list[bytes], str], None]

# Most messages handed over per wake-up before yielding to the rest of the loop for one turn.
DEFAULT_MAX_BATCH = 1_024

_POLLIN = int(zmq.POLLIN)  # a plain int: enum arithmetic per send is what this module avoids
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)

log = structlog.get_logger("zmq_drain")


def send_multipart_nowait(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """``sock.send_multipart(frames, NOBLOCK)`` with plain-int flags (pyzmq's ORs an enum per frame).

    Raises ``zmq.ZMQError`` (``zmq.Again`` at the high-water mark); a socket that is also drained
    must be sent on through ``DrainingSocket.send_multipart`` instead, which re-checks for input.
    """
    if not frames:
        raise ValueError("send_multipart needs at least one frame")
    send = sock.send
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, _SNDMORE_NOBLOCK if i < last else _NOBLOCK)


def _recv_authenticated(sock: zmq.Socket[bytes]) -> tuple[list[bytes], str]:
    """One message and the ZAP User-Id its connection proved. Only the frames after the first
    are taken as ``zmq.Frame`` (the first of a ROUTER's is the routing id, which ZMQ makes
    without the connection's metadata): ``recv_multipart(copy=False)`` made a Frame of every
    part, 3.3 µs of the receiving thread's CPU per message against 2.1 here (a scheduler
    receives about five per trivial cell)."""
    frames = [sock.recv(_NOBLOCK)]
    user = ""
    more = sock.getsockopt(_RCVMORE)
    while more:  # the rest of a multipart message is already here: ZMQ delivers it whole
        part = sock.recv(_NOBLOCK, copy=False)
        user = part.get("User-Id") or ""
        frames.append(part.bytes)
        more = part.more
    return frames, user


class DrainingSocket:
    """A plain zmq socket whose inbound messages are delivered by an event-loop reader callback.

    ``on_message`` runs synchronously for each multipart message, in arrival order; an exception
    from it is logged and the next message is delivered (one odd message never kills a channel).
    ``on_drained`` (optional) runs once after each wake-up that delivered at least one message, for
    callers that want to act on a batch (Raft steps all of them and writes once).
    ``on_authenticated`` (instead of ``on_message``) also gets each message's ZAP User-Id, for a
    server that authorises by who the peer proved to be rather than by what it says.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_message: MessageHandler | None,
        *,
        name: str,
        on_authenticated: AuthenticatedHandler | None = None,
        on_drained: Callable[[], None] | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        logger: Any = None,
    ) -> None:
        if isinstance(sock, zmq.asyncio.Socket):  # its sends return Futures nobody would await
            raise TypeError(f"{name}: DrainingSocket needs a plain zmq.Socket, not a zmq.asyncio one")
        if (on_message is None) == (on_authenticated is None):
            raise ValueError(f"{name}: give exactly one of on_message and on_authenticated")
        if on_authenticated is not None and sock.type != zmq.ROUTER:  # see _recv_authenticated
            raise ValueError(f"{name}: on_authenticated needs a ROUTER socket")
        if max_batch < 1:
            raise ValueError(f"{name}: max_batch must be at least 1, got {max_batch}")
        self._sock = sock
        self._on_message = on_message
        self._on_authenticated = on_authenticated
        self._on_drained = on_drained
        self._max_batch = max_batch
        self._log = (logger if logger is not None else log).bind(socket=name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._draining = False
        self._scheduled: asyncio.Handle | None = None
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The underlying socket, for options and bind/connect; read it only through this class."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Watch the socket from the running loop; anything queued before now is delivered too."""
        if self._closed:
            raise RuntimeError("DrainingSocket.start() after close()")
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule()  # the FD's edge for messages already queued may have passed

    def stop(self) -> None:
        """Stop delivering (idempotent); the socket stays open. No callback runs after this."""
        if self._loop is not None and self._fd >= 0:
            self._loop.remove_reader(self._fd)
            self._fd = -1
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        self._closed = True

    def close(self, linger: int = 0) -> None:
        """Stop delivering and close the socket (idempotent)."""
        self.stop()
        if not self._sock.closed:
            self._sock.close(linger=linger)

    # ---- sending -----------------------------------------------------------------------------

    def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Queue one multipart message without blocking; ``zmq.ZMQError`` (``zmq.Again`` at the
        high-water mark) is the caller's to handle."""
        try:
            send_multipart_nowait(self._sock, frames)
        finally:
            self._after_send()

    def send(self, frame: bytes) -> None:
        """Queue one single-frame message without blocking (see ``send_multipart``)."""
        try:
            self._sock.send(frame, _NOBLOCK)
        finally:
            self._after_send()

    def _after_send(self) -> None:
        """A send may have consumed the FD's readable edge: check for a waiting message ourselves."""
        if self._draining or self._scheduled is not None or self._loop is None or self._closed:
            return  # a drain in progress or already due reads until Again anyway
        try:
            waiting = self._sock.getsockopt(zmq.EVENTS) & _POLLIN
        except zmq.ZMQError:
            return
        if waiting:
            self._schedule()

    # ---- receiving ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        if self._scheduled is None and self._loop is not None and not self._closed:
            self._scheduled = self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Deliver every waiting message (up to the batch limit) in arrival order."""
        if self._scheduled is not None:  # the reader fired first: this drain covers the due one
            self._scheduled.cancel()
            self._scheduled = None
        if self._closed or self._draining:
            return
        sock = self._sock
        on_message = self._on_message
        on_authenticated = self._on_authenticated
        delivered = 0
        self._draining = True
        try:
            while delivered < self._max_batch:
                try:
                    if on_authenticated is None:
                        frames = sock.recv_multipart(_NOBLOCK)
                    else:
                        frames, user = _recv_authenticated(sock)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    self._on_recv_error(exc)
                    break
                delivered += 1
                try:
                    if on_authenticated is None:
                        on_message(frames)  # type: ignore[misc]
                    else:
                        on_authenticated(frames, user)
                except Exception:
                    self._log.exception("zmq_drain.handler_failed", frames=len(frames))
                if self._closed:  # the handler closed us
                    break
            else:
                self._schedule()  # more may wait: give the rest of the loop a turn first
        finally:
            self._draining = False
        if delivered and self._on_drained is not None and not self._closed:
            try:
                self._on_drained()
            except Exception:
                self._log.exception("zmq_drain.batch_handler_failed", messages=delivered)

    def _on_recv_error(self, exc: zmq.ZMQError) -> None:
        if exc.errno == errno.EINTR:
            self._schedule()
            return
        # ETERM / ENOTSOCK: the context or socket is gone under us; nothing more will arrive.
        self._log.warning("zmq_drain.receive_failed", error=str(exc))
        self.stop()
