"""The local scheduler's asyncio shell: one per host.

Upstream, a DEALER (identity = host id) to the global scheduler: ``host.register`` /
``host.heartbeat``, replica lifecycle requests, Jupyter frames both ways. Downstream, a ROUTER
where replicas register and ask for GPUs, plus per replica the Jupyter client sockets. The GPU
ledger (pure) is the authority for this host's GPUs. Jupyter forwarding is synchronous: a frame
read from a replica is sent upstream in the same callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import structlog
import zmq
import zmq.asyncio

from services.local_scheduler.batch_jobs import BatchJobs
from services.local_scheduler.checkpoints import ServiceLink, store_env
from services.local_scheduler.gpus import GpuInventory, detect_gpus
from services.local_scheduler.packing import PackingSettings
from services.local_scheduler.replica_link import ReplicaLink
from services.local_scheduler.replica_process import ReplicaProcess, raft_identity_json
from services.local_scheduler.runtime_template import RuntimeTemplate, TemplateGone
from services.local_scheduler.warm_pool import WarmPool, runtime_env, setpriv_path
from shared import messages
from shared.cluster_core.gpu_ledger import GpuLedger, LedgerError
from shared.config import Config
from shared.election_round import election_key, round_of
from shared.envelope import Envelope
from shared.host_address import advertised_ip, is_wildcard
from shared.kernel_launch import KernelLaunch, LaunchError
from shared.rpc import OutboundRequests, RpcClient, RpcError, RpcTimeout
from shared.runner import cancel_and_wait
from shared.security import curve
from shared.security.authorization import REPLICA_PREFIX, local_scheduler_refusal

log = structlog.get_logger("local_scheduler")

REPLICA_REQUEST_TIMEOUT_S = 30.0
HIBERNATE_TIMEOUT_S = 140.0
STOP_GRACE_S = 2.0

ReplicaKey = tuple[str, str]  # (kernel_id, replica_id)


class LaunchFailed(Exception):
    """A replica process did not start and register; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LocalScheduler:
    def __init__(
        self, cfg: Config, *, host_id: str, scheduler_address: str, gpus: GpuInventory | None = None
    ) -> None:
        self.cfg = cfg
        self.host_id = host_id
        self.scheduler_address = scheduler_address
        self._advertised: str | None = None  # the Raft host of this host's replicas (_raft_host)
        host = cfg["host"]
        self.gpus = gpus or detect_gpus(
            use_nvml=bool(host["use_nvml"]),
            virtual_count=int(host["gpus"]),
            virtual_vram_gb=float(host["vram_gb_per_gpu"]),
        )
        self.ledger = GpuLedger(self.gpus.device_ids)
        self.replicas: dict[ReplicaKey, ReplicaProcess] = {}
        self.log = log.bind(host=host_id)
        self._heartbeat_interval = float(cfg.get("scheduler.heartbeat_interval_s"))
        self._start_timeout = float(cfg.get("scheduler.replica_start_timeout_s"))
        self._ctx = zmq.asyncio.Context()
        keys_dir = cfg.keys_dir()
        # a host registers only with the key the operator issued for its id (`tandem keys`)
        self._host_keys = curve.load_secret(keys_dir, curve.host_principal(host_id))
        self._upstream = RpcClient(
            self._ctx,
            identity=host_id.encode(),
            on_message=self._on_upstream,
            name="global_scheduler",
            curve=curve.ClientCurve(
                self._host_keys, curve.load(keys_dir, curve.SCHEDULER).public, curve.host_principal(host_id)
            ),
        )
        # replicas connect over ipc (admitted by pid) or CURVE (by the keys minted at launch)
        self._link = ReplicaLink(
            self._ctx,
            host_keys=self._host_keys,
            handler=self._on_replica_message,
            authorize=self._authorize_replica,
            name=f"local_scheduler:{host_id}",
            state_dir=cfg.state_dir().absolute() / "hosts" / host_id,
            default_ip=str(cfg.get("cluster.ip")),
        )
        self._outbound = OutboundRequests(self._link)
        # replicas' Jupyter messages of this loop turn, for _flush_upstream: ((kernel, replica), channel, frames)
        self._outgoing: list[tuple[tuple[str, str], str, list[bytes]]] = []
        self._batch_upstream = False  # the scheduler's host.register answer says it takes batches
        self._registered = asyncio.Event()
        # absolute: a replica starts in its kernel's working directory (shared/kernel_launch.py)
        self._data_root = cfg.state_dir().absolute() / "hosts" / host_id
        self.warm_pool = WarmPool(
            cfg, host_id=host_id, directory=self._data_root / "warm", idle_gpus=lambda: self.ledger.free_count
        )
        # prewarm.template: replica starts fork from this host's runtime template (a fork server)
        self.template: RuntimeTemplate | None = None
        if cfg.get("prewarm.template"):
            self.template = RuntimeTemplate(
                python=str(cfg.get("kernel.python")) or sys.executable,
                imports=[str(m) for m in cfg.get("prewarm.imports")],
                directory=self._data_root / "warm",
                env=runtime_env(host_id),
                setpriv=setpriv_path(),
            )
        # best-effort jobs on leased GPUs (issue #16): the arbiter grants, this host carries out
        arbiter = cfg["arbiter"]
        self._report_interval = float(arbiter["report_interval_s"])
        self._report_now = asyncio.Event()
        # the checkpoint service (issue #17): this host relays its jobs' images, restores from them
        self._checkpoints: ServiceLink | None = None
        if cfg.get("checkpoint.address"):
            self._checkpoints = ServiceLink(self._ctx, cfg, host_id=host_id, host_keys=self._host_keys)
        self.jobs = BatchJobs(
            self.ledger,
            host_id=host_id,
            state_dir=cfg.state_dir(),
            stop_grace_s=float(arbiter["stop_grace_s"]),
            overdue_s=2 * float(arbiter["round_s"]) + float(arbiter["stop_grace_s"]),
            keep_paused_s=float(arbiter["keep_paused_s"]),
            cell_reserve=int(arbiter["cell_reserve_gpus"]),
            on_exit=self._report_now.set,
            fitgpp_s=float(arbiter["fitgpp_s"]),
            max_preemptions=int(arbiter["max_preemptions"]),
            pause_grace_s=float(arbiter["preempt_pause_grace_s"]),
            packing=PackingSettings.from_config(cfg["packing"]),
            checkpoints=self._checkpoints,
            checkpoint_env=store_env(cfg),
        )
        self._arbiter: RpcClient | None = None
        if arbiter["address"]:
            self._arbiter = RpcClient(
                self._ctx,
                identity=host_id.encode(),
                on_message=self._on_arbiter,
                name="arbiter",
                curve=curve.ClientCurve(self._host_keys, curve.load(keys_dir, curve.ARBITER).public),
            )

        self._serving: RpcClient | None = None
        if cfg.get("serving.address") and self.warm_pool.enabled:
            self._serving = RpcClient(
                self._ctx,
                identity=host_id.encode(),
                on_message=lambda env: None,
                name="serving",
                curve=curve.ClientCurve(self._host_keys, curve.load(keys_dir, curve.SERVING).public),
            )

    @property
    def address(self) -> str:
        return self._link.server.address

    def bind(self, address: str | None = None) -> str:
        """The replicas' link: ``ipc://`` (by default, where the kernel reports peer pids) or
        ``tcp://`` (CURVE); see ``replica_link``."""
        return self._link.bind(address)

    @staticmethod
    def _authorize_replica(principal: str, identity: bytes, env: Envelope) -> str | None:
        """A replica speaks only for itself, under a routing identity of its own."""
        own = principal[len(REPLICA_PREFIX) :]
        if not identity.startswith(f"{own}/".encode()):
            return f"{principal or 'anonymous'} may not use the routing identity {identity!r}"
        return local_scheduler_refusal(principal, env.type, env.body)

    def resources(self) -> dict[str, Any]:
        host = self.cfg["host"]
        return {
            "millicpus": int(host["millicpus"]),
            "memory_mb": int(host["memory_mb"]),
            "gpus": self.gpus.count,
            "vram_gb": float(self.gpus.vram_gb_per_gpu * self.gpus.count),
        }

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._link.server.start()
        self._upstream.connect(self.scheduler_address)
        heartbeat = asyncio.ensure_future(self._heartbeat_loop())
        prewarm = asyncio.ensure_future(self.warm_pool.run())
        loops = [heartbeat, prewarm]
        if self.template is not None:
            try:
                await self.template.start()
                if self.template.pid is not None:  # its forks are replicas this host spawned
                    self._link.peers.add_launcher(self.template.pid)
            except OSError as exc:  # replica starts go on without it (warm pool, or cold)
                self.log.error("runtime_template_not_started", reason=str(exc))
        if self._checkpoints is not None:
            self._checkpoints.connect()
        if self._arbiter is not None:
            self._arbiter.connect(str(self.cfg.get("arbiter.address")))
            loops.append(asyncio.ensure_future(self._agent_loop()))
        if self._serving is not None:
            self._serving.connect(str(self.cfg.get("serving.address")))
            loops.append(asyncio.ensure_future(self._serving_loop()))
        self.log.info("started", address=self.address, scheduler=self.scheduler_address, gpus=self.gpus.count)
        try:
            await stop.wait()
        finally:
            await cancel_and_wait(loops)
            await asyncio.gather(self.stop_all_replicas(), self.warm_pool.close(), self.jobs.close())
            if self.template is not None:  # after its runtimes: they die with it
                await self.template.close()
            if self._arbiter is not None:
                await self._arbiter.close()
            if self._serving is not None:
                await self._serving.close()
            if self._checkpoints is not None:
                await self._checkpoints.close()
            for replica in list(self.replicas.values()):
                # a replica whose exit watcher has not run yet (or that outlived SIGKILL) still
                # has its client sockets open; term() would wait for them forever
                replica.close_sockets()
            self._outbound.cancel_all()
            await self._upstream.close()
            await self._link.close()
            self._ctx.destroy(linger=0)  # never blocks: closes whatever is still open, drops pending sends
            self.log.info("stopped")

    async def stop_all_replicas(self) -> None:
        replicas = list(self.replicas.values())
        if replicas:
            self.log.info("stopping_replicas", count=len(replicas))
        await asyncio.gather(*(self._stop(r) for r in replicas), return_exceptions=True)

    async def _register(self) -> None:
        body = {
            "host_id": self.host_id,
            "address": self.address,
            "resources": self.resources(),
            "gpu_kind": self.gpus.kind,
            "replicas": [r.describe() for r in self.replicas.values() if r.running and r.registered.done()],
        }
        answer = await self._upstream.request(
            Envelope(messages.HOST_REGISTER, body), timeout=max(self._heartbeat_interval, 1.0)
        )
        self._batch_upstream = answer.body.get("batch") is True
        self._registered.set()
        self.log.info("registered", scheduler=self.scheduler_address, replicas=len(body["replicas"]))

    async def _heartbeat_loop(self) -> None:
        """Register (again whenever the scheduler does not know us), then heartbeat forever."""
        while True:
            try:
                if not self._registered.is_set():
                    await self._register()
                else:
                    await self._upstream.request(
                        Envelope(
                            messages.HOST_HEARTBEAT,
                            {
                                "host_id": self.host_id,
                                "committed": self.ledger.snapshot(),
                                "leased": [j.to_wire() for j in self.jobs.leased_jobs()],
                                **({"pool": self.warm_pool.report()} if self.warm_pool.enabled else {}),
                            },
                        ),
                        timeout=max(self._heartbeat_interval * 2, 1.0),
                    )
            except RpcError as exc:
                if exc.code == "unknown_host":
                    self.log.warning("scheduler_forgot_host", reason=exc.reason)
                else:
                    self.log.warning("heartbeat_rejected", reason=exc.reason, code=exc.code)
                self._registered.clear()
            except RpcTimeout:
                self.log.warning("scheduler_unreachable", scheduler=self.scheduler_address)
                self._registered.clear()
            await asyncio.sleep(self._heartbeat_interval)

    # ---- best-effort jobs: this host as the arbiter's agent ---------------------------------

    async def _serving_loop(self) -> None:
        """``pool.report`` every ``prewarm.interval_s`` (and at once after a take); the answer is
        this host's target, decided by the serving controller over the whole cluster."""
        assert self._serving is not None
        interval = self.warm_pool.interval
        while True:
            try:
                answer = await self._serving.request(
                    Envelope(messages.POOL_REPORT, self.warm_pool.pool_report()),
                    timeout=max(2 * interval, 1.0),
                )
                self.warm_pool.follow(int(answer.body.get("target", 0)))
            except (RpcError, RpcTimeout) as exc:
                self.log.debug("pool_report_failed", reason=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.warm_pool.taken_event.wait(), interval)
            self.warm_pool.taken_event.clear()

    async def _agent_loop(self) -> None:
        """``agent.report`` every interval, and at once when a job exits; the safety net for
        leases the arbiter left running past their expiry."""
        assert self._arbiter is not None
        while True:
            self._report_now.clear()
            try:
                answer = await self._arbiter.request(
                    Envelope(messages.AGENT_REPORT, self.jobs.report()),
                    timeout=max(2 * self._report_interval, 1.0),
                )
                self.jobs.acknowledged([str(j) for j in answer.body.get("ack", [])])
            except (RpcError, RpcTimeout) as exc:
                self.log.warning("arbiter_report_failed", reason=str(exc))
            await self.jobs.expire(time.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), self._report_interval)

    def _on_arbiter(self, env: Envelope) -> Any:
        if env.type == messages.LEASE_GRANT:
            return self._answer(env, self.jobs.grant(env.body))
        if env.type == messages.LEASE_END:
            return self._answer(env, self.jobs.end(env.body["job_id"], reason=env.body["reason"]))
        if env.type == messages.JOB_LOGS:
            return self._answer(env, self.jobs.logs(env.body["job_id"], int(env.body.get("offset", 0))))
        return env.error(
            f"a local scheduler does not handle {env.type!r} from the arbiter", code="unsupported"
        )

    @staticmethod
    async def _answer(env: Envelope, pending: Any) -> Envelope:
        return env.reply(await pending)

    # ---- from the global scheduler ----------------------------------------------------------

    def _on_upstream(self, env: Envelope) -> Any:
        if env.type == messages.JUPYTER_REQUEST:  # hot path: synchronous, no task
            body = env.body
            replica = self.replicas.get((body["kernel_id"], body.get("replica_id", "")))
            frames = body["frames"]
            bound = None
            if replica is not None and len(frames) > 1 and b'"execute_request"' in frames[1]:
                bound = self._bind_ahead(
                    replica,
                    frames[1],
                    designated=body.get("designated") is True,
                    revoke=body.get("revoke") or (),
                )
            if replica is None or not replica.send(body["channel"], frames):
                self.log.warning(
                    "request_for_absent_replica", kernel=body["kernel_id"], replica=body.get("replica_id")
                )
                if replica is not None and bound is not None:
                    self._release_gpus(replica.kernel_id, replica.replica_id, bound, on="request_not_sent")
            return None
        if env.type == messages.REPLICA_START:
            return self._replica_start(env)
        if env.type in (messages.REPLICA_CONFIGURE, messages.REPLICA_MEMBERSHIP, messages.REPLICA_HIBERNATE):
            return self._replica_configure(env)
        if env.type == messages.REPLICA_STOP:
            return self._replica_stop(env)
        if env.type == messages.REPLICA_RESTART:
            return self._replica_restart(env)
        if env.type == messages.REPLICA_PROCESS:
            replica = self.replicas.get((env.body["kernel_id"], env.body["replica_id"]))
            return env.reply({"state": replica.os_state() if replica is not None else "gone"})
        return env.error(f"a local scheduler does not handle {env.type!r}", code="unsupported")

    async def _replica_start(self, env: Envelope) -> Envelope:
        body = env.body
        key: ReplicaKey = (body["kernel_id"], body["replica_id"])
        existing = self.replicas.get(key)
        if existing is not None and existing.running:
            await asyncio.wait_for(asyncio.shield(existing.registered), self._start_timeout)
            return env.reply({"pid": existing.pid, "raft_address": existing.raft_address})
        started = time.monotonic()
        join = bool(body.get("join", False))
        replica = self._new_replica(key, body)
        try:
            imports = [m for m in body.get("imports") or [] if isinstance(m, str) and m.isidentifier()][:64]
            warm = await self._launch(key, replica, join=join, warm_ok=True, imports=imports)
        except LaunchFailed as exc:
            tail = replica.log_tail()
            replica.log.error("replica_start_failed", reason=exc.reason)
            raise RpcError(
                f"{exc.reason}{' | log: ' + tail[-800:] if tail and tail not in exc.reason else ''}",
                "start_failed",
            ) from None
        seconds = time.monotonic() - started
        replica.log.info(
            "replica_started",
            pid=replica.pid,
            raft_address=replica.raft_address,
            warm=warm,
            seconds=round(seconds, 3),
        )
        return env.reply(
            {"pid": replica.pid, "raft_address": replica.raft_address, "warm": warm, "start_s": seconds}
        )

    async def _launch(
        self,
        key: ReplicaKey,
        replica: ReplicaProcess,
        *,
        join: bool,
        warm_ok: bool,
        imports: Sequence[str] = (),
    ) -> bool:
        """Start ``replica`` (when ``warm_ok``: in a pre-warmed runtime, or forked from the
        runtime template), wait for its registration and connect its client sockets; True if it
        did not start cold. ``imports``: a resumed kernel's modules, which the template imports
        before it forks. On failure the process is stopped and forgotten, and ``LaunchFailed``
        says why."""
        self.replicas[key] = replica
        self._link.start_began()
        try:
            launch: dict[str, Any] = {
                "local_scheduler": self.address,
                "config_json": self.cfg.to_json(),
                "join": join,
                "on_exit": self._on_replica_exit,
                "on_spawned": self._link.spawned,
            }
            # a ready warm runtime first, unless the kernel's image needs modules it lacks; else
            # a fork of the template (which imports them); else a cold start
            template = self.template if self.template is not None and self.template.alive else None
            runtime = None
            if warm_ok and (template is None or not set(imports) - set(self.warm_pool.imports)):
                runtime = self.warm_pool.take()
            forked = False
            if warm_ok and runtime is None and template is not None:
                try:
                    await replica.fork_from(template, imports=list(imports), **launch)
                    forked = True
                except TemplateGone as exc:
                    replica.log.warning("runtime_template_unusable", reason=str(exc))
            if runtime is not None:
                try:
                    await replica.adopt(runtime, **launch)
                except (BrokenPipeError, ConnectionResetError):  # it died as we handed it over
                    replica.log.warning("warm_runtime_lost", pid=runtime.pid)
                    self._link.exited(replica)
                    runtime = None
            if runtime is None and not forked:
                await replica.spawn(python=str(self.cfg.get("kernel.python")), **launch)
            await asyncio.wait_for(asyncio.shield(replica.registered), self._start_timeout)
            replica.connect(self._ctx, self._sink_for(replica))
            return forked or runtime is not None
        except BaseException as exc:
            await self._stop(replica)
            self.replicas.pop(key, None)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise LaunchFailed(str(exc) or f"no replica.register within {self._start_timeout:g}s") from None
        finally:
            self._link.start_ended()

    def _sink_for(self, replica: ReplicaProcess) -> Any:
        """Forwarding closure: the replica's Jupyter messages go upstream at the end of the loop
        turn they arrived in (``_flush_upstream``). A replica's ``execute_reply`` also ends the
        GPU commitment it held for that cell."""
        kernel_id, replica_id = replica.kernel_id, replica.replica_id
        ledger = self.ledger
        outgoing = self._outgoing
        key = (kernel_id, replica_id)

        def sink(channel: str, frames: list[bytes]) -> None:
            if not outgoing:
                asyncio.get_running_loop().call_soon(self._flush_upstream)
            outgoing.append((key, channel, frames))
            if channel == "shell" and ledger.holds(kernel_id, replica_id):
                self._release_on_reply(kernel_id, replica_id, frames)

        return sink

    def _send_upstream(self, env: Envelope) -> None:
        """Send ``env`` behind the replicas' Jupyter messages not flushed yet: the scheduler
        reads the link in order (an ``exited`` event must not overtake the replica's reply)."""
        if self._outgoing:
            self._flush_upstream(env)  # with them: the executor's ``elected`` often comes with its busy
        else:
            self._upstream.send(env)

    def _flush_upstream(self, then: Envelope | None = None) -> None:
        """Send what the replicas said in this loop turn: one ``jupyter.reply`` per run of one
        replica's messages, in arrival order, then ``then``. Every envelope costs each hop a
        CURVE box each way and a decode: to a scheduler that takes batches, all of them go as one
        ``batch``. Nothing is held for a later turn: a busy and its execute_input, or a reply and
        its idle, rarely arrive in one turn (0.9 envelopes each per cell), but holding the first
        for the second made the cell slower (see c3ef6fc)."""
        outgoing = self._outgoing.copy()  # the sinks hold this list: emptied in place
        self._outgoing.clear()
        envs = [Envelope(messages.JUPYTER_REPLY, body) for body in messages.jupyter_replies(outgoing)]
        if then is not None:
            envs.append(then)
        if self._batch_upstream:
            self._upstream.send_batch(envs)
        else:
            for env in envs:
                self._upstream.send(env)

    def _release_on_reply(self, kernel_id: str, replica_id: str, frames: list[bytes]) -> None:
        """The cell is over on this replica once it replies (its tensors went to host memory
        before the reply): release here, as the reply goes by, instead of a ``gpu.release`` round
        trip from the replica's Raft thread on every cell's critical path. (A replica still
        sends ``gpu.release`` where it binds without replying as executor; releasing twice is
        harmless.)"""
        try:
            if json.loads(frames[1]).get("msg_type") != "execute_reply":
                return
            parent = json.loads(frames[2])
            msg_id = election_key(parent["msg_id"], round_of(parent))  # what the replica bound under
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # not ours to judge: the scheduler and the client see the message as it is
        self._release_gpus(kernel_id, replica_id, msg_id, on="execute_reply")

    def _release_gpus(self, kernel_id: str, replica_id: str, msg_id: str, *, on: str) -> list[int]:
        released = list(self.ledger.release(kernel_id, replica_id, msg_id))
        if released:
            self.jobs.cells_released()  # suspended jobs get their GPUs back
        self.log.debug(
            "gpu_released", kernel=kernel_id, replica=replica_id, msg_id=msg_id, device_ids=released, on=on
        )
        return released

    async def _replica_configure(self, env: Envelope) -> Envelope:
        body = env.body
        replica = self.replicas.get((body["kernel_id"], body["replica_id"]))
        if replica is None or not replica.running or replica.identity is None:
            raise RpcError(
                f"replica {body['kernel_id']}/{body['replica_id']} is not running here", "not_found"
            )
        answer = await self._outbound.request(
            replica.identity,
            Envelope(env.type, dict(body)),  # replica.configure, .membership or .hibernate
            # a namespace image waits for the last cell's STATE, possibly written behind the reply
            timeout=HIBERNATE_TIMEOUT_S
            if env.type == messages.REPLICA_HIBERNATE
            else REPLICA_REQUEST_TIMEOUT_S,
        )
        return env.reply(answer.body)

    async def _replica_stop(self, env: Envelope) -> Envelope:
        replica = self.replicas.get((env.body["kernel_id"], env.body["replica_id"]))
        if replica is None:
            return env.reply({"returncode": None})
        returncode = await self._stop(replica)
        return env.reply({"returncode": returncode})

    def _replica_jupyter_ip(self) -> str:
        """Where a replica binds its Jupyter sockets: only this local scheduler connects to them,
        so a node that binds every interface keeps them on loopback."""
        ip = str(self.cfg.get("cluster.ip"))
        return "127.0.0.1" if is_wildcard(ip) else ip

    def _raft_host(self) -> str:
        """The address this host's replicas bind and register for their Raft links: one other
        hosts reach (shared/host_address.py), looked up once it resolves."""
        if self._advertised is None:
            try:
                self._advertised = advertised_ip(
                    str(self.cfg.get("cluster.ip")),
                    str(self.cfg.get("host.advertise_ip") or ""),
                    self.scheduler_address,
                )
            except (OSError, ValueError) as exc:
                raise RpcError(
                    f"no address for this host's Raft links ({exc}); set host.advertise_ip", "start_failed"
                ) from None
            self.log.info("raft_host", address=self._advertised)
        return self._advertised

    def _new_replica(self, key: ReplicaKey, body: dict[str, Any]) -> ReplicaProcess:
        """The process record for a start or a restart: the same data dir for the same replica."""
        try:
            raft_identity = raft_identity_json(body.get("raft_identity"), key[0], key[1])
        except ValueError as exc:
            raise RpcError(f"unusable raft_identity: {exc}", "bad_request") from None
        try:
            launch = KernelLaunch.from_wire(body.get("launch"))
            working_dir, warning = launch.directory_on_this_host()
        except LaunchError as exc:
            raise RpcError(f"{exc} ({self.host_id})", "start_failed") from None
        if warning is not None:
            self.log.warning("working_dir_missing", kernel=key[0], replica=key[1], reason=warning)
        replica = ReplicaProcess(
            host_id=self.host_id,
            kernel_id=key[0],
            replica_id=key[1],
            key=body["key"],
            signature_scheme=str(body.get("signature_scheme") or "hmac-sha256"),
            resources=dict(body["resources"]),
            data_dir=self._data_root / key[0] / key[1],
            ip=self._replica_jupyter_ip(),
            jupyter_ipc_dir=self._link.socket_path.parent if self._link.socket_path is not None else None,
            raft_host=self._raft_host(),
            raft_identity=raft_identity,
            launch=launch,
            working_dir=working_dir,
        )
        self._link.prepare(replica)
        return replica

    async def _replica_restart(self, env: Envelope) -> Envelope:
        """Restart one replica in place (after a crash, or to replace its process): stop it if it
        still runs, then start the same replica id on the same data dir. It comes back as the
        same Raft member (log, snapshots and address kept) and rebuilds its namespace from its
        snapshot, the log tail and the data store before it may execute; the global scheduler
        then sends ``replica.configure`` with the peers. Not a replacement by a new member."""
        body = env.body
        key: ReplicaKey = (body["kernel_id"], body["replica_id"])
        if "key" not in body or "resources" not in body:
            raise RpcError(
                "replica.restart to a local scheduler needs the kernel's key and resources", "bad_request"
            )
        old = self.replicas.get(key)
        if old is not None:
            await self._stop(old)
            await old.wait_exit()  # its ``exited`` event goes upstream before this reply
        replica = self._new_replica(key, body)
        if not (replica.data_dir / "raft").is_dir():
            raise RpcError(
                f"replica {key[0]}/{key[1]} has no Raft storage on host {self.host_id} to restart from",
                "not_found",
            )
        replica.keep_data = True
        try:
            await self._launch(key, replica, join=False, warm_ok=False)
        except LaunchFailed as exc:
            replica.log.error("replica_restart_failed", reason=exc.reason)
            raise RpcError(f"{exc.reason} | log: {replica.log_tail()[-800:]}", "start_failed") from None
        replica.log.info("replica_restarted", pid=replica.pid, raft_address=replica.raft_address)
        return env.reply({"pid": replica.pid, "raft_address": replica.raft_address})

    async def _stop(self, replica: ReplicaProcess) -> int | None:
        def ask() -> None:
            if replica.identity is not None:
                self._link.server.send(
                    replica.identity,
                    Envelope(
                        messages.REPLICA_STOP,
                        {"kernel_id": replica.kernel_id, "replica_id": replica.replica_id},
                    ),
                )

        return await replica.stop(ask=ask, grace_s=STOP_GRACE_S)

    def _on_replica_exit(self, replica: ReplicaProcess) -> None:
        self._link.exited(replica)
        key = (replica.kernel_id, replica.replica_id)
        if self.replicas.get(key) is replica:
            del self.replicas[key]
        released = self.ledger.release_replica(replica.kernel_id, replica.replica_id)
        if released:
            self.jobs.cells_released()
        replica.log.log(
            20 if replica.stopping else 30,
            "replica_exited",
            returncode=replica.returncode,
            requested=replica.stopping,
            released_gpus=list(released),
        )
        if replica.registered.done() and not replica.registered.exception():
            self._send_upstream(
                Envelope(
                    messages.REPLICA_EVENT,
                    {
                        "kernel_id": replica.kernel_id,
                        "replica_id": replica.replica_id,
                        "event": "exited",
                        "detail": {"returncode": replica.returncode, "requested": replica.stopping},
                    },
                )
            )

    # ---- from replicas ----------------------------------------------------------------------

    def _on_replica_message(self, identity: bytes, env: Envelope) -> Envelope | None:
        body = env.body
        if env.type == messages.GPU_COMMIT:
            return self._gpu_commit(env)
        if env.type == messages.GPU_RELEASE:
            released = self._release_gpus(
                body["kernel_id"], body["replica_id"], body["msg_id"], on="gpu.release"
            )
            return env.reply({"device_ids": released})
        if env.type == messages.REPLICA_EVENT:
            replica = self.replicas.get((body["kernel_id"], body["replica_id"]))
            if replica is not None and body["event"] == "raft_role":
                role = (body.get("detail") or {}).get("role")
                replica.role = role.lower() if isinstance(role, str) else replica.role
            if replica is not None and body["event"] == "pinned":
                detail = body.get("detail") or {}
                if isinstance(detail.get("pinned"), bool) and isinstance(detail.get("at"), int | float):
                    replica.pin = (detail["pinned"], float(detail["at"]))
            self._send_upstream(Envelope(messages.REPLICA_EVENT, dict(body)))
            return None  # a push: the replica awaits no answer (one would cost it a wake-up)
        if env.type == messages.REPLICA_REGISTER:
            return self._replica_register(identity, env)
        if env.type in (messages.REPLY, messages.ERROR):
            if not self._outbound.on_answer(env, identity) and env.type == messages.ERROR:
                self.log.warning("replica_error", reason=body.get("reason"))
            return None
        return env.error(f"a local scheduler does not accept {env.type!r} from replicas", code="unsupported")

    def _replica_register(self, identity: bytes, env: Envelope) -> Envelope:
        body = env.body
        replica = self.replicas.get((body["kernel_id"], body["replica_id"]))
        if replica is None or not replica.running:
            return env.error(
                f"no replica {body['kernel_id']}/{body['replica_id']} was started here", code="not_found"
            )
        if replica.pid != body["pid"]:
            replica.log.info("register_pid_differs", spawned=replica.pid, reported=body["pid"])
        replica.identity = identity
        replica.raft_address = body["raft_address"]
        if not replica.registered.done():
            replica.registered.set_result(None)
        return env.reply({"host_id": self.host_id})

    def _gpu_commit(self, env: Envelope) -> Envelope:
        body = env.body
        try:
            device_ids = self._bind(body["kernel_id"], body["replica_id"], body["msg_id"], body["gpus"])
        except LedgerError as exc:
            return env.error(str(exc), code="no_gpus")
        return env.reply({"device_ids": device_ids})

    def _bind_ahead(
        self, replica: ReplicaProcess, header: bytes, *, designated: bool, revoke: Sequence[str] = ()
    ) -> str | None:
        """The scheduler designated this replica to execute: bind its GPUs now and push them to it
        ahead of the request, so it needs no gpu.commit round trip (that request stays the
        authority: it is idempotent, and covers a push that arrives late or bound nothing).
        Pushed right behind the request, the push lost the race to the replica's kernel thread
        in 40-70% of trivial cells (bench_latency, 2 cores), each loss a round trip more on the
        cell's path. The msg_id bound under, or None when nothing was bound."""
        try:
            parsed = json.loads(header)
            msg_id = parsed["msg_id"]
            if parsed.get("msg_type") != "execute_request" or not isinstance(msg_id, str):
                return None
            msg_id = election_key(msg_id, round_of(parsed))  # what the replica binds under
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # the replica's ipykernel reports the malformed message
        if replica.identity is None:
            return None
        body: dict[str, Any] = {
            "kernel_id": replica.kernel_id,
            "replica_id": replica.replica_id,
            "msg_id": msg_id,
            "designated": designated,
        }
        # A refusal is usually the previous cell's release still on its way (the global scheduler
        # saw that cell's reply first): the replica then asks with gpu.commit, which retries.
        with contextlib.suppress(LedgerError):
            body["device_ids"] = self._bind(
                replica.kernel_id,
                replica.replica_id,
                msg_id,
                int(replica.resources.get("gpus", 0)),
                ahead=True,
                revoke=revoke,
            )
        self._link.server.send(replica.identity, Envelope(messages.GPU_BOUND, body))
        return msg_id if "device_ids" in body else None

    def _bind(
        self,
        kernel_id: str,
        replica_id: str,
        msg_id: str,
        gpus: int,
        *,
        ahead: bool = False,
        revoke: Sequence[str] = (),
    ) -> list[int]:
        """Bind device ids (idempotent per cell). Nothing goes upstream: a binding is not a win
        (a stand-in's LEAD for a silent candidate can lose to the candidate's own), so the
        replica announces ``elected`` itself once its LEAD has won, and a replica that never
        does (lost, stopped, dead) still lets the scheduler's deadline fail the request."""
        try:
            try:
                commit = self.ledger.commit(kernel_id, replica_id, msg_id, gpus)
            except LedgerError:
                if not self.ledger.leased_count:
                    raise
                commit = self.jobs.revoke_for_cell(kernel_id, replica_id, msg_id, gpus, victims=revoke)
        except LedgerError as exc:
            self.log.warning(
                "gpu_commit_refused", kernel=kernel_id, replica=replica_id, msg_id=msg_id, reason=str(exc)
            )
            raise
        device_ids = list(commit.device_ids)
        self.log.debug(
            "gpu_bound",
            kernel=kernel_id,
            replica=replica_id,
            msg_id=msg_id,
            device_ids=device_ids,
            ahead=ahead,
        )
        return device_ids
