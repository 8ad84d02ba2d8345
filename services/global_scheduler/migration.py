"""Moving replicas between hosts: migration when no replica can run a cell, replacement of dead
replicas, draining a host (NotebookOS §3.2.3, §3.2.5).

Every move is the same membership change of the kernel's Raft group, driven from here:
start a replica on the target host with ``join`` -> configure it with the members' addresses ->
``add_learner`` through a live member -> wait until it applied the group's log (its namespace is
rebuilt from the Raft snapshot and the STATE entries; nothing else has to be persisted, the
executor commits each cell's state before the next cell runs) -> ``promote`` -> ``remove`` the old
member -> stop the old process. A failed step rolls the new member back out.

The decisions are the cluster core's (``ClusterCore.executor_for``, ``plan_held_migration``,
``held_step``, ``held_migration_failed``, ``plan_replacement``, ``replacement_step``,
``replacement_failed``; ``shared.cluster_core.moves``), the simulator's too; this module gathers
what they look at and carries out what they decide (RPCs, sleeps, the journal). A cell that no replica can run is held here, with every later
shell request of its kernel behind it (Jupyter runs a kernel's shell requests in order), until a
replica can run it (sent on as usual), or the core gives it up (an error ``execute_reply``): a
migration that finds no host asks for one (``ClusterCore.held_migration_failed``, NotebookOS
§3.4.2) and the hold waits for it up to ``autoscale.scale_out_timeout_s``, looked at again when
it registers; with no host coming, ``scheduler.migration_deadline_s`` ends it.
Nothing here runs for a cell that has an executor: the service's hooks are two attribute checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from services.global_scheduler.cluster_state import RUNNING, ClusterState, KernelRecord, ReplicaRecord
from services.global_scheduler.held_journal import HeldJournal, HeldQueue
from services.global_scheduler.metrics import SchedulerMetrics
from services.global_scheduler.reply_merger import Failed, Forward
from shared import messages
from shared.cluster_core.core import ClusterCore
from shared.cluster_core.held import HELD_POLL_S, HeldFailure, HeldLook, SendOn, WaitUntil, held_again
from shared.cluster_core.moves import (
    Abort,
    Member,
    ReplacementLook,
    ReplicaOnHost,
    explain,
    failed_election_verdict,
    membership_contact,
    replicas_to_drain,
)
from shared.config import Config
from shared.envelope import Envelope
from shared.jupyter_wire import WireError, header_of
from shared.policies.executor_choice import ReplicaView
from shared.policies.migration import GiveUp, MigrationPlan, NoTarget
from shared.rpc import RpcError, RpcTimeout

if TYPE_CHECKING:
    from services.global_scheduler.autoscaling import ClusterAutoscaler

log = structlog.get_logger("global_scheduler.migration")

MEMBERSHIP_TIMEOUT_S = 20.0
CATCH_UP_POLL_S = 0.1
OWN_GPUS_POLL_S = HELD_POLL_S  # while the kernel's own earlier cell holds the GPUs: wait, do not migrate
REASON_ALL_YIELD = "no replica's host can bind the cell's GPUs"
REASON_ELECTION_FAILED = "the cell's election failed: its executor's host could not bind the GPUs"
REASON_DEAD = "replica died"
REASON_DRAIN = "host drained"
REASON_SCALE_IN = "host released by scale-in"


class MigrationError(RuntimeError):
    """One move failed; the message names the step and the cause."""


@dataclass(slots=True)
class HeldCell:
    """The execute_request at the head of a kernel's held queue."""

    msg_id: str
    header: dict[str, Any]
    since: float  # monotonic
    attempts: int = 0
    busy_sent: bool = False  # sent before (its election failed): the client saw busy
    # after a failed election, our ledger was wrong about that host: wait for the heartbeats
    # to correct it before trusting it to pick an executor
    settle_first: bool = False


class SchedulerShell(Protocol):
    """What the migrator needs of the global scheduler that runs it: its model, its core and
    the I/O it carries out (the scheduler, not this module, talks to the hosts and the gateway)."""

    state: ClusterState
    core: ClusterCore
    metrics: SchedulerMetrics
    autoscaling: ClusterAutoscaler

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    def route_from_gateway(self, kernel: KernelRecord, channel: str, frames: list[bytes]) -> None: ...

    def to_gateway(self, kernel: KernelRecord, forwards: list[Forward]) -> None: ...

    async def start_replica(
        self, kernel: KernelRecord, replica: ReplicaRecord, *, join: bool = False
    ) -> None: ...

    async def configure_replica(
        self, kernel: KernelRecord, replica: ReplicaRecord, peers: dict[str, str]
    ) -> None: ...

    async def stop_replica(self, kernel: KernelRecord, replica: ReplicaRecord) -> None: ...

    def is_restarting(self, kernel_id: str, replica_id: str) -> bool: ...

    async def restart_lost_in_place(self, kernel: KernelRecord, replica_id: str) -> None: ...

    async def ask_host(self, host_id: str, env: Envelope, timeout: float) -> Envelope: ...


class Migrator:
    """Per global scheduler: held cells, moves in flight (one per kernel at a time), counters."""

    def __init__(self, scheduler: SchedulerShell, cfg: Config, *, clock: Callable[[], float]) -> None:
        sched = cfg["scheduler"]
        self._gs = scheduler
        self._clock = clock
        # when to retry a held cell or a replacement, when to give up, the first wait: the core's
        self._core = scheduler.core
        self.catch_up_timeout = float(sched["migration_catch_up_timeout_s"])
        self.replace_dead = bool(sched["replace_dead_replicas"])
        self._held: dict[str, HeldCell] = {}  # kernel_id -> the cell waiting for a replica
        # held queues on disk, so a restarted scheduler still runs them (held_journal.py)
        self._journal = HeldJournal(cfg.state_dir() / "scheduler" / "held")
        self._restored: set[str] = set()  # kernels whose queue came back from it, not resolving yet
        self._resolving: set[str] = set()  # kernels whose held cell has a _resolve running
        self._locks: dict[str, asyncio.Lock] = {}
        self._issued: dict[str, int] = {}  # kernel_id -> highest replica number handed out
        self._replacing: set[tuple[str, str]] = set()
        self._retired: set[tuple[str, str]] = set()  # (kernel_id, replica_id) removed from a group

    # ---- cells no replica can run -------------------------------------------------------------

    def hold(self, kernel: KernelRecord, msg_id: str, frames: list[bytes]) -> bool:
        """Called when an execute_request got no executor. Keep it (and the kernel's later shell
        requests) here instead of letting every replica yield (the core said to:
        ``moves.holds_cell``); False: it cannot be parsed, route it as usual."""
        try:
            header = header_of(frames)
        except WireError:
            return False
        kernel.router.withdraw(msg_id)
        kernel.held = [frames]
        cell = self._held.get(kernel.kernel_id)
        if cell is None or not held_again(cell.msg_id, msg_id):
            self._held[kernel.kernel_id] = HeldCell(msg_id, header, self._clock())
            log.info("cell_held", kernel=kernel.kernel_id, msg_id=msg_id, reason=REASON_ALL_YIELD)
        self.persist(kernel)
        if kernel.kernel_id not in self._resolving:
            self._resolving.add(kernel.kernel_id)
            self._gs.spawn(self._resolve(kernel))
        return True

    def hold_failed_election(
        self, kernel: KernelRecord, msg_id: str, frames: list[bytes], *, round_: int, busy_sent: bool
    ) -> None:
        """A cell sent to replicas whose election failed for lack of GPUs (the router withdrew
        it): held at the head of the kernel's queue like a cell no replica could take, then sent
        on as election round ``round_`` once a replica (moved, if need be) can bind the GPUs.
        After ``moves.MAX_ELECTION_ROUNDS`` failed rounds (``failed_election_verdict``), or if the kernel no longer runs, the client
        gets an error reply instead."""
        try:
            header = header_of(frames)
        except WireError:  # it was routed, so it parsed: cannot happen, but never hang the client
            header = {"msg_id": msg_id, "msg_type": "execute_request"}
        kernel.held = [frames, *(kernel.held or [])]
        # a later cell held meanwhile stays queued behind this one (held afresh when sent on)
        cell = HeldCell(msg_id, header, self._clock(), busy_sent=busy_sent, settle_first=True)
        self._held[kernel.kernel_id] = cell
        self.persist(kernel)
        verdict = failed_election_verdict(kernel.kernel_id, kernel.state, round_)
        if verdict is not None:
            self._give_up(kernel, cell, verdict, "NoExecutorAvailable")
            return
        log.info("cell_held", kernel=kernel.kernel_id, msg_id=msg_id, reason=REASON_ELECTION_FAILED)
        if kernel.kernel_id not in self._resolving:
            self._resolving.add(kernel.kernel_id)
            self._gs.spawn(self._resolve(kernel))

    async def _resolve(self, kernel: KernelRecord) -> None:
        """Until the held cell is sent on or given up: an executor now? else migrate, else back off."""
        kernel_id = kernel.kernel_id
        clog = log.bind(kernel=kernel_id)
        try:
            while kernel.held is not None and kernel_id in self._held:
                cell = self._held[kernel_id]
                gone = kernel.state != RUNNING or self._gs.state.kernels.get(kernel_id) is not kernel
                look = HeldLook(
                    cell.since,
                    cell.attempts,
                    not gone and self._holds_gpus(kernel),
                    cell.settle_first,
                    not gone and self._executor_now(kernel),
                    kernel_gone=gone,
                )
                now = self._clock()
                step = self._core.held_step(look, now, OWN_GPUS_POLL_S)
                if isinstance(step, WaitUntil):
                    await asyncio.sleep(max(step.at - now, 0.0))
                    continue
                if isinstance(step, SendOn):
                    await self._dispatch_or_pause(kernel)
                    continue
                failure = await self._try_migration(kernel, cell, clog)
                if failure is None:
                    await self._dispatch_or_pause(kernel)
                    continue
                reason, no_host = failure
                cell.attempts += 1
                now = self._clock()
                scaling = self._gs.autoscaling
                failure = HeldFailure(
                    kernel_id, kernel.resources, cell.attempts, cell.since, now, reason, no_host
                )
                held = self._core.held_migration_failed(
                    failure, live_hosts=scaling.live_hosts(), can_add_hosts=scaling.enabled
                )
                if held.scale_out is not None:
                    clog.info("held_cell_scale_out", msg_id=cell.msg_id, reason=held.scale_out.reason)
                    await scaling.scale_out_for_held(kernel_id, held.scale_out)
                decision = held.decision
                if isinstance(decision, GiveUp):
                    self._give_up(kernel, cell, decision.reason)
                    continue
                clog.info("migration_retry", msg_id=cell.msg_id, attempt=cell.attempts, reason=reason)
                await scaling.wait_for_held_host(kernel_id, max(decision.at - self._clock(), 0.0))
        finally:
            self._resolving.discard(kernel_id)

    async def _dispatch_or_pause(self, kernel: KernelRecord) -> None:
        """Send the held requests on; if the cell was held again at once (another kernel's cell
        took the GPUs first), pause before the next look rather than spin."""
        self._dispatch(kernel)
        if kernel.held is not None:
            await asyncio.sleep(OWN_GPUS_POLL_S)

    def _holds_gpus(self, kernel: KernelRecord) -> bool:
        for replica in kernel.replicas.values():
            host = self._gs.state.hosts.get(replica.host_id)
            if host is not None and host.ledger.holds_kernel(kernel.kernel_id):
                return True
        return False

    def _executor_now(self, kernel: KernelRecord) -> bool:
        state = self._gs.state
        choice = self._core.executor_for(
            state.replica_views(kernel),
            state.ledger_views({r.host_id for r in kernel.replicas.values()}),
            kernel.resources.gpus,
            kernel.router.last_executor,
        )
        return choice.executor is not None

    async def _try_migration(
        self, kernel: KernelRecord, cell: HeldCell, clog: Any
    ) -> tuple[str, bool] | None:
        """One attempt; None when a replica now sits on a host that can bind the GPUs, else why
        not and whether it was for want of a host (not a move that broke)."""
        async with self._lock(kernel.kernel_id):
            if self._executor_now(kernel):
                return None
            plan = self._core.plan_held_migration(
                self._gs.state.replica_views(kernel),
                kernel.resources,
                self._gs.state.host_views(),
                self._warm_runtimes(),
            )
            if isinstance(plan, NoTarget):
                return explain(plan), True
            # Keep the target's GPUs for this cell while the replica moves there.
            self._gs.state.reserve(kernel, cell.msg_id, plan.target_host)
            try:
                await self._move(kernel, plan, REASON_ALL_YIELD)
            except MigrationError as exc:
                clog.warning("migration_failed", msg_id=cell.msg_id, reason=str(exc))
                return str(exc), False
            finally:
                self._gs.state.release(kernel, cell.msg_id)
                kernel.reserved_on.pop(cell.msg_id, None)
                target = self._gs.state.hosts.get(plan.target_host)
                if target is not None:
                    target.ledger.forget(kernel.kernel_id, cell.msg_id)
        return None

    def _dispatch(self, kernel: KernelRecord) -> None:
        """Send the held requests on, in order, through the normal path (which may hold again)."""
        held, kernel.held = kernel.held or [], None
        self.persist(kernel)  # before they go: a crash in between must not send them twice
        for frames in held:
            self._gs.route_from_gateway(kernel, "shell", frames)
        if kernel.held is None and self._held.pop(kernel.kernel_id, None) is not None:
            self._gs.autoscaling.held_over(kernel.kernel_id)

    # ---- held queues across a scheduler restart (held_journal.py) ------------------------------

    def persist(self, kernel: KernelRecord) -> None:
        """Write the kernel's held queue to disk as it is now (nothing held: remove it)."""
        cell = self._held.get(kernel.kernel_id)
        queue = None
        if kernel.held and cell is not None:
            queue = HeldQueue(
                cell.msg_id,
                kernel.router.round_of(cell.msg_id),
                cell.busy_sent,
                tuple(tuple(frames) for frames in kernel.held),
            )
        self._journal.save(kernel.kernel_id, queue)

    def close(self) -> None:
        """Finish writing the held queues (the journal's writer thread) at shutdown."""
        self._journal.close()

    def restore(self, kernel: KernelRecord) -> None:
        """A kernel this restarted scheduler adopts: hold again what its predecessor held. It is
        resolved (``resume_restored``) once the kernel's hosts are back, not from the first one."""
        queue = self._journal.load(kernel.kernel_id)
        if queue is None:
            return
        requests = [list(frames) for frames in queue.requests]
        try:
            header = header_of(requests[0])
        except WireError:
            header = {"msg_id": queue.msg_id, "msg_type": "execute_request"}
        kernel.held = requests
        if queue.round_ > 0:
            kernel.router.resume_round(queue.msg_id, queue.round_, queue.busy_sent)
        self._held[kernel.kernel_id] = HeldCell(
            queue.msg_id, header, self._clock(), busy_sent=queue.busy_sent, settle_first=True
        )
        self._restored.add(kernel.kernel_id)
        log.info("held_cells_restored", kernel=kernel.kernel_id, msg_id=queue.msg_id, requests=len(requests))

    def resume_restored(self, *, rebuilding: bool, replicas: int) -> None:
        """Start resolving restored queues: of kernels with ``replicas`` live replicas back, or
        of every kernel once the restarted scheduler's rebuilding window is over."""
        for kernel_id in list(self._restored):
            kernel = self._gs.state.kernels.get(kernel_id)
            if kernel is None:
                self._restored.discard(kernel_id)
                continue
            if not self._core.resumes_restored(rebuilding, len(kernel.live_replicas()), replicas):
                continue
            self._restored.discard(kernel_id)
            if kernel.held is not None and kernel_id not in self._resolving:
                self._resolving.add(kernel_id)
                self._gs.spawn(self._resolve(kernel))

    def interrupt(self, kernel: KernelRecord) -> bool:
        """An interrupt while a cell waits for a migration ends that cell, as it would end a
        running one (the move itself goes on). True if a held cell was ended."""
        cell = self._held.get(kernel.kernel_id)
        if cell is None or kernel.held is None:
            return False
        self._give_up(kernel, cell, "interrupted while waiting for a replica to move", "KeyboardInterrupt")
        return True

    def _give_up(
        self, kernel: KernelRecord, cell: HeldCell, reason: str, ename: str = "MigrationFailed"
    ) -> None:
        log.warning("migration_gave_up", kernel=kernel.kernel_id, msg_id=cell.msg_id, reason=reason)
        held = kernel.held or []
        kernel.held = held[1:] or None
        self._held.pop(kernel.kernel_id, None)
        self._gs.autoscaling.held_over(kernel.kernel_id)
        self.persist(kernel)
        failed = Failed(cell.msg_id, cell.header, "shell", cell.busy_sent, False, False)
        self._gs.to_gateway(kernel, kernel.router.synthesize_failure(failed, ename, reason))
        if kernel.held is not None:
            self._dispatch(kernel)

    # ---- dead replicas and drained hosts ------------------------------------------------------

    def is_replacing(self, kernel_id: str, replica_id: str) -> bool:
        return (kernel_id, replica_id) in self._replacing

    def on_replica_lost(self, kernel: KernelRecord, replica: ReplicaRecord, reason: str) -> None:
        """A replica died for good and the kernel still runs: replace it on another host."""
        key = (kernel.kernel_id, replica.replica_id)
        if not self._core.replaces_lost_replica(self.replace_dead, kernel.state, key in self._replacing):
            return
        self._gs.spawn(self._replace_quietly(kernel, replica.replica_id, reason))

    async def _replace_quietly(self, kernel: KernelRecord, replica_id: str, reason: str) -> None:
        try:
            await self.replace(kernel, replica_id, f"{REASON_DEAD}: {reason}")
        except MigrationError as exc:
            log.warning("replacement_gave_up", kernel=kernel.kernel_id, replica=replica_id, reason=str(exc))
            await self._gs.restart_lost_in_place(kernel, replica_id)

    async def drain(
        self, host_id: str, *, reason: str = REASON_DRAIN, wait_for_target: bool = True
    ) -> dict[str, Any]:
        """Move every replica of a running kernel off ``host_id`` (already cordoned): ``tandem host
        drain``, and the autoscaler's scale-in (``wait_for_target=False``: a replica no host can
        take fails at once, so the scale-in is abandoned rather than held for the retry deadline)."""
        kernels = {k.kernel_id: k for k, _ in self._gs.state.replicas_on(host_id)}
        on_host = [
            ReplicaOnHost(k.kernel_id, r.replica_id, r.alive, k.state)
            for k, r in self._gs.state.replicas_on(host_id)
        ]
        moves = [(kernels[r.kernel_id], r.replica_id) for r in replicas_to_drain(on_host)]
        outcomes = await asyncio.gather(
            *(self.replace(kernel, rid, reason, wait_for_target=wait_for_target) for kernel, rid in moves),
            return_exceptions=True,
        )
        moved: list[dict[str, str]] = []
        failed: list[dict[str, str]] = []
        for (kernel, rid), outcome in zip(moves, outcomes, strict=True):
            entry = {"kernel": kernel.kernel_id, "replica": rid}
            if isinstance(outcome, BaseException):
                failed.append(entry | {"reason": str(outcome)})
            else:
                moved.append(entry | {"to": str(outcome)})
        left = [r.replica_id for k, r in self._gs.state.replicas_on(host_id) if r.alive]
        return {"host_id": host_id, "moved": moved, "failed": failed, "replicas_left": len(left)}

    async def replace(
        self, kernel: KernelRecord, replica_id: str, reason: str, *, wait_for_target: bool = True
    ) -> str:
        """Move ``replica_id`` to another host (retrying while none can take it, unless not
        ``wait_for_target``); the new replica's id. Waits while the replica executes a cell
        (moving it would lose the cell)."""
        key = (kernel.kernel_id, replica_id)
        self._replacing.add(key)
        started = self._clock()
        attempts = 0
        try:
            while True:
                replica = kernel.replicas.get(replica_id)
                look = ReplacementLook(
                    kernel.kernel_id,
                    kernel.state,
                    replica_id,
                    replica is not None,
                    replica is not None and replica.alive and self._executing_on(kernel, replica),
                )
                now = self._clock()
                step = self._core.replacement_step(look, now, OWN_GPUS_POLL_S)
                if isinstance(step, Abort):
                    raise MigrationError(step.reason)
                if isinstance(step, WaitUntil):
                    await asyncio.sleep(max(step.at - now, 0.0))
                    continue
                async with self._lock(kernel.kernel_id):
                    plan = self._core.plan_replacement(
                        replica_id,
                        self._replica_views_coming_back(kernel),
                        kernel.resources,
                        self._gs.state.host_views(),
                        self._warm_runtimes(),
                    )
                    no_target = isinstance(plan, NoTarget)
                    if isinstance(plan, MigrationPlan):
                        try:
                            return await self._move(kernel, plan, reason)
                        except MigrationError as exc:
                            why = str(exc)
                    else:
                        why = explain(plan)
                attempts += 1
                now = self._clock()
                decision = self._core.replacement_failed(
                    attempts, started, now, why, no_target=no_target, wait_for_target=wait_for_target
                )
                if isinstance(decision, GiveUp):
                    raise MigrationError(decision.reason)
                log.info("replacement_retry", kernel=kernel.kernel_id, replica=replica_id, reason=why)
                await asyncio.sleep(max(decision.at - now, 0.0))
        finally:
            self._replacing.discard(key)

    def _replica_views_coming_back(self, kernel: KernelRecord) -> list[ReplicaView]:
        """The kernel's replicas, with those being restarted in place counted alive: their host
        is taken (a replacement placed beside one would leave two replicas on one host)."""
        return [
            replace(v, alive=True) if self._gs.is_restarting(kernel.kernel_id, v.replica_id) else v
            for v in self._gs.state.replica_views(kernel)
        ]

    def _warm_runtimes(self) -> dict[str, int]:
        """Pre-warmed runtimes per host as last heartbeated: a target with one starts the
        replica without a cold start (the local scheduler takes it for any replica.start)."""
        return {host: pool.get("warm", 0) for host, pool in self._gs.metrics.warm_pools.items()}

    def _executing_on(self, kernel: KernelRecord, replica: ReplicaRecord) -> bool:
        host = self._gs.state.hosts.get(replica.host_id)
        return host is not None and host.ledger.holds_kernel(kernel.kernel_id, tentative=False)

    def retired(self, kernel_id: str, replica_id: str) -> bool:
        """Whether a move removed this replica from its kernel's Raft group: a host that comes
        back still running it (it was only unreachable) must stop it, not have it adopted."""
        return (kernel_id, replica_id) in self._retired

    # ---- the membership change ----------------------------------------------------------------

    def _lock(self, kernel_id: str) -> asyncio.Lock:
        return self._locks.setdefault(kernel_id, asyncio.Lock())

    def _new_replica_id(self, kernel: KernelRecord) -> str:
        numbers = [int(r[1:]) for r in kernel.replicas if r[:1] == "r" and r[1:].isdigit()]
        n = max([self._issued.get(kernel.kernel_id, 0), *numbers]) + 1
        self._issued[kernel.kernel_id] = n
        return f"r{n}"

    async def _move(self, kernel: KernelRecord, plan: MigrationPlan, reason: str) -> str:
        """Swap ``plan.replica_id`` for a new replica on ``plan.target_host``; the new id."""
        gs = self._gs
        started = time.monotonic()
        old_id = plan.replica_id
        new = ReplicaRecord(self._new_replica_id(kernel), plan.target_host, alive=False)
        mlog = log.bind(kernel=kernel.kernel_id, replica=old_id, new_replica=new.replica_id)
        mlog.info(
            "migration_started",
            source=plan.source_host,
            target=plan.target_host,
            prewarmed=plan.use_prewarmed,
            reason=reason,
        )
        kernel.replicas[new.replica_id] = new
        stage = "start"
        contact: ReplicaRecord | None = None
        try:
            await gs.start_replica(kernel, new, join=True)
            members = {
                r.replica_id: r.raft_address
                for r in kernel.replicas.values()
                if r.alive and r.replica_id != new.replica_id and r.raft_address
            }
            stage = "configure"
            await gs.configure_replica(kernel, new, members | {new.replica_id: new.raft_address})
            contact = self._contact(kernel, exclude={old_id, new.replica_id})
            stage = "add_learner"
            view = await self._membership(kernel, contact, "add_learner", new.replica_id, new.raft_address)
            stage = "catch_up"
            await self._caught_up(kernel, new, int(view.get("commit") or 0))
            stage = "promote"
            await self._membership(kernel, contact, "promote", new.replica_id)
            stage = "remove"
            await self._membership(kernel, contact, "remove", old_id)
        except (RpcError, RpcTimeout, MigrationError) as exc:
            await self._roll_back(kernel, new, contact, stage)
            raise MigrationError(f"{stage} of {new.replica_id} on {plan.target_host} failed: {exc}") from None
        if kernel.state != RUNNING:  # it died or was shut down meanwhile
            await self._roll_back(kernel, new, None, stage)
            raise MigrationError(f"kernel {kernel.kernel_id} became {kernel.state} during the move")
        new.alive = True
        self._retired.add((kernel.kernel_id, old_id))
        old = kernel.replicas.pop(old_id, None)
        if old is not None:
            was_alive, old.alive, old.role = old.alive, False, None
            if was_alive:
                gs.spawn(gs.stop_replica(kernel, old))
        seconds = round(time.monotonic() - started, 3)
        kernel.migrations += 1
        gs.metrics.record_migration()
        kernel.last_migration = {
            "replica": old_id,
            "new_replica": new.replica_id,
            "from": plan.source_host,
            "to": plan.target_host,
            "reason": reason,
            "seconds": seconds,
            "at": time.time(),
        }
        mlog.info("migration_done", source=plan.source_host, target=plan.target_host, seconds=seconds)
        return new.replica_id

    def _contact(self, kernel: KernelRecord, *, exclude: set[str]) -> ReplicaRecord:
        """The live member to propose the changes through (the core chooses: ``membership_contact``)."""
        members = [Member(r.replica_id, r.role, r.alive and r.started) for r in kernel.replicas.values()]
        chosen = membership_contact(members, exclude)
        if chosen is None:
            raise MigrationError("no live member of the kernel's Raft group to propose the change")
        return kernel.replicas[chosen]

    async def _membership(
        self, kernel: KernelRecord, via: ReplicaRecord, action: str, member: str = "", address: str = ""
    ) -> dict[str, Any]:
        body = {"kernel_id": kernel.kernel_id, "replica_id": via.replica_id, "action": action}
        if member:
            body["member"] = member
        if address:
            body["address"] = address
        answer = await self._gs.ask_host(
            via.host_id, Envelope(messages.REPLICA_MEMBERSHIP, body), timeout=MEMBERSHIP_TIMEOUT_S
        )
        return dict(answer.body)

    async def _caught_up(self, kernel: KernelRecord, new: ReplicaRecord, index: int) -> None:
        """Until the learner applied the group's log up to ``index`` (the add_learner's commit)."""
        deadline = time.monotonic() + self.catch_up_timeout
        applied = 0
        while time.monotonic() < deadline:
            view = await self._membership(kernel, new, "status")
            applied = int(view.get("applied") or 0)
            if applied >= index:
                return
            await asyncio.sleep(CATCH_UP_POLL_S)
        raise MigrationError(
            f"the new member applied {applied} of {index} log entries within {self.catch_up_timeout:g}s"
        )

    async def _roll_back(
        self, kernel: KernelRecord, new: ReplicaRecord, contact: ReplicaRecord | None, stage: str
    ) -> None:
        kernel.replicas.pop(new.replica_id, None)
        if contact is not None and stage not in ("start", "configure", "add_learner"):
            with contextlib.suppress(RpcError, RpcTimeout):
                await self._membership(kernel, contact, "remove", new.replica_id)
        if new.started:
            await self._gs.stop_replica(kernel, new)
