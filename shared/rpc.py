"""Request/reply and push messaging over ZMQ ROUTER/DEALER, carrying ``Envelope``s.

Why not a plain REQ/REP: services talk both ways at once (the global scheduler pushes Jupyter
traffic to the gateway while the gateway asks it to start kernels) and must never block on a
peer that died, so every link is an asynchronous DEALER <-> ROUTER pair, requests are matched to
replies by envelope id, and every wait has a timeout.

Handlers are plain callables returning ``Envelope | None`` (answered in arrival order, which the
Jupyter forwarding path relies on) or an awaitable of one (run as its own task, so a slow
operation such as starting a replica never stalls the socket).

Sockets are plain zmq sockets drained from an event-loop reader (``shared.zmq_drain``), not
``zmq.asyncio`` ones: every hop of every Jupyter message passes through here, and a Future per
message sent or received was the largest Python cost per hop.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from shared import messages
from shared.envelope import Envelope, EnvelopeError, decode
from shared.security.curve import ClientCurve, CurveAuthority, ServerCurve, server_curve
from shared.security.peer_credentials import ServerPeerCredentials
from shared.zmq_drain import DrainingSocket

log = structlog.get_logger("rpc")

# handshakes a CURVE server refuses before its ZAP handler is asked (ZAP logs its own refusals)
_MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_HANDSHAKE_FAILURES_EXPLAINED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed: the peer broke it off (as a client without a cluster key does)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: protocol error",
}
# a peer that keeps reconnecting is logged once per interval, with how many were not logged
_REFUSAL_LOG_INTERVAL_S = 1.0
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

HandlerResult = Envelope | None | Awaitable[Envelope | None]
ServerHandler = Callable[[bytes, Envelope], HandlerResult]
ClientHandler = Callable[[Envelope], HandlerResult]
# (principal the peer's key was issued to, its routing identity, the message) -> why it is refused
Authorizer = Callable[[str, bytes, Envelope], str | None]


class RpcError(RuntimeError):
    """The peer answered with an ``error`` envelope."""

    def __init__(self, reason: str, code: str = "error") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class RpcTimeout(TimeoutError):
    """No answer within the deadline (after all retries)."""


def _configure(sock: zmq.Socket[bytes]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


def _error_id(data: bytes) -> str:
    """Best effort: the id of an envelope that failed validation, so the sender's wait ends."""
    try:
        import msgpack

        raw = msgpack.unpackb(data, raw=False)
        if isinstance(raw, dict) and isinstance(raw.get("id"), str):
            return raw["id"]
    except Exception:
        pass
    return "unknown"


async def _outcome(env: Envelope, pending: Awaitable[Envelope | None], logger: Any) -> Envelope | None:
    """A slow handler's answer; its failure becomes an ``error`` envelope, never a dead task."""
    try:
        return await pending
    except asyncio.CancelledError:
        raise
    except RpcError as exc:
        return env.error(exc.reason, code=exc.code)
    except Exception as exc:
        logger.exception("handler_failed", type=env.type, request_id=env.id)
        return env.error(f"{exc.__class__.__name__}: {exc}", code="internal")


class _Dispatcher:
    """Runs handler results: sync ones inline, awaitables as tracked tasks."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, aw: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class RpcServer:
    """A ROUTER socket that validates, dispatches and answers envelopes."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        handler: ServerHandler,
        *,
        name: str,
        mandatory: bool = False,
        curve: ServerCurve | None = None,
        peer_credentials: ServerPeerCredentials | None = None,
        authorize: Authorizer | None = None,
    ) -> None:
        """``mandatory``: a push to a peer not connected now fails (``send`` returns False)
        instead of vanishing, for a caller that keeps what it could not deliver.

        ``curve``: only clients whose keys the context's ``CurveAuthority`` admits to the
        domain can connect; ``peer_credentials`` (an ``ipc://`` server): only the processes the
        authority's spawned peers of the domain name; ``authorize`` then sees each message with
        the principal its connection proved, and a reason it returns refuses the message
        (``unauthorized``) before any handler runs."""
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        _configure(self._sock)
        self._curve = curve
        if curve is not None:
            curve.apply(self._sock)
        if peer_credentials is not None:
            peer_credentials.apply(self._sock)
        self._authorize = authorize
        self.refused = 0
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1 if mandatory else 0)
        # A peer that restarts (a gateway, a local scheduler) connects again under its identity
        # while its old connection may not be seen as closed yet (a crashed machine sends no FIN):
        # the new connection takes the identity over instead of being refused.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._handler = handler
        self._log = log.bind(server=name)
        self._dispatch = _Dispatcher()
        self._monitor: DrainingSocket | None = None
        self.refused_handshakes = 0
        self._refusal_logged_at: dict[str, float] = {}  # per reason
        self._refusals_unlogged: dict[str, int] = {}
        if curve is not None:
            self._channel = DrainingSocket(
                self._sock, None, on_authenticated=self._on_frames, name=name, logger=self._log
            )
            # a client with a key the cluster did not issue is refused (and logged) by ZAP; one
            # with no key or no CURVE at all fails the handshake before ZAP: the monitor logs it
            address = f"inproc://rpc-monitor-{id(self._sock):x}"
            self._sock.monitor(address, _HANDSHAKE_FAILURES)
            monitor: zmq.Socket[bytes] = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
            monitor.connect(address)
            self._monitor = DrainingSocket(monitor, self._on_monitor_event, name=f"{name}.monitor")
        elif peer_credentials is not None:  # ZAP logs its refusals
            self._channel = DrainingSocket(
                self._sock, None, on_authenticated=self._on_frames, name=name, logger=self._log
            )
        else:
            self._channel = DrainingSocket(self._sock, self._on_frames, name=name, logger=self._log)
        self.address = ""
        self.local_address = ""  # an ipc endpoint bound beside ``address`` (``bind``)

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        self.refused_handshakes += 1
        if event["value"] == _MECHANISM_MISMATCH:
            reason = "handshake failed: the peer holds no cluster key (it is not a CURVE client)"
        else:
            reason = _HANDSHAKE_FAILURES_EXPLAINED.get(event["event"], "handshake failed")
        now = time.monotonic()
        if now - self._refusal_logged_at.get(reason, -_REFUSAL_LOG_INTERVAL_S) < _REFUSAL_LOG_INTERVAL_S:
            self._refusals_unlogged[reason] = self._refusals_unlogged.get(reason, 0) + 1
            return
        self._refusal_logged_at[reason] = now
        self._log.warning(
            "peer_refused",
            reason=reason,
            endpoint=bytes(event["endpoint"]).decode(errors="replace"),
            detail=event["value"],
            not_logged_since=self._refusals_unlogged.pop(reason, 0),
        )

    def bind(self, address: str) -> str:
        """Bind (``tcp://127.0.0.1:0`` picks a free port) and return the real address. A CURVE
        server's ``ipc://`` endpoint speaks PLAIN (``shared.security.curve``) and is kept apart,
        as ``local_address``: ``address`` stays the one other machines reach."""
        if address.endswith(":0"):
            if self._curve is not None:
                self._curve.apply(self._sock)  # CURVE on TCP, even after an ipc endpoint's PLAIN
            base = address.rsplit(":", 1)[0]
            port = self._sock.bind_to_random_port(base)
            self.address = f"{base}:{port}"
            return self.address
        if self._curve is not None:
            self._curve.bind(self._sock, address)
        else:
            self._sock.bind(address)
        if address.startswith("ipc://") and self.address:
            self.local_address = address
        else:
            self.address = address
        return address

    def start(self) -> None:
        """Start receiving (needs the running loop); messages queued before now are delivered."""
        self._channel.start()
        if self._monitor is not None:
            self._monitor.start()

    def send(self, identity: bytes, env: Envelope) -> bool:
        """Push to a connected peer; never blocks (the peer may be gone: then it is dropped).
        False when ZMQ refused it (a ``mandatory`` server's peer not connected, or a full queue)."""
        try:
            self._channel.send_multipart([identity, env.encode()])
        except zmq.ZMQError as exc:
            self._log.warning("send_failed", peer=identity, type=env.type, error=str(exc))
            return False
        return True

    def _on_frames(self, frames: list[bytes], principal: str = "") -> None:
        """One inbound message: validate, authorise, then dispatch or answer with an ``error``."""
        if len(frames) != 2:
            self._log.warning("malformed_frames", count=len(frames))
            if len(frames) > 2:
                self.send(frames[0], Envelope(messages.ERROR, {"reason": "expected one payload frame"}))
            return
        identity, payload = frames
        env = self._decoded(identity, payload)
        if env is None or not self._authorized(principal, identity, env):
            return
        if env.type != messages.BATCH:
            self._run(identity, env)
            return
        for item in env.body["items"]:  # in order, each as if it had come alone
            inner = self._decoded(identity, item)
            if inner is None:
                continue
            if inner.type == messages.BATCH:
                self._log.warning("rejected_message", peer=identity, reason="a batch inside a batch")
                self.send(identity, inner.error("a batch may not hold a batch", code="bad_message"))
            elif self._authorized(principal, identity, inner):
                self._run(identity, inner)

    def _decoded(self, identity: bytes, payload: bytes) -> Envelope | None:
        """The valid envelope, or None once the sender has been told why not."""
        try:
            return decode(payload)
        except EnvelopeError as exc:
            self._log.warning("rejected_message", peer=identity, reason=str(exc))
            bad = Envelope(messages.ERROR, {"reason": str(exc), "code": "bad_message"}, id=_error_id(payload))
            self.send(identity, bad)
            return None

    def _authorized(self, principal: str, identity: bytes, env: Envelope) -> bool:
        """Whether the peer's proven principal may send ``env``; a refusal is counted and answered."""
        if self._authorize is None:
            return True
        refusal = self._authorize(principal, identity, env)
        if refusal is None:
            return True
        self.refused += 1
        self._log.warning("unauthorized", principal=principal or "anonymous", type=env.type, reason=refusal)
        self.send(identity, env.error(refusal, code="unauthorized"))
        return False

    def _run(self, identity: bytes, env: Envelope) -> None:
        try:
            result = self._handler(identity, env)
        except Exception as exc:
            self._log.exception("handler_failed", type=env.type, request_id=env.id)
            self.send(identity, env.error(f"{exc.__class__.__name__}: {exc}", code="internal"))
            return
        if result is None:  # the hot path (Jupyter forwarding) answers nothing
            return
        if type(result) is not Envelope and inspect.isawaitable(result):
            self._dispatch.spawn(self._finish(identity, env, result))
        else:
            self.send(identity, result)

    async def _finish(self, identity: bytes, env: Envelope, pending: Awaitable[Envelope | None]) -> None:
        result = await _outcome(env, pending, self._log)
        if result is not None:
            self.send(identity, result)

    async def close(self) -> None:
        """Stop receiving, cancel running handlers, close the socket (pending sends are dropped)."""
        self._channel.stop()
        await self._dispatch.cancel_all()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close()
        self._sock.close(linger=0)


class RpcClient:
    """A DEALER socket: requests with correlation ids, timeouts and retries; pushes both ways."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        identity: bytes | None = None,
        on_message: ClientHandler | None = None,
        name: str = "client",
        curve: ClientCurve | None = None,
    ) -> None:
        """``curve``: this client's keys and the server's public key (a CURVE server refuses a
        client without them: the handshake fails and requests time out)."""
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        _configure(self._sock)
        self._curve = curve
        if curve is not None:
            curve.apply(self._sock)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._on_message = on_message
        self._pending: dict[str, asyncio.Future[Envelope]] = {}
        self._log = log.bind(client=name)
        self._dispatch = _Dispatcher()
        self._channel = DrainingSocket(self._sock, self._on_frames, name=name, logger=self._log)
        self._receiving = False

    def connect(self, address: str) -> None:
        """Connect (needs the running loop on the first call, which starts receiving); with
        ``curve``, an ``ipc://`` server is reached with PLAIN (``shared.security.curve``)."""
        if self._curve is not None:
            self._curve.connect(self._sock, address)
        else:
            self._sock.connect(address)
        if not self._receiving:
            self._receiving = True
            self._channel.start()

    def send(self, env: Envelope) -> None:
        """Fire and forget. Queues while disconnected (up to the high-water mark)."""
        try:
            self._channel.send(env.encode())
        except zmq.ZMQError as exc:
            self._log.warning("send_failed", type=env.type, error=str(exc))

    def send_batch(self, envs: list[Envelope]) -> None:
        """Fire and forget ``envs`` in order, as one ``batch`` envelope when there are several (a
        CURVE box and a frame for the lot; only to a server that said it takes batches)."""
        if len(envs) == 1:
            self.send(envs[0])
            return
        for start in range(0, len(envs), messages.MAX_BATCH_ITEMS):
            chunk = envs[start : start + messages.MAX_BATCH_ITEMS]
            self.send(Envelope(messages.BATCH, {"items": [env.encode() for env in chunk]}))

    async def request(self, env: Envelope, *, timeout: float = 10.0, retries: int = 0) -> Envelope:
        """Send and wait for the matching reply; ``RpcError`` on an error answer.

        A retry resends the same envelope id, so a receiver can recognise a duplicate.
        """
        fut: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._pending[env.id] = fut
        try:
            for attempt in range(retries + 1):
                self.send(env)
                try:
                    answer = await asyncio.wait_for(asyncio.shield(fut), timeout)
                    break
                except TimeoutError:
                    if attempt == retries:
                        raise RpcTimeout(
                            f"no answer to {env.type} within {timeout:g}s (attempts: {retries + 1})"
                        ) from None
                    self._log.info("request_retry", type=env.type, request_id=env.id, attempt=attempt + 1)
        finally:
            self._pending.pop(env.id, None)
        if answer.type == messages.ERROR:
            raise RpcError(str(answer.body.get("reason")), str(answer.body.get("code", "error")))
        return answer

    def _on_frames(self, frames: list[bytes]) -> None:
        """One inbound message: a reply ends a request's wait, anything else goes to the handler."""
        if len(frames) != 1:
            self._log.warning("malformed_frames", count=len(frames))
            return
        try:
            env = decode(frames[0])
        except EnvelopeError as exc:
            self._log.warning("rejected_message", reason=str(exc))
            return
        if env.type in (messages.REPLY, messages.ERROR):
            fut = self._pending.get(env.id)
            if fut is not None and not fut.done():
                fut.set_result(env)
            elif env.type == messages.ERROR:
                self._log.warning("peer_error", reason=env.body.get("reason"), request_id=env.id)
            return
        if self._on_message is None:
            self._log.warning("unexpected_message", type=env.type)
            return
        try:
            result = self._on_message(env)
        except Exception:
            self._log.exception("handler_failed", type=env.type)
            return
        if result is None:  # the hot path (Jupyter forwarding) answers nothing
            return
        if type(result) is not Envelope and inspect.isawaitable(result):
            self._dispatch.spawn(self._finish(env, result))
        else:
            self.send(result)

    async def _finish(self, env: Envelope, pending: Awaitable[Envelope | None]) -> None:
        result = await _outcome(env, pending, self._log)
        if result is not None:
            self.send(result)

    async def close(self) -> None:
        """Stop receiving, cancel handlers and waiting requests, close the socket."""
        self._channel.stop()
        await self._dispatch.cancel_all()
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._sock.close(linger=0)


class PeerSender(Protocol):
    """What ``OutboundRequests`` sends through: an ``RpcServer``, or a holder of one."""

    def send(self, identity: bytes, env: Envelope) -> bool: ...


class OutboundRequests:
    """Requests a ROUTER side sends to one of its peers and awaits (scheduler → local scheduler,
    local scheduler → replica). ``RpcServer`` only pushes; answers come back through the server's
    handler as ``reply``/``error`` envelopes and are matched here by envelope id."""

    def __init__(self, server: PeerSender) -> None:
        self._server = server
        self._pending: dict[str, asyncio.Future[Envelope]] = {}
        self._peer_of: dict[str, bytes] = {}

    async def request(self, identity: bytes, env: Envelope, *, timeout: float) -> Envelope:
        """Send ``env`` to the peer ``identity``; ``RpcError`` on an error answer, ``RpcTimeout``."""
        fut: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._pending[env.id] = fut
        self._peer_of[env.id] = identity
        try:
            self._server.send(identity, env)
            try:
                answer = await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise RpcTimeout(f"no answer to {env.type} from {identity!r} within {timeout:g}s") from None
        finally:
            self._pending.pop(env.id, None)
            self._peer_of.pop(env.id, None)
        if answer.type == messages.ERROR:
            raise RpcError(str(answer.body.get("reason")), str(answer.body.get("code", "error")))
        return answer

    def on_answer(self, env: Envelope, identity: bytes | None = None) -> bool:
        """Feed a ``reply``/``error`` received by the server from ``identity``; False if nobody
        waits for it, or if it came from another peer than the one asked (never a forged answer)."""
        fut = self._pending.get(env.id)
        if fut is None or fut.done():
            return False
        if identity is not None and self._peer_of.get(env.id) != identity:
            log.warning(
                "answer_from_wrong_peer", request_id=env.id, peer=identity, asked=self._peer_of.get(env.id)
            )
            return False
        fut.set_result(env)
        return True

    def fail_peer(self, identity: bytes, reason: str) -> int:
        """The peer is gone (host declared dead): end every wait on it now, not at its timeout."""
        failed = 0
        for request_id, peer in list(self._peer_of.items()):
            fut = self._pending.get(request_id)
            if peer == identity and fut is not None and not fut.done():
                fut.set_exception(RpcError(reason, "unreachable"))
                failed += 1
        return failed

    def cancel_all(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()


class ClusterServerShell:
    """The listening half every cluster service with a server key of its own shares (the arbiter,
    the checkpoint service): its ROUTER admits any key of the cluster's directory but its own;
    what each may send is the service's authorization."""

    server_key: str  # the principal of the service's server key
    _ctx: zmq.Context[Any]
    _server: RpcServer
    _keys_dir: Path
    _authority: CurveAuthority | None

    def _listen(
        self,
        keys_dir: Path,
        handler: ServerHandler,
        *,
        name: str,
        authorize: Authorizer,
        mandatory: bool = False,
    ) -> None:
        """Its context and its ROUTER, CURVE with the server key; bound by ``bind``."""
        import zmq.asyncio

        self._keys_dir = keys_dir
        self._ctx = zmq.asyncio.Context()
        self._authority = None
        self._server = RpcServer(
            self._ctx,
            handler,
            name=name,
            mandatory=mandatory,
            curve=server_curve(keys_dir, self.server_key),
            authorize=authorize,
        )

    def bind(self, address: str) -> str:
        if self._authority is None:
            self._authority = CurveAuthority.for_cluster_server(self._ctx, self._keys_dir, self.server_key)
        return self._server.bind(address)

    @property
    def address(self) -> str:
        return self._server.address
