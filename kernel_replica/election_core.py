"""One replica's side of the executor election (NotebookOS §3.2.2) as a sans-I/O core.

``ElectionBook`` (kernel_replica/election.py) turns committed log entries into decisions that every
replica shares. What one replica does around them is here: when it proposes LEAD or YIELD, how
long it gives a designated candidate (yield grace) or a silent voter (proxy YIELDs, a stand-in
LEAD), what a member's death changes, when a standby gives up on a silent executor and commits its
``ExecutorLost`` DONE, the PROGRESS beats, the order of an executor's DONE and STATE, the batched
VOTEs, and when the Raft leader hands leadership to the executor. Above all it holds the at-most-once
rule: ``Execute`` is answered only once this replica's own LEAD is the committed winner in its
applied log, and ``ended_before_run``/``superseded`` say when a won cell must still not run, or
when a replica's namespace ran ahead of the log.

Modelled on etcd-io/raft's ``RawNode`` + ``Ready`` and h11's ``Connection``: inputs are method
calls (committed entries, voter changes, requests from the kernel, notices from the scheduler,
results of the commands it issued, ``tick(now)``), outputs are commands collected by
``take_commands()`` (propose an entry, bind or release GPUs, answer a request, tell the kernel or
the scheduler something, transfer leadership, log). The caller passes the time with every input;
``next_deadline()`` says when it wants a ``tick``. It reads the Raft peer's state (running, leader)
through a read-only port, as etcd's core reads its ``Storage``. No sockets, clock, threads or
asyncio: ``kernel_replica/raft_bridge.py`` runs it on a real Raft peer, and
``kernel_replica/election_simulation.py`` runs three of them on a simulated log under faults.

Inside, each multi-step procedure (an election, a standby's watch, the finish of a cell) is a
generator that yields what it waits for (``_Wait``: a readiness check and a deadline); after every
input the core resumes whatever became ready, in creation order, so a run is deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from kernel_replica.election import (
    CellDone,
    ElectionBook,
    ElectionDecided,
    EntryIgnored,
    ExecutorLost,
    StateAccepted,
)
from kernel_replica.log_entries import Done, Lead, LogEntry, Progress, State, Vote, Votes, Yield
from shared.quorum import majority


@dataclass(frozen=True, slots=True)
class ElectionSettings:
    """The election's timing (config section ``[election]``); defaults suit the embedded cluster."""

    propose_timeout_s: float = 5.0  # a proposal not applied by then is reported as a lost quorum
    election_wait_s: float = 5.0  # a yielder waits this long for silent voters, then yields for them
    state_wait_s: float = 10.0  # the next executor waits this long for the previous cell's STATE
    quorum_timeout_s: float = 10.0  # a standby with no Raft leader for this long gives up on DONE
    # NotebookOS appends VOTE(winner) after the election. Here the commit order alone decides, so
    # votes only record each replica's view in the log; they ride along with this replica's next
    # proposal (same Ready, same fsync) or go out after ``vote_flush_s`` of quiet.
    propose_votes: bool = True
    vote_flush_s: float = 0.5
    # A replica told to yield first waits this long for the candidate's LEAD to commit; only if it
    # does not (the candidate is slow, dead, or there is none) does it append its YIELD. Saves two
    # log entries per cell; a failed election is detected this much later.
    yield_grace_s: float = 0.05
    # The executor appends PROGRESS this often while a cell runs; a standby that hears neither
    # PROGRESS nor DONE for ``executor_silence_s`` (with a healthy Raft group) commits a DONE with
    # an ``ExecutorLost`` error itself, so a dead executor cannot block the kernel forever.
    progress_interval_s: float = 2.0
    executor_silence_s: float = 10.0
    # Silent for half that, the executor is asked after: the scheduler asks its host whether its
    # process runs (user code can hold the GIL for minutes in one C call: a regex, a big int, a
    # pickle, and no Python thread beats meanwhile). While the host says it runs, its silence is
    # waited out, for at most ``executor_busy_max_s`` after its last beat.
    executor_busy_max_s: float = 600.0
    # The leader hands Raft leadership to a replica that executed this many cells in a row (its
    # LEADs then commit without the hop to a remote leader); 0 disables. At most once per
    # ``leader_transfer_every_s``: a transfer drops proposals for a moment.
    leader_follows_executor: int = 3
    leader_transfer_every_s: float = 10.0

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> ElectionSettings:
        """From the ``[election]`` section (shared/config.py names and checks its keys)."""
        return cls(**{name: section[name] for name in cls.__dataclass_fields__ if name in section})


# ---- what the kernel is told to do with a cell ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class Replay:
    """DONE is already in the log: answer from it, never run again."""

    done: Done


@dataclass(frozen=True, slots=True)
class Execute:
    device_ids: list[int]
    elect_ms: float = 0.0  # LEAD proposed -> outcome known
    state_wait_ms: float = 0.0  # waiting for the previous cell's STATE
    bind_ms: float = 0.0  # won -> GPUs bound (the gpu.commit round trip left after the LEAD committed)
    state_missing: tuple[str, ...] = ()  # earlier cells whose DONE/STATE never arrived in time


@dataclass(frozen=True, slots=True)
class BindFailed:
    """Won the election but the local scheduler refused the GPUs."""

    reason: str


@dataclass(frozen=True, slots=True)
class Standby:
    winner: str


@dataclass(frozen=True, slots=True)
class Failed:
    """Every voter yielded."""


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Raft could not decide (no quorum, not configured, stopped); ``reason`` says which.
    ``declined``: this replica is leaving and did nothing for the cell (no LEAD, no GPUs), so
    the scheduler may send it to another replica instead of answering the client."""

    reason: str
    declined: bool = False


Decision = Replay | Execute | BindFailed | Standby | Failed | Unavailable


def lost_content(reason: str, execution_count: int, ename: str = "ExecutorLost") -> dict[str, Any]:
    """The ``execute_reply`` a standby commits for a cell whose executor vanished (or, with
    ``ename`` ReplicaUnavailable, a winner for a cell it gave up on and never ran)."""
    return {
        "status": "error",
        "ename": ename,
        "evalue": reason,
        "traceback": [f"{ename}: {reason}"],
        "execution_count": execution_count,
        "user_expressions": {},
        "payload": [],
    }


# ``ElectionCore.committed_answer`` verdicts
COMMITTED = "committed"
SUPERSEDED = "superseded"
UNCOMMITTED = "uncommitted"
DONE_RETRY_S = 0.5  # an executor's DONE that failed to commit is proposed again after this pause
GAVE_UP_KEPT = 1024  # cells answered Unavailable whose LEAD may still win, remembered at most
# A replica whose namespace ran ahead of the log (a cell it ran was superseded) exits with this
# code once its reply is out; the scheduler replaces it like any dead replica.
DIVERGED_EXIT_CODE = 75


# ---- the read-only port on the Raft peer ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RaftView:
    """What the core reads of its Raft peer: whether it runs, who leads, and who votes."""

    running: bool
    leader: str | None
    voters: tuple[str, ...] = ()


# ---- commands (the core's output) ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Propose:
    """Propose ``entry`` until it is applied here, then call ``proposal_settled(token, index)``;
    or ``proposal_settled(token, error)`` once that failed (timeout, Raft stopped). Retrying is
    the caller's: a duplicate LEAD/YIELD/VOTE/DONE/STATE changes nothing in the book."""

    entry: LogEntry
    token: int
    why: str  # for logs: lead, yield, proxy_yield, vote, progress, executor_lost, done, state, ...


@dataclass(frozen=True, slots=True)
class BindGpus:
    """Ask the local scheduler for the cell's GPUs; answer with ``bind_settled(token, ...)``."""

    token: int
    msg_id: str


@dataclass(frozen=True, slots=True)
class ReleaseGpus:
    msg_id: str


@dataclass(frozen=True, slots=True)
class Answer:
    """The result of request ``request``: a ``Decision`` (``decide``, ``outcome_of``), ``Done |
    str`` (``wait_done``), or ``None | Exception`` (``finish``: the exception to raise)."""

    request: int
    value: Any


@dataclass(frozen=True, slots=True)
class NotifyScheduler:
    """A ``replica.event`` for the global scheduler: ``election_failed``, or ``elected`` with the
    bound ``gpus`` once this replica's own LEAD has won (the scheduler forwards the output of the
    first replica to announce itself, so only the winner may), ``executor_quiet``: the cell's
    ``executor`` has been silent for half of ``executor_silence_s`` (is its process running?), or
    ``leaving``: the log overruled the cell's outcome here, and this replica is about to exit."""

    event: str
    msg_id: str
    gpus: tuple[int, ...] = ()
    executor: str | None = None


@dataclass(frozen=True, slots=True)
class TransferLeadership:
    to: str


@dataclass(frozen=True, slots=True)
class DeliverDone:
    """Another replica's DONE (or a restored snapshot's last one): the kernel's history and
    execution count follow it."""

    done: Done


@dataclass(frozen=True, slots=True)
class ApplyState:
    """A STATE accepted by the book: apply it to the replicated namespace, and, unless this
    process proposed it (``notify_kernel`` False: the kernel's namespace already has it), to the
    kernel's."""

    state: State
    notify_kernel: bool


@dataclass(frozen=True, slots=True)
class CellReplicated:
    """The cell of finish job ``job`` is as replicated as it will be: the kernel may publish idle."""

    job: int


@dataclass(frozen=True, slots=True)
class CellFinished:
    """Job ``job`` is over: ``finish_s`` from ``finish_cell`` until DONE and STATE committed (None
    when they did not)."""

    job: int
    msg_id: str
    finish_s: float | None


@dataclass(frozen=True, slots=True)
class ExitDiverged:
    """A cell ran here but the log holds another outcome for it (the standbys took this replica
    for dead): its namespace holds changes the group does not. The process must exit (with
    ``DIVERGED_EXIT_CODE``, once the cell's reply is out) so a fresh replica replaces it; until
    then it runs no other cell."""

    msg_id: str


@dataclass(frozen=True, slots=True)
class Log:
    level: str  # debug | info | warning | error
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


Command = (
    Propose
    | BindGpus
    | ReleaseGpus
    | Answer
    | NotifyScheduler
    | TransferLeadership
    | DeliverDone
    | ApplyState
    | CellReplicated
    | CellFinished
    | ExitDiverged
    | Log
)


# ---- internals --------------------------------------------------------------------------------------
class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NOT_YET = _Sentinel("NOT_YET")  # a readiness check that is not ready
TIMEOUT = _Sentinel("TIMEOUT")  # what a wait gets at its deadline
_STOP_WAITING = _Sentinel("STOP_WAITING")  # a condition other than the awaited value came true


@dataclass(slots=True)
class _Wait:
    """What a procedure waits for: ``ready()`` returns NOT_YET, or the value to resume with;
    at ``deadline`` (if any) it is resumed with TIMEOUT instead."""

    ready: Callable[[], Any]
    deadline: float | None = None


def _never() -> Any:
    return NOT_YET


Proc = Generator[_Wait, Any, Any]


@dataclass(slots=True)
class _Task:
    proc: Proc
    on_result: Callable[[Any], None]
    on_error: Callable[[Exception], None]
    wait: _Wait | None = None
    done: bool = False


@dataclass(slots=True)
class _Binding:
    msg_id: str
    result: Any = NOT_YET  # device ids, or the exception
    release: bool = False  # release as soon as it settles (a LEAD that did not win)


@dataclass(slots=True)
class _Follower:
    """The watch of a cell another replica executes, with the requests waiting on it."""

    msg_id: str
    result: Any = NOT_YET  # its Done
    requests: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _FinishJob:
    job: int
    done: Done | None  # None: a repair STATE (``finish_repair``)
    state: State | None  # None: written behind, ``state_written`` brings it
    written: Any = NOT_YET  # the written-behind STATE, or the exception
    finished: bool = False
    replicated: bool = False
    started: float = 0.0
    finish_s: float | None = None  # finish_cell until DONE and STATE committed


class ElectionCore:
    """The election as one replica runs it. Feed inputs with the current time; execute
    ``take_commands()`` after each; call ``tick(now)`` at ``next_deadline()``."""

    def __init__(
        self,
        replica_id: str,
        settings: ElectionSettings,
        *,
        raft: Callable[[], RaftView],
        now: float = 0.0,
    ) -> None:
        self.replica_id = replica_id
        self.settings = settings
        self.book = ElectionBook()
        self._raft = raft
        self._now = now
        self._commands: list[Command] = []
        self._tasks: list[_Task] = []
        self._ids = itertools.count(1)
        self._configured = False
        # Entries up to this index were in this replica's log when it started: applying them again
        # replays history (no votes, no watchers). None until the peer runs.
        self._replayed_through: int | None = None
        self._settled: dict[int, Any] = {}  # proposal token -> applied index or the exception
        self._watched: set[int] = set()  # tokens a procedure waits on (the others are background)
        self._background: dict[int, tuple[str, str]] = {}  # token -> (why, msg_id) for the log
        self._bindings: dict[int, _Binding] = {}
        self._own_entries: set[tuple[str, str]] = set()  # (kind, msg_id) proposed by this process
        self._last_progress: dict[str, float] = {}  # msg_id -> when its executor was last heard
        # msg_id -> when the scheduler last said its executor's process runs (``executor_busy``),
        # and when this replica last asked it (``executor_quiet``)
        self._vouched: dict[str, float] = {}
        self._quiet_asked: dict[str, float] = {}
        self._followers: dict[str, _Follower] = {}
        self._deciding: dict[str, int] = {}  # msg_id -> decide requests in flight for it
        self._requested: set[str] = set()  # msg_ids this process was asked to decide
        # msg_id -> why: cells this process answered Unavailable while a LEAD it proposed could
        # still commit; if that LEAD wins, the log gets the cell's DONE from here (it never ran)
        self._gave_up: dict[str, str] = {}
        self._caught_up = False  # the log it held at start is applied (``_watch_running``)
        self._applied_index = 0
        # Cells whose executor's process the scheduler saw die (``member_lost``): their DONE, or
        # the STATE after it, will not come, so nothing waits out a silence timeout for them.
        self._executor_died: set[str] = set()
        self._state_died: set[str] = set()
        self._dead_members: set[str] = set()  # until an entry of theirs shows them back (restarted)
        self._executor_removed: dict[str, str] = {}  # msg_id -> its winner, removed from the voters
        # elections open when a member_lost came: only those skip waiting for a dead voter (one
        # routed later went to a live candidate; the dead one may since have been restarted)
        self._open_at_death: set[str] = set()
        self._lost_epoch = 0  # bumped by each member_lost: waits on a dead member look again
        self._pending_votes: list[Vote] = []
        self._vote_deadline: float | None = None
        self._beat: _Task | None = None
        self._streak: tuple[str | None, int] = (None, 0)  # (executor, cells in a row) from DONEs
        self._last_transfer = float("-inf")
        self._jobs: list[_FinishJob] = []  # finish jobs in cell order, oldest first
        self._replicate_on_settle: dict[int, _FinishJob] = {}  # DONE token -> its write-behind job
        self._finishing: set[str] = set()  # msg_ids executed here whose DONE/STATE are in flight
        self._diverged: str | None = None  # a cell run here whose outcome the log overruled

    # ---- output --------------------------------------------------------------------------------------
    def take_commands(self) -> list[Command]:
        commands, self._commands = self._commands, []
        return commands

    def next_deadline(self) -> float | None:
        """When the core next needs ``tick``: the earliest deadline of anything it waits for."""
        deadlines = [
            t.wait.deadline for t in self._tasks if t.wait is not None and t.wait.deadline is not None
        ]
        if self._vote_deadline is not None:
            deadlines.append(self._vote_deadline)
        return min(deadlines) if deadlines else None

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def voters(self) -> frozenset[str]:
        return self.book.voters

    def finishing(self) -> bool:
        """Whether DONE/STATE entries of cells executed here are still in flight."""
        return bool(self._finishing)

    def ended_before_run(self, msg_id: str) -> Done | None:
        """An ``Execute`` decision whose cell must not run after all: this replica won it, then
        stalled (paused, swapped out) before running it for longer than the executor silence, and
        the standbys committed its outcome without it. The log is the truth: answer from it."""
        return self.book.done(msg_id)

    def committed_answer(
        self, msg_id: str, reply: dict[str, Any], execution_count: int
    ) -> tuple[dict[str, Any], str]:
        """What the winner of msg_id tells the client once the cell ran here (or could not get
        its GPUs) and its DONE had its chance to commit (the kernel waits a bounded time):
        ``(content, verdict)``. Only a committed outcome is ever answered as such:

        - ``committed``: this replica's DONE is the log's: its own reply;
        - ``superseded``: another DONE is the log's (``superseded``): that one, and, if the cell
          ran here, this process must exit once the answer is out;
        - ``uncommitted``: no DONE is in the log yet (no quorum, or this replica was paused): an
          error saying so, never the run's own ``ok``, which the standbys' ``ExecutorLost`` may
          still overrule. The DONE keeps being proposed (``finish_cell``)."""
        logged = self.book.done(msg_id)
        if logged is None:
            return (
                {
                    "status": "error",
                    "ename": "ReplicationFailed",
                    "evalue": (
                        f"the cell ran on {self.replica_id} but its completion is not committed to the "
                        "kernel's Raft log yet (the group may have lost its quorum): its outcome, and "
                        "whether its changes are kept, will be what the log records"
                    ),
                    "traceback": [],
                    "execution_count": execution_count,
                    "user_expressions": {},
                    "payload": [],
                },
                UNCOMMITTED,
            )
        if logged.replica_id != self.replica_id:
            return logged.content, SUPERSEDED
        return reply, COMMITTED

    def superseded(self, msg_id: str) -> Done | None:
        """After this replica ran msg_id: the DONE the log holds for it when that is another
        replica's (this one stalled inside the cell past the executor silence and the standbys
        committed ``ExecutorLost``). The client hears that one, and this process, whose namespace
        holds changes the group does not, must leave so a fresh replica replaces it."""
        logged = self.book.done(msg_id)
        return logged if logged is not None and logged.replica_id != self.replica_id else None

    # ---- inputs: the Raft peer -----------------------------------------------------------------------
    def configure(self, voters: Iterable[str]) -> None:
        """The bootstrap voters, before the peer starts (none when joining an existing group)."""
        voters = tuple(voters)
        if voters:
            self.book.set_voters(voters)

    def started(self, *, last_index: int, voters: Iterable[str], now: float, applied: int = 0) -> None:
        """The peer runs: entries up to ``last_index`` are this replica's own log, replayed (not
        live) as they are applied; ``applied``: the index its restored snapshot covers."""
        self._now = now
        self._configured = True
        self._replayed_through = last_index
        self._applied_index = max(self._applied_index, applied)
        voters = tuple(voters)
        if voters and not self.book.voters:  # restarted from a data dir without a snapshot
            self._handle(self.book.set_voters(voters))
        if self._applied_index >= last_index:  # nothing to replay
            self._caught_up = True
            self._watch_running()
        self._pump()

    def apply(self, index: int, entry: LogEntry, now: float) -> None:
        """One committed entry, in log order."""
        self._now = now
        if self._dead_members and not isinstance(entry, Lead):  # a stand-in LEAD names the dead one
            self._dead_members.discard(entry.proposer if isinstance(entry, Yield) else entry.replica_id)
        if isinstance(entry, Progress):
            if self.book.done(entry.msg_id) is None:  # a late beat of a finished cell means nothing
                self._last_progress[entry.msg_id] = now
            self._pump()
            return
        live = self._replayed_through is not None and index > self._replayed_through
        self._applied_index = index
        try:
            self._handle(self.book.apply(entry), live=live)
        except Exception as exc:  # a bug here must not stop the replica applying its log
            self._log("error", "log_entry_failed", index=index, kind=type(entry).__name__, error=repr(exc))
        if not self._caught_up and self._replayed_through is not None and index >= self._replayed_through:
            self._caught_up = True  # the log this replica held when it started is applied
            self._watch_running()
        self._pump()

    def set_voters(self, voters: Iterable[str], now: float, *, restored: bool = False) -> None:
        """A membership change committed, or (``restored``) a snapshot restored: the book counts
        LEADs against these voters (a joiner's book restored from the bootstrap snapshot has none:
        it would ignore every LEAD, and every DONE that carries one)."""
        self._now = now
        voters = frozenset(voters)
        if restored and self.book.voters == voters:
            return
        self._handle(self.book.set_voters(voters))
        self._pump()

    def restore(self, book: ElectionBook, now: float) -> None:
        """A snapshot replaced the applied state: the kernel follows its last DONE."""
        self._now = now
        self.book = book
        last = book.last_done()
        if last is not None:
            self._emit(DeliverDone(last))
        if self._configured:  # a member that joins (or catches up) mid-cell watches it too
            self._watch_running()
        self._pump()

    def proposal_settled(self, token: int, result: int | Exception, now: float) -> None:
        """A ``Propose`` command's outcome: the index it was applied at here, or why it failed."""
        self._now = now
        job = self._replicate_on_settle.pop(token, None)
        if job is not None:
            self._replicated(job)  # write-behind: idle once DONE is in, the upload is not waited for
        background = self._background.pop(token, None)
        if token in self._watched:
            self._watched.discard(token)
            self._settled[token] = result
        elif background is not None and isinstance(result, Exception):
            why, msg_id = background
            self._log("warning", "background_proposal_failed", what=why, msg_id=msg_id, error=str(result))
        self._pump()

    def bind_settled(self, token: int, result: list[int] | Exception, now: float) -> None:
        """A ``BindGpus`` command's outcome: the device ids, or why the local scheduler refused."""
        self._now = now
        binding = self._bindings.get(token)
        if binding is not None:
            binding.result = result
            if binding.release:
                del self._bindings[token]
                self._emit(ReleaseGpus(binding.msg_id))
        self._pump()

    def tick(self, now: float) -> None:
        self._now = now
        if self._vote_deadline is not None and now >= self._vote_deadline:
            self._flush_votes()
        self._pump()

    # ---- inputs: the scheduler -----------------------------------------------------------------------
    def member_lost(self, member: str, started: Iterable[str], now: float) -> list[str]:
        """``replica.membership lost``: the scheduler saw ``member``'s process exit. A cell it was
        running will never commit DONE, and a STATE it had yet to send will never come: the
        standbys waiting for that DONE commit an ``ExecutorLost`` one now (instead of after
        ``executor_silence_s``), the next executor starts without that STATE, telling the user,
        and an election waiting on it (its designated candidate) does not wait ``election_wait_s``.

        ``started`` are the cells the scheduler saw it take GPUs for: it may have started one
        before its LEAD committed (the fast path). Such a cell must not run again elsewhere (a
        cell that crashes its process would take the next replica with it), so its LEAD is
        proposed on the dead member's behalf: if no other LEAD came first, it won, and its DONE
        is ``ExecutorLost``. No Raft change: replacing the member is the scheduler's next step.
        Returns the cells it was running."""
        if member == self.replica_id:
            raise ValueError("a replica cannot be told that it died itself")
        self._now = now
        self._dead_members.add(member)
        self._open_at_death.update(m for m in self._deciding if self.book.outcome(m) is None)
        for msg_id in started:
            if self.book.outcome(msg_id) is None and self.book.done(msg_id) is None:
                self._executor_died.add(msg_id)
                self._propose(Lead(msg_id, member), "lead_for_dead_executor", background=True)
        cells = self.book.running_on(member)
        self._executor_died.update(cells)
        awaiting = self.book.awaiting_state()
        done = self.book.done(awaiting) if awaiting is not None else None
        if awaiting is not None and done is not None and done.replica_id == member:
            self._state_died.add(awaiting)
        self._lost_epoch += 1
        self._log("warning", "member_lost", member=member, running=cells, state_lost=sorted(self._state_died))
        self._pump()
        return cells

    def executor_busy(self, member: str, now: float) -> list[str]:
        """``replica.membership busy``: ``member``'s host says its process is running (not
        stopped, not exited) although its Raft has been silent: the cells it runs count as heard
        from now, for at most ``executor_busy_max_s`` after their last beat. Only ever delays an
        ``ExecutorLost``: a stopped or unreachable executor is not vouched for. Returns the cells."""
        self._now = now
        cells = [m for m in self.book.running_on(member) if m in self._last_progress]
        for msg_id in cells:
            self._vouched[msg_id] = now
        if cells:
            self._log("info", "executor_busy", executor=member, cells=cells)
        self._pump()
        return cells

    def _heard_from(self, msg_id: str) -> float:
        """When the executor of ``msg_id`` was last heard, or vouched for within the cap."""
        beat = self._last_progress.get(msg_id, self._now)
        vouched = self._vouched.get(msg_id, beat)
        return max(beat, vouched) if vouched - beat <= self.settings.executor_busy_max_s else beat

    # ---- inputs: the kernel (requests answered by ``Answer``) ----------------------------------------
    def decide(self, msg_id: str, *, lead: bool, silent: str | None = None, now: float) -> int:
        """Steps 3-4 of the execute path: election, waiting for the previous state, GPU binding.
        ``lead``: this replica was sent the cell (``execute_request``), else told to yield;
        ``silent``: the designated candidate the scheduler found hung (not waited for again).
        Returns the request id its ``Answer`` (a ``Decision``) will carry."""
        self._now = now
        request = next(self._ids)
        self._requested.add(msg_id)
        self._deciding[msg_id] = self._deciding.get(msg_id, 0) + 1

        def finished(decision: Decision) -> None:
            left = self._deciding.pop(msg_id, 1) - 1
            if left:
                self._deciding[msg_id] = left
            self._open_at_death.discard(msg_id)
            self._emit(Answer(request, decision))

        self._start(self._decide(msg_id, lead, silent), finished, self._unavailable_on_error(finished))
        self._pump()
        return request

    def outcome_of(self, msg_id: str, executor: str, now: float) -> int:
        """The scheduler lost ``executor`` while it ran msg_id and asks this survivor what became
        of the cell: its DONE if one is committed (the executor died after finishing it), else
        the ``ExecutorLost`` DONE the standbys commit on its behalf. Never an election that could
        run the cell here: it started on ``executor``, so a LEAD is proposed in its name (a
        duplicate of its own changes nothing) and the first committed LEAD still decides."""
        self._now = now
        request = next(self._ids)

        def finished(decision: Decision) -> None:
            self._emit(Answer(request, decision))

        self._start(self._outcome_of(msg_id, executor), finished, self._unavailable_on_error(finished))
        self._pump()
        return request

    def wait_done(self, msg_id: str, winner: str, execution_count: int, now: float) -> int:
        """A standby's wait for the executor's DONE: its ``Answer`` is the Done, or a reason why
        none can come (quorum lost, Raft stopped)."""
        self._now = now
        request = next(self._ids)
        done = self.book.done(msg_id)
        if done is not None:
            self._emit(Answer(request, done))
        else:
            self._follow(msg_id, winner, execution_count).requests.append(request)
        self._pump()
        return request

    def finish(self, done: Done, *, release_gpus: bool, now: float) -> int:
        """Step 5 without a run (the GPUs were refused): release them if asked and commit DONE.
        Its ``Answer`` is None, or the exception the first proposal failed with; the DONE is
        then proposed again until the log holds one for the cell (a won cell left without a
        DONE would hold up every later executor for ``state_wait_s``)."""
        self._now = now
        request = next(self._ids)
        self._stop_beat()
        if release_gpus:
            self._emit(ReleaseGpus(done.msg_id))

        def failed(exc: Exception) -> None:
            self._emit(Answer(request, exc))

        self._start(self._propose_done_until_committed(done, request), lambda _: None, failed)
        self._pump()
        return request

    def _propose_done_until_committed(self, done: Done, request: int | None) -> Proc:
        """Propose ``done`` until the log holds a DONE for its cell (``request``: answered with
        the first proposal's failure, or None)."""
        result = yield from self._propose_and_wait(done, "done")
        if request is not None:
            self._emit(Answer(request, result if isinstance(result, Exception) else None))
        while self.book.done(done.msg_id) is None and self._raft().running:
            self._log("warning", "done_not_committed_yet", msg_id=done.msg_id, error=str(result))
            yield _Wait(_never, self._now + DONE_RETRY_S)
            result = yield from self._propose_and_wait(done, "done")

    def abandon(self, now: float) -> None:
        """An Execute decision whose cell will not run after all (``ended_before_run``): stop the
        PROGRESS beats."""
        self._now = now
        self._stop_beat()
        self._pump()

    def finish_cell(self, done: Done, state: State | None, now: float) -> int:
        """Steps 5 and 7 off the critical path: the executor has run the cell (the committed LEAD
        guarantees at-most-once); DONE and STATE are proposed together, in order after the
        previous cell's, and the standbys reply once DONE commits. Until both commit the next cell
        on this replica runs without waiting for them (its namespace is current); any other
        executor waits for them (``_wait_previous_cell``). ``state`` None: written behind, the
        STATE comes with ``state_written`` once its large objects are in the data store; DONE
        does not wait for it. Returns the job id of its ``CellReplicated`` (once DONE and STATE
        committed, or with write-behind once DONE did, or once that failed) and ``CellFinished``."""
        self._now = now
        self._stop_beat()  # no VOTE of its own: the winner's DONE is that (ElectionBook)
        job = _FinishJob(next(self._ids), done, state, started=now)
        previous = self._jobs[-1] if self._jobs else None
        self._jobs.append(job)
        self._finishing.add(done.msg_id)

        def finished(_: Any) -> None:
            self._end_job(job)

        def failed(exc: Exception) -> None:
            self._log("error", "finish_failed", msg_id=done.msg_id, error=repr(exc))
            self._end_job(job)

        self._start(self._finish_cell(job, previous), finished, failed)
        self._pump()
        return job.job

    def finish_repair(self, state: State | None, now: float) -> int:
        """A repair STATE (values stored after their cell, ``durability.apply_repair``), proposed
        in order after this replica's cells still in flight: what it carries is newer than their
        STATEs. ``state`` None: it comes with ``state_written`` once its values are in the data
        store. Returns the job id for ``state_written``."""
        self._now = now
        job = _FinishJob(next(self._ids), None, state, started=now)
        previous = self._jobs[-1] if self._jobs else None
        self._jobs.append(job)

        def failed(exc: Exception) -> None:
            self._log("error", "repair_failed", error=repr(exc))
            self._end_job(job)

        self._start(self._finish_repair(job, previous), lambda _: self._end_job(job), failed)
        self._pump()
        return job.job

    def state_written(self, job: int, result: State | Exception, now: float) -> None:
        """The written-behind STATE of finish job ``job`` (its large objects are in the store), or
        why writing it failed."""
        self._now = now
        for candidate in self._jobs:
            if candidate.job == job:
                candidate.written = result
        self._pump()

    # ---- the procedures ------------------------------------------------------------------------------
    def _decide(self, msg_id: str, lead: bool, silent: str | None) -> Proc:
        started = self._now
        if not self._configured:
            return Unavailable("this replica's Raft group is not configured yet")
        done = self.book.done(msg_id)
        if done is not None:
            return Replay(done)
        if self._diverged is not None:
            return Unavailable(self._leaving(), declined=lead)
        outcome = self.book.outcome(msg_id)
        decided_before = outcome is not None
        if outcome is None and not lead and self.settings.yield_grace_s > 0:
            got = yield _Wait(
                lambda: self.book.outcome(msg_id) or NOT_YET, self._now + self.settings.yield_grace_s
            )
            outcome = None if got is TIMEOUT else got
        binding: int | None = None
        if outcome is None:
            if lead:
                # Only the designated candidate proposes LEAD, so it almost always wins: bind the
                # GPUs while the LEAD commits (the local scheduler also tells the global scheduler
                # who executes, before any output); a LEAD that loses gives them back.
                binding = self._bind(msg_id)
                entry: LogEntry = Lead(msg_id, self.replica_id)
            else:
                entry = Yield(msg_id, self.replica_id, self.replica_id)
            late: list[int] = []  # the binding of a stand-in LEAD (``_lead_for_silent_candidate``)
            result = yield from self._propose_and_wait(entry, "lead" if lead else "yield")
            if not isinstance(result, Exception):
                result = yield from self._wait_outcome(msg_id, silent, late)
            if binding is None and late:
                binding = late[0]
            if isinstance(result, Exception):
                self._unbind(binding)
                return self._give_up(msg_id, f"Raft could not commit the election for this cell: {result}")
            if isinstance(result, Unavailable):
                self._unbind(binding)
                return self._give_up(msg_id, result.reason)
            outcome = result
        if outcome.failed:
            self._unbind(binding)
            self._log("info", "election_failed", msg_id=msg_id)
            self._emit(NotifyScheduler("election_failed", msg_id))
            return Failed()
        winner = outcome.winner
        assert winner is not None
        if winner != self.replica_id:
            self._unbind(binding)
            return Standby(winner)
        if decided_before:
            # A retry of a cell this replica already won: it ran (or started) here, and its DONE
            # is not in the log. Running it again would break at-most-once.
            return Unavailable(
                f"this cell was already claimed by {self.replica_id} but its completion is not in the log"
            )
        elected = self._now
        # Beat from the win on: waiting for the previous cell's STATE (``state_wait_s``) and the
        # GPUs is work on the cell too, and a winner silent that long was taken for dead.
        self._start_beat(msg_id)
        if binding is None:
            binding = self._bind(msg_id)
        device_ids = yield from self._bound(binding)
        bind_ms = (self._now - elected) * 1000
        if isinstance(device_ids, Exception):
            self._log("warning", "gpu_commit_failed", msg_id=msg_id, error=str(device_ids))
            return BindFailed(str(device_ids))  # its DONE (``finish``) stops the beats
        # Announced only now, by the winner: a binding is no claim (a stand-in's LEAD for a silent
        # candidate can lose to the candidate's own), and the scheduler shows the client the
        # output of the replica that announces itself first.
        self._emit(NotifyScheduler("elected", msg_id, tuple(device_ids)))
        waited, missing = yield from self._wait_previous_cell(msg_id)
        if self._diverged is not None:  # found out while this election ran: never run on that namespace
            self._stop_beat()
            self._unbind(binding)
            return Unavailable(self._leaving())
        return Execute(
            device_ids,
            elect_ms=(elected - started) * 1000,
            state_wait_ms=waited,
            bind_ms=bind_ms,
            state_missing=tuple(missing),
        )

    def _give_up(self, msg_id: str, reason: str) -> Unavailable:
        """Answer Unavailable for a cell whose election this process could not see decided. A LEAD
        it proposed (its own, or one for a silent candidate) may still commit and win: the log
        would then hold a winner that never runs the cell and no DONE for it, and nobody would
        commit one (the standbys stop watching a cell once a later cell's DONE commits; this
        replica's own request is answered). So the DONE comes from here, once that LEAD wins."""
        outcome = self.book.outcome(msg_id)
        if outcome is None:
            self._gave_up[msg_id] = reason
            while len(self._gave_up) > GAVE_UP_KEPT:
                del self._gave_up[next(iter(self._gave_up))]
        elif outcome.winner == self.replica_id:
            self._commit_unrun(msg_id, reason)
        return Unavailable(reason)

    def _commit_unrun(self, msg_id: str, reason: str) -> None:
        """Commit the DONE of a cell this replica won but did not run (it answered Unavailable):
        what the client heard, so every replica answers a retry the same way. Nothing when the
        log already holds the cell's DONE."""
        if self.book.done(msg_id) is not None:
            return
        last = self.book.last_done()
        count = last.execution_count if last is not None else 0
        self._log("warning", "won_after_giving_up", msg_id=msg_id, reason=reason)
        done = Done(msg_id, self.replica_id, lost_content(reason, count, "ReplicaUnavailable"), count, False)
        self._start(self._propose_done_until_committed(done, None), lambda _: None, lambda _: None)

    def _wait_outcome(self, msg_id: str, silent: str | None, late: list[int]) -> Proc:
        """After our own LEAD/YIELD applied: a LEAD decides at once; a YIELD waits for the others,
        and after ``election_wait_s`` yields on behalf of voters that stayed silent (at once when
        the only silent ones died during this election and none ran it, or the only silent one is
        ``silent``, a candidate the scheduler already waited for). Returns the Outcome, the
        exception a proposal failed with, or Unavailable."""
        outcome = self.book.outcome(msg_id)
        if outcome is not None:
            return outcome

        def decided_or_given_up() -> Any:
            found = self.book.outcome(msg_id)
            if found is not None:
                return found
            silent_voters = self.book.silent_voters(msg_id)
            if (
                msg_id in self._open_at_death
                and msg_id not in self._executor_died
                and silent_voters <= self._dead_members
            ):
                return _STOP_WAITING  # only voters that died during this election are silent, and none ran it
            if silent is not None and silent_voters <= {silent}:
                return _STOP_WAITING
            return NOT_YET

        got = yield _Wait(decided_or_given_up, self._now + self.settings.election_wait_s)
        if got is not TIMEOUT and got is not _STOP_WAITING:
            return got
        silent_voters = sorted(self.book.silent_voters(msg_id))
        self._log("warning", "election_waiting_on_silent_voters", msg_id=msg_id, silent=silent_voters)
        # One replica, the first in id order among those that answered, offers to run the cell;
        # the others give it time before yielding for the silent ones (which would fail the cell).
        answered = sorted(self.book.voters - set(silent_voters))
        decided = self._outcome_ready(msg_id)
        if answered and answered[0] == self.replica_id:
            led = yield from self._lead_for_silent_candidate(msg_id, late)
            if isinstance(led, Exception):
                return led
            if led:
                outcome = self.book.outcome(msg_id)
                if outcome is not None:
                    return outcome
                got = yield _Wait(decided, self._now + self.settings.propose_timeout_s)
                if got is not TIMEOUT:
                    return got
        elif answered:
            got = yield _Wait(decided, self._now + self.settings.propose_timeout_s)
            if got is not TIMEOUT:
                return got
        for voter in silent_voters:
            result = yield from self._propose_and_wait(Yield(msg_id, voter, self.replica_id), "proxy_yield")
            if isinstance(result, Exception):
                return result
        outcome = self.book.outcome(msg_id)
        if outcome is not None:
            return outcome
        got = yield _Wait(decided, self._now + self.settings.propose_timeout_s)
        if got is not TIMEOUT:
            return got
        # Every voter silent at the time has yielded and the election is still open: the voters
        # changed meanwhile (a member joined). Answer rather than leave the request hanging.
        return Unavailable(
            f"the election for this cell was still open {self.settings.propose_timeout_s:g}s after "
            f"yielding for the silent voters {silent_voters} (the group's voters changed)"
        )

    def _lead_for_silent_candidate(self, msg_id: str, late: list[int]) -> Proc:
        """The designated candidate stayed silent (it died just before the cell reached it): if
        this replica's host can bind the GPUs now, it proposes LEAD itself rather than yield on
        the candidate's behalf. The first committed LEAD still wins, so the cell runs at most
        once; a losing LEAD gives its GPUs back. True if a LEAD was proposed; the exception if
        proposing it failed."""
        if self.book.outcome(msg_id) is not None:
            return False
        binding = self._bind(msg_id)
        device_ids = yield from self._bound(binding, keep=True)
        if isinstance(device_ids, Exception):
            del self._bindings[binding]
            self._log("info", "no_lead_for_silent_candidate", msg_id=msg_id, reason=str(device_ids))
            return False
        late.append(binding)
        result = yield from self._propose_and_wait(Lead(msg_id, self.replica_id), "lead_for_silent_candidate")
        if isinstance(result, Exception):
            late.clear()
            self._unbind(binding)
            return result
        self._log("warning", "lead_for_silent_candidate", msg_id=msg_id)
        return True

    def _outcome_of(self, msg_id: str, executor: str) -> Proc:
        if not self._configured:
            return Unavailable("this replica's Raft group is not configured yet")
        done = self.book.done(msg_id)
        if done is not None:
            return Replay(done)
        if executor == self.replica_id:
            return Unavailable("the scheduler asked this replica for the outcome of its own cell")
        outcome = self.book.outcome(msg_id)
        if outcome is None:
            result = yield from self._propose_and_wait(Lead(msg_id, executor), "lead_for_lost_executor")
            if isinstance(result, Exception):
                return Unavailable(f"Raft could not commit the outcome of this cell: {result}")
            outcome = self.book.outcome(msg_id)
            if outcome is None:
                return Unavailable("the cell's election is still undecided after a committed LEAD")
        if outcome.failed:  # every voter yielded before: the cell ran nowhere
            return Failed()
        winner = outcome.winner
        assert winner is not None
        if winner == self.replica_id:
            return Unavailable(
                f"this cell was claimed by {self.replica_id} but its completion is not in the log"
            )
        if winner == executor:
            self._executor_died.add(msg_id)  # its DONE will not come: commit ExecutorLost now
        return Standby(winner)

    def _previous_cell_pending(self, msg_id: str) -> list[str]:
        """What the executor of msg_id still waits for: earlier cells without DONE, or the latest
        DONE's STATE, except this process's own (its namespace already reflects them)."""
        pending = [m for m in self.book.unfinished_before(msg_id) if m not in self._finishing]
        awaiting = self.book.awaiting_state()
        if (
            awaiting is not None
            and awaiting != msg_id
            and awaiting not in self._finishing
            and awaiting not in self._state_died
        ):
            pending.append(awaiting)
        return pending

    def _state_lost_before(self, msg_id: str) -> list[str]:
        """The previous cell's STATE, if its executor died before sending it (told by the user)."""
        awaiting = self.book.awaiting_state()
        return (
            [awaiting] if awaiting is not None and awaiting != msg_id and awaiting in self._state_died else []
        )

    def _wait_previous_cell(self, msg_id: str) -> Proc:
        """The executor must see the namespace the previous cell left: its DONE and STATE must be
        applied (its executor replied before committing them), unless it ran in this process.
        Returns the wait (ms) and the cells still missing at the deadline, so the user can be told."""
        if not self._previous_cell_pending(msg_id):
            return 0.0, self._state_lost_before(msg_id)
        started = self._now
        got = yield _Wait(
            lambda: NOT_YET if self._previous_cell_pending(msg_id) else True,
            self._now + self.settings.state_wait_s,
        )
        waited = (self._now - started) * 1000
        if got is TIMEOUT:
            pending = self._previous_cell_pending(msg_id)
            if pending:
                self._log(
                    "warning",
                    "previous_state_missing",
                    msg_id=msg_id,
                    awaiting=pending,
                    waited_s=self.settings.state_wait_s,
                )
                return waited, pending
        return waited, self._state_lost_before(msg_id)

    def _watch_running(self) -> None:
        """Watch the cells the log shows running that this replica did not see start live (it
        replayed them from its disk, or got them in a snapshot), as it watches those whose LEAD
        it applies live. One it won itself that this process never asked for ran in its previous
        process, which is gone: its DONE will not come from there, so its ExecutorLost is
        committed at once."""
        for msg_id, winner in self.book.running().items():
            if winner == self.replica_id:
                if msg_id in self._requested:
                    continue  # this process's own cell
                self._executor_died.add(msg_id)
            self._follow(msg_id, winner)

    def _follow(self, msg_id: str, winner: str, execution_count: int | None = None) -> _Follower:
        """The one watcher of a cell ``winner`` executes, started when its LEAD commits."""
        follower = self._followers.get(msg_id)
        if follower is None:
            if execution_count is None:
                last = self.book.last_done()
                execution_count = last.execution_count if last is not None else 0
            follower = self._followers[msg_id] = _Follower(msg_id)

            def finished(result: Done | str) -> None:
                self._followers.pop(msg_id, None)
                self._answer_requests(follower, result)

            def failed(exc: Exception) -> None:
                finished(f"internal error while waiting for the cell's DONE: {exc!r}")

            self._start(self._wait_done(follower, winner, execution_count), finished, failed)
        return follower

    def _wait_done(self, follower: _Follower, winner: str, execution_count: int) -> Proc:
        """No deadline while the executor shows progress (cells run for minutes), but a group
        without a leader for ``quorum_timeout_s`` answers the requests waiting with the reason,
        and a silent or dead executor gets an ``ExecutorLost`` DONE committed on its behalf. The
        watch itself goes on until some DONE is in the log: a cell left without one would hold
        up every later executor for ``state_wait_s`` (``unfinished_before``), for good. An
        executor removed from the group before its DONE committed (a replacement's membership
        change) gets its ``ExecutorLost`` DONE proposed at once. Every answer is the first DONE
        the log holds (the removed member's own, if it still came first), so all agree."""
        msg_id = follower.msg_id
        leaderless_since: float | None = None
        gave_up = False
        lost_token: int | None = None  # this replica's ExecutorLost proposal, while in flight
        self._last_progress.setdefault(msg_id, self._now)
        try:
            while True:
                epoch = self._lost_epoch

                def ended_or_lost(epoch: int = epoch) -> Any:
                    if follower.result is not NOT_YET:
                        return follower.result
                    done = self.book.done(msg_id)  # a DONE applied before this watch began
                    if done is not None:
                        return done
                    return _STOP_WAITING if self._lost_epoch != epoch else NOT_YET

                got = yield _Wait(ended_or_lost, self._now + 0.5)
                if isinstance(got, Done):
                    return got
                if lost_token is not None and lost_token in self._settled:
                    failed = self._settled.pop(lost_token)
                    lost_token = None
                    if isinstance(failed, Exception):  # not committed: propose it again when due
                        self._log("warning", "executor_lost_not_committed", msg_id=msg_id, error=str(failed))
                        gave_up = False
                view = self._raft()
                if not view.running:
                    return "this replica's Raft peer is not running"
                if view.leader is None:
                    if leaderless_since is None:
                        leaderless_since = self._now
                    if self._now - leaderless_since > self.settings.quorum_timeout_s and follower.requests:
                        voters = len(self.book.voters) or len(view.voters)
                        self._answer_requests(
                            follower,
                            f"the kernel's Raft group has had no leader for "
                            f"{self.settings.quorum_timeout_s:g}s (quorum lost: fewer than "
                            f"{majority(voters)} of {voters} replicas reachable)",
                        )
                    continue
                leaderless_since = None
                heard = self._heard_from(msg_id)
                silent_s = self._now - heard
                died = msg_id in self._executor_died
                removed = msg_id in self._executor_removed
                if (
                    not (gave_up or died or removed)
                    and silent_s > self.settings.executor_silence_s / 2
                    and self._quiet_asked.get(msg_id, heard - 1) < heard
                ):
                    self._quiet_asked[msg_id] = self._now  # once per silence: is its process running?
                    self._emit(NotifyScheduler("executor_quiet", msg_id, executor=winner))
                if not gave_up and (died or removed or silent_s > self.settings.executor_silence_s):
                    gave_up = True  # once: the DONE (ours or the executor's) then ends the wait
                    self._log(
                        "warning",
                        "executor_silent",
                        msg_id=msg_id,
                        executor=winner,
                        silent_s=round(silent_s, 1),
                        died=died,
                        removed=removed,
                    )
                    reason = (
                        f"the executor {winner} was removed from the kernel's Raft group before it finished"
                        if removed
                        else f"the executor {winner}'s process died while running this cell; its outcome is unknown"
                        if died
                        else f"the executor {winner} reported no progress for "
                        f"{self.settings.executor_busy_max_s:g}s, although its host said its process ran; "
                        "the cell's outcome is unknown"
                        if msg_id in self._vouched
                        else f"the executor {winner} stopped reporting progress for "
                        f"{self.settings.executor_silence_s:g}s and its host did not say that its process "
                        "runs (it died, was paused, or is unreachable); the cell's outcome is unknown"
                    )
                    lost = Done(
                        msg_id, self.replica_id, lost_content(reason, execution_count), execution_count, False
                    )
                    lost_token = self._propose(lost, "executor_lost", watched=True)
        finally:
            self._last_progress.pop(msg_id, None)
            self._vouched.pop(msg_id, None)
            self._quiet_asked.pop(msg_id, None)
            if lost_token is not None:  # still in flight: nobody waits for it now
                self._watched.discard(lost_token)
                self._settled.pop(lost_token, None)

    def _answer_requests(self, follower: _Follower, result: Done | str) -> None:
        """Answer the requests waiting on ``follower`` (later ones wait for what comes next)."""
        requests, follower.requests = follower.requests, []
        for request in requests:
            self._emit(Answer(request, result))

    def _beat_proc(self, msg_id: str) -> Proc:
        """While this replica executes msg_id: PROGRESS entries tell the standbys it is alive."""
        while True:
            yield _Wait(_never, self._now + self.settings.progress_interval_s)
            yield from self._propose_and_wait(Progress(msg_id, self.replica_id), "progress")

    def _finish_repair(self, job: _FinishJob, previous: _FinishJob | None) -> Proc:
        if previous is not None and not previous.finished:
            yield _Wait(lambda: True if previous.finished else NOT_YET)  # after the cells' STATEs
        state = job.state
        if state is None:
            written = yield _Wait(lambda: job.written)
            if isinstance(written, Exception):
                self._log("warning", "repair_not_replicated", error=repr(written))
                return None
            state = written
        result = yield from self._propose_and_wait(state, "repair")
        if isinstance(result, Exception):
            self._log("warning", "repair_not_replicated", msg_id=state.msg_id, error=str(result))
        return None

    def _finish_cell(self, job: _FinishJob, previous: _FinishJob | None) -> Proc:
        done = job.done
        assert done is not None
        if previous is not None and not previous.finished:
            yield _Wait(lambda: True if previous.finished else NOT_YET)  # DONE/STATE in cell order in the log
        done_token = self._propose(done, "done", watched=True)
        state = job.state
        if state is None:  # written behind: idle once DONE settles, STATE once the store has it
            self._replicate_on_settle[done_token] = job
            written = yield _Wait(lambda: job.written)
            if isinstance(written, Exception):
                self._replicate_on_settle.pop(done_token, None)
                self._watched.discard(done_token)
                self._settled.pop(done_token, None)
                self._log("error", "finish_failed", msg_id=done.msg_id, error=repr(written))
                return None
            state = written
        state_token = self._propose(state, "state", watched=True)
        results = yield _Wait(
            lambda: (
                (self._settled[done_token], self._settled[state_token])
                if done_token in self._settled and state_token in self._settled
                else NOT_YET
            )
        )
        del self._settled[done_token], self._settled[state_token]
        failure = results[0]
        while self.book.done(done.msg_id) is None:
            # The cell ran here: its outcome must reach the log, or the standbys' ExecutorLost
            # must, before this replica answers or leaves it (a DONE dropped for good while a
            # quorum was away, or while this replica was paused, left its run out of the log
            # and an ``ok`` the log then contradicted). Proposed again until some DONE is in.
            if not self._raft().running:
                self._log("error", "done_not_committed", msg_id=done.msg_id, error=str(failure))
                return None
            self._log("warning", "done_not_committed_yet", msg_id=done.msg_id, error=str(failure))
            yield _Wait(_never, self._now + DONE_RETRY_S)
            failure = yield from self._propose_and_wait(done, "done")
        if self.superseded(done.msg_id) is not None:
            # the standbys' ExecutorLost came first: this replica's STATE counts for nothing, and
            # its namespace holds what the group's does not
            if self._diverged is None:
                self._diverged = done.msg_id
                self._log("error", "namespace_diverged", msg_id=done.msg_id)
                # the scheduler stops sending it cells now, not when its process is gone: one
                # sent meanwhile would be refused (it never runs on this namespace)
                self._emit(NotifyScheduler("leaving", done.msg_id))
                self._emit(ExitDiverged(done.msg_id))
            return None
        if isinstance(results[1], Exception) or self.book.awaiting_state() == done.msg_id:
            # dropped, or retried ahead of its DONE (then the book ignored it): once more
            again = yield from self._propose_and_wait(state, "state")
            if isinstance(again, Exception):
                self._log("warning", "state_not_replicated", msg_id=done.msg_id, error=str(again))
                return None
        job.finish_s = self._now - job.started
        return None

    def _end_job(self, job: _FinishJob) -> None:
        if job.done is None:  # a repair: nothing waits on it but the jobs after it
            job.finished = True
            self._jobs = [j for j in self._jobs if not j.finished]
            return
        self._replicated(job)
        self._emit(CellFinished(job.job, job.done.msg_id, job.finish_s))  # the job's last command
        self._finishing.discard(job.done.msg_id)
        job.finished = True
        self._jobs = [j for j in self._jobs if not j.finished]

    def _replicated(self, job: _FinishJob) -> None:
        if not job.replicated:
            job.replicated = True
            self._emit(CellReplicated(job.job))

    # ---- reacting to the book ------------------------------------------------------------------------
    def _handle(self, events: list[Any], *, live: bool = False) -> None:
        for event in events:
            match event:
                case ElectionDecided(msg_id=msg_id, winner=winner):
                    given_up = self._gave_up.pop(msg_id, None)
                    if (
                        given_up is not None
                        and winner == self.replica_id
                        and not self._deciding.get(msg_id)  # a retry deciding it now runs it
                    ):
                        self._commit_unrun(msg_id, given_up)
                    if winner != self.replica_id and live:
                        # Standbys are not sent the cell: they learn it here, vote for the winner
                        # and watch it until its DONE.
                        self._vote_later(msg_id, winner)
                        if self.book.done(msg_id) is None:  # not a LEAD carried by its DONE
                            self._follow(msg_id, winner)
                    elif live and msg_id not in self._requested and self.book.done(msg_id) is None:
                        # Its own LEAD, which this process never proposed: its previous process
                        # did (or a survivor did for it, dead), and that one is gone. Nothing here
                        # runs the cell, so its ExecutorLost DONE is committed at once (the host
                        # would vouch for this process, and the standbys wait for ever).
                        self._executor_died.add(msg_id)
                        self._follow(msg_id, winner)
                case ExecutorLost(msg_id=msg_id, executor=executor):
                    # No DONE of its own can come: its watch commits an ExecutorLost one at once
                    # (the first DONE in the log is what every replica answers)
                    self._executor_removed[msg_id] = executor
                    self._lost_epoch += 1
                case CellDone(done=done):
                    follower = self._followers.get(done.msg_id)
                    if follower is not None and follower.result is NOT_YET:
                        follower.result = done
                    self._last_progress.pop(done.msg_id, None)
                    self._leader_follows(done)
                    if not self._proposed_here(done):
                        self._emit(DeliverDone(done))
                case StateAccepted(state=state):
                    self._emit(ApplyState(state, notify_kernel=not self._proposed_here(state)))
                case EntryIgnored(entry=entry, reason=reason):
                    self._log(
                        "debug",
                        "log_entry_ignored",
                        kind=type(entry).__name__,
                        msg_id=entry.msg_id,
                        reason=reason,
                    )

    def _leader_follows(self, done: Done) -> None:
        """On the leader: after ``leader_follows_executor`` cells in a row ran on another voter,
        hand leadership to it, off the critical path (its reply went out before this DONE)."""
        if done.replica_id == self._streak[0]:
            self._streak = (done.replica_id, self._streak[1] + 1)
        else:
            self._streak = (done.replica_id, 1)
        wanted = self.settings.leader_follows_executor
        if wanted <= 0 or self._streak[1] < wanted or done.replica_id == self.replica_id:
            return
        view = self._raft()
        if (
            not view.running
            or view.leader != self.replica_id
            or done.replica_id not in view.voters
            or self._now - self._last_transfer < self.settings.leader_transfer_every_s
        ):
            return
        self._last_transfer = self._now
        self._emit(TransferLeadership(done.replica_id))

    def _proposed_here(self, entry: Done | State) -> bool:
        """True for this process's own DONE/STATE (the kernel already reflects it). The same
        replica's entries from before a restart are applied like anyone else's, and so is the
        winner's DONE/STATE for a cell this replica also ran and proposed but lost (its own
        were ignored: the kernel must take the winner's)."""
        if entry.replica_id != self.replica_id:
            return False
        key = (type(entry).__name__, entry.msg_id)
        if key in self._own_entries:
            self._own_entries.discard(key)
            return True
        return False

    # ---- votes, beats, bindings, proposals -----------------------------------------------------------
    def _vote_later(self, msg_id: str, winner: str) -> None:
        if not self.settings.propose_votes:
            return
        self._pending_votes.append(Vote(msg_id, self.replica_id, winner))
        if self._vote_deadline is None:
            self._vote_deadline = self._now + self.settings.vote_flush_s

    def _flush_votes(self) -> None:
        self._vote_deadline = None
        votes, self._pending_votes = self._pending_votes, []
        if len(votes) == 1:
            self._propose(votes[0], "vote", background=True)
        elif votes:
            self._propose(
                Votes(self.replica_id, tuple((v.msg_id, v.winner) for v in votes)), "votes", background=True
            )

    def _start_beat(self, msg_id: str) -> None:
        self._stop_beat()
        self._beat = self._start(self._beat_proc(msg_id), lambda _: None, lambda _: None)

    def _stop_beat(self) -> None:
        if self._beat is not None:
            self._cancel(self._beat)
            self._beat = None

    def _bind(self, msg_id: str) -> int:
        token = next(self._ids)
        self._bindings[token] = _Binding(msg_id)
        self._emit(BindGpus(token, msg_id))
        return token

    def _bound(self, token: int, *, keep: bool = False) -> Proc:
        """Wait for binding ``token``: its device ids or the exception. Forgotten after unless
        ``keep`` (a binding that may still be released)."""
        binding = self._bindings[token]
        result = yield _Wait(lambda: binding.result)
        if not keep:
            self._bindings.pop(token, None)
        return result

    def _unbind(self, token: int | None) -> None:
        """The GPUs of a LEAD that did not win go back (once the binding settled, whatever bound)."""
        if token is None:
            return
        binding = self._bindings.get(token)
        if binding is None:
            return
        if binding.result is NOT_YET:
            binding.release = True
        else:
            del self._bindings[token]
            self._emit(ReleaseGpus(binding.msg_id))

    def _propose(self, entry: LogEntry, why: str, *, background: bool = False, watched: bool = False) -> int:
        if self._pending_votes and not isinstance(entry, Vote | Votes):
            self._flush_votes()  # proposed in this turn, so they share this entry's Ready
        if isinstance(entry, Done | State):
            self._own_entries.add((type(entry).__name__, entry.msg_id))
        token = next(self._ids)
        if watched:
            self._watched.add(token)
        if background:
            self._background[token] = (why, entry.msg_id)
        self._emit(Propose(entry, token, why))
        return token

    def _propose_and_wait(self, entry: LogEntry, why: str) -> Proc:
        """Propose and wait until applied here: the index, or the exception it failed with."""
        token = self._propose(entry, why, watched=True)
        result = yield _Wait(lambda: self._settled.get(token, NOT_YET))
        del self._settled[token]
        return result

    def _leaving(self) -> str:
        return (
            f"replica {self.replica_id} is leaving the kernel: the log overruled the outcome of "
            f"{self._diverged}, which ran here, so its namespace differs from the group's"
        )

    def _outcome_ready(self, msg_id: str) -> Callable[[], Any]:
        return lambda: self.book.outcome(msg_id) or NOT_YET

    # ---- the scheduler of procedures -----------------------------------------------------------------
    def _start(
        self, proc: Proc, on_result: Callable[[Any], None], on_error: Callable[[Exception], None]
    ) -> _Task:
        task = _Task(proc, on_result, on_error)
        self._tasks.append(task)
        self._resume(task, None)
        return task

    def _resume(self, task: _Task, value: Any) -> None:
        try:
            task.wait = task.proc.send(value)
        except StopIteration as stop:
            self._finish(task)
            task.on_result(stop.value)
        except Exception as exc:  # a bug in a procedure: end it, never the core
            self._finish(task)
            self._log("error", "election_procedure_failed", error=repr(exc))
            task.on_error(exc)

    def _finish(self, task: _Task) -> None:
        task.done = True
        task.wait = None
        self._tasks = [t for t in self._tasks if t is not task]

    def _cancel(self, task: _Task) -> None:
        if not task.done:
            self._finish(task)
            task.proc.close()

    def _pump(self) -> None:
        """Resume every procedure whose wait is over, until none is."""
        progressed = True
        while progressed:
            progressed = False
            for task in list(self._tasks):
                if task.done or task.wait is None:
                    continue
                value = task.wait.ready()
                if value is NOT_YET:
                    deadline = task.wait.deadline
                    if deadline is None or self._now < deadline:
                        continue
                    value = TIMEOUT
                self._resume(task, value)
                progressed = True

    def _unavailable_on_error(self, finished: Callable[[Decision], None]) -> Callable[[Exception], None]:
        return lambda exc: finished(Unavailable(f"internal error in the election: {exc!r}"))

    def _emit(self, command: Command) -> None:
        self._commands.append(command)

    def _log(self, level: str, event: str, **fields: Any) -> None:
        self._emit(Log(level, event, fields))

    def close(self) -> None:
        """Drop every procedure (the replica is stopping)."""
        for task in list(self._tasks):
            self._cancel(task)
