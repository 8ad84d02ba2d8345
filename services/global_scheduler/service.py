"""The global scheduler's asyncio shell: one ROUTER for the gateway, the local schedulers and the CLI.

All decisions live in pure objects (``ClusterState``, ``KernelRouter``/``ReplyMerger``, the
placement and executor-choice policies); this module feeds them messages and the clock and
carries out what they return. The Jupyter forwarding handlers are synchronous so frames are
forwarded in arrival order without a task per message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from services.global_scheduler.cluster_state import (
    DEAD,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    ClusterState,
    KernelRecord,
    ReplicaRecord,
)
from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.reply_merger import Forward
from shared import messages
from shared.config import Config
from shared.envelope import Envelope
from shared.policies.executor_choice import ExecutorChoice, choose_executor
from shared.policies.placement import PlacementRequest, default_placement_policy
from shared.resources import Resources
from shared.rpc import OutboundRequests, RpcError, RpcServer, RpcTimeout

log = structlog.get_logger("global_scheduler")

GATEWAY_IDENTITY = b"gateway"
STOP_TIMEOUT_S = 10.0


class GlobalScheduler:
    def __init__(self, cfg: Config, *, clock: Any = time.monotonic) -> None:
        sched = cfg["scheduler"]
        self._cfg = cfg
        self._clock = clock
        self._heartbeat_timeout = float(sched["heartbeat_timeout_s"])
        self._request_timeout = float(sched["request_timeout_s"])
        self._replica_start_timeout = float(sched["replica_start_timeout_s"])
        self._replicas_per_kernel = int(cfg.get("cluster.replicas_per_kernel"))
        self._policy = default_placement_policy(float(sched["subscription_ratio_watermark"]))
        kernel_defaults = cfg["kernel"]
        self._default_request = {k: kernel_defaults[k] for k in ("millicpus", "memory_mb", "gpus", "vram_gb")}
        self.state = ClusterState(replicas_per_kernel=self._replicas_per_kernel)
        self._ctx = zmq.asyncio.Context()
        self._server = RpcServer(self._ctx, self._handle, name="global_scheduler")
        self._outbound = OutboundRequests(self._server)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sync_handlers = {
            messages.JUPYTER_REQUEST: self._on_jupyter_request,
            messages.JUPYTER_REPLY: self._on_jupyter_reply,
            messages.REPLICA_EVENT: self._on_replica_event,
            messages.HOST_REGISTER: self._on_host_register,
            messages.HOST_HEARTBEAT: self._on_host_heartbeat,
            messages.HOST_CORDON: self._on_cordon,
            messages.HOST_UNCORDON: self._on_cordon,
            messages.CLUSTER_STATUS: self._on_cluster_status,
            messages.KERNEL_STATUS: self._on_kernel_status,
            messages.KERNEL_INTERRUPT: self._on_kernel_interrupt,
        }
        self._async_handlers = {
            messages.KERNEL_START: self._on_kernel_start,
            messages.KERNEL_SHUTDOWN: self._on_kernel_shutdown,
        }

    # ---- lifecycle --------------------------------------------------------------------------

    def bind(self, address: str) -> str:
        return self._server.bind(address)

    @property
    def address(self) -> str:
        return self._server.address

    async def run(self, stop: asyncio.Event) -> None:
        self._server.start()
        monitor = asyncio.ensure_future(self._monitor())
        log.info("started", address=self.address)
        try:
            await stop.wait()
        finally:
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._outbound.cancel_all()
            await self._server.close()
            self._ctx.destroy(linger=0)
            log.info("stopped")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _monitor(self) -> None:
        """Host liveness and request deadlines; the only place the clock drives decisions."""
        period = max(min(self._request_timeout / 4, self._heartbeat_timeout / 4, 0.5), 0.05)
        while True:
            await asyncio.sleep(period)
            try:
                self._check_hosts()
                self._check_deadlines()
            except Exception:
                log.exception("monitor_failed")

    def _check_hosts(self) -> None:
        now = self._clock()
        for host in self.state.silent_hosts(now, self._heartbeat_timeout):
            host.alive = False
            reason = f"host {host.host_id} silent for more than {self._heartbeat_timeout:g}s"
            log.warning("host_dead", host=host.host_id, reason=reason)
            self._outbound.fail_peer(host.identity, reason)
            for kernel, replica in self.state.replicas_on(host.host_id):
                if replica.alive:
                    self._replica_lost(kernel, replica, reason)

    def _check_deadlines(self) -> None:
        now = self._clock()
        for kernel in self.state.kernels.values():
            if kernel.state in (STOPPED, DEAD):
                continue
            forwards, done = kernel.router.expire(now, self._request_timeout)
            if done:
                log.warning("requests_timed_out", kernel=kernel.kernel_id, msg_ids=done)
            self._to_gateway(kernel, forwards)
            self._release(kernel, done)

    # ---- dispatch ---------------------------------------------------------------------------

    def _handle(self, identity: bytes, env: Envelope) -> Any:
        handler = self._sync_handlers.get(env.type)
        if handler is not None:
            return handler(identity, env)
        async_handler = self._async_handlers.get(env.type)
        if async_handler is not None:
            return async_handler(identity, env)
        if env.type in (messages.REPLY, messages.ERROR):
            if not self._outbound.on_answer(env) and env.type == messages.ERROR:
                log.warning("peer_error", peer=identity, reason=env.body.get("reason"))
            return None
        return env.error(f"the global scheduler does not handle {env.type!r}", code="unsupported")

    # ---- Jupyter traffic (hot path) ---------------------------------------------------------

    def _on_jupyter_request(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        kernel = self.state.kernels.get(body["kernel_id"])
        if kernel is None:
            log.warning("request_for_unknown_kernel", kernel=body["kernel_id"], peer=identity)
            return None
        if kernel.state == STARTING:
            log.warning("request_before_kernel_started", kernel=kernel.kernel_id)
        channel: str = body["channel"]
        frames: list[bytes] = body["frames"]
        router = kernel.router

        def choose() -> ExecutorChoice:
            return choose_executor(
                self.state.replica_views(kernel),
                self.state.ledger_views({r.host_id for r in kernel.replicas.values()}),
                kernel.resources.gpus,
                router.last_executor,
            )

        live = kernel.live_replicas()
        routed = router.route_request(channel, frames, live=live, choose=choose, single=self._single(kernel))
        if routed.problem is not None:
            log.warning("request_dropped", kernel=kernel.kernel_id, channel=channel, reason=routed.problem)
            return None
        if routed.to_client:
            self._to_gateway(kernel, routed.to_client)
        if routed.executor is not None:
            self.state.reserve(kernel, routed.msg_id, kernel.replicas[routed.executor].host_id)
        if routed.msg_type == "shutdown_request" and kernel.state in (STARTING, RUNNING):
            kernel.state = STOPPING
            log.info("kernel_stopping", kernel=kernel.kernel_id, by="shutdown_request")
        kernel_id = kernel.kernel_id
        send = self._server.send
        for replica_id, out_channel, out_frames in routed.to_replicas:
            send(
                kernel.replicas[replica_id].host_id.encode(),
                Envelope(
                    messages.JUPYTER_REQUEST,
                    {
                        "kernel_id": kernel_id,
                        "replica_id": replica_id,
                        "channel": out_channel,
                        "frames": out_frames,
                    },
                ),
            )
        return None

    def _single(self, kernel: KernelRecord) -> str | None:
        """The replica for requests answered by one: the last executor (freshest namespace), else
        the Raft leader, else the first live one."""
        last = kernel.router.last_executor
        if last is not None and kernel.replicas.get(last, None) is not None and kernel.replicas[last].alive:
            return last
        for replica in kernel.replicas.values():
            if replica.alive and replica.role == "leader":
                return replica.replica_id
        return None

    def _on_jupyter_reply(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        kernel = self.state.kernels.get(body["kernel_id"])
        replica_id = body.get("replica_id")
        if kernel is None or replica_id is None:
            return None
        merged = kernel.router.on_replica_message(replica_id, body["channel"], body["frames"])
        if merged.forwards:
            self._to_gateway(kernel, merged.forwards)
        if merged.finished:
            self._release(kernel, merged.finished)
        return None

    def _to_gateway(self, kernel: KernelRecord, forwards: list[Forward]) -> None:
        send = self._server.send
        kernel_id = kernel.kernel_id
        for channel, frames in forwards:
            send(
                GATEWAY_IDENTITY,
                Envelope(
                    messages.JUPYTER_REPLY, {"kernel_id": kernel_id, "channel": channel, "frames": frames}
                ),
            )

    def _release(self, kernel: KernelRecord, msg_ids: list[str]) -> None:
        for msg_id in msg_ids:
            self.state.release(kernel, msg_id)

    # ---- replica events ---------------------------------------------------------------------

    def _on_replica_event(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        kernel = self.state.kernels.get(body["kernel_id"])
        replica = kernel.replicas.get(body["replica_id"]) if kernel is not None else None
        if kernel is None or replica is None:
            log.info("event_for_unknown_replica", kernel=body["kernel_id"], replica=body["replica_id"])
            return None
        event = body["event"]
        msg_id = body.get("msg_id")
        detail: dict[str, Any] = body.get("detail") or {}
        blog = log.bind(kernel=kernel.kernel_id, replica=replica.replica_id, host=replica.host_id)
        if event == "elected" and msg_id:
            gpus = detail.get("gpus") or []
            self.state.committed_by_election(kernel, msg_id, replica.host_id, len(gpus))
            merged = kernel.router.on_elected(replica.replica_id, msg_id)
            blog.debug("elected", msg_id=msg_id, gpus=gpus)
            self._to_gateway(kernel, merged.forwards)
            self._release(kernel, merged.finished)
        elif event == "election_failed" and msg_id:
            blog.warning("election_failed", msg_id=msg_id)
            self.state.release(kernel, msg_id)
            merged = kernel.router.on_election_failed(msg_id)
            self._to_gateway(kernel, merged.forwards)
            self._release(kernel, merged.finished)
        elif event == "raft_role":
            role = detail.get("role")
            role = role.lower() if isinstance(role, str) else None
            if role is not None and role != replica.role:
                replica.role = role
                blog.info("raft_role", role=role, term=detail.get("term"))
        elif event == "exited":
            if replica.alive:
                returncode = detail.get("returncode")
                blog.log(
                    20 if kernel.state == STOPPING or detail.get("requested") else 30,
                    "replica_exited",
                    returncode=returncode,
                )
                self._replica_lost(kernel, replica, f"replica {replica.replica_id} exited ({returncode})")
        else:
            blog.debug("replica_event", event=event, msg_id=msg_id)
        return None

    def _replica_lost(self, kernel: KernelRecord, replica: ReplicaRecord, reason: str) -> None:
        replica.alive = False
        replica.role = None
        forwards, done = kernel.router.on_replica_lost(replica.replica_id, reason)
        self._to_gateway(kernel, forwards)
        self._release(kernel, done)
        live = kernel.live_replicas()
        if kernel.state == STOPPING and not live:
            self._mark_stopped(kernel)
        elif kernel.state == RUNNING and len(live) < 2:
            self._mark_dead(kernel, f"{len(live)} of {len(kernel.replicas)} replicas alive: {reason}")

    def _mark_stopped(self, kernel: KernelRecord) -> None:
        kernel.state = STOPPED
        kernel.router.dead_reason = "kernel was shut down"
        forwards, done = kernel.router.fail_all("KernelShutdown", "kernel was shut down")
        self._to_gateway(kernel, forwards)
        self._release(kernel, done)
        log.info("kernel_stopped", kernel=kernel.kernel_id)

    def _mark_dead(self, kernel: KernelRecord, reason: str) -> None:
        kernel.state = DEAD
        kernel.dead_reason = reason
        kernel.router.dead_reason = reason
        forwards, done = kernel.router.fail_all("KernelDead", reason)
        self._to_gateway(kernel, forwards)
        self._release(kernel, done)
        log.error("kernel_dead", kernel=kernel.kernel_id, reason=reason, failed_requests=len(done))
        self._server.send(
            GATEWAY_IDENTITY,
            Envelope(messages.KERNEL_DEAD, {"kernel_id": kernel.kernel_id, "reason": reason}),
        )
        # The survivors cannot form a quorum: stop them rather than leave processes behind.
        for replica in kernel.replicas.values():
            if replica.alive:
                self._spawn(self._stop_replica(kernel, replica))

    # ---- hosts ------------------------------------------------------------------------------

    def _on_host_register(self, identity: bytes, env: Envelope) -> Envelope:
        body = env.body
        host_id = body["host_id"]
        if identity != host_id.encode():
            return env.error(f"host {host_id!r} must register from identity {host_id!r}", code="bad_request")
        try:
            capacity = Resources.from_dict(body["resources"], what="host resources")
        except ValueError as exc:
            return env.error(str(exc), code="bad_request")
        host = self.state.register_host(
            host_id, capacity, body["gpu_kind"], body.get("address", ""), self._clock()
        )
        self._reconcile_host(host_id, body.get("replicas") or [])
        log.info(
            "host_registered",
            host=host_id,
            gpus=capacity.gpus,
            gpu_kind=host.gpu_kind,
            cordoned=host.cordoned,
        )
        return env.reply({"host_id": host_id, "cordoned": host.cordoned})

    def _reconcile_host(self, host_id: str, reported: list[Any]) -> None:
        """Rebuild our view from what a (re)registering host says it runs."""
        running: set[tuple[str, str]] = set()
        for item in reported:
            if not isinstance(item, dict) or not item.get("kernel_id") or not item.get("replica_id"):
                continue
            kernel_id, replica_id = str(item["kernel_id"]), str(item["replica_id"])
            running.add((kernel_id, replica_id))
            kernel = self.state.kernels.get(kernel_id)
            if kernel is None:
                kernel = self._adopt_kernel(item)
                if kernel is None:
                    continue
            if kernel.state in (STOPPED, DEAD, STOPPING):
                replica = kernel.replicas.get(replica_id) or ReplicaRecord(replica_id, host_id)
                kernel.replicas.setdefault(replica_id, replica)
                self._spawn(self._stop_replica(kernel, replica))
                continue
            replica = kernel.replicas.setdefault(replica_id, ReplicaRecord(replica_id, host_id))
            replica.host_id = host_id
            replica.pid = item.get("pid") if isinstance(item.get("pid"), int) else replica.pid
            replica.raft_address = str(item.get("raft_address") or replica.raft_address)
            replica.role = item.get("role") if isinstance(item.get("role"), str) else replica.role
            replica.alive = True
            replica.started = True
        for kernel, replica in self.state.replicas_on(host_id):
            if replica.alive and (kernel.kernel_id, replica.replica_id) not in running and replica.started:
                self._replica_lost(kernel, replica, f"host {host_id} no longer runs it")

    def _adopt_kernel(self, item: dict[str, Any]) -> KernelRecord | None:
        """A kernel we do not know (this scheduler restarted): rebuild it from the host's report."""
        key = item.get("key")
        if not isinstance(key, str):
            return None
        try:
            resources = Resources.from_dict(item.get("resources") or {})
        except ValueError:
            resources = Resources()
        scheme = str(item.get("signature_scheme") or "hmac-sha256")
        kernel_id = str(item["kernel_id"])
        kernel = KernelRecord(
            kernel_id, key, scheme, resources, KernelRouter(kernel_id, key.encode(), scheme)
        )
        kernel.state = RUNNING
        self.state.kernels[kernel_id] = kernel
        log.info("kernel_adopted", kernel=kernel_id)
        return kernel

    def _on_host_heartbeat(self, identity: bytes, env: Envelope) -> Envelope:
        host = self.state.heartbeat(env.body["host_id"], env.body.get("committed"), self._clock())
        if host is None:
            return env.error("unknown host: register first", code="unknown_host")
        return env.reply({"cordoned": host.cordoned})

    def _on_cordon(self, identity: bytes, env: Envelope) -> Envelope:
        host = self.state.hosts.get(env.body["host_id"])
        if host is None:
            return env.error(f"unknown host {env.body['host_id']!r}", code="not_found")
        host.cordoned = env.type == messages.HOST_CORDON
        log.info("host_cordoned" if host.cordoned else "host_uncordoned", host=host.host_id)
        return env.reply({"host_id": host.host_id, "cordoned": host.cordoned})

    def _on_cluster_status(self, identity: bytes, env: Envelope) -> Envelope:
        return env.reply(self.state.cluster_status())

    # ---- kernels ----------------------------------------------------------------------------

    def _on_kernel_status(self, identity: bytes, env: Envelope) -> Envelope:
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            return env.error(f"unknown kernel {env.body['kernel_id']!r}", code="not_found")
        return env.reply(self.state.kernel_status(kernel))

    def _on_kernel_interrupt(self, identity: bytes, env: Envelope) -> Envelope:
        """Out-of-band interrupt: a signed interrupt_request to the executing replica (else all)."""
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            return env.error(f"unknown kernel {env.body['kernel_id']!r}", code="not_found")
        live = kernel.live_replicas()
        executor = kernel.router.current_executor()
        targets = [executor] if executor in live else live
        frames = kernel.router.internal_request("interrupt_request", {})
        for replica_id in targets:
            self._server.send(
                kernel.replicas[replica_id].host_id.encode(),
                Envelope(
                    messages.JUPYTER_REQUEST,
                    {
                        "kernel_id": kernel.kernel_id,
                        "replica_id": replica_id,
                        "channel": "control",
                        "frames": frames,
                    },
                ),
            )
        return env.reply({"replicas": targets})

    async def _on_kernel_start(self, identity: bytes, env: Envelope) -> Envelope:
        body = env.body
        kernel_id: str = body["kernel_id"]
        klog = log.bind(kernel=kernel_id)
        try:
            # Fields the request leaves out come from the [kernel] defaults of the configuration.
            resources = Resources.from_dict({**self._default_request, **body["resources"]})
        except ValueError as exc:
            raise RpcError(str(exc), "bad_request") from None
        existing = self.state.kernels.get(kernel_id)
        if existing is not None:
            if existing.state == RUNNING and existing.key == body["key"]:
                return env.reply(self.state.kernel_status(existing))  # a retried start
            if existing.state in (STARTING, RUNNING, STOPPING):
                raise RpcError(f"kernel {kernel_id} is {existing.state}", "conflict")
        decision = self._policy.place(
            PlacementRequest(kernel_id, resources, self._replicas_per_kernel), self.state.host_views()
        )
        if not decision.ok:
            klog.warning("placement_failed", reasons=decision.explain())
            raise RpcError(
                f"cannot place {self._replicas_per_kernel} replicas: {decision.explain()}", "no_capacity"
            )
        scheme = str(body.get("signature_scheme") or "hmac-sha256")
        key: str = body["key"]
        kernel = KernelRecord(
            kernel_id, key, scheme, resources, KernelRouter(kernel_id, key.encode(), scheme)
        )
        for n, host_id in enumerate(decision.hosts, start=1):
            kernel.replicas[f"r{n}"] = ReplicaRecord(f"r{n}", host_id)
        self.state.kernels[kernel_id] = kernel
        klog.info("placing", hosts=list(decision.hosts), resources=resources.to_dict())
        started = time.monotonic()
        try:
            await _on_every_replica(
                "replica start", kernel, lambda r: self._start_replica(kernel, r), with_host=True
            )
            if kernel.state != STARTING:
                raise RpcError(f"kernel became {kernel.state} while starting", "start_failed")
            peers = {r.replica_id: r.raft_address for r in kernel.replicas.values()}
            await _on_every_replica(
                "replica configure", kernel, lambda r: self._configure_replica(kernel, r, peers)
            )
            if kernel.state != STARTING or len(kernel.live_replicas()) < len(kernel.replicas):
                raise RpcError(f"kernel became {kernel.state} while starting", "start_failed")
        except BaseException as exc:
            klog.error("kernel_start_failed", reason=str(exc))
            kernel.state = DEAD
            kernel.dead_reason = f"start failed: {exc}"
            kernel.router.dead_reason = kernel.dead_reason
            await asyncio.gather(
                *(self._stop_replica(kernel, r) for r in kernel.replicas.values()), return_exceptions=True
            )
            raise
        kernel.state = RUNNING
        klog.info("kernel_started", seconds=round(time.monotonic() - started, 3))
        return env.reply(self.state.kernel_status(kernel))

    async def _start_replica(
        self, kernel: KernelRecord, replica: ReplicaRecord, *, join: bool = False
    ) -> None:
        body = {
            "kernel_id": kernel.kernel_id,
            "replica_id": replica.replica_id,
            "key": kernel.key,
            "signature_scheme": kernel.signature_scheme,
            "resources": kernel.resources.to_dict(),
            "join": join,
        }
        answer = await self._outbound.request(
            replica.host_id.encode(),
            Envelope(messages.REPLICA_START, body),
            timeout=self._replica_start_timeout + 5.0,
        )
        replica.pid = answer.body.get("pid")
        replica.raft_address = str(answer.body.get("raft_address", ""))
        replica.started = True

    async def _configure_replica(
        self, kernel: KernelRecord, replica: ReplicaRecord, peers: dict[str, str]
    ) -> None:
        await self._outbound.request(
            replica.host_id.encode(),
            Envelope(
                messages.REPLICA_CONFIGURE,
                {"kernel_id": kernel.kernel_id, "replica_id": replica.replica_id, "peers": peers},
            ),
            timeout=self._replica_start_timeout,
        )

    async def _stop_replica(self, kernel: KernelRecord, replica: ReplicaRecord) -> None:
        host = self.state.hosts.get(replica.host_id)
        if host is None or not host.alive:
            replica.alive = False
            return
        try:
            await self._outbound.request(
                host.identity,
                Envelope(
                    messages.REPLICA_STOP, {"kernel_id": kernel.kernel_id, "replica_id": replica.replica_id}
                ),
                timeout=STOP_TIMEOUT_S,
            )
        except (RpcError, RpcTimeout) as exc:
            log.warning(
                "replica_stop_failed", kernel=kernel.kernel_id, replica=replica.replica_id, reason=str(exc)
            )
        replica.alive = False

    async def _on_kernel_shutdown(self, identity: bytes, env: Envelope) -> Envelope:
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            return env.reply({"state": STOPPED})  # nothing to stop: shutdown is idempotent
        if kernel.state in (STARTING, RUNNING):
            kernel.state = STOPPING
        log.info("kernel_shutdown", kernel=kernel.kernel_id, restart=env.body.get("restart", False))
        await asyncio.gather(
            *(self._stop_replica(kernel, r) for r in kernel.replicas.values() if r.alive or not r.started),
            return_exceptions=True,
        )
        if kernel.state == STOPPING:
            self._mark_stopped(kernel)
        return env.reply({"state": kernel.state})


async def _on_every_replica(
    what: str,
    kernel: KernelRecord,
    step: Callable[[ReplicaRecord], Awaitable[Any]],
    *,
    with_host: bool = False,
) -> None:
    """Run ``step`` on all of a kernel's replicas at once; one error naming every failure."""
    replicas = list(kernel.replicas.values())
    answers = await asyncio.gather(*(step(r) for r in replicas), return_exceptions=True)
    failures = [
        f"{r.replica_id}@{r.host_id}: {a}" if with_host else f"{r.replica_id}: {a}"
        for r, a in zip(replicas, answers, strict=True)
        if isinstance(a, BaseException)
    ]
    if failures:
        raise RpcError(f"{what} failed: " + "; ".join(failures), "start_failed")
