"""The evaluation's baseline scheduling modes (NotebookOS §5.1.1): plug-ins of the cluster core
(``shared.cluster_core.core.ClusterCore``) behind its session-level interface (``sessions.py``).

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
* ``notebookos`` is the core's own plug-in (``shared.cluster_core.replicated``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from shared.cluster_core.gpu_ledger import GpuLedger
from shared.cluster_core.sessions import (
    Action,
    Queued,
    Rejected,
    ReturnWarm,
    RunCell,
    Session,
    SessionPolicy,
    StartRuntime,
    StopRuntime,
    TakeWarm,
)

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


def make_policy(name: str, hosts: Mapping[str, int] | None = None) -> SessionPolicy:
    """A baseline by its mode name (``notebookos`` is the core's own: ``ClusterCore``)."""
    factories: dict[str, Callable[[Mapping[str, int] | None], SessionPolicy]] = {
        "reservation": ReservationPolicy,
        "batch": BatchPolicy,
        "lcp": LcpPolicy,
    }
    if name not in factories:
        raise ValueError(f"unknown baseline {name!r}; known: {sorted(factories)}")
    return factories[name](hosts)
