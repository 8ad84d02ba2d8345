"""The gateway service: Jupyter edge for every distributed kernel, plus the kernel lifecycle API.

Two links: an API ROUTER (``kernel.start/shutdown/status/interrupt`` from the provisioner and the
CLI) and a DEALER to the global scheduler (identity ``gateway``) carrying ``jupyter.request`` out
and ``jupyter.reply`` / ``kernel.dead`` back. All decisions about replicas live in the scheduler;
the gateway only binds sockets, checks signatures and routes frames.

A gateway restart loses no kernel: every kernel handed to a client is in the gateway's kernel
table on disk (kernel_table.py), and a restarted gateway binds each one's five ports again with
its key, then checks with the scheduler which of them still live (``_restore_kernels``). The
replicas never noticed: clients reconnect to the same ports and find their namespaces.
"""

from __future__ import annotations

import asyncio
import errno
import time
import uuid
from typing import Any

import structlog
import zmq
import zmq.asyncio

from services.gateway.kernel_endpoint import KernelEndpoint
from services.gateway.kernel_table import KernelEntry, KernelTableFile
from shared import messages
from shared.config import Config
from shared.envelope import Envelope
from shared.jupyter_wire import WireError, json_part
from shared.policies.culling import CullPolicy, KernelActivity, kernels_to_cull
from shared.policies.hibernation import HibernatePolicy, kernels_to_hibernate
from shared.rpc import RpcClient, RpcError, RpcServer, RpcTimeout
from shared.security import curve
from shared.security.authorization import gateway_refusal

log = structlog.get_logger("gateway")

GATEWAY_IDENTITY = b"gateway"
# A restarted gateway waits this long before its first word to the scheduler, which then sends
# what it kept for the gateway (services/global_scheduler/gateway_outbox.py), and before it
# forwards clients' requests: time for clients' iopub subscriptions to reconnect (ZMQ retries
# every 100 ms), or they would miss those outputs.
RECONNECT_GRACE_S = 1.0
# The scheduler's answer to kernel.hibernate: a large namespace's last STATE may still be written
HIBERNATE_TIMEOUT_S = 180.0
# How long a restarted gateway waits for a kernel's old port to be free before it gives the kernel up.
PORTS_FREED_WITHIN_S = 2.0


class KernelState:
    STARTING = "starting"
    ALIVE = "alive"
    HIBERNATED = "hibernated"  # its replicas stopped, its namespace stored: a request resumes it
    DEAD = "dead"
    STOPPED = "stopped"


class Gateway:
    """Owns the API server, the scheduler link and one ``KernelEndpoint`` per kernel."""

    def __init__(self, ctx: zmq.asyncio.Context, cfg: Config, *, scheduler_address: str) -> None:
        self._ctx = ctx
        self._cfg = cfg
        self._kernel_ip: str = cfg.get("gateway.kernel_ip")
        self._start_timeout: float = cfg.get("gateway.kernel_start_timeout_s")
        self._request_timeout: float = cfg.get("scheduler.request_timeout_s")
        self._poll_interval: float = cfg.get("gateway.status_poll_interval_s")
        self._scheduler_address = scheduler_address
        self._cull = CullPolicy(
            idle_s=float(cfg.get("kernel.cull_idle_s")),
            cull_connected=bool(cfg.get("kernel.cull_connected")),
            cull_busy=bool(cfg.get("kernel.cull_busy")),
        )
        self._cull_interval: float = cfg.get("kernel.cull_interval_s")
        self._hibernate = HibernatePolicy(after_s=float(cfg.get("kernel.hibernate_after_s")))
        self._hibernate_interval: float = cfg.get("kernel.hibernate_interval_s")
        # kernel -> its last activity when the scheduler refused to hibernate it: tried again
        # only after new activity (a name that cannot be saved stays unsaved until it changes)
        self._hibernate_refused: dict[str, float] = {}
        self._ports_kept_s: float = cfg.get("gateway.restart_ports_kept_s")
        keys_dir = cfg.keys_dir()
        api_curve = curve.server_curve(keys_dir, curve.GATEWAY)
        scheduler_curve = curve.client_curve(keys_dir, curve.GATEWAY, curve.SCHEDULER)
        # the lifecycle API admits only the operator's key (the CLI, the Jupyter provisioner)
        self._authority: curve.CurveAuthority | None = curve.CurveAuthority.acquire(ctx)
        self._authority.serve(
            curve.GATEWAY, curve.PeerDirectory(keys_dir, exclude=(curve.SCHEDULER, curve.GATEWAY))
        )
        self.api = RpcServer(
            ctx,
            self._on_api,
            name="gateway-api",
            curve=api_curve,
            authorize=lambda principal, _identity, env: gateway_refusal(principal, env.type),
        )
        self.scheduler = RpcClient(
            ctx,
            identity=GATEWAY_IDENTITY,
            on_message=self._on_scheduler_push,
            name="gateway->scheduler",
            curve=scheduler_curve,
        )
        self.kernels: dict[str, KernelEndpoint] = {}
        self.states: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        # who stopped a stopped kernel: "client", "operator" (`tandem kernel stop`) or "culler";
        # the provisioner does not auto-restart a kernel the operator or the culler stopped
        self.stopped_by: dict[str, str] = {}
        self.names: dict[str, str] = {}  # kernel id -> kernelspec name, as the provisioner said
        self._poller: asyncio.Task[None] | None = None
        self._culler: asyncio.Task[None] | None = None
        self._hibernator: asyncio.Task[None] | None = None
        # kernels stopped for a restart, whose ports go back unless a start comes first
        self._port_holds: dict[str, asyncio.TimerHandle] = {}
        self._refreshing: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        # kernels whose connection info a client got: what the table on disk lists
        self._table = KernelTableFile(cfg.state_dir() / "gateway" / "kernels.json")
        self._table_lock = asyncio.Lock()
        self._published: dict[str, KernelEntry] = {}

    async def start(self, api_address: str) -> str:
        restored = await self._restore_kernels()  # before the API answers: a client asks about them
        address = self.api.bind(api_address)
        self.api.start()
        self.scheduler.connect(self._scheduler_address)
        self._poller = asyncio.ensure_future(self._poll_liveness())
        if self._cull.enabled:
            self._culler = asyncio.ensure_future(self._cull_idle_kernels())
            log.info("idle_culling", idle_s=self._cull.idle_s, cull_connected=self._cull.cull_connected,
                     cull_busy=self._cull.cull_busy, interval_s=self._cull_interval)  # fmt: skip
        if self._hibernate.enabled:
            self._hibernator = asyncio.ensure_future(self._hibernate_idle_kernels())
            log.info("hibernation", after_s=self._hibernate.after_s, interval_s=self._hibernate_interval)
        if restored:
            self._in_background(self._check_liveness(restored, after=RECONNECT_GRACE_S))
            asyncio.get_running_loop().call_later(RECONNECT_GRACE_S, self._release_restored, restored)
        log.info("gateway_started", api=address, scheduler=self._scheduler_address)
        return address

    async def close(self) -> None:
        await _cancel([t for t in (self._poller, self._culler, self._hibernator) if t is not None])
        for hold in self._port_holds.values():
            hold.cancel()
        await _cancel(list(self._background))
        for endpoint in list(self.kernels.values()):
            await endpoint.close()
        self.kernels.clear()
        await self.api.close()
        await self.scheduler.close()
        if self._authority is not None:
            self._authority.release()
            self._authority = None

    # ---- API -------------------------------------------------------------------------------

    def _on_api(self, identity: bytes, env: Envelope) -> Any:
        handlers = {
            messages.KERNEL_START: self._kernel_start,
            messages.KERNEL_SHUTDOWN: self._kernel_shutdown,
            messages.KERNEL_STATUS: self._kernel_status,
            messages.KERNEL_INTERRUPT: self._kernel_interrupt,
            messages.KERNEL_LIST: self._kernel_list,
            messages.KERNEL_HIBERNATE: self._kernel_hibernate,
        }
        handler = handlers.get(env.type)
        if handler is None:
            log.warning("rejected_api_message", type=env.type, reason="not a gateway API request")
            return env.error(f"the gateway does not handle {env.type!r}", code="bad_message")
        return handler(env)

    async def _kernel_start(self, env: Envelope) -> Envelope:
        body = env.body
        kernel_id: str = body["kernel_id"]
        klog = log.bind(kernel=kernel_id)
        scheme = body.get("signature_scheme", "hmac-sha256")
        key = body["key"].encode()
        if self.states.get(kernel_id) in (KernelState.STARTING, KernelState.ALIVE, KernelState.HIBERNATED):
            return env.error(f"kernel {kernel_id} is already running", code="conflict")
        endpoint = self.kernels.get(kernel_id)
        fresh = endpoint is None
        try:
            if endpoint is None:
                endpoint = KernelEndpoint(
                    self._ctx, kernel_id, key, scheme, self._forwarder(kernel_id), ip=self._kernel_ip
                )
            else:
                endpoint.set_key(key, scheme)
        except WireError as exc:
            return env.error(str(exc), code="bad_message")
        endpoint.bind()
        self.kernels[kernel_id] = endpoint
        self.states[kernel_id] = KernelState.STARTING
        self._end_port_hold(kernel_id)
        self.reasons.pop(kernel_id, None)
        self.stopped_by.pop(kernel_id, None)
        self.names[kernel_id] = str(body.get("name") or self.names.get(kernel_id, ""))
        endpoint.last_activity = time.time()
        klog.info("kernel_starting", resources=body["resources"], reused_ports=not fresh)
        forward = Envelope(messages.KERNEL_START, {k: v for k, v in body.items() if k != "name"})
        try:
            answer = await self.scheduler.request(forward, timeout=self._start_timeout)
        except (RpcError, RpcTimeout) as exc:
            reason = exc.reason if isinstance(exc, RpcError) else str(exc)
            klog.warning("kernel_start_failed", reason=reason)
            # The scheduler may still finish placing replicas after our deadline: tell it to stop.
            self.scheduler.send(Envelope(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id}))
            self.states[kernel_id] = KernelState.DEAD
            self.reasons[kernel_id] = reason
            if fresh:
                await self._forget(kernel_id)
            return env.error(f"kernel start failed: {reason}", code="start_failed")
        endpoint.alive = True
        endpoint.on_unknown_replica = lambda: self._refresh_placement_soon(kernel_id)
        self._learn_placement(kernel_id, answer.body)
        self.states[kernel_id] = KernelState.ALIVE
        info = endpoint.connection_info()
        info["kernel_id"] = kernel_id
        info["placement"] = answer.body
        # On disk before the client has the ports: a gateway restart after this finds the kernel.
        self._published[kernel_id] = KernelEntry(
            kernel_id, endpoint.key.decode(), endpoint.signature_scheme, endpoint.ip, dict(endpoint.ports)
        )
        await self._save_table()
        klog.info("kernel_started", ports=endpoint.ports)
        return env.reply(info)

    async def _kernel_shutdown(self, env: Envelope) -> Envelope:
        kernel_id: str = env.body["kernel_id"]
        if kernel_id not in self.kernels and kernel_id not in self.states:
            return env.error(f"unknown kernel {kernel_id}", code="unknown_kernel")
        by = str(env.body.get("by") or "client")
        scheduler_error = await self._stop(
            kernel_id,
            keep_ports=bool(env.body.get("restart", False)),
            by=by,
            reason=f"stopped by the {by}" if by != "client" else "",
        )
        return env.reply(
            {"kernel_id": kernel_id, "state": KernelState.STOPPED, "scheduler_error": scheduler_error}
        )

    async def _stop(self, kernel_id: str, *, keep_ports: bool, by: str, reason: str) -> str:
        """Stop the kernel's replicas; ``keep_ports``: its sockets stay bound for a restart (the
        connected clients keep their ports), released if no start comes within
        ``gateway.restart_ports_kept_s``. Returns the scheduler's error, if any."""
        endpoint = self.kernels.get(kernel_id)
        if endpoint is not None:  # else restored without its ports (taken): it still has replicas
            endpoint.alive = False
        scheduler_error = ""
        if self.states.get(kernel_id) != KernelState.STOPPED:  # else who stopped it first is kept
            self.stopped_by[kernel_id] = by
            if reason:
                self.reasons[kernel_id] = reason
            try:
                await self.scheduler.request(
                    Envelope(messages.KERNEL_SHUTDOWN, {"kernel_id": kernel_id, "restart": keep_ports}),
                    timeout=self._request_timeout,
                )
            except (RpcError, RpcTimeout) as exc:
                scheduler_error = exc.reason if isinstance(exc, RpcError) else str(exc)
                log.warning("kernel_shutdown_scheduler_error", kernel=kernel_id, reason=scheduler_error)
        self.states[kernel_id] = KernelState.STOPPED
        self._end_port_hold(kernel_id)
        if keep_ports and endpoint is not None:
            self._port_holds[kernel_id] = asyncio.get_running_loop().call_later(
                self._ports_kept_s, self._release_ports_if_stopped, kernel_id, endpoint
            )
        else:
            await self._forget(kernel_id)
        log.info("kernel_stopped", kernel=kernel_id, restart=keep_ports, by=by, reason=reason or None)
        return scheduler_error

    def _end_port_hold(self, kernel_id: str) -> None:
        hold = self._port_holds.pop(kernel_id, None)
        if hold is not None:
            hold.cancel()

    def _release_ports_if_stopped(self, kernel_id: str, endpoint: KernelEndpoint) -> None:
        """A restart whose start never came (its KernelManager died between the two): the ports
        of the stopped kernel go back."""
        self._port_holds.pop(kernel_id, None)
        if self.kernels.get(kernel_id) is endpoint and self.states.get(kernel_id) == KernelState.STOPPED:
            log.info("kernel_ports_released", kernel=kernel_id, after_s=self._ports_kept_s)
            self._in_background(self._forget(kernel_id))

    def _kernel_list(self, env: Envelope) -> Envelope:
        """Every kernel the gateway serves or stopped, with what only it sees: connections,
        last activity, busy/idle."""
        kernels = []
        for kernel_id, state in self.states.items():
            endpoint = self.kernels.get(kernel_id)
            entry: dict[str, Any] = {
                "id": kernel_id,
                "name": self.names.get(kernel_id, ""),
                "state": state,
                "reason": self.reasons.get(kernel_id, ""),
                "stopped_by": self.stopped_by.get(kernel_id, ""),
            }
            if endpoint is not None:
                entry.update(
                    execution_state=endpoint.execution_state,
                    last_activity=endpoint.last_activity,
                    connections=endpoint.connections,
                    ports=dict(endpoint.ports),
                )
            kernels.append(entry)
        return env.reply({"kernels": kernels})

    # ---- idle culling (shared/policies/culling.py) --------------------------------------------

    async def _cull_idle_kernels(self) -> None:
        while True:
            await asyncio.sleep(self._cull_interval)
            activity = [  # a hibernated kernel is culled too: idle that long, hibernated or not
                KernelActivity(kid, e.last_activity, e.busy, e.connections)
                for kid, e in self.kernels.items()
                if self.states.get(kid) in (KernelState.ALIVE, KernelState.HIBERNATED)
            ]
            for decision in kernels_to_cull(self._cull, activity, time.time()):
                log.warning("kernel_culled", kernel=decision.kernel_id, reason=decision.reason)
                try:
                    await self._stop(
                        decision.kernel_id, keep_ports=False, by="culler", reason=decision.reason
                    )
                except Exception:  # the next round tries again; the loop must outlive one failure
                    log.exception("kernel_cull_failed", kernel=decision.kernel_id)

    # ---- hibernation (shared/policies/hibernation.py) -----------------------------------------

    async def _hibernate_idle_kernels(self) -> None:
        while True:
            await asyncio.sleep(self._hibernate_interval)
            activity = [
                KernelActivity(kid, e.last_activity, e.busy, e.connections)
                for kid, e in self.kernels.items()
                if self.states.get(kid) == KernelState.ALIVE
                and self._hibernate_refused.get(kid) != e.last_activity
            ]
            for decision in kernels_to_hibernate(self._hibernate, activity, time.time()):
                try:
                    await self._hibernate_kernel(decision.kernel_id, decision.reason)
                except (RpcError, RpcTimeout) as exc:
                    endpoint = self.kernels.get(decision.kernel_id)
                    if endpoint is not None:
                        self._hibernate_refused[decision.kernel_id] = endpoint.last_activity
                    log.info("kernel_not_hibernated", kernel=decision.kernel_id, reason=str(exc))
                except Exception:  # the next round tries again; the loop must outlive one failure
                    log.exception("kernel_hibernation_failed", kernel=decision.kernel_id)

    async def _hibernate_kernel(self, kernel_id: str, reason: str) -> dict[str, Any]:
        """Ask the scheduler to hibernate the kernel; its ports stay bound and its heartbeat
        answered (clients see a live, idle kernel), and its next request resumes it."""
        asked = time.time()
        answer = await self.scheduler.request(
            Envelope(messages.KERNEL_HIBERNATE, {"kernel_id": kernel_id, "reason": reason}),
            timeout=HIBERNATE_TIMEOUT_S,
        )
        if self.states.get(kernel_id) == KernelState.ALIVE:
            endpoint = self.kernels.get(kernel_id)
            # a request that came while it was saved has already started its resume
            if endpoint is None or endpoint.last_activity <= asked:
                self.states[kernel_id] = KernelState.HIBERNATED
        self._hibernate_refused.pop(kernel_id, None)
        log.info("kernel_hibernated", kernel=kernel_id, reason=reason)
        return answer.body

    async def _kernel_hibernate(self, env: Envelope) -> Envelope:
        """``tandem kernel hibernate K``: now, whatever the policy says (not while a cell runs)."""
        kernel_id: str = env.body["kernel_id"]
        if self.states.get(kernel_id) not in (KernelState.ALIVE, KernelState.HIBERNATED):
            return env.error(f"kernel {kernel_id} is not running", code="unknown_kernel")
        try:
            body = await self._hibernate_kernel(kernel_id, str(env.body.get("reason") or "operator"))
        except RpcError as exc:
            return env.error(exc.reason, code=exc.code or "refused")
        except RpcTimeout as exc:
            return env.error(str(exc), code="timeout")
        return env.reply(body)

    def _kernel_status(self, env: Envelope) -> Envelope:
        kernel_id: str = env.body["kernel_id"]
        state = self.states.get(kernel_id)
        if state is None:
            return env.error(f"unknown kernel {kernel_id}", code="unknown_kernel")
        endpoint = self.kernels.get(kernel_id)
        body: dict[str, Any] = {
            "kernel_id": kernel_id,
            "state": state,
            "reason": self.reasons.get(kernel_id, ""),
            "stopped_by": self.stopped_by.get(kernel_id, ""),
        }
        if endpoint is not None:
            stats = endpoint.stats
            body.update(
                alive=endpoint.alive,
                forwarded=stats.forwarded,
                delivered=stats.delivered,
                rejected=stats.rejected,
                last_rejection=stats.last_rejection,
                pending=endpoint.pending_count(),
            )
        return env.reply(body)

    def _kernel_interrupt(self, env: Envelope) -> Envelope:
        kernel_id: str = env.body["kernel_id"]
        endpoint = self.kernels.get(kernel_id)
        if endpoint is None or self.states.get(kernel_id) != KernelState.ALIVE:
            return env.error(f"kernel {kernel_id} is not running", code="unknown_kernel")
        header = {
            "msg_id": uuid.uuid4().hex,
            "msg_type": "interrupt_request",
            "session": "tandem-gateway",
            "username": "tandem",
            "date": _now_iso(),
            "version": "5.3",
        }
        parts = [json_part(header), b"{}", b"{}", b"{}"]
        endpoint.expect_reply(header["msg_id"], "control", "interrupt_request")
        self._forward(kernel_id, "control", [endpoint.sign(parts), *parts])
        return env.reply({"kernel_id": kernel_id, "msg_id": header["msg_id"]})

    async def _forget(self, kernel_id: str) -> None:
        self._hibernate_refused.pop(kernel_id, None)
        endpoint = self.kernels.pop(kernel_id, None)
        if endpoint is not None:
            await endpoint.close()
        if self._published.pop(kernel_id, None) is not None:
            await self._save_table()

    # ---- the kernel table on disk (kernel_table.py) ------------------------------------------

    async def _save_table(self) -> None:
        """Write the published kernels; serialized, so the last write carries the latest table.
        A failure is logged as an error: the kernels keep running, but would not survive a
        gateway restart."""
        async with self._table_lock:
            entries = list(self._published.values())
            try:
                await asyncio.to_thread(self._table.save, entries)
            except OSError as exc:
                log.error("kernel_table_not_saved", path=str(self._table.path), reason=str(exc))

    async def _restore_kernels(self) -> list[str]:
        """Serve again every kernel of the table on its old ports, alive until the scheduler says
        otherwise (``_check_liveness``, at once and then periodically). A kernel whose ports are
        now taken is reported dead with the reason; its replicas are stopped by the client's
        shutdown as usual."""
        restored: list[str] = []
        for entry in self._table.load():
            kernel_id = entry.kernel_id
            klog = log.bind(kernel=kernel_id)
            try:
                endpoint = KernelEndpoint(
                    self._ctx,
                    kernel_id,
                    entry.key.encode(),
                    entry.signature_scheme,
                    self._forwarder(kernel_id),
                    ip=entry.ip,
                )
                await _bind_when_free(endpoint, entry.ports)
            except (WireError, zmq.ZMQError) as exc:
                reason = f"the gateway restarted and cannot serve the kernel on ports {entry.ports}: {exc}"
                klog.error("kernel_not_restored", reason=reason)
                self.states[kernel_id] = KernelState.DEAD
                self.reasons[kernel_id] = reason
                continue
            endpoint.alive = True
            endpoint.on_unknown_replica = lambda kid=kernel_id: self._refresh_placement_soon(kid)
            endpoint.hold_requests()  # until its clients had time to reconnect (RECONNECT_GRACE_S)
            self.kernels[kernel_id] = endpoint
            self.states[kernel_id] = KernelState.ALIVE
            self._published[kernel_id] = entry
            restored.append(kernel_id)
            klog.info("kernel_restored", ports=entry.ports)
        if restored:
            log.info("kernel_table_restored", kernels=len(restored), path=str(self._table.path))
        return restored

    # ---- Jupyter traffic -------------------------------------------------------------------

    def _forwarder(self, kernel_id: str) -> Any:
        def forward(channel: str, frames: list[bytes]) -> None:
            self._forward(kernel_id, channel, frames)

        return forward

    def _forward(self, kernel_id: str, channel: str, frames: list[bytes]) -> None:
        if self.states.get(kernel_id) == KernelState.HIBERNATED:  # the scheduler holds it and resumes
            self.states[kernel_id] = KernelState.ALIVE
            log.info("kernel_resuming", kernel=kernel_id, channel=channel)
        self.scheduler.send(
            Envelope(messages.JUPYTER_REQUEST, {"kernel_id": kernel_id, "channel": channel, "frames": frames})
        )

    def _on_scheduler_push(self, env: Envelope) -> None:
        kernel_id = env.body.get("kernel_id", "")
        endpoint = self.kernels.get(kernel_id)
        if env.type == messages.JUPYTER_REPLY:
            if endpoint is None:
                log.warning("reply_for_unknown_kernel", kernel=kernel_id)
                return
            for channel, frames in messages.jupyter_messages(env.body):
                endpoint.deliver(channel, frames)
        elif env.type == messages.KERNEL_DEAD:
            reason = env.body["reason"]
            log.warning("kernel_dead", kernel=kernel_id, reason=reason)
            if endpoint is not None:
                endpoint.alive = False
            if self.states.get(kernel_id) in (KernelState.ALIVE, KernelState.STARTING):
                self.states[kernel_id] = KernelState.DEAD
                self.reasons[kernel_id] = reason
        else:
            log.warning("unexpected_scheduler_message", type=env.type)

    def _release_restored(self, kernel_ids: list[str]) -> None:
        for kernel_id in kernel_ids:
            endpoint = self.kernels.get(kernel_id)
            if endpoint is not None:
                endpoint.release_requests()

    async def _poll_liveness(self) -> None:
        """Backstop for a lost ``kernel.dead`` push: ask the scheduler about each live kernel."""
        while True:
            await asyncio.sleep(self._poll_interval)
            await self._check_liveness([k for k, state in self.states.items() if state == KernelState.ALIVE])

    async def _check_liveness(self, kernel_ids: list[str], *, after: float = 0.0) -> None:
        await asyncio.sleep(after)
        for kernel_id in kernel_ids:
            if self.states.get(kernel_id) != KernelState.ALIVE:
                continue
            try:
                answer = await self.scheduler.request(
                    Envelope(messages.KERNEL_STATUS, {"kernel_id": kernel_id}),
                    timeout=self._request_timeout,
                )
            except RpcError as exc:  # "rebuilding": a restarted scheduler may still adopt it
                if exc.code in ("unknown_kernel", "not_found"):
                    self._mark_dead(kernel_id, f"scheduler does not know the kernel: {exc.reason}")
                    if self._published.pop(kernel_id, None) is not None:  # never restore it again
                        await self._save_table()
                continue
            except RpcTimeout:
                continue
            self._learn_placement(kernel_id, answer.body)
            state = str(answer.body.get("state", "")).lower()
            if state == KernelState.HIBERNATED:  # not dead: hibernated by the operator, or before our restart
                self.states[kernel_id] = KernelState.HIBERNATED
            elif state in ("hibernating", "starting"):  # being saved or resumed: alive for clients
                continue
            elif state in ("stopping", "stopped"):  # a client's own shutdown_request on control
                self._mark_stopped(kernel_id)
            elif scheduler_says_dead(answer.body):
                self._mark_dead(kernel_id, str(answer.body.get("reason") or "scheduler reports it dead"))

    def _in_background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _learn_placement(self, kernel_id: str, status: dict[str, Any]) -> None:
        """Remember replica -> host from a kernel status, to label replies with where they ran."""
        endpoint = self.kernels.get(kernel_id)
        replicas = status.get("replicas")
        if endpoint is None or not isinstance(replicas, list):
            return
        for replica in replicas:
            if isinstance(replica, dict):
                replica_id = replica.get("id", replica.get("replica_id"))
                host = replica.get("host", replica.get("host_id"))
                if isinstance(replica_id, str) and isinstance(host, str):
                    endpoint.replica_hosts[replica_id] = host

    def _refresh_placement_soon(self, kernel_id: str) -> None:
        """A reply named a replica we have not seen (a replacement): ask where it lives."""
        if kernel_id in self._refreshing:
            return
        self._refreshing.add(kernel_id)

        async def refresh() -> None:
            try:
                answer = await self.scheduler.request(
                    Envelope(messages.KERNEL_STATUS, {"kernel_id": kernel_id}), timeout=self._request_timeout
                )
                self._learn_placement(kernel_id, answer.body)
            except (RpcError, RpcTimeout):
                pass
            finally:
                self._refreshing.discard(kernel_id)

        self._in_background(refresh())

    def _mark_stopped(self, kernel_id: str) -> None:
        if self.states.get(kernel_id) != KernelState.ALIVE:
            return
        log.info("kernel_stopped_by_client", kernel=kernel_id)
        self.states[kernel_id] = KernelState.STOPPED
        self.stopped_by[kernel_id] = "client"
        endpoint = self.kernels.get(kernel_id)
        if endpoint is not None:
            endpoint.alive = False

    def _mark_dead(self, kernel_id: str, reason: str) -> None:
        if self.states.get(kernel_id) != KernelState.ALIVE:
            return
        log.warning("kernel_dead", kernel=kernel_id, reason=reason)
        self.states[kernel_id] = KernelState.DEAD
        self.reasons[kernel_id] = reason
        endpoint = self.kernels.get(kernel_id)
        if endpoint is not None:
            endpoint.alive = False


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and wait for ``tasks``, cancelling again any that swallowed it (on Python 3.11,
    ``asyncio.wait_for`` loses a cancellation that lands as its awaitable completes, which left
    a closing gateway waiting for ever on its liveness poller)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)


async def _bind_when_free(endpoint: KernelEndpoint, ports: dict[str, int]) -> None:
    """Bind the kernel's old ports, waiting a moment for any still held by the previous gateway's
    sockets while they close; ``zmq.ZMQError`` if one stays taken."""
    deadline = time.monotonic() + PORTS_FREED_WITHIN_S
    while True:
        try:
            endpoint.bind(ports)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.05)


def scheduler_says_dead(body: dict[str, Any]) -> bool:
    """Tolerant reading of the scheduler's ``kernel.status``: ``alive: false`` or a dead state."""
    if body.get("alive") is False:
        return True
    return str(body.get("state", "")).lower() in ("dead", "failed")


def _now_iso() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat()
