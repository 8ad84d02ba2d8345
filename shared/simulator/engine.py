"""The discrete-event simulator: a trace, one ``SessionPolicy`` from ``shared.policies``, a clock.

The policy objects are the ones the live global scheduler uses (placement index, executor choice,
migration planning, autoscaler, prewarm reconciliation); this module only supplies what the live
cluster supplies to them: events at the right simulated times, and the time the cluster's
physical steps take (container cold/warm starts, data-store reads and writes of large objects,
host provisioning). Deterministic for (trace, policy, params, seed): one seeded numpy generator
drawn in event order, and a heap ordered by (time, insertion number).

Event model, per session (a Jupyter kernel runs one cell at a time, so a cell that arrives while
the previous one is still in flight waits client-side, and its delay counts from the trace's
submit time):

* session start -> ``on_session_start``; its runtime(s) are ready ``cold_start`` after a
  ``StartRuntime`` (reservation, notebookos replicas);
* task submit -> ``on_cell_submit``; a ``RunCell`` binds GPUs now and executes after the startup
  of whatever runtime the policy chose (a fresh container + reading the session's large objects
  for batch/lcp or a migrated replica, a warm hand-over, the replica election for notebookos);
* cell end -> ``on_cell_end`` (batch/lcp first write the large objects back, GPUs still held);
* session end -> ``on_session_end`` (deferred while a cell runs);
* periodic autoscaler check -> ``Autoscaler.evaluate``; scale-out hosts register after
  ``host_provision_s``; scale-in drains a notebookos host's replicas first (all of them or the
  host stays), never picking a host that holds a replica of a session with a cell in flight.

Interactivity delay = execution start - trace submit; task completion time = cell end - trace
submit (NotebookOS §5.3.2, §5.3.3). A cell counts as *immediately committed* when the policy bound
its GPUs the moment the request reached it (which is later than the trace's submit time when the
session's previous cell ran late), without a migration (§5.3.2's 89.6%).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shared.cluster_core.core import POLICIES, ClusterCore
from shared.cluster_core.held import HELD_POLL_S, HeldFailure, SendOn, WaitUntil
from shared.cluster_core.idle import HostFacts, KernelFacts, replicas_and_active_hosts
from shared.cluster_core.replicated import ReplicatedKernel
from shared.cluster_core.sessions import (
    Action,
    Held,
    Migrate,
    Queued,
    Rejected,
    RunCell,
    StartFailed,
    StartRuntime,
    StopRuntime,
    TakeWarm,
    WakeHeld,
)
from shared.cluster_core.sessions import Session as PolicySession
from shared.cluster_core.starts import kernel_facts
from shared.policies.autoscale import ScaleIn, ScaleOut
from shared.policies.culling import KernelActivity
from shared.policies.hibernation import HibernatePolicy, kernels_to_hibernate
from shared.policies.migration import GiveUp
from shared.policies.placement import PlacementRequest
from shared.serving import HostReport, ServingConfig, ServingCore
from shared.simulator.params import SimParams
from shared.workload.model import Trace

POLICY_NAMES = POLICIES

# heap event kinds
_CELL_END = 0
_HOST_READY = 1
_WARM_READY = 2
_TICK = 3
_RETRY = 4  # a held cell's next look (ClusterCore.first_migration_at / held_migration_failed)
_START_DEADLINE = 5  # a session waiting for hosts fails if still unplaced (ClusterCore.start_deadline)

# trace arrival kinds, in the order they are handled at equal times
_SESSION_START = 0
_TASK_SUBMIT = 1
_SESSION_END = 2

_NAN = math.nan
_JITTER_BLOCK = 65_536
_MAX_DRAIN_S = 365 * 86_400.0  # a run that has not drained a year after its last arrival is stuck


def build_core(name: str, params: SimParams) -> ClusterCore:
    """The cluster core for policy ``name``, configured from ``params`` (the live rules, these values)."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICIES)}")
    return ClusterCore(
        params.core_config(), policy=name, prewarmed={}, lcp_pool_per_host=params.lcp_pool_per_host
    )


@dataclass
class SimResult:
    """Everything one run measured; ``shared.simulator.results`` turns it into figures."""

    policy: str
    seed: int
    params: SimParams
    trace: Trace
    end_s: float
    wall_s: float
    cpu_s: float  # this process's CPU time: the wall time a busy shared machine inflates
    # per task (trace order); NaN where the task never ran
    commit_s: npt.NDArray[np.float64]
    exec_start_s: npt.NDArray[np.float64]
    exec_end_s: npt.NDArray[np.float64]
    end_s_task: npt.NDArray[np.float64]
    immediate: npt.NDArray[np.bool_]
    # (start, end, gpus) of every host the provider paid for
    host_intervals: npt.NDArray[np.float64]
    # (start, end, gpus) held exclusively by reservation sessions
    reserved_intervals: npt.NDArray[np.float64]
    # (placed, stopped, replicas) of every notebookos kernel
    replica_intervals: npt.NDArray[np.float64]
    # (time, cluster subscription ratio) at each autoscaler check (notebookos), else empty
    subscription: npt.NDArray[np.float64]
    scale_out_s: list[float] = field(default_factory=list)
    scale_in_s: list[float] = field(default_factory=list)
    migration_s: list[float] = field(default_factory=list)
    cells_failed: int = 0
    sessions_never_started: int = 0
    # hibernation (params.hibernate_after_s > 0): (hibernated, resumed or ended, gpus) per
    # hibernation, and the interactivity delay of each cell that resumed its kernel
    hibernated_intervals: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 3)))
    resume_delays_s: list[float] = field(default_factory=list)


class Simulator:
    """One policy over one trace. ``run()`` once; build a new one for another policy or seed."""

    def __init__(
        self,
        trace: Trace,
        policy_name: str,
        params: SimParams | None = None,
        *,
        seed: int = 0,
        core: ClusterCore | None = None,
        gpu_recorder: Callable[[float, str, int, int], None] | None = None,
    ) -> None:
        self.params = params or SimParams()
        self.trace = trace
        self.name = policy_name
        self.seed = seed
        # the same core class the live global scheduler steps, with simulated time and hosts
        self.core = core if core is not None else build_core(policy_name, self.params)
        self.policy = self.core.sessions
        self.autoscaler = self.core.autoscaler
        too_big = next((s for s in trace.sessions if s.gpus > self.params.gpus_per_host), None)
        if too_big is not None:
            raise ValueError(
                f"session {too_big.session_id!r} asks for {too_big.gpus} GPUs, "
                f"more than a host has (simulator.gpus_per_host = {self.params.gpus_per_host})"
            )
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._jitter: list[float] = []
        self._jitter_pos = 0
        self._per_cell_runtimes = policy_name in ("batch", "lcp")
        replicated = self.core.replicated
        self._replicated = replicated is not None
        self._election_s = self.params.election_s if replicated is not None else 0.0
        self._prewarmed: dict[str, int] | None = replicated.prewarmed if replicated is not None else None
        self._owned: set[str] = set()  # hosts the simulated provider started (only those are released)
        # held cell -> (held since, failed tries, when its next look is due: a woken look makes
        # the retry already queued stale)
        self._holding: dict[int, tuple[float, int, float]] = {}
        # the serving controller's core decides the warm pools, as in the live cluster
        per_host = self.params.prewarm_per_host
        self._serving = ServingCore(
            ServingConfig(policy="min", per_host=per_host, max_per_host=max(per_host, 4), stale_s=math.inf)
        )
        self._warming: dict[str, int] = {}
        # the live gateway's rule (shared/policies/hibernation.py), for notebookos kernels
        self._hibernate = HibernatePolicy(self.params.hibernate_after_s if replicated is not None else 0.0)
        self._heap: list[tuple[float, int, int, int | str]] = []
        self._seq = 0
        self._hosts_alive: dict[str, float] = {}  # host -> paid since
        self._host_intervals: list[tuple[float, float, float]] = []
        self._in_flight_hosts = 0
        self._paid_since: dict[str, float] = {}  # requested hosts: the provider pays from the request
        self._next_host = 0
        self._scale_out_s: list[float] = []
        self._scale_in_s: list[float] = []
        self._migration_s: list[float] = []
        self._sr: list[tuple[float, float]] = []
        # mixed runs: (now, host, GPUs, committed) whenever a live host's committed count changes,
        # GPUs 0 when it leaves; read from the core's ledgers, never deciding anything
        self._gpu_recorder = gpu_recorder
        self._recorded: dict[str, tuple[int, int]] = {}

    # ---- randomness --------------------------------------------------------------------------

    def _start_time(self, mean_s: float) -> float:
        """A container start of mean ``mean_s``: lognormal jitter, drawn in blocks in event order."""
        if self._jitter_pos >= len(self._jitter):
            sigma = self.params.start_jitter_sigma
            self._jitter = self._rng.lognormal(-sigma * sigma / 2, sigma, _JITTER_BLOCK).tolist()
            self._jitter_pos = 0
        x = self._jitter[self._jitter_pos]
        self._jitter_pos += 1
        return mean_s * x

    # ---- the run -----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, arg: int | str) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, arg))

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        """Simulate to the end of the trace; ``progress(fraction)`` is called now and then."""
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        tr = self.trace
        p = self.params
        n_s, n_t = len(tr.sessions), tr.n_tasks
        self._sid = [s.session_id for s in tr.sessions]
        self._pos = {sid: k for k, sid in enumerate(self._sid)}
        self._specs = [PolicySession(s.session_id, s.resources) for s in tr.sessions]
        self._gpus = [s.gpus for s in tr.sessions]
        self._cid = [str(i) for i in range(n_t)]
        self._t_sess = tr.task_session.tolist()
        self._submit_s = tr.task_submit_s.tolist()
        self._dur = tr.task_duration_s.tolist()
        self._commit = [_NAN] * n_t
        self._start = [_NAN] * n_t
        self._exec_end = [_NAN] * n_t
        self._end = [_NAN] * n_t
        self._immediate = [False] * n_t
        self._busy = [-1] * n_s  # the cell in flight (submitted, not ended)
        self._held = [-1] * n_s  # a cell the policy refused until the session's runtime exists
        self._queue: list[deque[int]] = [deque() for _ in range(n_s)]
        self._ending = [False] * n_s
        self._ready_at = [0.0] * n_s
        self._boot = [0.0] * n_s
        self._runtime_since = [_NAN] * n_s  # reservation: GPUs bound since; notebookos: placed since
        self._reserved: list[tuple[float, float, float]] = []
        self._replica_intervals: list[tuple[float, float, float]] = []
        self._replicas = [0] * n_s
        self._open_sessions = 0
        self._started = [False] * n_s
        self._start_failed = [False] * n_s  # its kernel start failed: its cells fail as they come
        self._cells_failed = 0
        self._cur = -1
        self._cur_migrated = False
        self._last_activity = [0.0] * n_s  # submit or end of its last cell, or its start
        self._hibernated_at = [_NAN] * n_s  # hibernated since (NaN: it is not)
        self._resuming = [False] * n_s  # its next StartRuntime is a resume, not a cold start
        self._hibernated: list[tuple[float, float, float]] = []
        self._resume_delays: list[float] = []

        for _ in range(p.initial_hosts):
            self._add_host(self._new_host_id(), 0.0)

        # trace arrivals, merged with the heap: sorted by (time, kind)
        starts = np.array([s.start_s for s in tr.sessions])
        ends = np.array([s.end_s for s in tr.sessions])
        times = np.concatenate((starts, tr.task_submit_s, ends))
        kinds = np.concatenate(
            (
                np.full(n_s, _SESSION_START),
                np.full(n_t, _TASK_SUBMIT),
                np.full(n_s, _SESSION_END),
            )
        )
        idx = np.concatenate((np.arange(n_s), np.arange(n_t), np.arange(n_s)))
        order = np.lexsort((idx, kinds, times))
        arr_t = times[order].tolist()
        arr_k = kinds[order].tolist()
        arr_i = idx[order].tolist()
        n = len(arr_t)
        horizon_end = float(ends.max()) if n_s else 0.0
        self._push(arr_t[0] if n else 0.0, _TICK, 0)
        heap = self._heap
        j = 0
        now = 0.0
        report_every = max(n // 200, 1)
        while j < n or heap:
            if heap and (j >= n or heap[0][0] <= arr_t[j]):
                now, _, kind, arg = heapq.heappop(heap)
                if kind == _CELL_END:
                    self._cell_end(int(arg), now)
                elif kind == _HOST_READY:
                    self._host_ready(str(arg), now)
                elif kind == _WARM_READY:
                    self._warm_ready(str(arg), now)
                elif kind == _RETRY:
                    self._retry_held(int(arg), now)
                elif kind == _START_DEADLINE:
                    self._apply(self.core.start_timed_out(self._sid[int(arg)]), now)
                else:
                    if j >= n and self._open_sessions == 0 and self._in_flight_hosts == 0:
                        continue  # drained: stop the periodic check
                    if j >= n and now > horizon_end + _MAX_DRAIN_S:
                        raise RuntimeError(f"{self.name}: simulation did not drain (stuck cells)")
                    self._tick(now)
                    self._push(now + p.autoscale_interval_s, _TICK, 0)
                continue
            now = arr_t[j]
            k = arr_k[j]
            x = arr_i[j]
            j += 1
            if k == _TASK_SUBMIT:
                s = self._t_sess[x]
                if self._busy[s] >= 0:
                    self._queue[s].append(x)
                else:
                    self._submit(x, now)
            elif k == _SESSION_START:
                self._session_start(x, now)
            else:
                self._session_end_arrival(x, now)
            if progress is not None and j % report_every == 0:
                progress(j / n)
        end = max(horizon_end, now)
        for since in self._hosts_alive.values():
            self._host_intervals.append((since, end, float(p.gpus_per_host)))
        for s, since in enumerate(self._hibernated_at):  # still hibernated at the end
            if not math.isnan(since):
                self._hibernated.append((since, end, float(self._gpus[s])))
        for s, since in enumerate(self._runtime_since):  # still running at the end
            if not math.isnan(since):
                if self.name == "reservation":
                    self._reserved.append((since, end, float(self._gpus[s])))
                else:
                    self._replica_intervals.append((since, end, float(self._replicas[s])))
        if progress is not None:
            progress(1.0)
        return SimResult(
            policy=self.name,
            seed=self.seed,
            params=p,
            trace=tr,
            end_s=end,
            wall_s=time.perf_counter() - wall0,
            cpu_s=time.process_time() - cpu0,
            commit_s=np.array(self._commit),
            exec_start_s=np.array(self._start),
            exec_end_s=np.array(self._exec_end),
            end_s_task=np.array(self._end),
            immediate=np.array(self._immediate, dtype=bool),
            host_intervals=np.array(self._host_intervals).reshape(-1, 3),
            reserved_intervals=np.array(self._reserved).reshape(-1, 3),
            replica_intervals=np.array(self._replica_intervals).reshape(-1, 3),
            subscription=np.array(self._sr).reshape(-1, 2),
            scale_out_s=self._scale_out_s,
            scale_in_s=self._scale_in_s,
            migration_s=self._migration_s,
            cells_failed=self._cells_failed,
            sessions_never_started=sum(1 for s in range(n_s) if not self._started[s]),
            hibernated_intervals=np.array(self._hibernated).reshape(-1, 3),
            resume_delays_s=self._resume_delays,
        )

    # ---- sessions and cells ------------------------------------------------------------------

    def _session_start(self, s: int, now: float) -> None:
        self._open_sessions += 1
        self._last_activity[s] = now
        self._apply(self.core.session_started(self._specs[s]), now)

    def _session_end_arrival(self, s: int, now: float) -> None:
        busy = self._busy[s]
        if busy >= 0 and self._held[s] != busy:
            self._ending[s] = True  # bound, or queued in the policy for GPUs: close after it ends
            return
        if busy >= 0:  # held: the session never got a runtime, its cells cannot run
            self._cells_failed += 1 + len(self._queue[s])
            self._queue[s].clear()
            self._held[s] = -1
            self._busy[s] = -1
        self._end_session(s, now)

    def _end_session(self, s: int, now: float) -> None:
        self._open_sessions -= 1
        self._ending[s] = False
        if not math.isnan(self._hibernated_at[s]):  # its replicas are gone already
            self._hibernated.append((self._hibernated_at[s], now, float(self._gpus[s])))
            self._hibernated_at[s] = _NAN
            return
        self._apply(self.core.session_ended(self._sid[s]), now)

    def _submit(self, i: int, now: float) -> None:
        s = self._t_sess[i]
        if self._start_failed[s]:  # the client gets an error for each cell of a failed kernel
            self._cells_failed += 1
            return
        self._busy[s] = i
        self._last_activity[s] = now
        if not math.isnan(self._hibernated_at[s]):
            self._resume(s, now)
        self._cur = i if self._held[s] != i else -1  # a resubmitted held cell was not committed at once
        self._held[s] = -1
        self._cur_migrated = False
        self._apply(self.core.cell_submitted(self._sid[s], self._cid[i]), now)
        self._cur = -1

    def _run_cell(self, a: RunCell, now: float) -> None:
        i = int(a.cell_id)
        s = self._t_sess[i]
        if i == self._cur and not self._cur_migrated:
            self._immediate[i] = True  # bound when the scheduler received it, as §5.3.2 counts
        start = max(now, self._ready_at[s]) + self._boot[s] + self._election_s
        self._boot[s] = 0.0
        self._commit[i] = now
        self._start[i] = start
        if self._resuming[s]:  # the first cell after a hibernation: its whole wait
            self._resuming[s] = False
            self._resume_delays.append(start - self._submit_s[i])
        end = start + self._dur[i]
        self._exec_end[i] = end
        if self._per_cell_runtimes:
            end += self.params.write_s  # the per-cell container writes model/data back, GPUs held
        self._push(end, _CELL_END, i)

    def _cell_end(self, i: int, now: float) -> None:
        s = self._t_sess[i]
        self._end[i] = now
        self._last_activity[s] = now
        self._apply(self.core.cell_ended(self._sid[s], self._cid[i]), now)
        self._next_cell(s, now)

    def _next_cell(self, s: int, now: float) -> None:
        """The session's cell is over (ended or given up): its next one, or its deferred end."""
        self._busy[s] = -1
        q = self._queue[s]
        if q:
            self._submit(q.popleft(), now)
        elif self._ending[s]:
            self._end_session(s, now)

    # ---- actions -----------------------------------------------------------------------------

    def _record_gpus(self, now: float) -> None:
        """Tell ``gpu_recorder`` which live hosts' committed GPU counts changed (a recording
        hook for mixed runs: the BE simulator replays it; it reads the core, decides nothing)."""
        if self._gpu_recorder is None:
            return
        replicated = self.core.replicated
        if replicated is not None:
            counts = {v.host_id: (v.gpus, v.committed_gpus) for v in replicated.index.views()}
        else:
            ledgers = self.policy.ledgers  # type: ignore[attr-defined]
            counts = {h: (led.total, led.committed_count) for h, led in ledgers.items()}
        counts = {h: c for h, c in counts.items() if h in self._hosts_alive}
        for h in self._recorded.keys() - counts.keys():
            del self._recorded[h]
            self._gpu_recorder(now, h, 0, 0)
        for h, c in counts.items():
            if self._recorded.get(h) != c:
                self._recorded[h] = c
                self._gpu_recorder(now, h, c[0], c[1])

    def _apply(self, actions: Sequence[Action], now: float) -> None:
        self._apply_actions(actions, now)
        self._record_gpus(now)

    def _apply_actions(self, actions: Sequence[Action], now: float) -> None:
        if not actions:
            return
        p = self.params
        resubmit: list[int] = []
        for a in actions:
            t = type(a)
            if t is RunCell:
                self._run_cell(a, now)
            elif t is StartRuntime:
                s = self._index_of(a.session_id)
                if self._per_cell_runtimes:
                    self._boot[s] += self._start_time(p.cold_start_s) + p.read_s
                    continue
                if self._resuming[s]:  # the namespace image loaded into new replicas
                    ready = now + self._start_time(p.resume_mean_s)
                elif self._take_warm(a.host_id, now):  # as a live replica start takes one
                    ready = now + self._start_time(p.warm_start_s)
                else:
                    ready = now + self._start_time(p.cold_start_s)
                self._ready_at[s] = max(self._ready_at[s], ready)
                if not self._started[s]:
                    self._started[s] = True
                if math.isnan(self._runtime_since[s]):
                    self._runtime_since[s] = now
                self._replicas[s] += 1
                if self._held[s] >= 0 and self._held[s] not in resubmit:
                    resubmit.append(self._held[s])
            elif t is TakeWarm:
                s = self._index_of(a.session_id)
                self._boot[s] += self._start_time(p.warm_start_s) + p.read_s
            elif t is StopRuntime:
                if self._per_cell_runtimes:
                    continue
                s = self._index_of(a.session_id)
                since = self._runtime_since[s]
                if math.isnan(since):
                    continue
                if self.name == "reservation":
                    self._reserved.append((since, now, float(self._gpus[s])))
                else:  # the first of the replicas' stops closes the kernel's replica interval
                    self._replica_intervals.append((since, now, float(self._replicas[s])))
                self._runtime_since[s] = _NAN
            elif t is Migrate:
                s = self._index_of(a.session_id)
                self._migration_s.append(now)
                if self._cur >= 0 and self._t_sess[self._cur] == s:
                    self._cur_migrated = True
                mean = p.warm_start_s if a.plan.use_prewarmed else p.cold_start_s
                self._boot[s] += self._start_time(mean) + p.read_s
                if a.plan.use_prewarmed:
                    self._prewarm((a.plan.target_host,), now)
            elif t is Held:
                i = int(a.cell_id)
                at = self.core.first_migration_at(now)
                self._holding[i] = (now, 0, at)
                self._push(at, _RETRY, i)
            elif t is WakeHeld:
                self._retry_held(int(a.cell_id), now, woken=True)
            elif t is StartFailed:
                self._start_failed_for(self._index_of(a.session_id))
            elif t is Rejected:
                if a.cell_id is not None:
                    self._held[self._index_of(a.session_id)] = int(a.cell_id)
            elif t is ScaleOut:
                self._provision(a.count, now)
            elif t is Queued and not self._replicated:
                self._placement_failed(a, now)
            elif t is Queued and a.cell_id is None:  # the kernel start waits for hosts, as live
                self._push(self.core.start_deadline(now), _START_DEADLINE, self._index_of(a.session_id))
            # Queued, ReturnWarm: nothing to model (the work waits for a later event)
        for i in resubmit:
            self._submit(i, now)

    # ---- hibernation -------------------------------------------------------------------------

    def _hibernate_idle(self, now: float) -> None:
        """The live gateway's periodic look (``kernel.hibernate_interval_s``; here at each
        autoscaler check): kernels idle past ``hibernate_after_s`` stop their replicas, which
        releases their subscriptions, as the live scheduler's ``kernel.hibernate`` does."""
        replicated = self.core.replicated
        if not self._hibernate.enabled or replicated is None:
            return
        idle = [
            KernelActivity(
                sid, self._last_activity[s], busy=self._busy[s] >= 0 or self._held[s] >= 0, connections=1
            )
            for sid in replicated.kernels
            if (s := self._pos.get(sid, -1)) >= 0 and not self._ending[s] and not self._resuming[s]
        ]
        for decision in kernels_to_hibernate(self._hibernate, idle, now):
            s = self._pos[decision.kernel_id]
            self._apply(self.core.session_ended(decision.kernel_id), now)
            self._hibernated_at[s] = now

    def _resume(self, s: int, now: float) -> None:
        """A request on a hibernated kernel: placement picks hosts and its replicas start from
        its image (``resume_mean_s``), the cell waiting."""
        self._hibernated.append((self._hibernated_at[s], now, float(self._gpus[s])))
        self._hibernated_at[s] = _NAN
        self._resuming[s] = True
        self._apply(self.core.session_started(self._specs[s]), now)

    def _index_of(self, session_id: str) -> int:
        return self._pos[session_id]

    def _start_failed_for(self, s: int) -> None:
        """The session's kernel start failed: the cell waiting for it and those queued behind fail."""
        self._start_failed[s] = True
        if self._held[s] >= 0:
            self._cells_failed += 1 + len(self._queue[s])
            self._queue[s].clear()
            self._held[s] = -1
            self._busy[s] = -1

    def _retry_held(self, i: int, now: float, *, woken: bool = False) -> None:
        """A held cell's next look, stepped as the live ``Migrator._resolve`` steps its own
        (``ClusterCore.held_step``): wait, run it, or migrate a replica and run it; a failed
        migration scales out for it and waits, backs off per the core, or gives it up.
        ``woken``: a host reserved for it registered (else a look not due now is a stale one)."""
        held = self._holding.get(i)
        if held is None or (not woken and now != held[2]):
            return
        since, attempts, _ = held
        s = self._t_sess[i]
        sid, cid = self._sid[s], self._cid[i]
        step = self.core.look_at_held(sid, cid, since, attempts, now, HELD_POLL_S)
        if isinstance(step, WaitUntil):
            self._holding[i] = (since, attempts, step.at)
            self._push(step.at, _RETRY, i)
            return
        outcome: list[Action] | str = f"cell {cid} of {sid} is not held"
        if isinstance(step, SendOn):
            outcome = self.core.send_held(sid, cid) or outcome  # [] only if it could not run after all
        elif step is not None:
            outcome = self.core.migrate_held(sid, cid)
        if not isinstance(outcome, str):
            del self._holding[i]
            self._apply(outcome, now)
            return
        attempts += 1
        failure = HeldFailure(self._sid[s], self._specs[s].resources, attempts, since, now, outcome)
        held_decision = self.core.held_migration_failed(failure, live_hosts=len(self._hosts_alive))
        if held_decision.scale_out is not None:
            self._provision(held_decision.scale_out.count, now)
        decision = held_decision.decision
        if isinstance(decision, GiveUp):
            del self._holding[i]
            self.core.give_up_held(self._sid[s], self._cid[i])
            self._cells_failed += 1
            self._next_cell(s, now)
            return
        self._holding[i] = (since, attempts, decision.at)
        self._push(decision.at, _RETRY, i)

    def _placement_failed(self, a: Queued, now: float) -> None:
        """A baseline could not place a session's runtime or a cell's container: the autoscaler's
        first trigger, as notebookos's placement failures call it from inside the policy."""
        s = self._pos[a.session_id]
        key = a.session_id if a.cell_id is None else f"{a.session_id}/{a.cell_id}"
        request = PlacementRequest(key, self._specs[s].resources, replicas=1)
        decision = self.core.placement_failed(request, 0, len(self._hosts_alive))
        if isinstance(decision, ScaleOut):
            self._provision(decision.count, now)

    # ---- hosts -------------------------------------------------------------------------------

    def _new_host_id(self) -> str:
        self._next_host += 1
        return f"h{self._next_host:05d}"

    def _add_host(self, host_id: str, now: float) -> None:
        self._hosts_alive[host_id] = now
        actions = self.core.host_added(host_id, self.params.gpus_per_host)
        if self._prewarmed is not None:
            self._prewarm((host_id,), now)
        self._apply(actions, now)

    def _provision(self, count: int, now: float) -> int:
        """Ask the provider for ``count`` hosts (fewer at ``max_hosts``); returns how many."""
        room = self.params.max_hosts - len(self._hosts_alive) - self._in_flight_hosts
        count = min(count, room)
        if count <= 0:
            return 0
        self._scale_out_s.append(now)
        for _ in range(count):
            self._in_flight_hosts += 1
            host_id = self._new_host_id()
            self._owned.add(host_id)
            self._push(now + self.params.host_provision_s, _HOST_READY, host_id)
            self._paid_since[host_id] = now
        return count

    def _host_ready(self, host_id: str, now: float) -> None:
        self._in_flight_hosts -= 1
        paid_since = self._paid_since.pop(host_id, now)
        if not self._replicated:
            self.autoscaler.on_host_registered(host_id)  # notebookos's add_host does this itself
        self._add_host(host_id, now)
        self._hosts_alive[host_id] = paid_since

    def _release(self, host_id: str, now: float) -> bool:
        """Drain ``host_id`` replica by replica (as live: the ones that can move do), then release
        it; if a replica cannot move, the host stays and the core backs its idle judgement off."""
        replicated = self.core.replicated
        if replicated is not None:
            warm = self._prewarmed or {}
            plan = self.core.plan_drain(
                host_id, replicated.replicas_on(host_id), replicated.index.views(), warm
            )
            targets = []
            for r, move in plan.moves:
                replicated.move_replica(r.kernel_id, move)
                self._migration_s.append(now)
                targets.append(move.target_host)
            if plan.why_not():  # a replica no host can take: the release is abandoned, as live
                self.core.release_failed(host_id)
                self._prewarm(targets, now)
                return False
            if self._prewarmed is not None:
                self._prewarmed.pop(host_id, None)
                self._warming.pop(host_id, None)
                self._serving.forget(host_id)
                self._prewarm(targets, now)
        self.core.host_removed(host_id)
        since = self._hosts_alive.pop(host_id)
        self._host_intervals.append((since, now, float(self.params.gpus_per_host)))
        self._record_gpus(now)
        return True

    def _prewarm(self, host_ids: tuple[str, ...] | list[str], now: float) -> None:
        """Top the hosts' warm pools up to the serving controller core's targets (min per host)."""
        warm = self._prewarmed
        if warm is None:
            return
        for h in dict.fromkeys(host_ids):
            if h not in self._hosts_alive:
                continue
            held = warm.get(h, 0) + self._warming.get(h, 0)
            target = self._serving.report(
                HostReport(h, warm=warm.get(h, 0), starting=self._warming.get(h, 0)), now
            )
            for _ in range(target - held):
                self._warming[h] = self._warming.get(h, 0) + 1
                self._push(now + self._start_time(self.params.cold_start_s), _WARM_READY, h)

    def _warm_ready(self, host_id: str, now: float) -> None:
        replicated = self.core.replicated
        if host_id not in self._hosts_alive or self._prewarmed is None or replicated is None:
            return
        self._warming[host_id] = self._warming.get(host_id, 0) - 1
        replicated.set_warm(host_id, self._prewarmed.get(host_id, 0) + 1)

    def _take_warm(self, host_id: str, now: float) -> bool:
        """A replica start on ``host_id`` takes a ready runtime if its pool has one (the pool refills)."""
        replicated = self.core.replicated
        if self._prewarmed is None or replicated is None or self._prewarmed.get(host_id, 0) <= 0:
            return False
        replicated.set_warm(host_id, self._prewarmed[host_id] - 1)
        self._prewarm((host_id,), now)
        return True

    # ---- the periodic autoscaler check -------------------------------------------------------

    def _facts(self) -> list[HostFacts]:
        """What the core's idle judgement needs, as the live autoscaler reports it
        (services/global_scheduler/autoscaling.py): a host holding a replica of a session with a
        cell in flight or held is active; only hosts the provider started are owned."""
        replicated = self.core.replicated
        if replicated is not None:
            replicas, active = replicas_and_active_hosts(
                self._kernel_facts(session_id, kernel) for session_id, kernel in replicated.kernels.items()
            )
            return [
                HostFacts(
                    v.host_id,
                    v.gpus,
                    v.committed_gpus,
                    v.subscribed_gpus,
                    replicas=replicas[v.host_id],
                    active=v.host_id in active,
                    owned=v.host_id in self._owned,
                )
                for v in replicated.index.views()
            ]
        ledgers = self.policy.ledgers  # type: ignore[attr-defined]
        reserved = self.name == "reservation"
        return [
            HostFacts(
                h,
                led.total,
                led.committed_count,
                led.committed_count if reserved else 0,
                owned=h in self._owned,
            )
            for h, led in ledgers.items()
        ]

    def _kernel_facts(self, session_id: str, kernel: ReplicatedKernel) -> KernelFacts:
        """The core's busy rule (``starts.kernel_facts``): a cell running or held, or one
        submitted and not ended (waiting client-side: live, a request in flight)."""
        s = self._pos.get(session_id, -1)
        return kernel_facts(
            kernel.hosts,
            cell_in_flight=bool(kernel.running) or (s >= 0 and self._busy[s] >= 0),
            held=bool(kernel.held) or (s >= 0 and self._held[s] >= 0),
        )

    def _tick(self, now: float) -> None:
        replicated = self.core.replicated
        if replicated is not None:
            live = replicated.index.live_gpus
            self._sr.append(
                (now, replicated.index.live_subscribed_gpus / (live * replicated.replicas) if live else 0.0)
            )
        self._hibernate_idle(now)
        decision = self.core.tick(now, self._facts())
        if isinstance(decision, ScaleOut):
            asked = self._provision(decision.count, now)
            self.core.scale_out_asked(asked)  # so the next check does not ask for them again
        elif isinstance(decision, ScaleIn):
            released = [h for h in decision.host_ids if self._release(h, now)]
            if released:
                self._scale_in_s.append(now)
