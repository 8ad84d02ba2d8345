"""Replicated kernels (``notebookos``), the cluster core's own scheduling plug-in: R replicas per
kernel placed by ``KernelPlacement`` under the subscription watermark, GPUs committed to one
replica per cell (``choose_executor``), and when no replica's host can commit them the cell is
*held* and the core retries a migration (``plan_migration``); one that finds no host scales out
for it (``held.py``, NotebookOS §3.4.2), and a host reserved for it wakes it here on arrival
(``WakeHeld``): the global scheduler's rule (``Migrator._resolve``) through the same core. A kernel
whose placement fails asks the autoscaler for hosts (scale-out) and waits for them up to the
core's ``start_deadline``, or fails at once when no host is coming, as a live kernel start does.

The driver (the simulator) owns the clock: it keeps when each cell was held and steps it through
``ClusterCore.look_at_held`` (the live ``Migrator``'s ``held_step``), then ``send_held`` or
``migrate_held``, and ``held_migration_failed`` decides when to look again.
Drains for a scale-in are planned per replica by ``ClusterCore.plan_drain`` and applied here with
``move_replica``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.cluster_core.drain import ReplicaToMove
from shared.cluster_core.gpu_ledger import GpuLedger
from shared.cluster_core.held import held_kernel
from shared.cluster_core.moves import executor_for, plan_held_migration
from shared.cluster_core.reservations import ArrivedReservations
from shared.cluster_core.sessions import (
    Action,
    Held,
    Migrate,
    Queued,
    Rejected,
    RunCell,
    Session,
    StartFailed,
    StartRuntime,
    StopRuntime,
    WakeHeld,
)
from shared.cluster_core.starts import can_add_hosts, start_unplaced, start_waits
from shared.policies.autoscale import Autoscaler, ScaleOut
from shared.policies.executor_choice import HostLedgerView, ReplicaView
from shared.policies.kernel_placement import KernelPlacement
from shared.policies.migration import MigrationPlan, NoTarget
from shared.policies.placement import HostView, PlacementRequest
from shared.policies.placement_index import PlacementIndex

REASON_HELD = "every replica yielded and no host can bind the GPUs now"


@dataclass(slots=True)
class ReplicatedKernel:
    session: Session
    hosts: list[str]  # replica i runs on hosts[i]
    last_executor: int | None = None
    running: dict[str, int] = field(default_factory=dict)  # cell -> replica index
    held: set[str] = field(default_factory=set)  # cells waiting for a replica that can run them


class ReplicatedKernels:
    """Replicated kernels: subscribe R hosts, bind GPUs per cell, hold and migrate when all yield."""

    name = "notebookos"

    def __init__(
        self,
        placement: KernelPlacement,
        autoscaler: Autoscaler | None = None,
        *,
        hosts: dict[str, int] | None = None,
        prewarmed: dict[str, int] | None = None,
        arrived: ArrivedReservations | None = None,
    ) -> None:
        self.placement = placement  # the core's: the very object the live scheduler places with
        self.replicas = placement.replicas_per_kernel
        self.watermark = placement.watermark
        self.index = PlacementIndex(self.watermark)
        self.autoscaler = autoscaler
        # the core's: hosts that came with reservations look subscribed to the kernels not waiting
        self.arrived = arrived if arrived is not None else ArrivedReservations()
        self.prewarmed = prewarmed if prewarmed is not None else {}
        self.kernels: dict[str, ReplicatedKernel] = {}
        self.ledgers: dict[str, GpuLedger] = {}  # GPUs committed to cells; subscriptions in ``index``
        self.waiting_sessions: deque[Session] = deque()
        self.migrations = 0
        for h, g in (hosts or {}).items():
            self.ledgers[h] = GpuLedger(range(g))
            self.index.upsert(HostView(h, g, replicas_per_kernel=self.replicas))

    def _update(self, host_id: str, *, subscribed: int = 0) -> None:
        """Re-index ``host_id``: its committed GPUs as its ledger says, ``subscribed`` more GPUs,
        its warm runtimes as ``prewarmed`` says."""
        v = self.index.get(host_id)
        ledger = self.ledgers.get(host_id)
        if v is not None and ledger is not None:  # the constructor, not replace: this runs twice per cell
            self.index.upsert(
                HostView(
                    v.host_id,
                    v.gpus,
                    ledger.committed_count,
                    max(v.subscribed_gpus + subscribed, 0),
                    v.capacity,
                    v.subscribed,
                    v.cordoned,
                    v.alive,
                    v.replicas_per_kernel,
                    self.prewarmed.get(host_id, 0),
                )
            )

    # ---- hosts ------------------------------------------------------------------------------

    def add_host(self, host_id: str, gpus: int) -> list[Action]:
        self.ledgers[host_id] = GpuLedger(range(gpus))
        self.index.upsert(HostView(host_id, gpus, replicas_per_kernel=self.replicas))
        wakes: list[Action] = []
        if self.autoscaler is not None:  # sessions' placement below re-finds the room
            reservations = self.autoscaler.on_host_registered(host_id)
            self.arrived.arrived(host_id, reservations)
            for key, _ in reservations:
                kernel = self.kernels.get(held_kernel(key) or "")
                if kernel is not None and kernel.held:
                    wakes.extend(WakeHeld(kernel.session.session_id, c) for c in sorted(kernel.held))
        return [*wakes, *self._retry_sessions()]

    def set_warm(self, host_id: str, count: int) -> None:
        """The host's pool now holds ``count`` ready runtimes (placement prefers such hosts among
        equals, ``WarmRuntimeScore``)."""
        if host_id in self.ledgers:
            self.prewarmed[host_id] = max(count, 0)
            self._update(host_id)

    def remove_host(self, host_id: str) -> None:
        self.index.remove(host_id)
        self.ledgers.pop(host_id, None)

    def replicas_on(self, host_id: str) -> list[ReplicaToMove]:
        """The replicas a release of ``host_id`` has to move, for ``ClusterCore.plan_drain``."""
        return [
            ReplicaToMove(
                sid,
                str(i),
                kernel.session.resources,
                tuple(ReplicaView(str(j), h) for j, h in enumerate(kernel.hosts)),
            )
            for sid, kernel in self.kernels.items()
            for i, h in enumerate(kernel.hosts)
            if h == host_id
        ]

    def move_replica(self, session_id: str, plan: MigrationPlan) -> Migrate:
        """Carry out one planned move (a drain's): the replica now lives on ``plan.target_host``."""
        kernel = self.kernels[session_id]
        g = kernel.session.resources.gpus
        kernel.hosts[int(plan.replica_id)] = plan.target_host
        if plan.use_prewarmed and self.prewarmed.get(plan.target_host, 0) > 0:
            self.prewarmed[plan.target_host] -= 1
        self._update(plan.source_host, subscribed=-g)
        self._update(plan.target_host, subscribed=g)
        self.migrations += 1
        return Migrate(session_id, plan)

    # ---- sessions ---------------------------------------------------------------------------

    def on_session_start(self, session: Session) -> list[Action]:
        return self._place(session, scale=True)

    def _place(self, session: Session, *, scale: bool) -> list[Action]:
        """Place the R replicas, or queue the session (asking for hosts only the first time)."""
        g = session.resources.gpus
        request = PlacementRequest(session.session_id, session.resources, self.replicas)
        decision = self.arrived.place(
            self.placement, self.index, request, can_add_hosts=self._can_add_hosts()
        )
        if not decision.ok:
            actions: list[Action] = [Queued(session.session_id, None, decision.explain())]
            if scale and self.autoscaler is not None:
                decision_out = start_unplaced(self.autoscaler, request, decision, len(self.index))
                if isinstance(decision_out, ScaleOut):
                    actions.append(decision_out)
                if not start_waits(self.autoscaler, session.session_id):
                    # nothing is coming for it: the live start fails here (``autoscaling.place``)
                    why = f"{decision.explain()}; no host is coming: {decision_out.reason}"
                    return [StartFailed(session.session_id, why)]
            self.waiting_sessions.append(session)
            return actions
        for host in decision.hosts:
            self._update(host, subscribed=g)
        self._done_waiting(session.session_id)  # placed: hosts still coming serve others
        self.kernels[session.session_id] = ReplicatedKernel(session, list(decision.hosts))
        return [StartRuntime(session.session_id, h, replica=i) for i, h in enumerate(decision.hosts)]

    def _can_add_hosts(self) -> bool:
        """Whether a refused placement could still scale out (the live scheduler asks the same)."""
        return can_add_hosts(self.autoscaler, len(self.index))

    def _retry_sessions(self) -> list[Action]:
        """Place waiting sessions again; one whose reserved hosts have all arrived and that still does
        not fit asks the autoscaler again, as the live start does (``autoscaling.place``): without
        that, a session whose new host another placement took waited for hours."""
        actions: list[Action] = []
        for _ in range(len(self.waiting_sessions)):
            s = self.waiting_sessions.popleft()
            rescale = self.autoscaler is not None and not start_waits(self.autoscaler, s.session_id)
            actions.extend(a for a in self._place(s, scale=rescale) if not isinstance(a, Queued))
        return actions

    def fail_start(self, session_id: str, reason: str) -> list[Action]:
        """The session's start deadline passed while it waits for hosts: it fails (if still waiting)."""
        if all(s.session_id != session_id for s in self.waiting_sessions):
            return []
        self.waiting_sessions = deque(s for s in self.waiting_sessions if s.session_id != session_id)
        self._done_waiting(session_id)
        return [StartFailed(session_id, reason)]

    def _done_waiting(self, session_id: str) -> None:
        """The session no longer waits for hosts: its reservations, pending or arrived, go."""
        self.arrived.done(session_id)
        if self.autoscaler is not None:
            self.autoscaler.cancel(session_id)

    def on_session_end(self, session_id: str) -> list[Action]:
        self.waiting_sessions = deque(s for s in self.waiting_sessions if s.session_id != session_id)
        self._done_waiting(session_id)
        kernel = self.kernels.pop(session_id, None)
        if kernel is None:
            return []
        g = kernel.session.resources.gpus
        for cell_id, i in kernel.running.items():
            self._end_cell(kernel, cell_id, i)
        for h in kernel.hosts:
            self._update(h, subscribed=-g)
        stops: list[Action] = [StopRuntime(session_id, h, replica=i) for i, h in enumerate(kernel.hosts)]
        return [*stops, *self._retry_sessions()]

    # ---- cells ------------------------------------------------------------------------------

    def on_cell_submit(self, session_id: str, cell_id: str) -> list[Action]:
        """An executor now (its host commits the GPUs), else the cell is held for the core's retries."""
        kernel = self.kernels.get(session_id)
        if kernel is None:
            return [Rejected(session_id, cell_id, "kernel not placed yet")]
        executor = self._executor(kernel)
        if executor is None:
            kernel.held.add(cell_id)
            return [Held(session_id, cell_id, REASON_HELD)]
        return self._run(kernel, cell_id, executor)

    def retry_cell(self, session_id: str, cell_id: str) -> list[Action] | str:
        """One look at a held cell: an executor now, else one migration; the actions, or why
        neither worked (the core decides when to look again, or gives up). The drivers step a
        held cell through ``ClusterCore.held_step`` (``held_look``, ``send_held``, ``migrate_held``)."""
        if self.held_look(session_id, cell_id) is None:
            return f"cell {cell_id} of {session_id} is not held"
        sent = self.send_held(session_id, cell_id)
        return sent if sent else self.migrate_held(session_id, cell_id)

    def held_look(self, session_id: str, cell_id: str) -> tuple[bool, bool] | None:
        """(the kernel's own earlier cell still holds GPUs, a replica can run the cell now) for
        ``HeldLook``; None when the cell is not held."""
        kernel = self.kernels.get(session_id)
        if kernel is None or cell_id not in kernel.held:
            return None
        return bool(kernel.running), self._executor(kernel) is not None

    def send_held(self, session_id: str, cell_id: str) -> list[Action]:
        """Run the held cell on the replica that can run it now ([] if none can, or not held)."""
        kernel = self.kernels.get(session_id)
        if kernel is None or cell_id not in kernel.held:
            return []
        executor = self._executor(kernel)
        if executor is None:
            return []
        kernel.held.discard(cell_id)
        return self._run(kernel, cell_id, executor)

    def migrate_held(self, session_id: str, cell_id: str) -> list[Action] | str:
        """Move a replica of the held cell's kernel to a host that can bind its GPUs and run it
        there; why not when no host can."""
        kernel = self.kernels.get(session_id)
        if kernel is None or cell_id not in kernel.held:
            return f"cell {cell_id} of {session_id} is not held"
        g = kernel.session.resources.gpus
        replicas = [ReplicaView(str(i), h) for i, h in enumerate(kernel.hosts)]
        plan = plan_held_migration(
            replicas, kernel.session.resources, self.index.hosts_that_can_bind(g), self.prewarmed
        )
        if isinstance(plan, NoTarget):
            return plan.reason
        kernel.held.discard(cell_id)
        migrate = self.move_replica(session_id, plan)
        return [migrate, *self._run(kernel, cell_id, int(plan.replica_id))]

    def give_up(self, session_id: str, cell_id: str) -> None:
        """The retry deadline passed: the cell fails (live: an error execute_reply)."""
        kernel = self.kernels.get(session_id)
        if kernel is not None:
            kernel.held.discard(cell_id)

    def _executor(self, kernel: ReplicatedKernel) -> int | None:
        g = kernel.session.resources.gpus
        replicas = [ReplicaView(str(i), h) for i, h in enumerate(kernel.hosts)]
        ledger: dict[str, HostLedgerView] = {}
        for h in kernel.hosts:
            v = self.index.get(h)
            if v is not None:
                ledger[h] = HostLedgerView(h, v.idle_gpus, v.cordoned, v.alive)
        last = None if kernel.last_executor is None else str(kernel.last_executor)
        choice = executor_for(replicas, ledger, g, last)  # the live scheduler's executor choice
        return None if choice.executor is None else int(choice.executor)

    def _run(self, kernel: ReplicatedKernel, cell_id: str, i: int) -> list[Action]:
        g = kernel.session.resources.gpus
        self.ledgers[kernel.hosts[i]].commit(kernel.session.session_id, str(i), cell_id, g)
        self._update(kernel.hosts[i])
        kernel.last_executor = i
        kernel.running[cell_id] = i
        return [RunCell(kernel.session.session_id, cell_id, kernel.hosts[i], g)]

    def on_cell_end(self, session_id: str, cell_id: str) -> list[Action]:
        kernel = self.kernels.get(session_id)
        if kernel is None or cell_id not in kernel.running:
            return []
        self._end_cell(kernel, cell_id, kernel.running.pop(cell_id))
        return []

    def _end_cell(self, kernel: ReplicatedKernel, cell_id: str, i: int) -> None:
        ledger = self.ledgers.get(kernel.hosts[i])
        if ledger is not None:
            ledger.release(kernel.session.session_id, str(i), cell_id)
            self._update(kernel.hosts[i])
