"""The evaluation's scheduling modes (NotebookOS §5.1.1) behind one session-level interface.

The simulator and the global scheduler ask a ``SessionPolicy`` only four things, the four events
of a notebook session's life, and carry out the returned actions in order:

    on_session_start(session)           -> actions
    on_cell_submit(session_id, cell_id) -> actions
    on_cell_end(session_id, cell_id)    -> actions
    on_session_end(session_id)          -> actions

plus cluster membership (``add_host``/``remove_host``) since hosts come and go with autoscaling.
Each policy keeps one ``GpuLedger`` per host (the cluster's one ledger model,
``shared.cluster_core.gpu_ledger``) of what it allocated: in every mode the policy is the authority
on which GPUs a session holds, so the driver never has to reconcile two books. Actions are plain
data (start/stop a runtime, take/return a warm one, run a cell, queue, migrate, scale out, reject);
"queued" cells are dispatched by a later event (a cell or session ending, a host arriving), never
by a timer, so the policies stay clock-free.

* ``reservation``: one runtime per session with its GPUs bound exclusively for the session's life.
* ``batch``: FCFS over cells; a fresh runtime per cell with its GPUs, stopped when the cell ends.
* ``lcp``: a large pool of warm runtimes; a cell takes one (and GPUs), returns it when done.
* ``notebookos``: 3 subscribed replicas per session (placement index + SR limit), GPUs bound to one
  replica per cell, migration when no replica's host can bind, scale-out when placement fails.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from shared.cluster_core.gpu_ledger import GpuLedger
from shared.policies.autoscale import Autoscaler, ScaleOut, feasible_hosts
from shared.policies.executor_choice import HostLedgerView, ReplicaView, choose_executor
from shared.policies.kernel_placement import KernelPlacement
from shared.policies.migration import MigrationPlan, plan_migration
from shared.policies.placement import HostView, PlacementRequest
from shared.policies.placement_index import PlacementIndex
from shared.resources import Resources


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    resources: Resources


# ---- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartRuntime:
    session_id: str
    host_id: str
    bound_gpus: int = 0  # GPUs bound to it from the start (reservation, batch)
    replica: int | None = None  # notebookos: which of the R replicas


@dataclass(frozen=True, slots=True)
class StopRuntime:
    session_id: str
    host_id: str
    replica: int | None = None


@dataclass(frozen=True, slots=True)
class TakeWarm:
    session_id: str
    host_id: str


@dataclass(frozen=True, slots=True)
class ReturnWarm:
    session_id: str
    host_id: str


@dataclass(frozen=True, slots=True)
class RunCell:
    session_id: str
    cell_id: str
    host_id: str
    gpus: int  # bind these before executing (already bound under reservation)


@dataclass(frozen=True, slots=True)
class Queued:
    session_id: str
    cell_id: str | None  # None: the session start itself waits
    reason: str


@dataclass(frozen=True, slots=True)
class Migrate:
    session_id: str
    plan: MigrationPlan


@dataclass(frozen=True, slots=True)
class Rejected:
    session_id: str
    cell_id: str | None
    reason: str


Action = StartRuntime | StopRuntime | TakeWarm | ReturnWarm | RunCell | Queued | Migrate | Rejected | ScaleOut


class SessionPolicy(Protocol):
    name: str

    def add_host(self, host_id: str, gpus: int) -> list[Action]: ...

    def remove_host(self, host_id: str) -> None: ...

    def on_session_start(self, session: Session) -> list[Action]: ...

    def on_cell_submit(self, session_id: str, cell_id: str) -> list[Action]: ...

    def on_cell_end(self, session_id: str, cell_id: str) -> list[Action]: ...

    def on_session_end(self, session_id: str) -> list[Action]: ...


# ---- the hosts' GPU ledgers ------------------------------------------------------------------


# reservation binds a session's GPUs for its whole life: one commit under this cell id
SESSION = "session"


def host_ledgers(hosts: Mapping[str, int] | None) -> dict[str, GpuLedger]:
    """One ledger per host of ``{host_id: GPUs}``."""
    return {h: GpuLedger(range(g)) for h, g in (hosts or {}).items()}


def best_fit(
    ledgers: Mapping[str, GpuLedger], gpus: int, among: Mapping[str, int] | None = None
) -> str | None:
    """The host with the fewest idle GPUs that still fits ``gpus`` (bin packing), else None.

    Packing, not spreading: these baselines own whole GPUs per runtime, so spreading only
    fragments hosts (an 8-GPU request finds no host with 8 free) and keeps every host partly
    busy, so an autoscaled cluster can never release one; the simulator measured ~2x the
    servers' GPU-hours with spreading on the synthetic trace.
    """
    best: tuple[int, str] | None = None
    for h, ledger in ledgers.items():
        if among is not None and among.get(h, 0) <= 0:
            continue
        free = ledger.idle_count
        if free >= gpus and (best is None or (free, h) < best):
            best = (free, h)
    return None if best is None else best[1]


def release_on(ledgers: Mapping[str, GpuLedger], host_id: str, session_id: str, cell_id: str) -> None:
    """Give back what ``(session, cell)`` holds on ``host_id`` (nothing if the host is gone)."""
    ledger = ledgers.get(host_id)
    if ledger is not None:
        ledger.release(session_id, cell_id, cell_id)


# ---- reservation -----------------------------------------------------------------------------


class ReservationPolicy:
    name = "reservation"

    def __init__(self, hosts: Mapping[str, int] | None = None) -> None:
        self.ledgers = host_ledgers(hosts)
        self.sessions: dict[str, tuple[Session, str]] = {}  # session -> (spec, host)
        self.waiting: deque[Session] = deque()

    def add_host(self, host_id: str, gpus: int) -> list[Action]:
        self.ledgers[host_id] = GpuLedger(range(gpus))
        return self._admit()

    def remove_host(self, host_id: str) -> None:
        self.ledgers.pop(host_id, None)

    def _admit(self) -> list[Action]:
        actions: list[Action] = []
        while self.waiting:
            s = self.waiting[0]
            host = best_fit(self.ledgers, s.resources.gpus)
            if host is None:
                break
            self.waiting.popleft()
            self.ledgers[host].commit(s.session_id, SESSION, SESSION, s.resources.gpus)
            self.sessions[s.session_id] = (s, host)
            actions.append(StartRuntime(s.session_id, host, bound_gpus=s.resources.gpus))
        return actions

    def on_session_start(self, session: Session) -> list[Action]:
        self.waiting.append(session)
        actions = self._admit()
        if any(isinstance(a, StartRuntime) and a.session_id == session.session_id for a in actions):
            return actions
        return [*actions, Queued(session.session_id, None, f"no host has {session.resources.gpus} free GPUs")]

    def on_cell_submit(self, session_id: str, cell_id: str) -> list[Action]:
        entry = self.sessions.get(session_id)
        if entry is None:
            return [Rejected(session_id, cell_id, "session has no runtime yet")]
        spec, host = entry
        return [RunCell(session_id, cell_id, host, spec.resources.gpus)]

    def on_cell_end(self, session_id: str, cell_id: str) -> list[Action]:
        return []  # the GPUs stay bound: that is the point (and the waste) of this mode

    def on_session_end(self, session_id: str) -> list[Action]:
        self.waiting = deque(s for s in self.waiting if s.session_id != session_id)
        entry = self.sessions.pop(session_id, None)
        if entry is None:
            return []
        _, host = entry
        release_on(self.ledgers, host, session_id, SESSION)
        return [StopRuntime(session_id, host), *self._admit()]


# ---- batch (FCFS) and LCP share a cell queue -------------------------------------------------


class _CellQueuePolicy:
    """FCFS over cells with strict head-of-line order (no backfilling), as a batch scheduler."""

    def __init__(self, hosts: Mapping[str, int] | None) -> None:
        self.ledgers = host_ledgers(hosts)
        self.specs: dict[str, Session] = {}
        self.queue: deque[tuple[str, str]] = deque()
        self.running: dict[tuple[str, str], str] = {}  # (session, cell) -> host

    def add_host(self, host_id: str, gpus: int) -> list[Action]:
        self.ledgers[host_id] = GpuLedger(range(gpus))
        return self._dispatch()

    def remove_host(self, host_id: str) -> None:
        self.ledgers.pop(host_id, None)

    def on_session_start(self, session: Session) -> list[Action]:
        self.specs[session.session_id] = session
        return []

    def on_cell_submit(self, session_id: str, cell_id: str) -> list[Action]:
        if session_id not in self.specs:
            return [Rejected(session_id, cell_id, "unknown session")]
        self.queue.append((session_id, cell_id))
        actions = self._dispatch()
        if (session_id, cell_id) in self.running:
            return actions
        gpus = self.specs[session_id].resources.gpus
        return [*actions, Queued(session_id, cell_id, f"FCFS: waiting for {gpus} free GPUs on one host")]

    def _dispatch(self) -> list[Action]:
        actions: list[Action] = []
        while self.queue:
            session_id, cell_id = self.queue[0]
            started = self._start(session_id, cell_id, self.specs[session_id].resources.gpus)
            if started is None:
                break
            self.queue.popleft()
            actions.extend(started)
        return actions

    def _start(self, session_id: str, cell_id: str, gpus: int) -> list[Action] | None:
        raise NotImplementedError

    def _finish(self, session_id: str, host: str, gpus: int) -> list[Action]:
        raise NotImplementedError

    def on_cell_end(self, session_id: str, cell_id: str) -> list[Action]:
        host = self.running.pop((session_id, cell_id), None)
        if host is None:
            return []
        gpus = self.specs[session_id].resources.gpus
        release_on(self.ledgers, host, session_id, cell_id)
        return [*self._finish(session_id, host, gpus), *self._dispatch()]

    def on_session_end(self, session_id: str) -> list[Action]:
        self.queue = deque(q for q in self.queue if q[0] != session_id)
        actions: list[Action] = []
        for session, cell in [k for k in self.running if k[0] == session_id]:
            actions.extend(self.on_cell_end(session, cell))
        self.specs.pop(session_id, None)
        return actions


class BatchPolicy(_CellQueuePolicy):
    name = "batch"

    def __init__(self, hosts: Mapping[str, int] | None = None) -> None:
        super().__init__(hosts)

    def _start(self, session_id: str, cell_id: str, gpus: int) -> list[Action] | None:
        host = best_fit(self.ledgers, gpus)
        if host is None:
            return None
        self.ledgers[host].commit(session_id, cell_id, cell_id, gpus)
        self.running[(session_id, cell_id)] = host
        return [StartRuntime(session_id, host, bound_gpus=gpus), RunCell(session_id, cell_id, host, gpus)]

    def _finish(self, session_id: str, host: str, gpus: int) -> list[Action]:
        return [StopRuntime(session_id, host)]


class LcpPolicy(_CellQueuePolicy):
    """Cells take a warm runtime from the host's pool, or start one cold if the pool there is empty."""

    name = "lcp"

    def __init__(self, hosts: Mapping[str, int] | None = None, pool_per_host: int = 8) -> None:
        super().__init__(hosts)
        self.pool_per_host = pool_per_host
        self.warm: dict[str, int] = dict.fromkeys(self.ledgers, pool_per_host)
        self.cold_starts = 0

    def add_host(self, host_id: str, gpus: int) -> list[Action]:
        self.warm[host_id] = self.pool_per_host
        return super().add_host(host_id, gpus)

    def remove_host(self, host_id: str) -> None:
        self.warm.pop(host_id, None)
        super().remove_host(host_id)

    def _start(self, session_id: str, cell_id: str, gpus: int) -> list[Action] | None:
        host = best_fit(self.ledgers, gpus, among=self.warm) or best_fit(self.ledgers, gpus)
        if host is None:
            return None
        self.ledgers[host].commit(session_id, cell_id, cell_id, gpus)
        self.running[(session_id, cell_id)] = host
        if self.warm.get(host, 0) > 0:
            self.warm[host] -= 1
            first: Action = TakeWarm(session_id, host)
        else:
            self.cold_starts += 1
            first = StartRuntime(session_id, host)
        return [first, RunCell(session_id, cell_id, host, gpus)]

    def _finish(self, session_id: str, host: str, gpus: int) -> list[Action]:
        if host in self.warm:
            self.warm[host] += 1
        return [ReturnWarm(session_id, host)]


# ---- notebookos ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Kernel:
    session: Session
    hosts: list[str]  # replica i runs on hosts[i]
    last_executor: int | None = None
    running: dict[str, int] = field(default_factory=dict)  # cell -> replica index


class NotebookOsPolicy:
    """Replicated kernels: subscribe R hosts, bind GPUs per cell, migrate when all replicas yield."""

    name = "notebookos"

    def __init__(
        self,
        hosts: Mapping[str, int] | None = None,
        *,
        replicas: int = 3,
        watermark: float = 3.0,
        autoscaler: Autoscaler | None = None,
        prewarmed: dict[str, int] | None = None,
    ) -> None:
        self.replicas = replicas
        self.watermark = watermark
        self.index = PlacementIndex(watermark)
        self.placement = KernelPlacement(watermark, replicas)  # the very class the live scheduler runs
        self.autoscaler = autoscaler
        self.prewarmed = prewarmed if prewarmed is not None else {}
        self.kernels: dict[str, _Kernel] = {}
        self.ledgers = host_ledgers(hosts)  # GPUs committed to cells; subscriptions in ``index``
        self.waiting_sessions: deque[Session] = deque()
        self.waiting_cells: deque[tuple[str, str]] = deque()
        self.migrations = 0
        for h, g in (hosts or {}).items():
            self.index.upsert(HostView(h, g, replicas_per_kernel=replicas))

    def _update(self, host_id: str, *, subscribed: int = 0) -> None:
        """Re-index ``host_id``: its committed GPUs as its ledger says, ``subscribed`` more GPUs."""
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
                )
            )

    def add_host(self, host_id: str, gpus: int) -> list[Action]:
        self.ledgers[host_id] = GpuLedger(range(gpus))
        self.index.upsert(HostView(host_id, gpus, replicas_per_kernel=self.replicas))
        if self.autoscaler is not None:
            self.autoscaler.on_host_registered(host_id)  # placement below re-finds the room
        return [*self._retry_sessions(), *self._retry_cells()]

    def remove_host(self, host_id: str) -> None:
        self.index.remove(host_id)
        self.ledgers.pop(host_id, None)

    def drain_host(self, host_id: str) -> list[Action] | None:
        """Move every replica off ``host_id`` before a scale-in releases it; None (and no change) if one cannot move.

        ``autoscale.ScaleIn`` leaves the moving to its caller. Each replica goes where the default
        placement puts one replica with its kernel's other hosts excluded; all or nothing, so a
        refused release leaves every kernel where it was. A host with committed GPUs is never drained.
        """
        view = self.index.get(host_id)
        if view is None or view.committed_gpus:
            return None
        affected = [k for k in self.kernels.values() if host_id in k.hosts]
        self.index.upsert(replace(view, cordoned=True))
        moves: list[tuple[_Kernel, int, str]] = []
        for kernel in affected:
            g = kernel.session.resources.gpus
            request = PlacementRequest(
                kernel.session.session_id, kernel.session.resources, 1, frozenset(kernel.hosts)
            )
            decision = self.placement.relocate(self.index, request)
            if not decision.ok:
                for k, _, target in moves:
                    self._update(target, subscribed=-k.session.resources.gpus)
                cordoned = self.index.get(host_id)
                if cordoned is not None:
                    self.index.upsert(replace(cordoned, cordoned=False))
                return None
            self._update(decision.hosts[0], subscribed=g)
            moves.append((kernel, kernel.hosts.index(host_id), decision.hosts[0]))
        actions: list[Action] = []
        for kernel, i, target in moves:
            warm = self.prewarmed.get(target, 0) > 0
            if warm:
                self.prewarmed[target] -= 1
            kernel.hosts[i] = target
            self._update(host_id, subscribed=-kernel.session.resources.gpus)
            self.migrations += 1
            actions.append(Migrate(kernel.session.session_id, MigrationPlan(str(i), host_id, target, warm)))
        return actions

    def on_session_start(self, session: Session) -> list[Action]:
        return self._place(session, scale=True)

    def _place(self, session: Session, *, scale: bool) -> list[Action]:
        """Place the R replicas, or queue the session (asking for hosts only the first time)."""
        g = session.resources.gpus
        request = PlacementRequest(session.session_id, session.resources, self.replicas)
        decision = self.placement.place(self.index, request, can_add_hosts=self._can_add_hosts())
        if not decision.ok:
            self.waiting_sessions.append(session)
            actions: list[Action] = [Queued(session.session_id, None, decision.explain())]
            if scale and self.autoscaler is not None:
                decision_out = self.autoscaler.on_placement_failed(
                    request, feasible_hosts(decision), len(self.index)
                )
                if isinstance(decision_out, ScaleOut):
                    actions.append(decision_out)
            return actions
        for host in decision.hosts:
            self._update(host, subscribed=g)
        self.kernels[session.session_id] = _Kernel(session, list(decision.hosts))
        return [StartRuntime(session.session_id, h, replica=i) for i, h in enumerate(decision.hosts)]

    def _can_add_hosts(self) -> bool:
        """Whether a refused placement could still scale out (the live scheduler asks the same)."""
        if self.autoscaler is None:
            return False
        return len(self.index) + self.autoscaler.pending_hosts < self.autoscaler.config.max_hosts

    def on_cell_submit(self, session_id: str, cell_id: str) -> list[Action]:
        kernel = self.kernels.get(session_id)
        if kernel is None:
            return [Rejected(session_id, cell_id, "kernel not placed yet")]
        actions = self._try_run(kernel, cell_id)
        if actions is None:
            self.waiting_cells.append((session_id, cell_id))
            queued: list[Action] = [
                Queued(session_id, cell_id, "every replica yielded and no host can bind the GPUs now")
            ]
            if self.autoscaler is not None:  # a failed migration is a failed replica placement (§3.4.2)
                request = PlacementRequest(session_id, kernel.session.resources, replicas=1)
                decision = self.autoscaler.on_placement_failed(request, 0, len(self.index))
                if isinstance(decision, ScaleOut):
                    queued.append(decision)
            return queued
        return actions

    def _try_run(self, kernel: _Kernel, cell_id: str) -> list[Action] | None:
        g = kernel.session.resources.gpus
        sid = kernel.session.session_id
        replicas = [ReplicaView(str(i), h) for i, h in enumerate(kernel.hosts)]
        ledger: dict[str, HostLedgerView] = {}
        for h in kernel.hosts:
            v = self.index.get(h)
            if v is not None:
                ledger[h] = HostLedgerView(h, v.idle_gpus, v.cordoned, v.alive)
        last = None if kernel.last_executor is None else str(kernel.last_executor)
        choice = choose_executor(replicas, ledger, g, last)  # the live scheduler's executor choice
        if choice.executor is not None:
            return self._run(kernel, cell_id, int(choice.executor))
        plan = plan_migration(
            replicas, kernel.session.resources, self.index.hosts_that_can_bind(g), prewarmed=self.prewarmed
        )
        if not isinstance(plan, MigrationPlan):
            return None
        i = int(plan.replica_id)
        self.migrations += 1
        self._update(plan.source_host, subscribed=-g)
        self._update(plan.target_host, subscribed=g)
        if plan.use_prewarmed:
            self.prewarmed[plan.target_host] -= 1
        kernel.hosts[i] = plan.target_host
        return [Migrate(sid, plan), *self._run(kernel, cell_id, i)]

    def _run(self, kernel: _Kernel, cell_id: str, i: int) -> list[Action]:
        g = kernel.session.resources.gpus
        self.ledgers[kernel.hosts[i]].commit(kernel.session.session_id, str(i), cell_id, g)
        self._update(kernel.hosts[i])
        kernel.last_executor = i
        kernel.running[cell_id] = i
        return [RunCell(kernel.session.session_id, cell_id, kernel.hosts[i], g)]

    def _retry_cells(self) -> list[Action]:
        actions: list[Action] = []
        for _ in range(len(self.waiting_cells)):
            sid, cell = self.waiting_cells.popleft()
            kernel = self.kernels.get(sid)
            if kernel is None:
                continue
            started = self._try_run(kernel, cell)
            if started is None:
                self.waiting_cells.append((sid, cell))
            else:
                actions.extend(started)
        return actions

    def on_cell_end(self, session_id: str, cell_id: str) -> list[Action]:
        kernel = self.kernels.get(session_id)
        if kernel is None or cell_id not in kernel.running:
            return []
        i = kernel.running.pop(cell_id)
        self._end_cell(kernel, cell_id, i)
        return self._retry_cells()

    def _end_cell(self, kernel: _Kernel, cell_id: str, i: int) -> None:
        ledger = self.ledgers.get(kernel.hosts[i])
        if ledger is not None:
            ledger.release(kernel.session.session_id, str(i), cell_id)
            self._update(kernel.hosts[i])

    def on_session_end(self, session_id: str) -> list[Action]:
        self.waiting_sessions = deque(s for s in self.waiting_sessions if s.session_id != session_id)
        self.waiting_cells = deque(c for c in self.waiting_cells if c[0] != session_id)
        kernel = self.kernels.pop(session_id, None)
        if kernel is None:
            return []
        g = kernel.session.resources.gpus
        for cell_id, i in kernel.running.items():
            self._end_cell(kernel, cell_id, i)
        for h in kernel.hosts:
            self._update(h, subscribed=-g)
        stops: list[Action] = [StopRuntime(session_id, h, replica=i) for i, h in enumerate(kernel.hosts)]
        return [*stops, *self._retry_cells(), *self._retry_sessions()]

    def _retry_sessions(self) -> list[Action]:
        actions: list[Action] = []
        for _ in range(len(self.waiting_sessions)):
            s = self.waiting_sessions.popleft()
            actions.extend(a for a in self._place(s, scale=False) if not isinstance(a, Queued))
        return actions


def make_policy(name: str, hosts: Mapping[str, int] | None = None) -> SessionPolicy:
    """The policy for a mode name from configuration (``notebookos`` is the default)."""
    factories: dict[str, Callable[[Mapping[str, int] | None], SessionPolicy]] = {
        "reservation": ReservationPolicy,
        "batch": BatchPolicy,
        "lcp": LcpPolicy,
        "notebookos": NotebookOsPolicy,
    }
    if name not in factories:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {sorted(factories)}")
    return factories[name](hosts)
