"""One distributed kernel presented as one ordinary Jupyter kernel.

A ``KernelEndpoint`` owns the five sockets a Jupyter client connects to (shell, control and stdin
ROUTERs, an iopub PUB, a heartbeat ROUTER) and the kernel's HMAC key. It checks every incoming
message's framing and signature, remembers which client identity asked what (by msg_id), and
hands the raw frames to ``forward``; replies coming back are routed to the identity that asked,
iopub traffic is published. It knows nothing about replicas or scheduling: that is the point.

The heartbeat socket is a ROUTER rather than a REP (wire compatible with the client's REQ) so the
endpoint can *not* answer while the kernel is dead, which is how Jupyter clients learn of it.

The sockets are plain zmq sockets drained from event-loop reader callbacks (``shared.zmq_drain``)
rather than ``zmq.asyncio`` ones: no Future per message on the cell's hot path.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from shared.jupyter_wire import (
    DELIMITER,
    Signer,
    WireError,
    header_of,
    json_part,
    parent_msg_id,
    split_identities,
)
from shared.zmq_drain import DrainingSocket, send_multipart_nowait

log = structlog.get_logger("gateway.kernel")

ForwardFn = Callable[[str, list[bytes]], None]

# Requests whose reply never came (a client that vanished) must not grow memory without bound.
MAX_PENDING_ROUTES = 10_000

ROUTED_CHANNELS = ("shell", "control", "stdin")
# A reply whose client is not connected (it is reconnecting to a restarted gateway, or its
# connection dropped for a moment) is kept and sent again this often, for this long, in order per
# client: ZMQ's ROUTER would drop it, and the client would wait for it forever.
UNDELIVERED_RETRY_S = 0.1
UNDELIVERED_KEEP_S = 60.0


@dataclass(slots=True)
class PendingRoute:
    """Where the answer to one request goes, and when the request reached us."""

    channel: str
    identities: list[bytes]
    msg_type: str
    arrived_at: float  # wall clock, comparable with the replica's execution start
    code_started_at: float | None = None  # when the executor's execute_input passed through here


@dataclass(slots=True)
class EndpointStats:
    forwarded: int = 0
    delivered: int = 0
    rejected: int = 0
    last_rejection: str = ""
    unroutable: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class KernelEndpoint:
    """The client-facing sockets of one kernel; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        kernel_id: str,
        key: bytes,
        signature_scheme: str,
        forward: ForwardFn,
        *,
        ip: str = "127.0.0.1",
    ) -> None:
        self.kernel_id = kernel_id
        self.ip = ip
        self.key = key
        self.signature_scheme = signature_scheme
        self._signer = Signer(key, signature_scheme)
        self._forward = forward
        self._ctx = ctx
        self._log = log.bind(kernel=kernel_id)
        self._routes: OrderedDict[str, PendingRoute] = OrderedDict()
        self._iopub_topic = f"kernel.{kernel_id}".encode()
        self.alive = False
        self.stats = EndpointStats()
        # shell, control, stdin and hb (ROUTERs, drained by reader callbacks); iopub only publishes
        self._sockets: dict[str, DrainingSocket] = {}
        self._iopub: zmq.Socket[bytes] | None = None
        self.ports: dict[str, int] = {}
        # replica_id -> host_id, kept fresh by the gateway from the scheduler's kernel.status, so
        # replies can say where they ran without the replica knowing its host.
        self.replica_hosts: dict[str, str] = {}
        self.on_unknown_replica: Callable[[], None] | None = None
        # requests kept back while clients reconnect to a restarted gateway (hold_requests)
        self._held: list[tuple[str, list[bytes]]] | None = None
        # what idle culling and `tandem kernel list` go by (shared/policies/culling.py)
        self.last_activity = time.time()  # any client request or kernel message, not heartbeats
        self.execution_state = "starting"  # from the kernel's iopub status messages
        self._peers: set[int] = set()  # fds of clients connected to iopub (socket monitor)
        self._monitor: DrainingSocket | None = None
        # (channel, client identity) -> replies not yet taken, oldest first, with their deadline
        self._undelivered: OrderedDict[tuple[str, bytes], list[tuple[float, list[bytes]]]] = OrderedDict()
        self._retry: asyncio.TimerHandle | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def bind(self, ports: dict[str, int] | None = None) -> dict[str, int]:
        """Bind the five sockets, on free ports or on ``ports`` (a restarted gateway serving the
        kernel where its clients' connection files point); idempotent, so a kernel restart keeps
        the client's ports. Raises ``zmq.ZMQError`` with nothing left bound if a port is taken."""
        if self._iopub is not None:
            return self.ports
        bound: list[zmq.Socket[bytes]] = []
        try:
            for channel in (*ROUTED_CHANNELS, "iopub", "hb"):
                bound.append(self._bind_one(channel, ports[channel] if ports else None))
        except zmq.ZMQError:
            for sock in bound:
                sock.close(linger=0)
            self.ports.clear()
            raise
        for channel, sock in zip((*ROUTED_CHANNELS, "iopub", "hb"), bound, strict=True):
            if channel == "iopub":
                self._iopub = sock
            elif channel == "hb":
                self._sockets[channel] = DrainingSocket(sock, self._on_heartbeat, name="hb", logger=self._log)
            else:
                self._sockets[channel] = DrainingSocket(
                    sock, self._client_handler(channel), name=channel, logger=self._log
                )
        self._watch_connections(self._iopub)
        for drained in self._sockets.values():
            drained.start()
        return self.ports

    def _watch_connections(self, iopub: zmq.Socket[bytes]) -> None:
        """Count the clients subscribed to iopub (every front end is; the KernelManager's own
        control socket is not) from the socket's monitor events: Enterprise Gateway's
        "connections" for ``cull_connected`` and ``tandem kernel list``."""
        address = f"inproc://tandem-monitor-{self.kernel_id}-{id(self)}"
        iopub.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        pair: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        self._monitor = DrainingSocket(pair, self._on_monitor_event, name="iopub-monitor", logger=self._log)
        self._monitor.start()

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._peers.add(fd)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self._peers.discard(fd)

    @property
    def connections(self) -> int:
        return len(self._peers)

    @property
    def busy(self) -> bool:
        """Running a cell, or holding one not started yet (queued behind an election or a
        migration, the kernel has not said "busy" for it): either way not idle."""
        if self.execution_state == "busy":
            return True
        return any(route.msg_type == "execute_request" for route in self._routes.values())

    def _bind_one(self, channel: str, port: int | None) -> zmq.Socket[bytes]:
        kind = zmq.PUB if channel == "iopub" else zmq.ROUTER
        sock: zmq.Socket[bytes] = self._ctx.socket(kind, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:  # routed replies learn that their client is away (_send)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1 if channel in ROUTED_CHANNELS else 0)
        try:
            if port is None:
                self.ports[channel] = sock.bind_to_random_port(f"tcp://{self.ip}")
            else:
                sock.bind(f"tcp://{self.ip}:{port}")
                self.ports[channel] = port
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def set_key(self, key: bytes, signature_scheme: str) -> None:
        """A restart may come with a new key; clients sign with whatever the provisioner handed out."""
        self.key = key
        self.signature_scheme = signature_scheme
        self._signer = Signer(key, signature_scheme)

    def connection_info(self) -> dict[str, Any]:
        return {
            "ip": self.ip,
            "transport": "tcp",
            "shell_port": self.ports["shell"],
            "iopub_port": self.ports["iopub"],
            "stdin_port": self.ports["stdin"],
            "control_port": self.ports["control"],
            "hb_port": self.ports["hb"],
            "key": self.key.decode(),
            "signature_scheme": self.signature_scheme,
        }

    async def close(self) -> None:
        for drained in self._sockets.values():
            drained.close(linger=0)
        self._sockets.clear()
        if self._iopub is not None:
            self._iopub.disable_monitor()
            self._iopub.close(linger=0)
            self._iopub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        self._peers.clear()
        self._routes.clear()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._undelivered.clear()

    # ---- client -> cluster -----------------------------------------------------------------

    def _client_handler(self, channel: str) -> Callable[[list[bytes]], None]:
        def on_client_message(frames: list[bytes]) -> None:
            try:
                self._accept(channel, frames)
            except WireError as exc:
                self._reject(channel, str(exc))
            except Exception as exc:  # never let one odd message kill the channel
                self._log.exception("client_message_failed", channel=channel)
                self._reject(channel, f"{exc.__class__.__name__}: {exc}")

        return on_client_message

    def _accept(self, channel: str, frames: list[bytes]) -> None:
        identities, msg = split_identities(frames)
        if not self._signer.verify(msg[0], msg[1:5]):
            raise WireError("invalid HMAC signature")
        header = header_of(msg)
        msg_id = header["msg_id"]
        if channel != "stdin":  # an input_reply is answered by nobody
            self._remember(msg_id, PendingRoute(channel, identities, header["msg_type"], time.time()))
        self.stats.forwarded += 1
        self.last_activity = time.time()
        self._log.debug("client_request", channel=channel, msg_id=msg_id, msg_type=header["msg_type"])
        if self._held is not None:
            self._held.append((channel, msg))
            return
        self._forward(channel, msg)

    def hold_requests(self) -> None:
        """Keep clients' requests back (in order) until ``release_requests``. A restarted gateway
        does so for a moment: a client's shell socket may reconnect before its iopub one, and
        the outputs of a cell sent at once would be published to nobody (ZMQ's PUB drops what
        no subscriber is connected for), leaving the client waiting for them."""
        if self._held is None:
            self._held = []

    def release_requests(self) -> None:
        held, self._held = self._held or [], None
        for channel, msg in held:
            self._forward(channel, msg)

    def _reject(self, channel: str, reason: str) -> None:
        self.stats.rejected += 1
        self.stats.last_rejection = reason
        self._log.warning("rejected_jupyter_message", channel=channel, reason=reason)

    def _remember(self, msg_id: str, route: PendingRoute) -> None:
        self._routes[msg_id] = route
        if len(self._routes) > MAX_PENDING_ROUTES:
            dropped, _ = self._routes.popitem(last=False)
            self._log.warning("pending_route_evicted", msg_id=dropped)

    def expect_reply(self, msg_id: str, channel: str, msg_type: str) -> None:
        """Register a request the gateway itself sent (e.g. kernel.interrupt) so its reply is swallowed."""
        self._remember(msg_id, PendingRoute(channel, [], msg_type, time.time()))

    def sign(self, parts: list[bytes]) -> bytes:
        return self._signer.sign(parts)

    # ---- cluster -> client -----------------------------------------------------------------

    def deliver(self, channel: str, frames: list[bytes]) -> None:
        """Route one message from the executor (via the scheduler) to the client that asked."""
        if self._iopub is None:
            return
        self.last_activity = time.time()
        if channel == "iopub":
            self._note_execute_input(frames)
            self._note_status(frames)
            try:
                send_multipart_nowait(self._iopub, [self._iopub_topic, DELIMITER, *frames])
            except zmq.ZMQError as exc:
                self._log.warning("client_send_failed", channel=channel, error=str(exc))
            self.stats.delivered += 1
            return
        parent_id = parent_msg_id(frames)
        route = self._routes.get(parent_id) if parent_id else None
        if route is None:
            self._deliver_without_route(channel, frames, parent_id)
            return
        if channel != "stdin":  # stdin traffic (input_request) precedes the shell reply it belongs to
            del self._routes[parent_id]
            if route.msg_type == "execute_request":
                frames = self._stamp_arrival(frames, route)
        if not route.identities:  # a request the gateway made itself
            return
        self._send(channel, [*route.identities, DELIMITER, *frames])
        self.stats.delivered += 1
        self._log.debug("reply_routed", channel=channel, msg_id=parent_id, request_type=route.msg_type)

    def _deliver_without_route(self, channel: str, frames: list[bytes], parent_id: str | None) -> None:
        """A reply to a request this endpoint does not remember: one a previous gateway process
        forwarded before it died (the routes died with it). jupyter_client names its shell,
        control and stdin sockets after the session (``identity=session.bsession``), so the
        parent header's session still reaches the client that asked; ZMQ drops it if no such
        client is connected. The request ran once, upstream: this only returns its answer."""
        session = parent_session(frames)
        if session is None:
            self.stats.unroutable += 1
            self._log.warning("unroutable_reply", channel=channel, msg_id=parent_id)
            return
        self._send(channel, [session, DELIMITER, *frames])
        self.stats.delivered += 1
        self._log.info("reply_routed_by_session", channel=channel, msg_id=parent_id)

    def _note_execute_input(self, frames: list[bytes]) -> None:
        """The executor publishes execute_input right before user code runs: our view of "started"."""
        if b'"execute_input"' not in frames[1]:  # cheap pre-check: most iopub traffic is not this
            return
        parent_id = parent_msg_id(frames)
        route = self._routes.get(parent_id) if parent_id else None
        if route is not None and route.code_started_at is None:
            route.code_started_at = time.time()

    def _note_status(self, frames: list[bytes]) -> None:
        """Follow the kernel's busy/idle status, as Jupyter Server does for its culler."""
        if b'"status"' not in frames[1]:
            return
        try:
            header, content = json.loads(frames[1]), json.loads(frames[4])
        except (json.JSONDecodeError, UnicodeDecodeError, IndexError):
            return
        if header.get("msg_type") == "status" and isinstance(content, dict):
            state = content.get("execution_state")
            if isinstance(state, str):
                self.execution_state = state

    def _stamp_arrival(self, frames: list[bytes], route: PendingRoute) -> list[bytes]:
        """Add our arrival time to execute_reply metadata.tandem, so clients can measure the
        interactivity delay (arrival here -> start of user code at the replica). Re-signs."""
        try:
            header = json.loads(frames[1])
            if header.get("msg_type") != "execute_reply":
                return frames
            metadata = json.loads(frames[3])
        except (json.JSONDecodeError, UnicodeDecodeError, IndexError):
            return frames
        if not isinstance(metadata, dict):
            return frames
        tandem = metadata.setdefault("tandem", {})
        if not isinstance(tandem, dict):
            return frames
        tandem["gateway_received_at"] = route.arrived_at
        started = tandem.get("started_at")  # the replica's own clock reading, when it reports one
        if not isinstance(started, int | float):
            started = route.code_started_at
            tandem["started_at_source"] = "gateway"
        if isinstance(started, int | float):
            tandem["interactivity_delay_ms"] = round((started - route.arrived_at) * 1000.0, 3)
        replica_id = tandem.get("replica_id")
        if "host_id" not in tandem and isinstance(replica_id, str):
            host = self.replica_hosts.get(replica_id)
            if host is None and self.on_unknown_replica is not None:
                self.on_unknown_replica()
            tandem["host_id"] = host
        parts = [frames[1], frames[2], json_part(metadata), frames[4]]
        return [self._signer.sign(parts), *parts, *frames[5:]]

    def _send(self, channel: str, frames: list[bytes]) -> None:
        if channel not in ROUTED_CHANNELS:
            try:
                self._sockets[channel].send_multipart(frames)
            except zmq.ZMQError as exc:
                self._log.warning("client_send_failed", channel=channel, error=str(exc))
            return
        key = (channel, frames[0])
        waiting = self._undelivered.get(key)
        if waiting is not None:  # behind this client's earlier replies, in order
            waiting.append((time.monotonic() + UNDELIVERED_KEEP_S, frames))
        elif not self._try_send(channel, frames):
            self._undelivered[key] = [(time.monotonic() + UNDELIVERED_KEEP_S, frames)]
            self._log.info("client_away_reply_kept", channel=channel)
            self._schedule_retry()

    def _try_send(self, channel: str, frames: list[bytes]) -> bool:
        """False if the client is not connected now (EHOSTUNREACH) or not reading (Again)."""
        sock = self._sockets.get(channel)
        if sock is None:
            return True  # closed: nobody to keep it for
        try:
            sock.send_multipart(frames)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            self._log.warning("client_send_failed", channel=channel, error=str(exc))
        return True

    def _schedule_retry(self) -> None:
        if self._retry is None and self._undelivered:
            self._retry = asyncio.get_running_loop().call_later(UNDELIVERED_RETRY_S, self._send_undelivered)

    def _send_undelivered(self) -> None:
        self._retry = None
        now = time.monotonic()
        for key in list(self._undelivered):
            channel, _ = key
            waiting = self._undelivered[key]
            while waiting and self._try_send(channel, waiting[0][1]):
                waiting.pop(0)
            expired = [frames for deadline, frames in waiting if deadline <= now]
            if expired:
                waiting[:] = [item for item in waiting if item[0] > now]
                self._log.warning("client_away_replies_dropped", channel=channel, count=len(expired))
            if not waiting:
                del self._undelivered[key]
        self._schedule_retry()

    # ---- heartbeat -------------------------------------------------------------------------

    def _on_heartbeat(self, frames: list[bytes]) -> None:
        if self.alive:
            self._send("hb", frames)

    def pending_count(self) -> int:
        return len(self._routes)


def parent_session(frames: list[bytes]) -> bytes | None:
    """The session named in a message's parent header, as a ZMQ identity (None if absent)."""
    try:
        parent = json.loads(frames[2])
    except (json.JSONDecodeError, UnicodeDecodeError, IndexError):
        return None
    session = parent.get("session") if isinstance(parent, dict) else None
    if not isinstance(session, str) or not session or len(session) > 255:
        return None
    return session.encode()
