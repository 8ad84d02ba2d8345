"""Deterministic fault-injection simulation of a kernel's replicas electing executors.

Three (and, after replacements, more) ``ElectionCore``s, the very class ``raft_bridge.ReplicaCore``
drives in a replica process, run on simulated time against a simulated committed log, a simulated
scheduler and a model of each replica's kernel. One seed fixes everything (the scenario's knobs,
every fault, every delay), so a failing seed replays exactly: ``python scripts/election_torture.py
--seeds 1 --start SEED --verbose``.

**The log.** Raft itself is tested by ``shared/raft/simulation.py``; here the committed log is
modelled by what Raft guarantees the election and nothing more: one totally ordered sequence of
entries that every member applies as a prefix, in order, each at its own pace. Commits need a
leader and a majority of the current voters reachable (up, not paused, not partitioned). What
the election must survive is modelled on the path from a proposal to the log: a proposal attempt
is lost, or reaches the leader late (up to 1.5 s); the proposer retries every second until it has
applied the entry itself or ``propose_timeout_s`` passed, so entries are duplicated, and a
proposal reported failed may still commit later; an entry accepted by a leader that then loses
its leadership commits or not. Membership changes (remove a dead member, add its replacement)
are log entries too. This is sound for the election because ``ElectionCore`` only ever sees
committed entries in log order and the results of its own proposals, which is exactly this
interface; what it cannot exercise are Raft's own bugs (the Raft simulation's job).

**The faults.** Message loss (proposal attempts; the scheduler's requests ride TCP and are lost
only with the replica's process); pauses
(SIGSTOP: a replica runs nothing, neither its Raft side nor its kernel, and on SIGCONT its expired
timers and the log's catch-up come in a random interleaving), some of them as user code holding
the GIL (every thread stalls just the same, but the host's OS says the process runs, so the
scheduler vouches for it when a standby asks after the silent executor); partitions (a replica runs but
cannot reach the log: it neither commits nor applies, and sees no leader); crashes (the process
and its core are gone; the scheduler notices after a heartbeat delay, tells the survivors
``member_lost`` and either restarts the replica from its disk, replaying its log, sometimes from
a snapshot of the book, or replaces it by a new member through two membership changes);
leadership moves; GPU bindings refused (the cell goes to the next election round). Every seed
has faults; three in four also have a scripted one: from issue 14, the executor paused inside its
cell past ``executor_silence_s``, or the Raft leader paused just as the cell is routed to it; or
the executor's process dying inside its cell.

**Checked at every step** (each fact is checked when the step that creates it happens):

- at most one executor per (msg_id, round): user code of an election key runs once at most,
  across all replicas and their restarts;
- no user code without this replica's committed winning LEAD: when a replica runs a key, its own
  book says it won, and an independent oracle over the committed log agrees that the first LEAD
  of a current voter for that key, before every voter yielded, is this replica's and lies within
  the prefix this replica has applied, with no DONE for the key before it;
- every request a replica is sent is answered by it at most once, and an ``ok`` comes only from a
  replica that ran the cell;
- only the committed winner announces itself ``elected``, and the client's ``ok`` comes with the
  output of the replica that ran the cell. As ``ReplyMerger`` does, the scheduler answers the
  client with the reply of the first replica to announce itself (its responder), drops every
  other replica's, and after the responder's death takes the first survivor's (a stand-in that
  announced at binding, then lost its LEAD to the silent candidate's, once left the client an
  ``ok`` without the cell's output);
- a dead executor's survivors, told by the scheduler, commit its cell's DONE within
  ``PROMPT_TAKEOVER_S`` when nothing else disturbed the group meanwhile and one of their DONE
  proposals reached the leader (not only after the executor silence).

**Checked after the faults stop** (every replica up and reachable, or replaced): within
``settle_s`` every request is answered exactly once by each live replica it reached, every cell
the client sent has its answer; every key with a committed winner has a committed DONE (a
surviving quorum always decides); every ``ok`` a replica sent, and every answer the client got
that did not say why it could not be given, is the first committed DONE of its key (an ``ok``
never hides a lost or different outcome); and every live replica's book holds exactly the
oracle's decisions and DONEs.

This is a test harness (used by ``tests/sim`` and ``scripts/election_torture.py``), not product code.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernel_replica import log_entries
from kernel_replica.election import ElectionBook
from kernel_replica.election_core import (
    COMMITTED,
    SUPERSEDED,
    Answer,
    BindFailed,
    BindGpus,
    CellReplicated,
    DeliverDone,
    ElectionCore,
    ElectionSettings,
    Execute,
    ExitDiverged,
    Failed,
    Log,
    NotifyScheduler,
    Propose,
    RaftView,
    Replay,
    Standby,
    TransferLeadership,
    Unavailable,
)
from kernel_replica.log_entries import Done, Lead, LogEntry, State, Yield
from shared.election_round import election_key
from shared.quorum import majority

# The kernel's executor publishes idle (and replies) once DONE and STATE committed, at most this
# long after the cell (kernel_replica/kernel.py IDLE_REPLICATION_WAIT_S), and a replica whose
# namespace ran ahead of the log exits this long after its reply (DIVERGED_EXIT_DELAY_S).
IDLE_REPLICATION_WAIT_S = 2.0
DIVERGED_EXIT_DELAY_S = 0.3
PROPOSE_ATTEMPT_S = 1.0  # raft_bridge.PROPOSE_ATTEMPT_S: one attempt, then propose again
DROPPED_RETRY_S = 0.05  # a proposal dropped at once (no leader known) is retried this soon
RESTART_S = (1.0, 10.0)  # a dead replica's restart, or its replacement's start, takes this long
PROMPT_TAKEOVER_S = 4.0  # the survivors of a dead executor commit its ExecutorLost this soon
MAX_ROUNDS = 3  # election rounds of a cell before the scheduler gives up (shared.cluster_core.moves.MAX_ELECTION_ROUNDS)
DEFAULT_CHAOS_S = 30.0
INITIAL_VOTERS = ("r1", "r2", "r3")


class SafetyViolation(AssertionError):
    """An election invariant did not hold; the message says which, where and when."""


# ====================================================================== scenario


@dataclass(frozen=True, slots=True)
class Scenario:
    """The knobs of one run; ``Scenario.for_seed`` draws them so seeds explore different regimes."""

    cells: int = 6
    chaos_s: float = DEFAULT_CHAOS_S  # faults are injected during this much simulated time
    settle_s: float = 120.0  # after the faults stop, everything must be done within this
    loss: float = 0.05  # a proposal attempt is lost
    slow: float = 0.05  # a proposal attempt reaches the leader late (up to 1.5 s)
    pause_rate: float = 0.05  # per second: some replica is paused (SIGSTOP) for a while
    gil_hold: float = 0.0  # the share of those pauses that are user code holding the GIL instead
    crash_rate: float = 0.02  # per second: some replica's process dies
    partition_rate: float = 0.03  # per second: some replica is cut off from the others
    transfer_rate: float = 0.05  # per second: Raft leadership moves
    restart: float = 0.5  # a dead replica restarts from its disk (else a new member replaces it)
    snapshot: float = 0.5  # a restart restores a snapshot of the book before replaying the rest
    bind_fail: float = 0.05  # the local scheduler refuses a cell's GPUs
    overlap: float = 0.2  # the client sends the next cell before the previous one's answer
    write_behind: float = 0.5  # STATE waits for large objects to reach the store
    long_cell: float = 0.15  # a cell runs for seconds rather than milliseconds
    candidate_silence_s: float = 1.0  # scheduler.candidate_silence_s
    # chaos | paused_executor | paused_leader | crashed_executor (for_seed), gil_executor (tests)
    focus: str = "chaos"
    settings: ElectionSettings = field(default_factory=ElectionSettings)

    @staticmethod
    def for_seed(seed: int, *, chaos_s: float = DEFAULT_CHAOS_S) -> Scenario:
        r = random.Random(f"election-scenario-{seed}")
        focus = ("chaos", "paused_executor", "paused_leader", "crashed_executor")[seed % 4]
        quiet = focus != "chaos"
        return Scenario(
            cells=r.choice((4, 8, 12)),
            chaos_s=chaos_s,
            loss=r.choice((0.0, 0.02, 0.1, 0.25)),
            slow=r.choice((0.0, 0.05, 0.2)),
            pause_rate=0.0 if quiet and r.random() < 0.5 else r.choice((0.0, 0.05, 0.15)),
            crash_rate=0.0 if quiet and r.random() < 0.5 else r.choice((0.0, 0.02, 0.06)),
            partition_rate=0.0 if quiet else r.choice((0.0, 0.03, 0.1)),
            transfer_rate=r.choice((0.0, 0.05, 0.2)),
            restart=r.choice((0.0, 0.5, 1.0)),
            snapshot=r.choice((0.0, 0.5)),
            bind_fail=r.choice((0.0, 0.05, 0.2)),
            overlap=r.choice((0.0, 0.2, 0.5)),
            write_behind=r.choice((0.0, 0.5, 1.0)),
            long_cell=r.choice((0.0, 0.15, 0.4)),
            candidate_silence_s=r.choice((0.5, 1.0, 3.0)),
            focus=focus,
            settings=ElectionSettings(
                propose_votes=r.random() < 0.8,
                yield_grace_s=r.choice((0.0, 0.05)),
                leader_follows_executor=r.choice((0, 3)),
                # a crashed executor's cell must end by its survivors' word, long before silence
                executor_silence_s=10.0 if focus == "crashed_executor" else r.choice((3.0, 10.0)),
                election_wait_s=r.choice((2.0, 5.0)),
                state_wait_s=r.choice((3.0, 10.0)),
            ),
            gil_hold=r.choice((0.0, 0.5)),  # drawn last: the earlier draws keep their seeds
        )


@dataclass(slots=True)
class SimResult:
    seed: int
    violations: list[str]
    sim_s: float = 0.0  # simulated seconds until everything settled (or the bound)
    stats: dict[str, int] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)  # with ``verbose``: what happened, in order

    @property
    def ok(self) -> bool:
        return not self.violations


def reproduce_command(seed: int, chaos_s: float = DEFAULT_CHAOS_S) -> str:
    extra = "" if chaos_s == DEFAULT_CHAOS_S else f" --chaos-s {chaos_s:g}"
    return f"python scripts/election_torture.py --seeds 1 --start {seed}{extra} --verbose"


# ====================================================================== the oracle


class Oracle:
    """The election's specification over a committed log, written independently of the book: per
    key, the first LEAD of a current voter wins unless every current voter yielded first; the
    first DONE per key counts. ``decided_at``/``done_at``: the log index that settled each."""

    def __init__(self, voters: tuple[str, ...]) -> None:
        self.voters = frozenset(voters)
        self.winner: dict[str, str | None] = {}  # None: the election failed
        self.decided_at: dict[str, int] = {}
        self.yielded: dict[str, set[str]] = {}
        self.done: dict[str, Done] = {}
        self.done_at: dict[str, int] = {}

    def feed(self, index: int, item: LogEntry | tuple[str, ...]) -> None:
        if isinstance(item, tuple):
            self.voters = frozenset(item)
            for key, yielded in self.yielded.items():
                if key not in self.winner and self.voters and self.voters <= yielded:
                    self.winner[key], self.decided_at[key] = None, index
            return
        match item:
            case Lead(msg_id=key, replica_id=rid):
                if key not in self.winner and rid in self.voters:
                    self.winner[key], self.decided_at[key] = rid, index
            case Yield(msg_id=key, replica_id=rid):
                if key not in self.winner:
                    yielded = self.yielded.setdefault(key, set())
                    yielded.add(rid)
                    if self.voters <= yielded:
                        self.winner[key], self.decided_at[key] = None, index
            case Done(msg_id=key):
                if key not in self.done:
                    self.done[key], self.done_at[key] = item, index
            case _:
                pass


# ====================================================================== the simulated world


@dataclass(slots=True)
class Request:
    """What the scheduler sent one replica for one election key."""

    rid: int
    cell: int
    key: str
    round: int
    lead: bool
    silent: str | None = None
    outcome_of: str | None = None


@dataclass(slots=True)
class Cell:
    """One execute_request of the client."""

    index: int
    msg_id: str
    round: int = 0
    targets: set[str] = field(default_factory=set)
    started_by: str | None = None  # the replica the scheduler saw take the GPUs (``elected``)
    responder: str | None = None  # whose output the client sees: the first ``elected`` (ReplyMerger)
    heard: bool = False  # the designated candidate started the request (the scheduler saw busy)
    answer: dict[str, Any] | None = None
    answered_at: float | None = None
    sent_at: float = 0.0

    @property
    def key(self) -> str:
        return election_key(self.msg_id, self.round)


@dataclass(slots=True)
class _Proposal:
    token: int
    pid: str
    deadline: float
    settled: bool = False


class SimReplica:
    """One replica process: its election core, its model kernel, and what its disk holds."""

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.incarnation = 0
        self.up = False
        self.paused = False
        self.gil_held = False  # paused by user code holding the GIL: its OS says it runs
        self.partitioned = False
        self.core: ElectionCore | None = None
        self.applied = 0  # log index applied by this incarnation
        self.base = 0  # the index of the snapshot it joined from (its disk holds nothing before)
        self.replayed_through = 0  # what this incarnation replayed from its own disk at start
        self.deferred: list[Callable[[], None]] = []  # what came while paused
        self.tick_at: float | None = None
        self.apply_at: float | None = None
        self.lag = 0.0
        self.answers: dict[int, Callable[[Any], None]] = {}
        self.proposals: dict[int, _Proposal] = {}
        self.pids: dict[str, int] = {}
        self.jobs: dict[int, Callable[[], None]] = {}
        self.queue: deque[Request] = deque()
        self.busy = False
        self.count = 0  # the kernel's execution count
        self.received: list[Request] = []  # requests delivered to this incarnation
        self.replied: dict[int, dict[str, Any]] = {}  # request id -> content (this incarnation)


class Simulation:
    def __init__(self, seed: int, scenario: Scenario | None = None, *, verbose: bool = False) -> None:
        self.seed = seed
        self.scenario = scenario or Scenario.for_seed(seed)
        self.rng = random.Random(seed)
        # GIL holds and the scheduler's vouches draw apart: the other faults keep their draws
        self._gil_rng = random.Random(f"gil-{seed}")
        self.verbose = verbose
        self.trace: list[str] = []
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.violations: list[str] = []
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "runs",
                "replies",
                "entries",
                "pauses",
                "gil_holds",
                "vouches",
                "crashes",
                "restarts",
                "replacements",
                "partitions",
                "diverged_exits",
                "executor_lost",
                "rounds",
            ),
            0,
        )
        initial = INITIAL_VOTERS
        self.log: list[tuple[LogEntry | tuple[str, ...], str | None]] = []  # (entry or voters, pid)
        self.commit_time: list[float] = []
        self.voters: tuple[str, ...] = initial
        self.oracle = Oracle(initial)
        self.replicas: dict[str, SimReplica] = {rid: SimReplica(rid) for rid in initial}
        self.leader: str | None = None
        self._electing = False
        self._next_member = 4
        self._rids = 0
        self.cells: list[Cell] = []
        self.alive: set[str] = set(initial)  # what the scheduler believes
        self.leaving: set[str] = set()  # replicas that said they are leaving (diverged): no cells
        self.last_executor: str | None = None
        self.runs: dict[str, list[str]] = {}  # key -> replicas (with incarnation) that ran it
        self.healed = False
        self.fault_epoch = (
            0  # bumped by what can keep a quorum from committing: pause, cut, crash, leader loss
        )
        self.focus_used = False
        # when a proposed DONE of each cell last reached the leader, and when an attempt to send
        # one was last lost: the prompt-takeover bound presumes the survivors' DONE got through
        self.done_arrived_at: dict[str, float] = {}
        self.done_lost_at: dict[str, float] = {}

    # ---- the event queue ---------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn))

    def on(self, t: float, r: SimReplica, fn: Callable[[], None]) -> None:
        """An event of replica ``r``'s current incarnation: dropped if it died, held while paused."""
        incarnation = r.incarnation

        def event() -> None:
            if r.incarnation != incarnation or not r.up:
                return
            if r.paused:
                r.deferred.append(fn)
                return
            fn()

        self.at(t, event)

    def note(self, what: str) -> None:
        if self.verbose:
            self.trace.append(f"{self.now:9.3f} {what}")

    def fail(self, what: str) -> None:
        message = f"t={self.now:.3f}s: {what}"
        self.violations.append(message)
        self.note(f"VIOLATION {what}")

    # ---- the run -----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        for r in self.replicas.values():
            self._start(r, bootstrap=True)
        self._elect_later()
        self.at(0.5, lambda: self._submit(0))
        self.at(0.25, self._chaos)
        self.at(self.scenario.chaos_s, self._heal)
        end = self.scenario.chaos_s + self.scenario.settle_s
        while self._heap and not self.violations:
            t, _, fn = heapq.heappop(self._heap)
            if t > end:
                break
            self.now = t
            fn()
            if self.healed and self._settled():
                break
        if not self.violations:
            self._final_checks()
        return SimResult(self.seed, self.violations, round(self.now, 3), dict(self.stats), self.trace)

    # ---- Raft, as the election sees it ---------------------------------------------------------------
    def reachable(self, rid: str) -> bool:
        r = self.replicas.get(rid)
        return r is not None and r.up and not r.paused and not r.partitioned

    def has_quorum(self) -> bool:
        return sum(self.reachable(v) for v in self.voters) >= majority(len(self.voters))

    def view(self, r: SimReplica) -> RaftView:
        leader = self.leader if self.reachable(r.id) else None
        return RaftView(running=r.up, leader=leader, voters=self.voters)

    def _refresh_leader(self) -> None:
        if self.leader is not None and (
            not self.reachable(self.leader) or self.leader not in self.voters or not self.has_quorum()
        ):
            self.note(f"leader {self.leader} lost")
            self.leader = None
            self.fault_epoch += 1
        if self.leader is None:
            self._elect_later()

    def _elect_later(self) -> None:
        if not self._electing:
            self._electing = True
            self.at(self.now + self.rng.uniform(0.15, 0.5), self._elect)

    def _elect(self) -> None:
        self._electing = False
        if self.leader is not None:
            return
        candidates = [v for v in self.voters if self.reachable(v)]
        if len(candidates) >= majority(len(self.voters)):
            self.leader = self.rng.choice(sorted(candidates))
            self.note(f"leader {self.leader}")
            for r in self.replicas.values():
                self._schedule_apply(r)
        else:
            self._elect_later()

    def _transfer(self, target: str) -> None:
        if self.reachable(target) and target in self.voters and self.has_quorum():
            self.leader = target
            self.note(f"leadership to {target}")

    def _arrive(self, leader: str, pid: str, entry: LogEntry) -> None:
        """A proposal attempt reached ``leader``: appended, then committed once replicated."""
        if self.leader != leader or not self.has_quorum():
            return
        if isinstance(entry, Done):
            self.done_arrived_at[entry.msg_id] = self.now

        def commit() -> None:
            if not self.has_quorum() or (self.leader != leader and self.rng.random() < 0.5):
                return  # the leader lost its place before a majority held it
            self._append(entry, pid)

        self.at(self.now + self.rng.uniform(0.0005, 0.005), commit)

    def _append(self, item: LogEntry | tuple[str, ...], pid: str | None) -> None:
        self.log.append((item, pid))
        self.commit_time.append(self.now)
        self.stats["entries"] += 1
        index = len(self.log)
        self.oracle.feed(index, item)
        if isinstance(item, tuple):
            self.voters = item
            self.note(f"#{index} voters {item}")
            self._refresh_leader()
        else:
            self.note(f"#{index} {_describe(item)}")
        for r in self.replicas.values():
            self._schedule_apply(r)

    def _schedule_apply(self, r: SimReplica) -> None:
        if not r.up or r.apply_at is not None or r.applied >= len(self.log):
            return
        t = max(self.now, self.commit_time[r.applied] + r.lag)
        r.apply_at = t

        def apply() -> None:
            r.apply_at = None
            self._apply_ready(r)

        self.on(t, r, apply)

    def _apply_ready(self, r: SimReplica) -> None:
        """Apply every committed entry this replica has received, in one batch (as a Ready)."""
        if not self.reachable(r.id) or r.core is None:
            return
        settled: list[tuple[int, int]] = []
        while r.applied < len(self.log) and self.commit_time[r.applied] + r.lag <= self.now:
            index = r.applied + 1
            item, pid = self.log[index - 1]
            if isinstance(item, tuple):
                r.core.set_voters(item, self.now)
            else:
                decoded = log_entries.decode(log_entries.encode(item))
                r.core.apply(index, decoded, self.now)
            r.applied = index
            self._carry_out(r)
            if pid is not None and pid in r.pids:
                settled.append((r.pids.pop(pid), index))
        for token, index in settled:  # the proposer's future resolves after the Ready is applied
            self.on(self.now, r, lambda token=token, index=index: self._settle(r, token, index))
        self._schedule_apply(r)

    # ---- a replica's shell: the core's commands ----------------------------------------------------
    def _carry_out(self, r: SimReplica) -> None:
        core = r.core
        if core is None:
            return
        for command in core.take_commands():
            match command:
                case Propose(entry=entry, token=token, why=why):
                    self._propose(r, entry, token, why)
                case BindGpus(token=token, msg_id=key):
                    self._bind(r, token, key)
                case Answer(request=request, value=value):
                    callback = r.answers.pop(request, None)
                    if callback is not None:
                        self.on(self.now, r, lambda cb=callback, v=value: cb(v))
                case NotifyScheduler(event="election_failed", msg_id=key):
                    self.at(self.now + 0.002, lambda key=key: self._election_failed(key))
                case NotifyScheduler(event="leaving"):
                    self.at(self.now + 0.002, lambda rid=r.id: self.leaving.add(rid))
                case NotifyScheduler(event="executor_quiet", executor=executor) if executor:
                    self.at(
                        self.now + self._gil_rng.uniform(0.001, 0.01), lambda e=executor: self._vouch(r.id, e)
                    )
                case NotifyScheduler(event="elected", msg_id=key):
                    self.at(
                        self.now + self.rng.uniform(0.0005, 0.003), lambda key=key: self._elected(r.id, key)
                    )
                case TransferLeadership(to=target):
                    self.at(self.now + self.rng.uniform(0.01, 0.05), lambda t=target: self._transfer(t))
                case ExitDiverged():
                    self.on(self.now + 1.0, r, lambda: self._crash(r, "diverged, backstop"))
                case DeliverDone(done=done):
                    r.count = max(r.count, done.execution_count)
                case CellReplicated(job=job):
                    waiter = r.jobs.pop(job, None)
                    if waiter is not None:
                        self.on(self.now, r, waiter)
                case Log(level=level, event=event, fields=fields) if level != "debug":
                    self.note(f"{r.id} {event} {fields}")
                case _:
                    pass
        deadline = core.next_deadline()
        if deadline is not None and (r.tick_at is None or deadline < r.tick_at):
            r.tick_at = deadline

            def tick(deadline: float = deadline) -> None:
                if r.tick_at == deadline:
                    r.tick_at = None
                if r.core is not None:
                    r.core.tick(self.now)
                    self._carry_out(r)

            self.on(deadline, r, tick)

    def _propose(self, r: SimReplica, entry: LogEntry, token: int, why: str) -> None:
        pid = f"{r.id}.{r.incarnation}.{token}"
        proposal = _Proposal(token, pid, self.now + self.scenario.settings.propose_timeout_s)
        r.proposals[token] = proposal
        r.pids[pid] = token
        self._attempt(r, proposal, entry)

    def _attempt(self, r: SimReplica, proposal: _Proposal, entry: LogEntry) -> None:
        if proposal.settled:
            return
        remaining = proposal.deadline - self.now
        if remaining <= 0:
            self._settle(r, proposal.token, TimeoutError("proposal timed out"))
            return
        leader = self.leader if self.reachable(r.id) else None
        if leader is None:  # ProposalDropped: no leader known; retried soon
            self.on(self.now + min(remaining, DROPPED_RETRY_S), r, lambda: self._attempt(r, proposal, entry))
            return
        if self.rng.random() >= self.scenario.loss:
            late = self.rng.random() < self.scenario.slow
            delay = self.rng.uniform(0.3, 1.5) if late else self.rng.uniform(0.0002, 0.003)
            self.at(self.now + delay, lambda: self._arrive(leader, proposal.pid, entry))
        elif isinstance(entry, Done):
            self.done_lost_at[entry.msg_id] = self.now
        self.on(self.now + min(remaining, PROPOSE_ATTEMPT_S), r, lambda: self._attempt(r, proposal, entry))

    def _settle(self, r: SimReplica, token: int, result: int | Exception) -> None:
        proposal = r.proposals.pop(token, None)
        if proposal is None or proposal.settled or r.core is None:
            return
        proposal.settled = True
        r.pids.pop(proposal.pid, None)
        r.core.proposal_settled(token, result, self.now)
        self._carry_out(r)

    def _bind(self, r: SimReplica, token: int, key: str) -> None:
        """gpu.commit: the local scheduler grants or refuses whatever state the replica is in
        (and tells nobody else: the winner announces itself); the replica hears the answer when
        it runs."""
        refused = self.rng.random() < self.scenario.bind_fail
        incarnation = r.incarnation

        def grant() -> None:
            if r.incarnation != incarnation or not r.up:
                return
            self.on(self.now + 0.0005, r, settle)

        def settle() -> None:
            if r.core is None:
                return
            result: list[int] | Exception = ValueError("no free GPUs on this host") if refused else [0]
            r.core.bind_settled(token, result, self.now)
            self._carry_out(r)

        self.at(self.now + self.rng.uniform(0.0005, 0.004), grant)

    # ---- a replica's kernel ------------------------------------------------------------------------
    def _deliver(self, r: SimReplica, request: Request) -> None:
        r.received.append(request)
        r.queue.append(request)
        self.note(f"{r.id} gets {_describe_request(request)}")
        if not r.busy:
            self._next_request(r)

    def _next_request(self, r: SimReplica) -> None:
        if r.busy or not r.queue or r.core is None:
            return
        request = r.queue.popleft()
        r.busy = True
        cell = self.cells[request.cell]
        if request.lead and request.round == cell.round:
            cell.heard = True  # its kernel publishes busy as it starts the request
        if request.outcome_of is not None and not request.lead:
            rid = r.core.outcome_of(request.key, request.outcome_of, self.now)
        else:
            rid = r.core.decide(request.key, lead=request.lead, silent=request.silent, now=self.now)
        r.answers[rid] = lambda decision: self._decided(r, request, decision)
        self._carry_out(r)

    def _ask(self, r: SimReplica, rid: int, then: Callable[[Any], None]) -> None:
        r.answers[rid] = then
        self._carry_out(r)

    def _decided(self, r: SimReplica, request: Request, decision: Any) -> None:
        core = r.core
        assert core is not None
        key = request.key
        match decision:
            case Execute():
                ended = core.ended_before_run(key)
                if ended is not None:
                    core.abandon(self.now)
                    self._carry_out(r)
                    self._reply(r, request, ended.content)
                else:
                    self._run(r, request)
            case BindFailed(reason=reason):
                content = _error("GpuUnavailable", reason, r.count)
                done = Done(key, r.id, content, r.count, False)

                def committed(error: Any) -> None:
                    if error is None:
                        answer, verdict = core.committed_answer(key, content, r.count)
                        self._reply(r, request, answer, no_executor=verdict == COMMITTED)
                    else:
                        self._reply(r, request, _error("ReplicationFailed", str(error), r.count))

                self._ask(r, core.finish(done, release_gpus=False, now=self.now), committed)
            case Standby(winner=winner):

                def waited(result: Done | str) -> None:
                    if isinstance(result, Done):
                        self._reply(r, request, result.content)
                    else:
                        self._reply(r, request, _error("ReplicaUnavailable", result, r.count))

                self._ask(r, core.wait_done(key, winner, r.count, self.now), waited)
            case Replay(done=done):
                self._reply(r, request, done.content)
            case Failed():
                self._reply(r, request, _error("NoExecutorAvailable", "every replica yielded", r.count), True)
            case Unavailable(reason=reason, declined=True) if request.lead:
                # the scheduler keeps it from the client and sends the cell to another replica
                self._reply(r, request, _error("ReplicaUnavailable", reason, r.count), declined=True)
            case Unavailable(reason=reason):
                self._reply(r, request, _error("ReplicaUnavailable", reason, r.count))
            case _:
                self.fail(f"{r.id} got an unknown decision {decision!r} for {key}")

    def _run(self, r: SimReplica, request: Request) -> None:
        key = request.key
        self._check_run(r, key)
        self.stats["runs"] += 1
        self.runs.setdefault(key, []).append(f"{r.id}#{r.incarnation}")
        long_cell = self.rng.random() < self.scenario.long_cell
        duration = self.rng.uniform(1.0, 8.0) if long_cell else self.rng.uniform(0.001, 0.05)
        self.note(f"{r.id} runs {key} for {duration:.3f}s")
        focus = self.scenario.focus
        if focus in ("paused_executor", "gil_executor") and not self.focus_used and request.cell >= 1:
            # issue 14: the executor stops inside the cell for longer than the executor silence
            # (or its user code holds the GIL that long: stalled alike, but its OS says it runs)
            self.focus_used = True
            silence = self.scenario.settings.executor_silence_s
            gil = focus == "gil_executor"
            self.at(
                self.now + duration / 2, lambda: self._pause(r, silence + self.rng.uniform(1.0, 5.0), gil=gil)
            )
        if self.scenario.focus == "crashed_executor" and not self.focus_used and request.cell >= 1:
            self.focus_used = True  # its process dies inside the cell
            self.at(self.now + duration * self.rng.random(), lambda: self._crash(r, "inside a cell"))
        self.on(self.now + duration, r, lambda: self._ran(r, request))

    def _ran(self, r: SimReplica, request: Request) -> None:
        core = r.core
        assert core is not None
        key = request.key
        r.count += 1
        content = {"status": "ok", "execution_count": r.count, "ran": f"{key}@{r.id}#{r.incarnation}"}
        done = Done(key, r.id, content, r.count, True)
        state = State(key, r.id)
        behind = self.rng.random() < self.scenario.write_behind
        job = core.finish_cell(done, None if behind else state, self.now)
        answered = False

        def replicated() -> None:
            nonlocal answered
            if answered:
                return
            answered = True
            r.jobs.pop(job, None)
            answer, verdict = core.committed_answer(key, content, r.count)
            self._reply(r, request, answer)
            if verdict == SUPERSEDED:
                self.stats["diverged_exits"] += 1
                self.on(self.now + DIVERGED_EXIT_DELAY_S, r, lambda: self._crash(r, "diverged"))

        r.jobs[job] = replicated
        self._carry_out(r)
        if behind:

            def written() -> None:
                core.state_written(job, state, self.now)
                self._carry_out(r)

            self.on(self.now + self.rng.uniform(0.005, 0.5), r, written)
        self.on(self.now + IDLE_REPLICATION_WAIT_S, r, replicated)

    def _reply(
        self,
        r: SimReplica,
        request: Request,
        content: dict[str, Any],
        no_executor: bool = False,
        declined: bool = False,
    ) -> None:
        if request.rid in r.replied:
            self.fail(f"{r.id} answered request {request.rid} ({request.key}) twice")
        r.replied[request.rid] = content
        self.stats["replies"] += 1
        self.note(f"{r.id} replies {_describe_content(content)} to {_describe_request(request)}")
        if content.get("status") == "ok":
            key, _, runner = str(content.get("ran")).partition("@")
            if key != request.key or runner not in self.runs.get(key, []):
                self.fail(f"{r.id} answered ok for {request.key} without a run of it: {content}")
        if content.get("ename") == "ExecutorLost":
            self.stats["executor_lost"] += 1
        r.busy = False
        self.at(
            self.now + self.rng.uniform(0.0005, 0.003),
            lambda: self._on_reply(r.id, request, content, no_executor, declined),
        )
        self._next_request(r)

    # ---- the checks at each step -------------------------------------------------------------------
    def _check_run(self, r: SimReplica, key: str) -> None:
        core = r.core
        assert core is not None
        earlier = self.runs.get(key, [])
        if earlier:
            self.fail(f"{key} runs a second time on {r.id}#{r.incarnation} (already on {earlier})")
        outcome = core.book.outcome(key)
        if outcome is None or outcome.winner != r.id:
            self.fail(f"{r.id} runs {key} without its own committed winning LEAD (book: {outcome})")
        winner = self.oracle.winner.get(key, "<undecided>")
        decided_at = self.oracle.decided_at.get(key)
        if winner != r.id or decided_at is None or decided_at > r.applied:
            self.fail(
                f"{r.id} runs {key} but the committed log's winner is {winner!r} (decided at "
                f"#{decided_at}, {r.id} applied #{r.applied})"
            )
        done_at = self.oracle.done_at.get(key)
        if done_at is not None and done_at <= r.applied:
            self.fail(f"{r.id} runs {key} whose DONE #{done_at} it has already applied")

    def _settled(self) -> bool:
        if any(cell.answer is None for cell in self.cells) or len(self.cells) < self.scenario.cells:
            return False
        for r in self.replicas.values():
            if r.up and (r.busy or r.queue or r.paused or r.applied < len(self.log)):
                return False
        # a surviving quorum decides: every cell won by a member of the group has its DONE (one
        # whose winner was removed is answered ExecutorLost by each replica without one)
        return all(key in self.oracle.done or w not in self.voters for key, w in self.oracle.winner.items())

    def _final_checks(self) -> None:
        if not self._settled():
            pending = [c.key for c in self.cells if c.answer is None]
            busy = {
                r.id: [q.key for q in r.queue] for r in self.replicas.values() if r.up and (r.busy or r.queue)
            }
            undecided = [
                k for k, w in self.oracle.winner.items() if w in self.voters and k not in self.oracle.done
            ]
            behind = {
                r.id: (r.applied, len(self.log))
                for r in self.replicas.values()
                if r.up and r.applied < len(self.log)
            }
            self.fail(
                f"not settled {self.scenario.settle_s:g}s after the faults stopped: cells unanswered "
                f"{pending}, replicas busy {busy}, won without DONE {undecided}, behind {behind}, "
                f"sent {len(self.cells)}/{self.scenario.cells}"
            )
            return
        for r in self.replicas.values():
            if not r.up:
                continue
            for request in r.received:
                if request.rid not in r.replied:
                    self.fail(f"{r.id} never answered request {request.rid} ({request.key})")
            for rid, content in r.replied.items():
                key = next(q.key for q in r.received if q.rid == rid)
                self._check_answer(f"{r.id}'s reply to request {rid}", key, content)
            core = r.core
            assert core is not None
            for key, winner in self.oracle.winner.items():
                outcome = core.book.outcome(key)
                if outcome is None or outcome.winner != winner:
                    self.fail(f"{r.id}'s book has {key} decided {outcome}, the log says {winner!r}")
            for key, done in self.oracle.done.items():
                if core.book.done(key) != done:
                    self.fail(
                        f"{r.id}'s book has DONE {core.book.done(key)} for {key}, the log's first is {done}"
                    )
        for cell in self.cells:
            assert cell.answer is not None
            self._check_answer(f"the client's answer to cell {cell.index}", cell.key, cell.answer)

    def _check_answer(self, what: str, key: str, content: dict[str, Any]) -> None:
        """An answer that is not an error saying why none could be given is the log's DONE."""
        if content.get("ename") in (
            "ReplicaUnavailable",
            "NoExecutorAvailable",
            "ReplicaLost",
            "ReplicationFailed",
        ):
            return
        done = self.oracle.done.get(key)
        if done is None or done.content != content:
            self.fail(f"{what} for {key} is {content}, the log's DONE is {done.content if done else None}")

    # ---- the scheduler -------------------------------------------------------------------------------
    def _submit(self, index: int) -> None:
        if index >= self.scenario.cells or index < len(self.cells):
            return
        cell = Cell(index, f"cell{index}", sent_at=self.now)
        self.cells.append(cell)
        self.note(f"client sends {cell.msg_id}")
        self._route(cell)
        if self.rng.random() < self.scenario.overlap:
            self.at(self.now + self.rng.uniform(0.0, 0.1), lambda: self._submit(index + 1))

    def _route(self, cell: Cell) -> None:
        live = sorted(r for r in self.alive if r in self.voters)
        staying = [r for r in live if r not in self.leaving]
        if len(live) < majority(len(self.voters)):
            self._answer(cell, _error("ReplicaLost", "the kernel lost its quorum", 0))
            return
        if (
            self.scenario.focus == "paused_leader"
            and not self.focus_used
            and cell.index >= 1
            and self.leader in live
        ):
            # issue 14: the Raft leader is designated and stops as the cell reaches it
            self.focus_used = True
            designated = self.leader
            r = self.replicas[designated]
            pause = self.scenario.candidate_silence_s + self.rng.uniform(0.5, 4.0)
            self.at(self.now + self.rng.uniform(0.0, 0.01), lambda: self._pause(r, pause))
        elif self.last_executor in staying and self.rng.random() < 0.7:
            designated = self.last_executor
        elif self.leader in staying and self.rng.random() < 0.7:
            designated = self.leader
        else:
            designated = self.rng.choice(staying or live)
        assert designated is not None
        cell.targets = {designated}
        cell.started_by = cell.responder = None
        cell.heard = False
        self._send(designated, cell, lead=True)
        round_ = cell.round
        self.at(
            self.now + self.scenario.candidate_silence_s,
            lambda: self._candidate_silent(cell, round_, designated),
        )

    def _send(
        self, rid: str, cell: Cell, *, lead: bool, silent: str | None = None, outcome_of: str | None = None
    ) -> None:
        self._rids += 1
        request = Request(self._rids, cell.index, cell.key, cell.round, lead, silent, outcome_of)
        r = self.replicas[rid]  # delivered unless the replica dies first (the link is TCP)
        self.on(self.now + self.rng.uniform(0.0005, 0.003), r, lambda: self._deliver(r, request))

    def _candidate_silent(self, cell: Cell, round_: int, designated: str) -> None:
        if (
            cell.answer is not None
            or cell.round != round_
            or cell.heard
            or cell.started_by is not None
            or cell.targets != {designated}
        ):
            return
        others = sorted(r for r in self.alive if r in self.voters and r != designated)
        if not others:
            return
        cell.targets |= set(others)
        for rid in others:
            self._send(rid, cell, lead=False, silent=designated)

    def _elected(self, rid: str, key: str) -> None:
        winner = self.oracle.winner.get(key)
        if winner != rid:
            self.fail(f"{rid} announces itself elected for {key}, the committed log's winner is {winner!r}")
        for cell in self.cells:
            if cell.key == key and cell.answer is None:
                cell.started_by = rid
                self.last_executor = rid
                if cell.responder is None and rid in cell.targets:
                    cell.responder = rid

    def _election_failed(self, key: str) -> None:
        for cell in self.cells:
            if cell.key == key and cell.answer is None:
                self._next_round(cell)

    def _next_round(self, cell: Cell) -> None:
        if cell.round + 1 >= MAX_ROUNDS:
            self._answer(cell, _error("NoExecutorAvailable", f"{MAX_ROUNDS} elections failed", 0))
            return
        cell.round += 1
        self.stats["rounds"] += 1
        self.note(f"{cell.msg_id} goes to round {cell.round}")
        self._route(cell)

    def _on_reply(
        self, rid: str, request: Request, content: dict[str, Any], no_executor: bool, declined: bool = False
    ) -> None:
        if declined:  # a leaving replica did nothing for it (the live ``Merged.declined``)
            self.leaving.add(rid)
        cell = self.cells[request.cell]
        if cell.answer is not None or request.round != cell.round:
            return
        if cell.responder is not None and rid != cell.responder:
            return  # the merger drops every other replica's frames once it knows the responder
        if no_executor:
            self._next_round(cell)
            return
        if declined:
            if cell.targets == {rid}:
                self._route(cell)
            return
        ran = [runner.split("#")[0] for runner in self.runs.get(cell.key, [])]
        if content.get("status") == "ok" and cell.responder is not None and ran and cell.responder not in ran:
            self.fail(
                f"the client gets ok for {cell.key} with {cell.responder}'s output, but {ran} ran it "
                f"(the scheduler took the first replica to announce ``elected`` as the responder)"
            )
        self._answer(cell, content)

    def _answer(self, cell: Cell, content: dict[str, Any]) -> None:
        if cell.answer is not None:
            return
        cell.answer, cell.answered_at = content, self.now
        self.note(f"client gets {_describe_content(content)} for {cell.msg_id}")
        self.at(self.now + self.rng.uniform(0.0, 0.5), lambda: self._submit(cell.index + 1))

    def _replica_dead(self, r: SimReplica) -> None:
        """The scheduler saw ``r``'s process exit (its local scheduler's report)."""
        if r.id not in self.alive:
            return
        self.alive.discard(r.id)
        self.leaving.discard(r.id)  # a restart in place is a fresh process
        survivors = sorted(s for s in self.alive if s in self.voters)
        # what the scheduler tells the survivors it was running: the cells it announced itself
        # elected for, not yet answered (``ReplyMerger.executing_on``)
        started = sorted(c.key for c in self.cells if c.answer is None and c.responder == r.id)
        for sid in survivors:
            s = self.replicas[sid]
            self.on(
                self.now + self.rng.uniform(0.0005, 0.003), s, lambda s=s: self._member_lost(s, r.id, started)
            )
        for cell in self.cells:
            if cell.answer is not None or r.id not in cell.targets:
                continue
            if cell.responder == r.id:
                if len(survivors) >= majority(len(self.voters)):
                    cell.targets = set(survivors)
                    cell.responder = None  # the first survivor to answer (ReplyMerger.reopen)
                    for sid in survivors:
                        self._send(sid, cell, lead=False, outcome_of=r.id)
                else:
                    self._answer(cell, _error("ReplicaLost", f"{r.id} died running the cell", 0))
            elif cell.targets == {r.id}:
                self._route(cell)  # it had not started the cell: to another replica, same round
            else:
                cell.targets.discard(r.id)
        others_up = sum(1 for v in self.voters if v != r.id and self.replicas[v].up)
        if self.rng.random() < self.scenario.restart or others_up < majority(len(self.voters)):
            # (without a quorum no replacement can commit: the operator restarts it in place)
            self.at(self.now + self.rng.uniform(*RESTART_S), lambda: self._restart(r))
        else:
            self.at(self.now + self.rng.uniform(*RESTART_S), lambda: self._replace(r))

    def _vouch(self, asker: str, executor: str) -> None:
        """The scheduler asks ``executor``'s host whether its process runs: up and not stopped
        (holding the GIL, or partitioned, it runs); if so, the asking standby hears it is busy."""
        e, s = self.replicas.get(executor), self.replicas.get(asker)
        if e is None or not e.up or (e.paused and not e.gil_held) or s is None or not s.up:
            return
        self.stats["vouches"] += 1

        def busy(s: SimReplica = s) -> None:
            if s.core is not None:
                s.core.executor_busy(executor, self.now)
                self._carry_out(s)

        self.on(self.now + self._gil_rng.uniform(0.0005, 0.003), s, busy)

    def _member_lost(self, s: SimReplica, member: str, started: list[str]) -> None:
        if s.core is None:
            return
        # a cell this survivor watched the dead member run must get its DONE now, not only after
        # the executor silence (checked PROMPT_TAKEOVER_S later, if nothing disturbed the group)
        for key in s.core.book.running_on(member) if self.has_quorum() else ():
            if self.oracle.decided_at.get(key, 0) > s.replayed_through:
                epoch, told = self.fault_epoch, self.now
                self.at(
                    self.now + PROMPT_TAKEOVER_S,
                    lambda k=key, e=epoch, t=told: self._check_takeover(k, member, e, t),
                )
        s.core.member_lost(member, started, self.now)
        self._carry_out(s)

    def _check_takeover(self, key: str, member: str, epoch: int, told: float) -> None:
        if key in self.oracle.done or epoch != self.fault_epoch or self.leader is None:
            return
        if self.done_lost_at.get(key, -1.0) >= told and self.done_arrived_at.get(key, -1.0) < told:
            return  # the channel lost every attempt at its DONE: the settle checks still hold it
        self.fail(
            f"{member} died running {key} and its survivors were told, yet no DONE for it committed "
            f"within {PROMPT_TAKEOVER_S:g}s on a healthy group"
        )

    # ---- lifecycle and faults ------------------------------------------------------------------------
    def _start(self, r: SimReplica, *, bootstrap: bool = False, snapshot_at: int = 0) -> None:
        r.incarnation += 1
        r.up, r.paused, r.partitioned = True, False, False
        r.deferred.clear()
        r.tick_at = r.apply_at = None
        r.answers, r.proposals, r.pids, r.jobs = {}, {}, {}, {}
        r.queue, r.busy = deque(), False
        r.received, r.replied = [], {}
        r.lag = self.rng.choice((0.0, 0.001, 0.005, 0.02))
        core = ElectionCore(r.id, self.scenario.settings, raft=lambda: self.view(r), now=self.now)
        r.core = core
        persisted = r.applied
        # the scheduler's replica.configure names the current members (none for a joiner)
        core.configure(self.voters if bootstrap or r.incarnation > 1 else ())
        r.applied = 0
        if not bootstrap:
            # The snapshot on its disk (a joiner's: the leader's, as it joined; an original
            # member's: at least the bootstrap one, index 0 here, whose voters are the first)
            # restores the book and the voters as of its index, before the log is replayed.
            snapshot_at = max(snapshot_at, r.base)
            book = ElectionBook()
            voters: tuple[str, ...] = INITIAL_VOTERS
            book.set_voters(voters)
            for item, _ in self.log[:snapshot_at]:
                if isinstance(item, tuple):
                    voters = item
                    book.set_voters(item)
                else:
                    book.apply(item)
            if snapshot_at:
                core.restore(ElectionBook.from_snapshot(book.to_snapshot()), self.now)
            core.set_voters(voters, self.now, restored=True)
            r.applied = snapshot_at
        # The peer starts (a snapshot is restored during its start), then replays the log it
        # holds through its Ready loop: those entries are applied after ``started``, not live.
        r.replayed_through = max(r.applied, persisted)
        core.started(
            last_index=r.replayed_through,
            applied=r.applied,
            voters=self.voters if bootstrap or r.incarnation > 1 else (),
            now=self.now,
        )
        while r.applied < persisted:
            item, _ = self.log[r.applied]
            r.applied += 1
            if isinstance(item, tuple):
                core.set_voters(item, self.now)
            else:
                core.apply(r.applied, item, self.now)
        r.count = 0
        last = core.book.last_done()
        if last is not None:
            r.count = last.execution_count
        self._carry_out(r)
        self._schedule_apply(r)

    def _chaos(self) -> None:
        if self.healed:
            return
        s = self.scenario
        step = 0.25
        up = [r for r in self.replicas.values() if r.up and r.id in self.voters]
        if up and self.rng.random() < s.pause_rate * step:
            r = self.rng.choice(up)
            if not r.paused:
                gil = self._gil_rng.random() < s.gil_hold
                self._pause(r, self.rng.uniform(0.2, s.settings.executor_silence_s + 4.0), gil=gil)
        if (
            self.rng.random() < s.crash_rate * step
            and len(self.voters) >= 3
            and all(self.replicas[v].up for v in self.voters)
            and all(r.up for r in self.replicas.values() if r.id in self.alive or r.id in self.voters)
        ):  # one death at a time: the group keeps a quorum (a kernel that loses two is stopped)
            self._crash(self.rng.choice(up), "chaos")
        if up and self.rng.random() < s.partition_rate * step:
            r = self.rng.choice(up)
            if not r.partitioned:
                self._partition(r, self.rng.uniform(0.2, 8.0))
        if self.rng.random() < s.transfer_rate * step:
            candidates = [v for v in self.voters if self.reachable(v)]
            if candidates:
                self._transfer(self.rng.choice(sorted(candidates)))
        self.at(self.now + step, self._chaos)

    def _pause(self, r: SimReplica, seconds: float, *, gil: bool = False) -> None:
        if not r.up or r.paused:
            return
        r.paused, r.gil_held = True, gil
        self.fault_epoch += 1
        self.stats["gil_holds" if gil else "pauses"] += 1
        self.note(f"{r.id} {'holds the GIL' if gil else 'paused'} for {seconds:.2f}s")
        self._refresh_leader()
        incarnation = r.incarnation
        self.at(self.now + seconds, lambda: self._resume(r, incarnation))

    def _resume(self, r: SimReplica, incarnation: int) -> None:
        if r.incarnation != incarnation or not r.paused:
            return
        r.paused = r.gil_held = False
        self.note(f"{r.id} resumed")
        deferred, r.deferred = r.deferred, []
        for fn in deferred:  # expired timers and the log's catch-up, in any interleaving
            self.on(self.now + self.rng.uniform(0.0, 0.05), r, fn)
        r.apply_at = None
        self._schedule_apply(r)
        self._refresh_leader()

    def _partition(self, r: SimReplica, seconds: float) -> None:
        r.partitioned = True
        self.fault_epoch += 1
        self.stats["partitions"] += 1
        self.note(f"{r.id} partitioned for {seconds:.2f}s")
        self._refresh_leader()
        incarnation = r.incarnation

        def heal() -> None:
            if r.incarnation == incarnation and r.partitioned:
                r.partitioned = False
                self.note(f"{r.id} reconnected")
                r.apply_at = None
                self._schedule_apply(r)
                self._refresh_leader()

        self.at(self.now + seconds, heal)

    def _crash(self, r: SimReplica, why: str) -> None:
        if not r.up:
            return
        r.up = False
        r.core = None
        self.fault_epoch += 1
        self.stats["crashes"] += 1
        self.note(f"{r.id} exits ({why})")
        self._refresh_leader()
        self.at(self.now + self.rng.uniform(0.1, 1.0), lambda: self._replica_dead(r))

    def _restart(self, r: SimReplica) -> None:
        if r.up or r.id not in self.voters:
            return
        self.stats["restarts"] += 1
        snapshot_at = (
            self.rng.randint(r.base, r.applied)
            if r.applied > r.base and self.rng.random() < self.scenario.snapshot
            else r.base
        )
        self.note(f"{r.id} restarts (applied #{r.applied}, snapshot #{snapshot_at})")
        self._start(r, snapshot_at=snapshot_at)
        self.alive.add(r.id)
        self._refresh_leader()

    def _replace(self, r: SimReplica) -> None:
        """Remove the dead member and add a new one, one committed membership change each."""
        if r.up:
            return
        if not self.has_quorum() or self.leader is None:
            self.at(self.now + 0.5, lambda: self._replace(r))
            return
        self.stats["replacements"] += 1
        self._append(tuple(v for v in self.voters if v != r.id), None)
        new = SimReplica(f"r{self._next_member}")
        self._next_member += 1
        self.replicas[new.id] = new

        def add() -> None:
            if not self.has_quorum() or self.leader is None:
                self.at(self.now + 0.5, add)
                return
            new.base = len(self.log)
            self._start(new, snapshot_at=new.base)  # joins from the leader's snapshot
            self._append((*self.voters, new.id), None)
            self.alive.add(new.id)
            self.note(f"{new.id} replaces {r.id}")

        self.at(self.now + self.rng.uniform(0.2, 1.0), add)

    def _heal(self) -> None:
        """The faults stop: every pause and partition ends; the dead come back or are replaced."""
        self.healed = True
        self.note("heal")
        for r in list(self.replicas.values()):
            if r.paused:
                self._resume(r, r.incarnation)
            if r.partitioned:
                r.partitioned = False
                r.apply_at = None
                self._schedule_apply(r)
        self._refresh_leader()


# ====================================================================== helpers


def _error(ename: str, evalue: str, count: int) -> dict[str, Any]:
    return {"status": "error", "ename": ename, "evalue": evalue, "execution_count": count}


def _describe(entry: LogEntry) -> str:
    kind = type(entry).__name__.upper()
    if isinstance(entry, Done):
        return f"{kind} {entry.msg_id} by {entry.replica_id} {_describe_content(entry.content)}"
    if isinstance(entry, Yield) and entry.proposer != entry.replica_id:
        return f"{kind} {entry.msg_id} {entry.replica_id} (by {entry.proposer})"
    return f"{kind} {entry.msg_id} {getattr(entry, 'replica_id', '')}"


def _describe_request(request: Request) -> str:
    kind = "execute" if request.lead else "yield"
    extra = f" silent={request.silent}" if request.silent else ""
    extra += f" outcome_of={request.outcome_of}" if request.outcome_of else ""
    return f"{kind}#{request.rid} {request.key}{extra}"


def _describe_content(content: dict[str, Any]) -> str:
    if content.get("status") == "ok":
        return f"ok({content.get('ran')})"
    return f"{content.get('ename')}"


def run_seed(seed: int, scenario: Scenario | None = None, *, verbose: bool = False) -> SimResult:
    return Simulation(seed, scenario, verbose=verbose).run()


__all__ = [
    "Oracle",
    "SafetyViolation",
    "Scenario",
    "SimResult",
    "Simulation",
    "reproduce_command",
    "run_seed",
]
