"""The global scheduler's asyncio shell: one ROUTER for the gateway, the local schedulers and the CLI.

All decisions live in pure objects (``ClusterState``, ``KernelRouter``/``ReplyMerger``, the
placement and executor-choice policies); this module feeds them messages and the clock and
carries out what they return. The Jupyter forwarding handlers are synchronous so frames are
forwarded in arrival order without a task per message.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio

from services.global_scheduler.autoscaling import ClusterAutoscaler
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
from services.global_scheduler.gateway_outbox import GatewayOutbox
from services.global_scheduler.hibernated_file import HibernatedFile
from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.metrics import PrometheusExporter, SchedulerMetrics, cluster_report
from services.global_scheduler.migration import REASON_SCALE_IN, Migrator
from services.global_scheduler.reply_merger import Forward
from services.host_provider import NoHostProvider, make_host_provider
from shared import messages
from shared.cluster_core.core import ClusterCore, CoreConfig
from shared.cluster_core.lifecycle import (
    HIBERNATED,
    HIBERNATING,
    OVER,
    RECOVER,
    REPLACE,
    RETRIED,
    LostReplicaLook,
    RestartBudget,
    RestartLook,
    after_replica_lost,
    keeps_reported_replica,
    rebuilding,
    replicas_may_still_come,
    restart_refusal,
    restartable_in_place,
    shutdown_stops,
    start_verdict,
    stops_on_request,
    tells_members_lost,
    transition,
)
from shared.config import Config, ConfigError
from shared.election_round import election_key, split_election_key
from shared.envelope import Envelope
from shared.kernel_launch import KernelLaunch
from shared.policies.executor_choice import ExecutorChoice
from shared.policies.placement import PlacementRequest
from shared.quorum import majority
from shared.resources import Resources
from shared.rpc import OutboundRequests, RpcClient, RpcError, RpcServer, RpcTimeout
from shared.runner import cancel_and_wait
from shared.security import curve
from shared.security.authorization import scheduler_refusal

if TYPE_CHECKING:
    from shared.raft.tls_ca import ClusterCA

log = structlog.get_logger("global_scheduler")

# a replica writing its namespace image first waits for its last cell's STATE (written behind
# the reply: a large one takes a while), then writes; beyond this the next replica is asked
HIBERNATE_IMAGE_TIMEOUT_S = 150.0
RESUME_ATTEMPTS = 3  # a hibernated kernel's start is tried this often before it is declared dead
RESUME_RETRY_S = 1.0  # times the attempt number, between tries

LIVE_POLICIES = ("notebookos",)


def _reported_pid(body: dict[str, Any]) -> int | None:
    """A host's answer's ``pid``, kept only if it is one: it reaches ``tandem status`` and the
    operator's dashboard, where a host's string is not to be shown as the host wrote it."""
    pid = body.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _call_soon(callback: Callable[[], None]) -> bool:
    """``callback`` later in this loop turn; False outside a running loop (then nothing is run)."""
    try:
        asyncio.get_running_loop().call_soon(callback)
    except RuntimeError:
        return False
    return True


def require_live_policy(cfg: Config) -> None:
    """The baselines (reservation, batch, lcp) are policies of the simulator (``tandem sim``): a
    live cluster asked to run one refuses to start rather than quietly run notebookos."""
    policy = cfg.get("scheduler.policy")
    if policy not in LIVE_POLICIES:
        raise ConfigError(
            f"scheduler.policy = {policy!r} runs only in the simulator (tandem sim --policies {policy}); "
            f"a live cluster runs {', '.join(LIVE_POLICIES)}"
        )


GATEWAY_IDENTITY = b"gateway"
STOP_TIMEOUT_S = 10.0
# Jupyter requests kept per kernel that a restarted scheduler has not adopted yet (its hosts have
# not registered again); beyond this they are dropped with a warning
UNADOPTED_KEPT = 256


class GlobalScheduler:
    def __init__(self, cfg: Config, *, clock: Any = time.monotonic) -> None:
        sched = cfg["scheduler"]
        self._cfg = cfg
        self._raft_ca: ClusterCA | None = None  # once a replica needs a Raft certificate
        self._clock = clock
        self._heartbeat_timeout = float(sched["heartbeat_timeout_s"])
        self._request_timeout = float(sched["request_timeout_s"])
        self._candidate_silence = float(sched["candidate_silence_s"])
        self._replica_start_timeout = float(sched["replica_start_timeout_s"])
        self._stopped_kept = int(sched["stopped_kernels_kept"])
        self._replicas_per_kernel = int(cfg.get("cluster.replicas_per_kernel"))
        self._quorum = majority(self._replicas_per_kernel)  # live replicas a kernel needs to run
        # The decisions the simulator makes too (placement, autoscaling, idle judgement, held-cell
        # retries, lifecycle): one ClusterCore, stepped with this scheduler's clock.
        self.core = ClusterCore(CoreConfig.from_config(cfg))
        self.placement = self.core.placement
        kernel_defaults = cfg["kernel"]
        self._default_request = {k: kernel_defaults[k] for k in ("millicpus", "memory_mb", "gpus", "vram_gb")}
        self.state = ClusterState(replicas_per_kernel=self._replicas_per_kernel)
        self.metrics = SchedulerMetrics(cells_kept=int(cfg.get("metrics.cells_kept")), clock=clock)
        self.autoscaling = ClusterAutoscaler(cfg, self.state, NoHostProvider(), core=self.core, clock=clock)
        self._exporter: PrometheusExporter | None = None
        require_live_policy(cfg)
        self._ctx = zmq.asyncio.Context()
        self._keys_dir = cfg.keys_dir()
        curve.ensure_cluster_keys(self._keys_dir)
        self._authority: curve.CurveAuthority | None = None
        self._server = RpcServer(
            self._ctx,
            self._handle,
            name="global_scheduler",
            mandatory=True,
            curve=curve.server_curve(self._keys_dir, curve.SCHEDULER),
            authorize=self._authorize,
        )
        # pushes to a gateway that is restarting wait for it (gateway_outbox.py)
        self._gateway = GatewayOutbox(
            lambda env: self._server.send(GATEWAY_IDENTITY, env) is not False, soon=_call_soon
        )
        self._outbound = OutboundRequests(self._server)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._migrator = Migrator(self, cfg, clock=clock)
        # scale-in empties an idle host through the same drain as `tandem host drain`
        self.autoscaling.attach_drain(
            lambda host_id: self._migrator.drain(host_id, reason=REASON_SCALE_IN, wait_for_target=False)
        )
        # replicas being restarted in place: their process exits, but that is no loss to replace
        self._restarting: set[tuple[str, str]] = set()
        # automatic in-place restarts: a lost quorum back (after_replica_lost: RECOVER), or a lost
        # replica no other host could take
        self._restarts_in_place = RestartBudget(
            int(sched["restart_in_place_limit"]), float(sched["restart_in_place_window_s"])
        )
        self._started_at = clock()
        # requests for kernels not (yet) adopted since a restart, in arrival order: routed once
        # enough of the kernel's replicas are back, dropped if it never comes back
        self._unadopted: dict[str, list[tuple[str, list[bytes]]]] = {}
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
            messages.HOST_DRAIN: self._on_host_drain,
            messages.REPLICA_RESTART: self._on_replica_restart,
            messages.KERNEL_HIBERNATE: self._on_kernel_hibernate,
            messages.KERNEL_RESUME: self._on_kernel_resume,
        }
        # the serving controller: "a runtime on host H, now" before each replica start
        self._serving: RpcClient | None = None
        if cfg.get("serving.address") and cfg.get("prewarm.policy") != "none":  # else no runtime to promise
            self._serving = RpcClient(
                self._ctx,
                identity=b"scheduler",
                on_message=lambda env: None,
                name="scheduler->serving",
                curve=curve.client_curve(self._keys_dir, curve.SCHEDULER, curve.SERVING),
            )
        self._acquire_timeout = float(cfg.get("serving.acquire_timeout_s"))
        # hibernated kernels survive a restart of this scheduler (no host reports them)
        self._hibernated_file = HibernatedFile(cfg.state_dir() / "scheduler" / "hibernated.json")
        self._adopt_hibernated()
        # hibernated kernels being resumed: the task, and the client requests held until it ends
        self._resumes: dict[str, asyncio.Task[None]] = {}
        self._held_for_resume: dict[str, list[tuple[str, list[bytes]]]] = {}
        # shell requests of a kernel whose quorum is being restored (``_recover_quorum``): sent on
        # once it is back, failed with the kernel's error if it dies instead
        self._held_for_quorum: dict[str, list[list[bytes]]] = {}

    # ---- lifecycle --------------------------------------------------------------------------

    def bind(self, address: str) -> str:
        if self._authority is None:  # admits the cluster's keys before any peer can connect
            self._authority = curve.CurveAuthority.acquire(self._ctx)
            directory = curve.PeerDirectory(self._keys_dir, exclude=(curve.SCHEDULER,))
            self._authority.serve(curve.SCHEDULER, directory)
        return self._server.bind(address)

    def _authorize(self, principal: str, identity: bytes, env: Envelope) -> str | None:
        """Who the peer's key says it is decides what it may send (shared/security/authorization)."""
        if (principal == curve.GATEWAY) != (identity == GATEWAY_IDENTITY):
            return f"{principal or 'anonymous'} may not use the routing identity {identity!r}"
        host = curve.host_of(principal)
        if host is not None and identity != host.encode():
            return f"{principal} may not use the routing identity {identity!r}"
        return scheduler_refusal(principal, env.type, env.body, self._host_of_replica)

    def _host_of_replica(self, kernel_id: str, replica_id: str) -> str | None:
        kernel = self.state.kernels.get(kernel_id)
        replica = kernel.replicas.get(replica_id) if kernel is not None else None
        return replica.host_id if replica is not None else None

    @property
    def address(self) -> str:
        return self._server.address

    async def run(self, stop: asyncio.Event) -> None:
        self._server.start()
        monitor = asyncio.ensure_future(self._monitor())
        self.autoscaling.attach_provider(
            make_host_provider(  # hosts it starts run on this machine: its ipc endpoint, if bound
                self._cfg,
                scheduler_address=self._server.local_address or self.address,
                on_exit=self.autoscaling.on_host_exited,
            )
        )
        autoscale = asyncio.ensure_future(self.autoscaling.run())
        self._start_exporter()
        if self._serving is not None:
            self._serving.connect(str(self._cfg.get("serving.address")))
        log.info("started", address=self.address)
        try:
            await stop.wait()
        finally:
            await cancel_and_wait([monitor, autoscale])
            if self._exporter is not None:
                self._exporter.stop()
            await self.autoscaling.provider.close()
            await cancel_and_wait(list(self._tasks))
            self._outbound.cancel_all()
            if self._serving is not None:
                await self._serving.close()
            await asyncio.to_thread(self._migrator.close)
            await self._server.close()
            if self._authority is not None:
                self._authority.release()
            self._ctx.destroy(linger=0)
            log.info("stopped")

    def _start_exporter(self) -> None:
        port = int(self._cfg.get("metrics.prometheus_port"))
        if port == 0:
            return
        address = str(self._cfg.get("metrics.prometheus_address"))
        exporter = PrometheusExporter(self._status, asyncio.get_running_loop(), self.metrics)
        try:
            exporter.start(address, port)
        except OSError as exc:  # scheduling goes on without /metrics
            log.error("metrics_unavailable", reason=f"cannot serve /metrics on {address}:{port}: {exc}")
            self.metrics.on_cell_completed = None
            self.metrics.on_replica_timings = None
            return
        self._exporter = exporter
        log.info("metrics_listening", url=self.metrics_url)

    @property
    def metrics_url(self) -> str | None:
        if self._exporter is None or not self._exporter.port:
            return None
        return f"http://{self._cfg.get('metrics.prometheus_address')}:{self._exporter.port}/metrics"

    async def ask_host(self, host_id: str, env: Envelope, timeout: float) -> Envelope:
        """One request to a host's local scheduler (or a replica through it); its answer."""
        return await self._outbound.request(host_id.encode(), env, timeout=timeout)

    def spawn(self, coro: Any) -> None:
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
                self._migrator.resume_restored(
                    rebuilding=self._rebuilding(), replicas=self.state.replicas_per_kernel
                )
                if self._unadopted:
                    self._route_unadopted()
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
            for replica_id, channel, frames in kernel.router.ask_the_others(
                now, self._candidate_silence, kernel.live_replicas()
            ):
                log.warning("candidate_silent", kernel=kernel.kernel_id, asking=replica_id)
                self._to_replica(kernel, replica_id, channel, frames)
            forwards, done = kernel.router.expire(now, self._request_timeout)
            if done:
                log.warning("requests_timed_out", kernel=kernel.kernel_id, msg_ids=done)
            self.to_gateway(kernel, forwards)
            self._release(kernel, done)

    # ---- dispatch ---------------------------------------------------------------------------

    def _handle(self, identity: bytes, env: Envelope) -> Any:
        if identity == GATEWAY_IDENTITY and self._gateway.waiting:
            self._gateway.gateway_seen()
        handler = self._sync_handlers.get(env.type)
        if handler is not None:
            return handler(identity, env)
        async_handler = self._async_handlers.get(env.type)
        if async_handler is not None:
            return async_handler(identity, env)
        if env.type in (messages.REPLY, messages.ERROR):
            if not self._outbound.on_answer(env, identity) and env.type == messages.ERROR:
                log.warning("peer_error", peer=identity, reason=env.body.get("reason"))
            return None
        return env.error(f"the global scheduler does not handle {env.type!r}", code="unsupported")

    # ---- Jupyter traffic (hot path) ---------------------------------------------------------

    def _on_jupyter_request(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        kernel_id = body["kernel_id"]
        kernel = self.state.kernels.get(kernel_id)
        if kernel_id in self._unadopted or (kernel is None and self._rebuilding()):
            self._keep_until_adopted(kernel_id, body["channel"], body["frames"])
            return None
        if kernel is None:
            log.warning("request_for_unknown_kernel", kernel=kernel_id, peer=identity)
            return None
        if kernel.state in (HIBERNATING, HIBERNATED) or kernel.kernel_id in self._resumes:
            self._held_for_resume.setdefault(kernel_id, []).append((body["channel"], body["frames"]))
            if kernel.state == HIBERNATED:
                self._resume_soon(kernel)  # else when its hibernation or resume ends
            return None
        if kernel.state == STARTING:
            log.warning("request_before_kernel_started", kernel=kernel.kernel_id)
        if kernel.recovering is not None and body["channel"] == "shell":
            self._held_for_quorum.setdefault(kernel_id, []).append(body["frames"])
            return None
        self.route_from_gateway(kernel, body["channel"], body["frames"])
        return None

    def _rebuilding(self) -> bool:
        """Whether this (restarted) scheduler is in its rebuilding window now (the core decides:
        ``lifecycle.rebuilding``)."""
        return rebuilding(self._clock(), self._started_at, self._heartbeat_timeout)

    def _replicas_may_still_come(self, kernel: KernelRecord) -> bool:
        return replicas_may_still_come(kernel.alive, kernel.state, rebuilding=self._rebuilding())

    def _keep_until_adopted(self, kernel_id: str, channel: str, frames: list[bytes]) -> None:
        """A request for a kernel this restarted scheduler has not adopted yet (the gateway's
        link queued it while no scheduler ran, or sent it before the kernel's hosts registered
        again): dropping it would leave its client waiting for ever. Later requests of the same
        kernel queue behind it, so the kernel sees them in order."""
        waiting = self._unadopted.setdefault(kernel_id, [])
        if len(waiting) >= UNADOPTED_KEPT:
            log.warning("request_dropped_while_rebuilding", kernel=kernel_id, kept=len(waiting))
            return
        waiting.append((channel, frames))
        log.info("request_kept_until_adopted", kernel=kernel_id, waiting=len(waiting))

    def _route_unadopted(self) -> None:
        """Route the kept requests of each kernel that has a quorum of its replicas back; once the
        rebuilding window is over, also those of kernels back with fewer (they get the kernel's
        own answer, dead or not) and drop those of kernels that never came back (the gateway
        then finds the kernel unknown and reports it dead to its client)."""
        rebuilding = self._rebuilding()
        for kernel_id in list(self._unadopted):
            kernel = self.state.kernels.get(kernel_id)
            if kernel is None:
                if not rebuilding:
                    dropped = self._unadopted.pop(kernel_id)
                    log.warning("requests_for_unknown_kernel", kernel=kernel_id, dropped=len(dropped))
                continue
            if rebuilding and self._replicas_may_still_come(kernel):
                continue
            waiting = self._unadopted.pop(kernel_id)
            log.info("kept_requests_routed", kernel=kernel_id, requests=len(waiting))
            for channel, frames in waiting:
                self.route_from_gateway(kernel, channel, frames)

    def route_from_gateway(
        self, kernel: KernelRecord, channel: str, frames: list[bytes], *, rerouted: bool = False
    ) -> None:
        """Route one client message of ``kernel`` (also what a held request is sent on through).
        ``rerouted``: a cell sent again because its designated executor died before starting it."""
        if self.core.queues_behind_held(channel, kernel.held is not None):  # behind a migrating cell
            kernel.held.append(frames)
            self._migrator.persist(kernel)
            return None
        router = kernel.router
        chosen: list[ExecutorChoice] = []  # the victims travel with the designation (one decision)

        def choose() -> ExecutorChoice:
            choice = self.core.executor_for(
                self.state.routable_views(kernel),
                self.state.ledger_views({r.host_id for r in kernel.replicas.values()}),
                kernel.resources.gpus,
                router.last_executor,
                pinned=router.debug_replica or kernel.pinned,
            )
            chosen.append(choice)
            return choice

        arrived = self._clock() if channel == "shell" else 0.0
        live = kernel.live_replicas()
        staying = [r for r in live if not kernel.replicas[r].leaving]
        live = staying or live  # a replica leaving would refuse the request
        routed = router.route_request(channel, frames, live=live, choose=choose, single=self._single(kernel))
        if routed.problem is not None:
            log.warning("request_dropped", kernel=kernel.kernel_id, channel=channel, reason=routed.problem)
            if routed.to_client:  # a signed request a kernel could not answer: the error reply
                self.to_gateway(kernel, routed.to_client)
            return None
        if routed.msg_type == "execute_request" and routed.to_replicas:
            log.debug(
                "execute_routed",
                kernel=kernel.kernel_id,
                msg_id=routed.msg_id,
                executor=routed.executor,
                rerouted=rerouted,
            )
        if routed.msg_type == "execute_request" and routed.to_replicas and not rerouted:
            self.metrics.cell_submitted(
                kernel.kernel_id, routed.msg_id, arrived, routed.executor, kernel.resources.gpus > 0
            )
        holds = self.core.holds_cell(
            routed.msg_type, routed.executor is not None, bool(routed.to_replicas), kernel.state
        )
        if holds and self._migrator.hold(kernel, routed.msg_id, frames):
            return None  # no replica can run it now: migration (services/global_scheduler/migration.py)
        if routed.to_client:
            self.to_gateway(kernel, routed.to_client)
        if routed.executor is not None:
            self.state.reserve(kernel, routed.msg_id, kernel.replicas[routed.executor].host_id)
        if self.core.interrupt_ends_held(routed.msg_type, kernel.held is not None):
            self._migrator.interrupt(kernel)
        if stops_on_request(routed.msg_type, kernel.state):
            transition(kernel, STOPPING)
            log.info("kernel_stopping", kernel=kernel.kernel_id, by="shutdown_request")
        for replica_id, out_channel, out_frames in routed.to_replicas:
            # The executor's local scheduler binds the GPUs as it forwards; designated, it may
            # start the cell before its LEAD commits. Not a rerouted cell: the dead candidate's
            # LEAD may still be on its way into the log, so the new one waits for the outcome.
            designated = not rerouted if replica_id == routed.executor else None
            victims = [v.job_id for v in chosen[-1].victims] if chosen and designated is not None else []
            self._to_replica(
                kernel, replica_id, out_channel, out_frames, designated=designated, revoke=victims
            )
        return None

    def _to_replica(
        self,
        kernel: KernelRecord,
        replica_id: str,
        channel: str,
        frames: list[bytes],
        *,
        designated: bool | None = None,
        revoke: list[str] | None = None,
    ) -> None:
        """One Jupyter message to a replica, through its host's local scheduler; ``revoke``: the
        jobs whose leases the designated executor's host suspends for the cell (FitGpp's victims)."""
        body: dict[str, Any] = {
            "kernel_id": kernel.kernel_id,
            "replica_id": replica_id,
            "channel": channel,
            "frames": frames,
        }
        if designated is not None:
            body["designated"] = designated
        if revoke:
            body["revoke"] = revoke
        self._server.send(
            kernel.replicas[replica_id].host_id.encode(), Envelope(messages.JUPYTER_REQUEST, body)
        )

    def _single(self, kernel: KernelRecord) -> str | None:
        """The replica for requests answered by one (the core's ``single_replica``)."""
        return self.core.single_replica(self.state.routable_views(kernel), kernel.router.last_executor)

    def _on_jupyter_reply(self, identity: bytes, env: Envelope) -> None:
        body = env.body
        kernel = self.state.kernels.get(body["kernel_id"])
        replica_id = body.get("replica_id")
        if kernel is None or replica_id is None:
            return None
        forwards: list[Forward] = []  # what this envelope's messages give the client: one push
        for channel, frames in messages.jupyter_messages(body):
            merged = kernel.router.on_replica_message(replica_id, channel, frames)
            for msg_id in merged.no_executor:  # its NoExecutorAvailable / GpuUnavailable is held back
                if forwards:  # a migration may tell the client something: after what came first
                    self.to_gateway(kernel, forwards)
                    forwards = []
                self._migrate_without_executor(kernel, msg_id, "its executor could not bind the GPUs")
            forwards += merged.forwards
            if merged.finished:
                self._release(kernel, merged.finished)
            for msg_id, cell in merged.declined:  # its replica is leaving: another one runs it
                if forwards:  # what came first reaches the client first
                    self.to_gateway(kernel, forwards)
                    forwards = []
                if (decliner := kernel.replicas.get(replica_id)) is not None:
                    decliner.leaving = True
                self.state.release(kernel, msg_id)
                log.info("cell_rerouted", kernel=kernel.kernel_id, msg_id=msg_id, declined=replica_id)
                self.route_from_gateway(kernel, "shell", cell, rerouted=True)
        if forwards:
            self.to_gateway(kernel, forwards)
        return None

    def to_gateway(self, kernel: KernelRecord, forwards: list[Forward]) -> None:
        """``forwards`` go with whatever else this loop turn sends the kernel's client: every
        envelope costs each hop a CURVE box and a decode (gateway_outbox.py)."""
        self._gateway.forward(kernel.kernel_id, forwards)

    def _release(self, kernel: KernelRecord, msg_ids: list[str]) -> None:
        for msg_id in msg_ids:
            self.state.release(kernel, msg_id)
        if msg_ids:
            self.metrics.requests_finished(kernel.kernel_id, msg_ids)
            if kernel.exit_after in msg_ids:
                self._stop_on_exit(kernel)

    def _on_exit_asked(self, kernel: KernelRecord, msg_id: str | None) -> None:
        """The notebook called exit() (``replica.event exit`` from the executor). A kernel process
        would end there; ipykernel ended only the executor, and the next cell ran on a standby with
        every variable the notebook asked to drop. The whole kernel stops, once the cell's reply
        (with ipykernel's ``ask_exit`` payload) has gone by, as a client's ``shutdown_request``
        stops it: the gateway then reports it stopped by the client, and a client with a
        restarter (Jupyter Server's) starts it fresh, as after a kernel process exits."""
        log.info("kernel_exit_asked", kernel=kernel.kernel_id, msg_id=msg_id)
        if msg_id and kernel.router.is_open_cell(msg_id):
            kernel.exit_after = msg_id  # the event overtook the reply: stop when it goes by
            return
        self._stop_on_exit(kernel)

    def _stop_on_exit(self, kernel: KernelRecord) -> None:
        kernel.exit_after = None
        if shutdown_stops(kernel.state):
            self.spawn(self._shutdown(kernel, restart=False, by="exit()"))

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
        if isinstance(msg_id, str) and msg_id:  # a cell sent again is elected under its round's key
            msg_id, round_ = split_election_key(msg_id)
            if event in ("elected", "election_failed") and round_ != kernel.router.round_of(msg_id):
                blog.info("earlier_round_event_ignored", msg_id=msg_id, replica_event=event, round=round_)
                return None
        if event == "elected" and msg_id:
            gpus = detail.get("gpus") or []
            if kernel.router.is_open_cell(msg_id):
                self.state.committed_by_election(
                    kernel, msg_id, replica.host_id, list(gpus), replica.replica_id
                )
            else:
                # The reply overtook this event (a replica that takes GPUs bound ahead announces
                # itself on its scheduler link, the reply comes on its Jupyter socket): the cell
                # is over and its GPUs were released as the reply went by. Recording the commit
                # now would show the host busy until its next heartbeat.
                blog.debug("elected_after_reply", msg_id=msg_id)
            self.metrics.cell_elected(kernel.kernel_id, msg_id, replica.replica_id, replica.host_id)
            merged = kernel.router.on_elected(replica.replica_id, msg_id)
            blog.debug("elected", msg_id=msg_id, gpus=gpus)
            self.to_gateway(kernel, merged.forwards)
            self._release(kernel, merged.finished)
        elif event == "election_failed" and msg_id:
            blog.warning("election_failed", msg_id=msg_id)
            if self._migrate_without_executor(kernel, msg_id, "every replica yielded"):
                return None
            self.metrics.cell_not_committed(kernel.kernel_id, msg_id)
            self.state.release(kernel, msg_id)
            merged = kernel.router.on_election_failed(msg_id)
            self.to_gateway(kernel, merged.forwards)
            self._release(kernel, merged.finished)
        elif event == "cell_timings" and msg_id:
            self.metrics.cell_timings(kernel.kernel_id, msg_id, replica.replica_id, body.get("detail"))
        elif event == "cell_timings":  # a batch (kernel_replica.scheduler_link.SchedulerLink.cell_timings)
            cells = detail.get("cells")
            if not isinstance(cells, list):
                blog.warning("cell_timings_dropped", reason="a batch needs detail.cells, a list")
                return None
            for cell in cells:
                key = cell.get("msg_id") if isinstance(cell, dict) else None
                if not isinstance(key, str) or not key:
                    blog.warning("cell_timings_dropped", reason="a batched cell needs its msg_id")
                    continue
                steps = {k: v for k, v in cell.items() if k != "msg_id"}
                self.metrics.cell_timings(
                    kernel.kernel_id, split_election_key(key)[0], replica.replica_id, steps
                )
        elif event == "pinned":  # ``%tandem pin`` / ``%tandem unpin`` ran on this replica
            at = detail.get("at")
            self._pin(
                kernel, replica.replica_id, detail.get("pinned"), at if isinstance(at, int | float) else 0.0
            )
            blog.info("kernel_pinned" if kernel.pinned else "kernel_unpinned")
        elif event == "exit":
            self._on_exit_asked(kernel, msg_id)
        elif event == "leaving":
            replica.leaving = True
            blog.warning("replica_leaving", msg_id=msg_id)
        elif event == "executor_quiet" and msg_id:
            executor = kernel.replicas.get(str(detail.get("executor")))
            if executor is None or executor is replica or not executor.alive:
                blog.info("executor_quiet_ignored", msg_id=msg_id, executor=detail.get("executor"))
                return None
            self.spawn(self._vouch_for_executor(kernel, replica, executor, msg_id))
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
                started = [  # what the replicas elected them under (a retried cell: its round's key)
                    election_key(m, kernel.router.round_of(m))
                    for m in kernel.router.merger.executing_on(replica.replica_id)
                ]
                self._replica_lost(kernel, replica, f"replica {replica.replica_id} exited ({returncode})")
                restarting = (kernel.kernel_id, replica.replica_id) in self._restarting
                if tells_members_lost(kernel.state, restarting=restarting):
                    self._tell_members_lost(kernel, replica.replica_id, started)
        else:
            blog.debug("replica_event", replica_event=event, msg_id=msg_id)
        return None

    async def _vouch_for_executor(
        self, kernel: KernelRecord, asker: ReplicaRecord, executor: ReplicaRecord, msg_id: str
    ) -> None:
        """``asker`` has not heard ``executor`` run ``msg_id`` for half its silence limit. User
        code can hold the GIL in one C call for minutes (a regex, a big integer, a pickle), and no
        thread of the executor beats meanwhile: if its host says its process runs, ``asker`` is
        told so and keeps waiting (``ElectionCore.executor_busy``). A stopped, exited or
        unreachable executor is not vouched for: the standby gives the cell up when the silence
        runs out, as before."""
        ids = {"kernel_id": kernel.kernel_id, "replica_id": executor.replica_id}
        try:
            answer = await self._outbound.request(
                executor.host_id.encode(), Envelope(messages.REPLICA_PROCESS, ids), timeout=2.0
            )
            state = str(answer.body.get("state"))
        except (RpcError, RpcTimeout) as exc:
            state = f"unknown: {exc}"
        log.info(
            "executor_quiet", kernel=kernel.kernel_id, executor=executor.replica_id, asker=asker.replica_id,
            msg_id=msg_id, state=state,
        )  # fmt: skip
        if state != "running" or not asker.alive:
            return
        body = {
            "kernel_id": kernel.kernel_id,
            "replica_id": asker.replica_id,
            "action": "busy",
            "member": executor.replica_id,
        }
        try:
            await self._outbound.request(
                asker.host_id.encode(), Envelope(messages.REPLICA_MEMBERSHIP, body), timeout=5.0
            )
        except (RpcError, RpcTimeout) as exc:  # it gives the cell up when the silence runs out
            log.info(
                "executor_busy_not_told", kernel=kernel.kernel_id, replica=asker.replica_id, reason=str(exc)
            )

    def _migrate_without_executor(self, kernel: KernelRecord, msg_id: str, why: str) -> bool:
        """NotebookOS §3.2.3: a GPU cell whose executor could not get the GPUs although our ledger
        said its host could (every replica yielded, or the designated one's local scheduler
        refused to bind: its ledger disagreed) goes through migration and is sent again as a new
        election round, instead of its NoExecutorAvailable / GpuUnavailable reaching the client.
        False when it is not such a cell (0 GPUs: the error goes through; no longer pending)."""
        if not self.core.migrates_after_failed_election(kernel.resources.gpus):
            return False
        refused_on = kernel.reserved_on.get(msg_id)
        retry = kernel.router.retry(msg_id)
        if retry is None:
            return False
        frames, round_, busy_sent = retry
        log.warning(
            "cell_without_executor",
            kernel=kernel.kernel_id,
            msg_id=msg_id,
            reason=why,
            designated_host=refused_on,
            next_round=round_,
        )
        self.metrics.cell_not_committed(kernel.kernel_id, msg_id)
        self.state.release(kernel, msg_id)
        self._migrator.hold_failed_election(kernel, msg_id, frames, round_=round_, busy_sent=busy_sent)
        return True

    def _replica_lost(self, kernel: KernelRecord, replica: ReplicaRecord, reason: str) -> None:
        replica.alive = False
        replica.leaving = False  # gone now; restarted in place, it is a fresh process
        replica.role = None
        forwards, done, resend, ask = kernel.router.on_replica_lost(
            replica.replica_id, reason, kernel.live_replicas()
        )
        self.to_gateway(kernel, forwards)
        self._release(kernel, done)
        for replica_id, channel, frames in ask:  # cells it was running: their outcome, from the log
            log.info("outcome_asked", kernel=kernel.kernel_id, replica=replica_id, lost=replica.replica_id)
            self._to_replica(kernel, replica_id, channel, frames)
        live = kernel.live_replicas()
        restarting = (kernel.kernel_id, replica.replica_id) in self._restarting
        restartable = self._restartable(kernel) if len(live) < self._quorum else []
        verdict = after_replica_lost(
            kernel.state, len(live), self._quorum, restarting=restarting, restartable=len(restartable)
        )
        if verdict == STOPPED:
            self._mark_stopped(kernel)
        elif verdict == DEAD:
            self._mark_dead(kernel, f"{len(live)} of {len(kernel.replicas)} replicas alive: {reason}")
        elif verdict == RECOVER:
            self._recover_quorum(kernel, restartable, reason)
        elif verdict == REPLACE:
            self._migrator.on_replica_lost(kernel, replica, reason)
        for msg_id, frames in resend:  # cells it was designated for and had not started
            self.state.release(kernel, msg_id)
            log.info("cell_rerouted", kernel=kernel.kernel_id, msg_id=msg_id, lost=replica.replica_id)
            self.route_from_gateway(kernel, "shell", frames, rerouted=True)

    def is_restarting(self, kernel_id: str, replica_id: str) -> bool:
        return (kernel_id, replica_id) in self._restarting

    def _restartable(self, kernel: KernelRecord) -> list[ReplicaRecord]:
        """The kernel's lost replicas an in-place restart can bring back (``restartable_in_place``)."""
        now = self._clock()
        out: list[ReplicaRecord] = []
        for r in kernel.replicas.values():
            key = (kernel.kernel_id, r.replica_id)
            host = self.state.hosts.get(r.host_id)
            look = LostReplicaLook(
                r.alive,
                r.started,
                host is not None and host.alive,
                self._migrator.is_replacing(*key),
                key in self._restarting,
            )
            if restartable_in_place(look, within_budget=self._restarts_in_place.allows(key, now)):
                out.append(r)
        return out

    async def restart_lost_in_place(self, kernel: KernelRecord, replica_id: str) -> None:
        """A lost replica no other host could take (its replacement gave up): restart it on its
        own host, if that host is alive and its restart budget allows, rather than leave the
        kernel one replica short until its next loss."""
        replica = kernel.replicas.get(replica_id)
        if replica is not None and kernel.state == RUNNING and replica in self._restartable(kernel):
            await self._restart_automatically(kernel, replica)

    def _recover_quorum(self, kernel: KernelRecord, replicas: list[ReplicaRecord], reason: str) -> None:
        """Below a quorum through replicas whose processes exited on live hosts: restart them in
        place (same Raft members, their logs on disk; a cell one of them was running is never run
        again: its ExecutorLost is committed once the group has a quorum) instead of declaring the
        kernel dead. Shell requests sent meanwhile are held until the quorum is back."""
        names = [r.replica_id for r in replicas]
        log.warning("kernel_below_quorum_restarting", kernel=kernel.kernel_id, replicas=names, reason=reason)
        kernel.recovering = kernel.recovering or reason
        for r in replicas:
            self.spawn(self._restart_automatically(kernel, r))

    async def _restart_automatically(self, kernel: KernelRecord, replica: ReplicaRecord) -> None:
        """One in-place restart the scheduler decided on itself, charged to the replica's budget
        (none when one is already under way: it is coming back). ``restart_in_place`` settles a
        recovering kernel either way."""
        key = (kernel.kernel_id, replica.replica_id)
        if key in self._restarting:
            return
        self._restarts_in_place.spend(key, self._clock())
        try:
            await self.restart_in_place(kernel, replica)
        except (RpcError, RpcTimeout) as exc:
            log.warning(
                "automatic_restart_failed",
                kernel=kernel.kernel_id,
                replica=replica.replica_id,
                reason=str(exc),
            )

    def _settle_recovery(self, kernel: KernelRecord, why: str) -> None:
        """After a restart in place ended: a recovering kernel with its quorum back goes on; one
        still below it with no restart left under way is dead (``why``: what the last one did)."""
        if kernel.recovering is None or kernel.state != RUNNING:
            return
        live = kernel.live_replicas()
        if len(live) >= self._quorum:
            log.info("kernel_quorum_back", kernel=kernel.kernel_id, live=live)
            self._recovered(kernel)
        elif not any(k == kernel.kernel_id for k, _ in self._restarting):
            self._mark_dead(
                kernel, f"{len(live)} of {len(kernel.replicas)} replicas alive: {kernel.recovering}; {why}"
            )

    def _recovered(self, kernel: KernelRecord) -> None:
        """The kernel's recovery is over (its quorum is back, or it stopped or died): the shell
        requests held meanwhile go on, in order; a stopped or dead kernel's router answers each
        with its error."""
        kernel.recovering = None
        held = self._held_for_quorum.pop(kernel.kernel_id, [])
        if held:
            log.info("held_requests_routed", kernel=kernel.kernel_id, requests=len(held), state=kernel.state)
        for frames in held:
            self.route_from_gateway(kernel, "shell", frames)

    def _tell_members_lost(self, kernel: KernelRecord, lost: str, started: list[str]) -> None:
        """The surviving replicas hear at once that ``lost``'s process died, so a cell it was
        running (``started``: it announced itself elected, its LEAD won) or the STATE it
        still owed is given up now rather than after a silence timeout, and never run again."""

        async def tell(survivor: ReplicaRecord) -> None:
            body = {
                "kernel_id": kernel.kernel_id,
                "replica_id": survivor.replica_id,
                "action": "lost",
                "member": lost,
                "cells": started,
            }
            try:
                await self._outbound.request(
                    survivor.host_id.encode(), Envelope(messages.REPLICA_MEMBERSHIP, body), timeout=5.0
                )
            except (RpcError, RpcTimeout) as exc:  # it learns from the silence timeout instead
                log.info(
                    "member_lost_not_told",
                    kernel=kernel.kernel_id,
                    replica=survivor.replica_id,
                    reason=str(exc),
                )

        for survivor in kernel.replicas.values():
            if survivor.alive and survivor.started and survivor.replica_id != lost:
                self.spawn(tell(survivor))

    def _mark_stopped(self, kernel: KernelRecord) -> None:
        transition(kernel, STOPPED)
        self._restarts_in_place.forget(kernel.kernel_id)
        kernel.router.dead_reason = "kernel was shut down"
        forwards, done = kernel.router.fail_all("KernelShutdown", "kernel was shut down")
        self.to_gateway(kernel, forwards)
        self._release(kernel, done)
        self._recovered(kernel)
        log.info("kernel_stopped", kernel=kernel.kernel_id)
        self._forget_oldest_stopped()

    def _forget_oldest_stopped(self) -> None:
        """Keep the records of the last ``scheduler.stopped_kernels_kept`` stopped kernels (for
        ``tandem status --all``); older ones would only grow the scheduler's memory."""
        stopped = [k.kernel_id for k in self.state.kernels.values() if k.state == STOPPED]
        for kernel_id in stopped[: max(0, len(stopped) - self._stopped_kept)]:
            del self.state.kernels[kernel_id]

    def _mark_dead(self, kernel: KernelRecord, reason: str) -> None:
        transition(kernel, DEAD)
        self._restarts_in_place.forget(kernel.kernel_id)
        kernel.dead_reason = reason
        kernel.router.dead_reason = reason
        forwards, done = kernel.router.fail_all("KernelDead", reason)
        self.to_gateway(kernel, forwards)
        self._release(kernel, done)
        self._recovered(kernel)  # requests held for its quorum get the same error
        log.error("kernel_dead", kernel=kernel.kernel_id, reason=reason, failed_requests=len(done))
        self._gateway.push(Envelope(messages.KERNEL_DEAD, {"kernel_id": kernel.kernel_id, "reason": reason}))
        # The survivors cannot form a quorum: stop them rather than leave processes behind.
        for replica in kernel.replicas.values():
            if replica.alive:
                self.spawn(self.stop_replica(kernel, replica))

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
        self._migrator.resume_restored(rebuilding=self._rebuilding(), replicas=self.state.replicas_per_kernel)
        if self._unadopted:
            self._route_unadopted()
        self.autoscaling.on_host_registered(host_id)
        log.info(
            "host_registered",
            host=host_id,
            gpus=capacity.gpus,
            gpu_kind=host.gpu_kind,
            cordoned=host.cordoned,
        )
        # batch: it may send its Jupyter replies and replica events as ``batch`` envelopes
        return env.reply({"host_id": host_id, "cordoned": host.cordoned, "batch": True})

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
            if self._migrator.retired(kernel_id, replica_id):  # moved away while its host was unreachable
                self.spawn(self.stop_replica(kernel, ReplicaRecord(replica_id, host_id, alive=False)))
                continue
            if not keeps_reported_replica(kernel.state):
                replica = kernel.replicas.get(replica_id) or ReplicaRecord(replica_id, host_id)
                kernel.replicas.setdefault(replica_id, replica)
                self.spawn(self.stop_replica(kernel, replica))
                continue
            replica = kernel.replicas.setdefault(replica_id, ReplicaRecord(replica_id, host_id))
            replica.host_id = host_id
            replica.pid = item.get("pid") if isinstance(item.get("pid"), int) else replica.pid
            replica.raft_address = str(item.get("raft_address") or replica.raft_address)
            replica.role = item.get("role") if isinstance(item.get("role"), str) else replica.role
            pin = item.get("pin")
            if isinstance(pin, list) and len(pin) == 2 and isinstance(pin[1], int | float):
                self._pin(kernel, replica_id, pin[0], float(pin[1]))
            replica.alive = True
            replica.started = True
        for kernel, replica in self.state.replicas_on(host_id):
            if replica.alive and (kernel.kernel_id, replica.replica_id) not in running and replica.started:
                self._replica_lost(kernel, replica, f"host {host_id} no longer runs it")

    @staticmethod
    def _pin(kernel: KernelRecord, replica_id: str, pinned: Any, at: float) -> None:
        """A replica's ``%tandem pin`` (``pinned`` True) or ``unpin`` made at ``at``: the latest
        one wins, also when a restarted scheduler learns them from its hosts' reports."""
        if not isinstance(pinned, bool) or at < kernel.pinned_at:
            return
        kernel.pinned_at = at
        kernel.pinned = replica_id if pinned else None

    def _adopt_kernel(self, item: dict[str, Any]) -> KernelRecord | None:
        """A kernel we do not know (this scheduler restarted): rebuild it from the host's report."""
        key = item.get("key")
        if not isinstance(key, str):
            return None
        try:
            resources = Resources.from_dict(item.get("resources") or {})
        except ValueError:
            resources = Resources()
        try:
            launch = KernelLaunch.from_wire(item.get("launch"))
        except ValueError:
            launch = KernelLaunch()  # from a host of an older version: its replicas already run
        scheme = str(item.get("signature_scheme") or "hmac-sha256")
        kernel_id = str(item["kernel_id"])
        kernel = KernelRecord(
            kernel_id,
            key,
            scheme,
            resources,
            KernelRouter(kernel_id, key.encode(), scheme, quorum=self._quorum),
        )
        kernel.router.migrate_without_executor = resources.gpus > 0  # see _migrate_without_executor
        kernel.launch = launch
        transition(kernel, RUNNING)
        kernel.router.merger.forward_unknown = True  # cells its predecessor routed still answer
        self.state.kernels[kernel_id] = kernel
        log.info("kernel_adopted", kernel=kernel_id)
        self._migrator.restore(kernel)  # what the predecessor held for it
        return kernel

    def _on_host_heartbeat(self, identity: bytes, env: Envelope) -> Envelope:
        host = self.state.heartbeat(
            env.body["host_id"], env.body.get("committed"), self._clock(), leased=env.body.get("leased")
        )
        if host is None:
            return env.error("unknown host: register first", code="unknown_host")
        if "pool" in env.body:
            self.metrics.record_pool(host.host_id, env.body["pool"])
            warm = int(env.body["pool"].get("warm", 0))
            if warm != host.warm_runtimes:  # re-indexed for placement only when it changes
                host.warm_runtimes = warm
        return env.reply({"cordoned": host.cordoned})

    def _on_cordon(self, identity: bytes, env: Envelope) -> Envelope:
        host = self.state.hosts.get(env.body["host_id"])
        if host is None:
            return env.error(f"unknown host {env.body['host_id']!r}", code="not_found")
        host.cordoned = env.type == messages.HOST_CORDON
        log.info("host_cordoned" if host.cordoned else "host_uncordoned", host=host.host_id)
        return env.reply({"host_id": host.host_id, "cordoned": host.cordoned})

    async def _on_host_drain(self, identity: bytes, env: Envelope) -> Envelope:
        """Cordon the host, then move every replica off it (migration.py); answers when done."""
        host = self.state.hosts.get(env.body["host_id"])
        if host is None:
            return env.error(f"unknown host {env.body['host_id']!r}", code="not_found")
        host.cordoned = True
        log.info("host_draining", host=host.host_id)
        outcome = await self._migrator.drain(host.host_id)
        log.info("host_drained", **outcome)
        return env.reply(outcome)

    def _on_cluster_status(self, identity: bytes, env: Envelope) -> Envelope:
        return env.reply(self._status(stopped=bool(env.body.get("all", False))))

    def _status(self, *, stopped: bool = False) -> dict[str, Any]:
        """``cluster.status``: the cluster state plus autoscaling, warm pools and metrics. Stopped
        kernels only with ``stopped`` (``tandem status --json --all``): they would pile up."""
        report = cluster_report(self.state, self.autoscaling, self.metrics, self.metrics_url)
        report["policy"] = self._cfg.get("scheduler.policy")
        report["hibernation"] = self._hibernation_report()
        if not stopped:
            report["kernels"] = [k for k in report["kernels"] if k["state"] != STOPPED]
        return report

    # ---- kernels ----------------------------------------------------------------------------

    def _on_kernel_status(self, identity: bytes, env: Envelope) -> Envelope:
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            if self._rebuilding():  # unknown does not mean gone yet
                return env.error("the scheduler restarted and is rebuilding its view", code="rebuilding")
            return env.error(f"unknown kernel {env.body['kernel_id']!r}", code="not_found")
        if self._replicas_may_still_come(kernel):
            # adopted from the first host that reported it; the others' replicas may still come:
            # "dead" now would make the gateway declare a kernel dead that is about to be whole
            return env.error("the scheduler restarted and is rebuilding its view", code="rebuilding")
        return env.reply(self.state.kernel_status(kernel))

    def _on_kernel_interrupt(self, identity: bytes, env: Envelope) -> Envelope:
        """Out-of-band interrupt: a signed interrupt_request to the executing replica (else all)."""
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            return env.error(f"unknown kernel {env.body['kernel_id']!r}", code="not_found")
        self._migrator.interrupt(kernel)  # a cell held for a migration ends here
        live = kernel.live_replicas()
        executor = kernel.router.current_executor()
        targets = [executor] if executor in live else live
        frames = kernel.router.internal_request("interrupt_request", {})
        for replica_id in targets:
            self._to_replica(kernel, replica_id, "control", frames)
        return env.reply({"replicas": targets})

    async def _on_kernel_start(self, identity: bytes, env: Envelope) -> Envelope:
        body = env.body
        kernel_id: str = body["kernel_id"]
        klog = log.bind(kernel=kernel_id)
        try:
            # Fields the request leaves out come from the [kernel] defaults of the configuration.
            resources = Resources.from_dict({**self._default_request, **body["resources"]})
            launch = KernelLaunch.from_wire(body.get("launch"))
        except ValueError as exc:  # LaunchError is one
            raise RpcError(str(exc), "bad_request") from None
        existing = self.state.kernels.get(kernel_id)
        verdict = start_verdict(
            kernel_id,
            None if existing is None else existing.state,
            same_key=existing is not None and existing.key == body["key"],
        )
        if existing is not None and verdict == RETRIED:
            return env.reply(self.state.kernel_status(existing))
        if verdict is not None:
            raise RpcError(verdict, "conflict")
        decision = await self._place(kernel_id, resources, klog)
        existing = self.state.kernels.get(kernel_id)
        verdict = start_verdict(kernel_id, None if existing is None else existing.state, same_key=False)
        if verdict is not None:
            raise RpcError(verdict, "conflict")  # started while we waited
        scheme = str(body.get("signature_scheme") or "hmac-sha256")
        key: str = body["key"]
        kernel = KernelRecord(
            kernel_id,
            key,
            scheme,
            resources,
            KernelRouter(kernel_id, key.encode(), scheme, quorum=self._quorum),
        )
        kernel.router.migrate_without_executor = resources.gpus > 0  # see _migrate_without_executor
        kernel.launch = launch
        for n, host_id in enumerate(decision.hosts, start=1):
            kernel.replicas[f"r{n}"] = ReplicaRecord(f"r{n}", host_id)
        self.state.kernels[kernel_id] = kernel
        klog.info("placing", hosts=list(decision.hosts), resources=resources.to_dict())
        started = time.monotonic()
        try:
            await self._start_placed(kernel)
        except BaseException as exc:
            klog.error("kernel_start_failed", reason=str(exc))
            if kernel.state not in OVER:  # shut down meanwhile: it stays stopped
                transition(kernel, DEAD)
                kernel.dead_reason = f"start failed: {exc}"
                kernel.router.dead_reason = kernel.dead_reason
            await self._stop_all(kernel)
            raise
        transition(kernel, RUNNING)
        klog.info("kernel_started", seconds=round(time.monotonic() - started, 3))
        return env.reply(self.state.kernel_status(kernel))

    async def _place(self, kernel_id: str, resources: Resources, klog: Any) -> Any:
        """Hosts for a kernel's replicas (a start, or a resume), scaling out if the autoscaler
        may; RpcError ``no_capacity`` naming why not."""
        decision, scaling = await self.autoscaling.place(
            self.placement,
            PlacementRequest(kernel_id, resources, self._replicas_per_kernel),
            self.state.placement_index,
        )
        if not decision.ok:
            klog.warning("placement_failed", reasons=decision.explain(), autoscaler=scaling)
            raise RpcError(
                f"cannot place {self._replicas_per_kernel} replicas: {decision.explain()}"
                + (f" (autoscaler: {scaling})" if scaling else ""),
                "no_capacity",
            )
        return decision

    async def _start_placed(self, kernel: KernelRecord) -> None:
        """Start and configure every placed replica of a starting kernel; RpcError if one fails
        or the kernel stopped meanwhile (the caller stops what started)."""
        purpose = "resume" if kernel.generation else "start"  # for the serving controller's log
        await _on_every_replica(
            "replica start", kernel, lambda r: self.start_replica(kernel, r, purpose=purpose), with_host=True
        )
        if kernel.state != STARTING:
            raise RpcError(f"kernel became {kernel.state} while starting", "start_failed")
        peers = {r.replica_id: r.raft_address for r in kernel.replicas.values()}
        await _on_every_replica(
            "replica configure", kernel, lambda r: self.configure_replica(kernel, r, peers)
        )
        if kernel.state != STARTING or len(kernel.live_replicas()) < len(kernel.replicas):
            raise RpcError(f"kernel became {kernel.state} while starting", "start_failed")

    async def _stop_all(self, kernel: KernelRecord) -> None:
        await asyncio.gather(
            *(self.stop_replica(kernel, r) for r in kernel.replicas.values()), return_exceptions=True
        )

    async def acquire_runtime(
        self, kernel: KernelRecord, replica: ReplicaRecord, purpose: str
    ) -> bool | None:
        """Ask the serving controller for a ready runtime on the replica's host (True: one is
        promised to this start, False: it will be cold, None: no controller or no answer in
        ``serving.acquire_timeout_s``: the host's pool decides alone, as without one)."""
        if self._serving is None:
            return None
        body = {"host_id": replica.host_id, "kernel_id": kernel.kernel_id, "purpose": purpose}
        try:
            answer = await self._serving.request(
                Envelope(messages.RUNTIME_ACQUIRE, body), timeout=self._acquire_timeout
            )
        except (RpcError, RpcTimeout) as exc:
            log.info("runtime_acquire_failed", host=replica.host_id, reason=str(exc))
            return None
        warm = bool(answer.body.get("warm"))
        log.debug("runtime_acquired", kernel=kernel.kernel_id, replica=replica.replica_id, host=replica.host_id,
                  warm=warm, purpose=purpose, reason=answer.body.get("reason") or None)  # fmt: skip
        return warm

    async def start_replica(
        self, kernel: KernelRecord, replica: ReplicaRecord, *, join: bool = False, purpose: str = "start"
    ) -> None:
        promised = await self.acquire_runtime(kernel, replica, "join" if join else purpose)
        body = {
            "kernel_id": kernel.kernel_id,
            "replica_id": replica.replica_id,
            "key": kernel.key,
            "signature_scheme": kernel.signature_scheme,
            "resources": kernel.resources.to_dict(),
            "launch": kernel.launch.to_wire(),
            "join": join,
            # a resumed kernel: its host's runtime template imports these before it forks
            **(
                {"imports": kernel.image_modules} if kernel.image is not None and kernel.image_modules else {}
            ),
            **self._raft_identity(kernel, replica),
        }
        answer = await self._outbound.request(
            replica.host_id.encode(),
            Envelope(messages.REPLICA_START, body),
            timeout=self._replica_start_timeout + 5.0,
        )
        if isinstance(answer.body.get("start_s"), int | float):
            self.metrics.record_replica_start(bool(answer.body.get("warm")), float(answer.body["start_s"]))
        if promised and not answer.body.get("warm"):
            log.info("promised_runtime_missed", kernel=kernel.kernel_id, host=replica.host_id)
        replica.pid = _reported_pid(answer.body)
        replica.raft_address = str(answer.body.get("raft_address", ""))
        replica.started = True

    def _raft_identity(self, kernel: KernelRecord, replica: ReplicaRecord) -> dict[str, Any]:
        """``{"raft_identity": ...}``: a new certificate from the cluster's Raft CA for a replica
        start or restart (shared/raft/tls.py), or nothing with ``raft.tls`` off. The CA is made
        on first use in ``<state_dir>/keys`` and read from there after a restart."""
        if not self._cfg.get("raft.tls"):
            return {}
        if self._raft_ca is None:
            from shared.raft.tls_ca import ClusterCA  # imports cryptography: only when needed

            self._raft_ca = ClusterCA.load_or_create(self._cfg.keys_dir())
        return {"raft_identity": self._raft_ca.issue(kernel.kernel_id, replica.replica_id).to_wire()}

    async def configure_replica(
        self, kernel: KernelRecord, replica: ReplicaRecord, peers: dict[str, str]
    ) -> None:
        await self._outbound.request(
            replica.host_id.encode(),
            Envelope(
                messages.REPLICA_CONFIGURE,
                {
                    "kernel_id": kernel.kernel_id,
                    "replica_id": replica.replica_id,
                    "peers": peers,
                    # a resumed kernel: every replica (a replacement or a restart too) loads the
                    # image first, then applies the group's log, or a Raft snapshot replaces it
                    **({"restore": kernel.image} if kernel.image is not None else {}),
                },
            ),
            timeout=self._replica_start_timeout,
        )

    async def stop_replica(self, kernel: KernelRecord, replica: ReplicaRecord) -> None:
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

    async def _on_replica_restart(self, identity: bytes, env: Envelope) -> Envelope:
        """``tandem replica restart K R``: the replica's host restarts the same replica on its Raft
        storage (the process is stopped first if it still runs), then it is configured with its
        peers and takes cells again once it has rebuilt its namespace. Restart in place only;
        replacing a lost replica by a new member is a membership change."""
        body = env.body
        kernel = self.state.kernels.get(body["kernel_id"])
        if kernel is None:
            raise RpcError(f"unknown kernel {body['kernel_id']!r}", "not_found")
        replica = kernel.replicas.get(body["replica_id"])
        if replica is None:
            raise RpcError(
                f"kernel {kernel.kernel_id} has no replica {body['replica_id']!r} "
                f"(it has {', '.join(sorted(kernel.replicas))})",
                "not_found",
            )
        host = self.state.hosts.get(replica.host_id)
        look = RestartLook(
            kernel.kernel_id,
            kernel.state,
            replica.replica_id,
            replica.alive,
            replica.host_id,
            host is not None and host.alive,
            tuple(kernel.live_replicas()),
        )
        refusal = restart_refusal(look, self._quorum)
        if refusal is not None:
            raise RpcError(*refusal)
        await self.restart_in_place(kernel, replica)
        return env.reply(self.state.kernel_status(kernel))

    async def restart_in_place(self, kernel: KernelRecord, replica: ReplicaRecord) -> None:
        """Restart ``replica`` on its host, on its own Raft storage, and configure it with its
        peers; RpcError when its host refuses or it is already restarting. Either way, a kernel
        recovering its quorum learns whether it is back (``_settle_recovery``)."""
        try:
            await self._restart_in_place(kernel, replica)
        except (RpcError, RpcTimeout) as exc:
            self._settle_recovery(kernel, f"restarting {replica.replica_id} in place failed: {exc}")
            raise
        self._settle_recovery(kernel, "no quorum after restarting the lost replicas in place")

    async def _restart_in_place(self, kernel: KernelRecord, replica: ReplicaRecord) -> None:
        host = self.state.hosts.get(replica.host_id)
        if host is None or not host.alive:
            raise RpcError(
                f"host {replica.host_id} of replica {replica.replica_id} is not alive", "unavailable"
            )
        rlog = log.bind(kernel=kernel.kernel_id, replica=replica.replica_id, host=replica.host_id)
        rlog.info("replica_restarting")
        key = (kernel.kernel_id, replica.replica_id)
        if key in self._restarting:
            raise RpcError(
                f"replica {replica.replica_id} of {kernel.kernel_id} is already restarting", "conflict"
            )
        self._restarting.add(key)
        try:
            answer = await self._outbound.request(
                host.identity,
                Envelope(
                    messages.REPLICA_RESTART,
                    {
                        "kernel_id": kernel.kernel_id,
                        "replica_id": replica.replica_id,
                        "key": kernel.key,
                        "signature_scheme": kernel.signature_scheme,
                        "resources": kernel.resources.to_dict(),
                        "launch": kernel.launch.to_wire(),
                        **self._raft_identity(kernel, replica),
                    },
                ),
                timeout=self._replica_start_timeout + STOP_TIMEOUT_S,
            )
            replica.pid = _reported_pid(answer.body)
            replica.raft_address = str(answer.body.get("raft_address") or replica.raft_address)
            peers = {r.replica_id: r.raft_address for r in kernel.replicas.values() if r.raft_address}
            await self.configure_replica(kernel, replica, peers)
        finally:
            self._restarting.discard(key)
        if kernel.state == RUNNING and kernel.replicas.get(replica.replica_id) is replica:
            replica.alive, replica.role, replica.started, replica.leaving = True, None, True, False
        else:  # stopped (or dead) while it restarted: no process of it may stay behind
            rlog.info("restarted_replica_stopped", state=kernel.state)
            await self.stop_replica(kernel, replica)
            return
        rlog.info("replica_restarted", pid=replica.pid)

    async def _on_kernel_shutdown(self, identity: bytes, env: Envelope) -> Envelope:
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            self.autoscaling.abandon(env.body["kernel_id"])  # a start waiting for new hosts gives up
            return env.reply({"state": STOPPED})  # nothing to stop: shutdown is idempotent
        if kernel.state == HIBERNATED:  # no replica to stop; its image stays in the data store
            kernel.hibernated_s_total += max(0.0, time.time() - (kernel.hibernated_at or time.time()))
            self._mark_stopped(kernel)
            self._save_hibernated()
            self._fail_held_for_resume(kernel, "kernel was shut down")
            return env.reply({"state": kernel.state})
        await self._shutdown(kernel, restart=bool(env.body.get("restart", False)), by="gateway")
        return env.reply({"state": kernel.state})

    async def _shutdown(self, kernel: KernelRecord, *, restart: bool, by: str) -> None:
        if shutdown_stops(kernel.state):
            transition(kernel, STOPPING)
        log.info("kernel_shutdown", kernel=kernel.kernel_id, restart=restart, by=by)
        await asyncio.gather(
            *(self.stop_replica(kernel, r) for r in kernel.replicas.values() if r.alive or not r.started),
            return_exceptions=True,
        )
        if kernel.state == STOPPING:
            self._mark_stopped(kernel)

    # ---- hibernation (shared/policies/hibernation.py decides when; the gateway asks) ----------

    async def _on_kernel_hibernate(self, identity: bytes, env: Envelope) -> Envelope:
        """Write an idle kernel's namespace to the data store (one replica writes the image of
        what the group committed), then stop its replicas: their memory, GPU subscriptions and
        Raft links are released. Refused, the kernel running on, if a cell is in flight or a
        name's latest value never reached the log (it would be lost)."""
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            raise RpcError(f"unknown kernel {env.body['kernel_id']!r}", "not_found")
        if kernel.state == HIBERNATED:
            return env.reply(self.state.kernel_status(kernel))
        if kernel.state != RUNNING or kernel.kernel_id in self._resumes:
            raise RpcError(f"kernel {kernel.kernel_id} is {kernel.state}, not running", "conflict")
        if kernel.held is not None or kernel.router.merger.pending_ids():
            raise RpcError(f"kernel {kernel.kernel_id} has requests in flight", "busy")
        klog = log.bind(kernel=kernel.kernel_id)
        started = time.monotonic()
        transition(kernel, HIBERNATING)
        try:
            image = await self._write_image(kernel)
        except RpcError as exc:
            if kernel.state == HIBERNATING:
                transition(kernel, RUNNING)
            klog.warning("hibernation_refused", reason=exc.reason)
            self._route_held_for_resume(kernel)
            raise
        if kernel.state != HIBERNATING:  # shut down or lost meanwhile
            raise RpcError(f"kernel {kernel.kernel_id} became {kernel.state} while hibernating", "conflict")
        saved_s = time.monotonic() - started
        await self._stop_all(kernel)
        if kernel.state != HIBERNATING:
            raise RpcError(f"kernel {kernel.kernel_id} became {kernel.state} while hibernating", "conflict")
        kernel.image = image["image"]
        kernel.image_bytes = int(image.get("bytes", 0))
        kernel.image_modules = [str(m) for m in image.get("modules") or []]
        kernel.hibernated_at = time.time()
        kernel.generation += 1
        kernel.replicas = {}
        transition(kernel, HIBERNATED)
        self._save_hibernated()
        klog.info(
            "kernel_hibernated",
            reason=env.body.get("reason", ""),
            image_bytes=kernel.image_bytes,
            names=image.get("names"),
            save_s=round(saved_s, 3),
            seconds=round(time.monotonic() - started, 3),
        )
        if self._held_for_resume.get(kernel.kernel_id):  # requests came while it was saving
            self._resume_soon(kernel)
        return env.reply(self.state.kernel_status(kernel))

    async def _write_image(self, kernel: KernelRecord) -> dict[str, Any]:
        """The namespace image from the last executor (it alone knows whether its last cell's
        STATE is still being written behind the reply: it waits for it), else the Raft leader,
        else any live replica; RpcError if none could write it, or if it would lose names."""
        executor = kernel.router.last_executor
        order = sorted(
            kernel.replicas.values(),
            key=lambda r: (r.replica_id != executor, r.role != "leader", r.replica_id),
        )
        reasons = []
        for replica in order:
            if not replica.alive or not replica.started:
                continue
            try:
                answer = await self._outbound.request(
                    replica.host_id.encode(),
                    Envelope(
                        messages.REPLICA_HIBERNATE,
                        {"kernel_id": kernel.kernel_id, "replica_id": replica.replica_id},
                    ),
                    timeout=HIBERNATE_IMAGE_TIMEOUT_S,
                )
            except (RpcError, RpcTimeout) as exc:
                reasons.append(f"{replica.replica_id}: {exc}")
                continue
            unprotected = answer.body.get("unprotected") or []
            if unprotected:
                raise RpcError(
                    "hibernating would lose the values of "
                    + ", ".join(map(str, unprotected[:10]))
                    + " (never written to the log or the data store)",
                    "unprotected",
                )
            if not isinstance(answer.body.get("image"), dict):
                reasons.append(f"{replica.replica_id}: no image in its answer")
                continue
            return dict(answer.body)
        raise RpcError("no replica wrote the namespace image: " + "; ".join(reasons), "unavailable")

    async def _on_kernel_resume(self, identity: bytes, env: Envelope) -> Envelope:
        """Start a hibernated kernel's replicas again (also done on its next request)."""
        kernel = self.state.kernels.get(env.body["kernel_id"])
        if kernel is None:
            raise RpcError(f"unknown kernel {env.body['kernel_id']!r}", "not_found")
        if kernel.state == HIBERNATED:
            self._resume_soon(kernel)
        task = self._resumes.get(kernel.kernel_id)
        if task is not None:
            await asyncio.shield(task)
        if kernel.state != RUNNING:
            raise RpcError(
                f"kernel {kernel.kernel_id} is {kernel.state}: {kernel.dead_reason or ''}", "conflict"
            )
        return env.reply(self.state.kernel_status(kernel))

    def _resume_soon(self, kernel: KernelRecord) -> None:
        if kernel.kernel_id in self._resumes or kernel.state != HIBERNATED:
            return
        task = asyncio.ensure_future(self._resume(kernel))
        self._resumes[kernel.kernel_id] = task
        task.add_done_callback(lambda t, kid=kernel.kernel_id: self._resume_ended(kid, t))

    def _resume_ended(self, kernel_id: str, task: asyncio.Task[None]) -> None:
        if self._resumes.get(kernel_id) is task:
            del self._resumes[kernel_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("kernel_resume_crashed", kernel=kernel_id, error=repr(task.exception()))

    async def _resume(self, kernel: KernelRecord) -> None:
        """Placement picks hosts as for a start; the replicas start (warm runtimes where there
        are), load the image when configured, and the requests held meanwhile go to them. A
        start that fails is retried (the image is kept); after the last try the kernel is dead."""
        klog = log.bind(kernel=kernel.kernel_id)
        for attempt in range(1, RESUME_ATTEMPTS + 1):
            started = time.monotonic()
            try:
                decision = await self._place(kernel.kernel_id, kernel.resources, klog)
                if kernel.state != HIBERNATED:
                    return  # shut down while placement waited
                transition(kernel, STARTING)
                self._save_hibernated()  # a resumed kernel is adopted from its hosts after a restart
                kernel.router = KernelRouter(
                    kernel.kernel_id, kernel.key.encode(), kernel.signature_scheme, quorum=self._quorum
                )
                kernel.router.migrate_without_executor = kernel.resources.gpus > 0
                kernel.replicas = {
                    f"r{n}-{kernel.generation}": ReplicaRecord(f"r{n}-{kernel.generation}", host_id)
                    for n, host_id in enumerate(decision.hosts, start=1)
                }
                klog.info("kernel_resuming", hosts=list(decision.hosts), attempt=attempt)
                await self._start_placed(kernel)
            except Exception as exc:
                klog.warning("kernel_resume_failed", reason=str(exc), attempt=attempt)
                if kernel.state == STARTING:
                    await self._stop_all(kernel)
                    kernel.replicas = {}
                    if attempt == RESUME_ATTEMPTS:  # its replicas cannot start: it is dead
                        self._mark_dead(kernel, f"resume failed {attempt} times: {exc}")
                        self._fail_held_for_resume(kernel, str(exc))
                        return
                    transition(kernel, HIBERNATED)
                    self._save_hibernated()
                if kernel.state != HIBERNATED:
                    self._fail_held_for_resume(kernel, f"kernel is {kernel.state}")
                    return
                if attempt == RESUME_ATTEMPTS:  # no hosts for it now: it stays hibernated
                    self._fail_held_for_resume(kernel, f"resume failed {attempt} times: {exc}")
                    return
                await asyncio.sleep(RESUME_RETRY_S * attempt)
                continue
            transition(kernel, RUNNING)
            kernel.resumes += 1
            kernel.hibernated_s_total += max(0.0, time.time() - (kernel.hibernated_at or time.time()))
            kernel.last_resume_s = time.monotonic() - started
            klog.info(
                "kernel_resumed",
                seconds=round(kernel.last_resume_s, 3),
                hibernated_s=round(time.time() - (kernel.hibernated_at or time.time()), 1),
                held_requests=len(self._held_for_resume.get(kernel.kernel_id, ())),
            )
            self._route_held_for_resume(kernel)
            return

    def _hibernation_report(self) -> dict[str, Any]:
        """Hibernated kernels now, resumes, and the GPU subscriptions hibernation gave back:
        GPU-hours of replicas that did not exist (each kernel's GPUs times its replicas), over
        ended hibernations and the ongoing ones."""
        now = time.time()
        gpu_hours = 0.0
        hibernated = resumes = 0
        resume_s = [k.last_resume_s for k in self.state.kernels.values() if k.last_resume_s is not None]
        for k in self.state.kernels.values():
            seconds = k.hibernated_s_total
            if k.state == HIBERNATED and k.hibernated_at is not None:
                hibernated += 1
                seconds += max(0.0, now - k.hibernated_at)
            resumes += k.resumes
            gpu_hours += seconds * k.resources.gpus * self._replicas_per_kernel / 3600
        return {
            "hibernated": hibernated,
            "resumes": resumes,
            "last_resume_s_p50": round(statistics.median(resume_s), 3) if resume_s else None,
            "gpu_hours_freed": round(gpu_hours, 4),
        }

    def _save_hibernated(self) -> None:
        self._hibernated_file.save(
            {
                "kernel_id": k.kernel_id,
                "key": k.key,
                "signature_scheme": k.signature_scheme,
                "resources": k.resources.to_dict(),
                "launch": k.launch.to_wire(),
                "image": k.image,
                "image_bytes": k.image_bytes,
                "image_modules": k.image_modules,
                "hibernated_at": k.hibernated_at,
                "generation": k.generation,
                "resumes": k.resumes,
            }
            for k in self.state.kernels.values()
            if k.state == HIBERNATED
        )

    def _adopt_hibernated(self) -> None:
        """The kernels the previous scheduler process had hibernated, hibernated here too."""
        for entry in self._hibernated_file.load():
            try:
                resources = Resources.from_dict(entry["resources"])
                launch = KernelLaunch.from_wire(entry["launch"])
            except ValueError as exc:
                log.error("hibernated_kernel_unusable", kernel=entry["kernel_id"], reason=str(exc))
                continue
            key, scheme = str(entry["key"]), str(entry["signature_scheme"])
            kernel = KernelRecord(
                entry["kernel_id"], key, scheme, resources,
                KernelRouter(entry["kernel_id"], key.encode(), scheme, quorum=self._quorum),
                state=HIBERNATED,
            )  # fmt: skip
            kernel.launch = launch
            kernel.image, kernel.image_bytes = entry["image"], int(entry["image_bytes"])
            kernel.image_modules = [str(m) for m in entry.get("image_modules") or []]  # absent before
            kernel.hibernated_at, kernel.generation = entry["hibernated_at"], int(entry["generation"])
            kernel.resumes = int(entry["resumes"])
            self.state.kernels[kernel.kernel_id] = kernel
            log.info("hibernated_kernel_adopted", kernel=kernel.kernel_id, image_bytes=kernel.image_bytes)

    def _route_held_for_resume(self, kernel: KernelRecord) -> None:
        """Send on what was held, in order; from now on requests route directly."""
        if self._resumes.get(kernel.kernel_id) is asyncio.current_task():
            del self._resumes[kernel.kernel_id]
        for channel, frames in self._held_for_resume.pop(kernel.kernel_id, []):
            self.route_from_gateway(kernel, channel, frames)

    def _fail_held_for_resume(self, kernel: KernelRecord, reason: str) -> None:
        """The requests held for a resume that will not happen get the error reply a dead
        kernel's requests get (``KernelDead`` with ``reason``), so no client waits for ever; the
        kernel itself keeps its state (a hibernated one resumes at its next request)."""
        held = self._held_for_resume.pop(kernel.kernel_id, [])
        if not held:
            return
        log.warning("held_requests_failed", kernel=kernel.kernel_id, requests=len(held), reason=reason)
        router, before = kernel.router, kernel.router.dead_reason
        router.dead_reason = before or reason
        try:
            for channel, frames in held:  # no live replica: the router answers each with the error
                self.route_from_gateway(kernel, channel, frames)
        finally:
            router.dead_reason = before


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
