"""The replica's Raft side: a thread with its own uvloop running the Raft peer, the election book,
the replicated namespace and the scheduler link, plus the cross-thread calls the kernel makes.

Why a thread: user code blocks the kernel's main thread (and its event loop) for as long as a cell
runs; Raft must keep heartbeating and the scheduler link must keep answering meanwhile. Everything
Raft-related therefore lives on the ``tandem-raft`` thread; the kernel calls in with
``run_coroutine_threadsafe`` (one hop per step of the execute path) and the Raft thread calls out
with ``call_soon_threadsafe`` on the kernel's loop (namespace loads, execution counts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import structlog
import uvloop
import zmq.asyncio

from kernel_replica import log_entries
from kernel_replica.election import (
    CellDone,
    ElectionBook,
    ElectionDecided,
    ElectionFailed,
    EntryIgnored,
    ExecutorLost,
    Outcome,
    StateAccepted,
)
from kernel_replica.log_entries import (
    Done,
    Lead,
    LogEntry,
    LogEntryError,
    Progress,
    State,
    Vote,
    Votes,
    Yield,
)
from kernel_replica.scheduler_link import SchedulerLink
from kernel_replica.state_sync import ReplicatedNamespace
from shared.raft.driver import NotRunning, PeerConfig, ProposalDropped, RaftError, RaftPeer, RaftTimeout
from shared.raft.tls import LinkTls
from shared.raft.types import ConfChange, ConfState, Entry, RaftConfig
from shared.rpc import RpcError, RpcTimeout
from shared.security.curve import ClientCurve

T = TypeVar("T")

SNAPSHOT_VERSION = 1
# One propose() attempt: a proposal forwarded to a leader that then died is never answered, so it
# is proposed again (a duplicate LEAD/YIELD/VOTE/DONE/STATE changes nothing in the book).
PROPOSE_ATTEMPT_S = 1.0
# After replica.stop, how long the main thread gets to stop gracefully before the process exits.
STOP_GRACE_S = 0.5
SILENT_POLL_S = 0.05  # how often a stand-in for a hung candidate checks whether the others answered
# Exit status of a replica whose Raft stopped on an error it cannot continue after (its state
# machine may have diverged): the local scheduler reports the exit and the member is replaced.
RAFT_FATAL_EXIT = 70  # EX_SOFTWARE


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """Timeouts of the execute path; defaults suit the embedded cluster."""

    gpus: int = 0
    propose_timeout_s: float = 5.0  # a proposal not applied by then is reported as a lost quorum
    election_wait_s: float = 5.0  # a yielder waits this long for silent voters, then yields for them
    state_wait_s: float = 10.0  # the next executor waits this long for the previous cell's STATE
    quorum_timeout_s: float = 10.0  # a standby with no Raft leader for this long gives up on DONE
    tick_interval_s: float = 0.02
    election_ticks: int = 10
    snapshot_every: int = 1000
    raft_fsync: bool = False  # config raft.fsync: see shared/raft/storage.py's durability policy
    raft_transport: str = "tcp"  # config raft.transport: shared/raft/tcp_transport.py says why
    # This member's TLS identity on the Raft links (shared/raft/tls.py); None only with raft.tls off
    raft_tls: LinkTls | None = None
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
    commit_notice_s: float = 0.001  # PeerConfig.commit_notice_delay (``raft.commit_notice_ms``)
    executor_silence_s: float = 10.0
    # The leader hands Raft leadership to a replica that executed this many cells in a row (its
    # LEADs then commit without the hop to a remote leader); 0 disables. At most once per
    # ``leader_transfer_every_s``: a transfer drops proposals for a moment.
    leader_follows_executor: int = 3
    leader_transfer_every_s: float = 10.0
    # keys on the link to the local scheduler (shared/security/curve.link_env); None: plain link
    link_curve: ClientCurve | None = None


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
    bind_ms: float = 0.0  # gpu.commit round trip
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
    """Raft could not decide (no quorum, not configured, stopped); ``reason`` says which."""

    reason: str


Decision = Replay | Execute | BindFailed | Standby | Failed | Unavailable


def lost_content(reason: str, execution_count: int) -> dict[str, Any]:
    """The ``execute_reply`` a standby commits for a cell whose executor vanished."""
    return {
        "status": "error",
        "ename": "ExecutorLost",
        "evalue": reason,
        "traceback": [f"ExecutorLost: {reason}"],
        "execution_count": execution_count,
        "user_expressions": {},
        "payload": [],
    }


class RaftThread:
    """A daemon thread running a uvloop event loop; ``submit`` schedules coroutines on it."""

    def __init__(self, name: str = "tandem-raft") -> None:
        self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 2.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


class ReplicaCore:
    """Everything of one replica that runs on the Raft thread. Only touch it from that thread."""

    def __init__(
        self,
        *,
        kernel_id: str,
        replica_id: str,
        data_dir: Path,
        raft_address: str,
        scheduler_address: str,
        settings: ReplicaSettings,
        post_to_kernel: Callable[..., None],
        join: bool = False,
    ) -> None:
        self.kernel_id = kernel_id
        self.replica_id = replica_id
        self.settings = settings
        self.raft_address = raft_address
        self.join = join  # start as a new member of an existing group, not a bootstrap voter
        self._data_dir = data_dir
        self._post = post_to_kernel  # thread-safe: runs fn(*args) on the kernel's main thread
        self._log = structlog.get_logger("replica.raft").bind(kernel=kernel_id, replica=replica_id)
        self.book = ElectionBook()
        self.namespace = ReplicatedNamespace()
        self.skipped_entries = 0  # committed entries that did not decode (skipped by every replica)
        self.peer: RaftPeer | None = None
        self._ctx = zmq.asyncio.Context()
        self.scheduler = SchedulerLink(
            self._ctx,
            kernel_id=kernel_id,
            replica_id=replica_id,
            address=scheduler_address,
            curve=settings.link_curve,
        )
        self._election_waiters: dict[str, list[asyncio.Future[Outcome]]] = {}
        # a cell's DONE, or why none can come (its executor was removed from the group)
        self._done_waiters: dict[str, list[asyncio.Future[Done | str]]] = {}
        self._state_waiters: list[asyncio.Future[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._pending_votes: list[Vote] = []
        # GPUs bound by a yielder that proposed LEAD for a silent candidate (_wait_outcome)
        self._late_bindings: dict[str, asyncio.Future[list[int]]] = {}
        self._own_entries: set[tuple[str, str]] = set()  # (kind, msg_id) proposed by this process
        self._last_progress: dict[str, float] = {}  # msg_id -> when its executor was last heard
        # One watcher per cell another replica executes (``_follow``): its DONE, or ExecutorLost.
        self._followers: dict[str, asyncio.Task[Done | str]] = {}
        # Entries up to this index were in this replica's log when it started: applying them again
        # replays history (no votes, no watchers). None until the peer runs.
        self._replayed_through: int | None = None
        self._applying_live = False  # the entry being applied is new (see _replayed_through)
        # Cells whose executor's process the scheduler saw die (``member_lost``): their DONE, or
        # the STATE after it, will not come, so nothing waits out a silence timeout for them.
        self._executor_died: set[str] = set()
        self._state_died: set[str] = set()
        self._dead_members: set[str] = set()  # until an entry of theirs shows them back (restarted)
        # elections open when a member_lost came: only those skip waiting for a dead voter (one
        # routed later went to a live candidate; the dead one may since have been restarted)
        self._open_at_death: set[str] = set()
        self._lost_signal: asyncio.Future[None] | None = None
        self._progress_task: asyncio.Task[None] | None = None
        self._streak: tuple[str | None, int] = (None, 0)  # (executor, cells in a row) from DONEs
        self._last_transfer = float("-inf")
        self._finish_tail: asyncio.Future[None] | None = None  # the latest finish_cell's completion
        self._finishing: set[str] = set()  # msg_ids executed here whose DONE/STATE are in flight
        self.finish_ms: deque[float] = deque(maxlen=1000)  # executed cell -> DONE and STATE committed
        self._vote_timer: asyncio.TimerHandle | None = None
        self.on_stop_requested: Callable[[], None] = lambda: None
        self.on_done: Callable[[Done], None] = lambda done: None
        self.on_state: Callable[[State], None] = lambda state: None
        # (imports, [(group, names)], gpu_resident) from ReplicatedNamespace.contents() and .gpu_resident()
        self.on_namespace_restored: Callable[[Any], None] = lambda contents: None

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def connect_scheduler(self) -> None:
        self.scheduler.set_handlers(
            on_configure=self.configure, on_stop=self._stop_requested, on_membership=self.membership
        )
        self.scheduler.connect()
        await self.scheduler.register(self.raft_address)
        self._log.info("registered", raft_address=self.raft_address)

    async def configure(self, peers: dict[str, str]) -> None:
        """Start Raft with ``peers`` as bootstrap voters (or, joining, as the members to reach)."""
        join = self.join
        if self.peer is not None:
            self._log.info("already_configured")
            return
        others = {rid: addr for rid, addr in peers.items() if rid != self.replica_id}
        voters = () if join else tuple(sorted(peers))
        config = PeerConfig(
            node_id=self.replica_id,
            address=self.raft_address,
            data_dir=self._data_dir / "raft",
            peers=others,
            bootstrap_voters=voters,
            tick_interval=self.settings.tick_interval_s,
            # Followers rarely propose (votes, and their own cells when they execute): they learn
            # a commit from the next append or, ``commit_notice_s`` after it, an empty append (not
            # one per entry), and a follower's own proposals are confirmed at once.
            raft=RaftConfig(election_ticks=self.settings.election_ticks, eager_commit=False),
            commit_notice_delay=self.settings.commit_notice_s,
            snapshot_every=self.settings.snapshot_every,
            fsync=self.settings.raft_fsync,
            transport_kind=self.settings.raft_transport,
            tls=self.settings.raft_tls,
        )
        if voters:
            self.book.set_voters(voters)
        peer = RaftPeer(
            config,
            on_apply=self._on_apply,
            take_snapshot=self._take_snapshot,
            restore_snapshot=self._restore_snapshot,
            on_conf_change=self._on_conf_change,
            check_snapshot=self._parse_snapshot,
            on_fatal=self._raft_failed,
            logger=self._log,
        )
        await peer.start()
        self.peer = peer
        status = peer.status()
        self._replayed_through = status.last_index
        if status.voters and not self.book.voters:  # restarted from a data dir without a snapshot
            self._handle(self.book.set_voters(status.voters))
        self._spawn(self._report_raft_role())
        self._log.info("raft_running", voters=status.voters, join=join)

    async def membership(
        self, action: str, member: str, address: str, cells: list[str] | None = None
    ) -> dict[str, Any]:
        """``replica.membership``: one single-server change proposed through this member (Raft
        forwards it to the leader), retried while the leader refuses for a moment (a change still
        pending, a new term not yet committed); idempotent, so a retried request is harmless.
        Answers this replica's view of the group after it (``status``: just the view)."""
        if action == "lost":
            return self.member_lost(member, cells or [])
        peer = self.peer
        if peer is None:
            raise RpcError("this replica's Raft group is not configured yet", "not_ready")
        deadline = time.monotonic() + self.settings.propose_timeout_s * 2
        while action != "status":
            st = peer.status()
            if (
                (action == "add_learner" and member in st.members)
                or (action == "promote" and member in st.voters)
                or (action == "remove" and member not in st.members)
            ):
                break
            if action == "add_learner" and not address:
                raise RpcError("add_learner needs the new member's address", "bad_request")
            try:
                if action == "add_learner":
                    await peer.add_learner(member, address, timeout=PROPOSE_ATTEMPT_S * 2)
                elif action == "promote":
                    await peer.promote(member, timeout=PROPOSE_ATTEMPT_S * 2)
                elif action == "remove":
                    await peer.remove(member, timeout=PROPOSE_ATTEMPT_S * 2)
                else:
                    raise RpcError(f"unknown membership action {action!r}", "bad_request")
                self._log.info("membership_changed", action=action, member=member)
                break
            except RaftError as exc:
                if time.monotonic() > deadline:
                    raise RpcError(f"{action} {member} failed: {exc}", "membership_failed") from None
                await asyncio.sleep(0.1)
        return self.status()

    def member_lost(self, member: str, started: list[str]) -> dict[str, Any]:
        """``replica.membership lost``: the scheduler saw ``member``'s process exit. A cell it was
        running will never commit DONE, and a STATE it had yet to send will never come: the
        standbys waiting for that DONE commit an ``ExecutorLost`` one now (instead of after
        ``executor_silence_s``), the next executor starts without that STATE, telling the user,
        and an election waiting on it (its designated candidate) does not wait ``election_wait_s``.

        ``started`` are the cells the scheduler saw it take GPUs for: it may have started one
        before its LEAD committed (the fast path). Such a cell must not run again elsewhere (a
        cell that crashes its process would take the next replica with it), so its LEAD is
        proposed on the dead member's behalf: if no other LEAD came first, it won, and its DONE
        is ``ExecutorLost``. No Raft change: replacing the member is the scheduler's next step."""
        if member == self.replica_id:
            raise RpcError("a replica cannot be told that it died itself", "bad_request")
        self._dead_members.add(member)
        self._open_at_death.update(self._election_waiters)
        for msg_id in started:
            if self.book.outcome(msg_id) is None and self.book.done(msg_id) is None:
                self._executor_died.add(msg_id)
                self.propose_in_background(Lead(msg_id, member), "lead_for_dead_executor")
        cells = self.book.running_on(member)
        self._executor_died.update(cells)
        awaiting = self.book.awaiting_state()
        done = self.book.done(awaiting) if awaiting is not None else None
        if awaiting is not None and done is not None and done.replica_id == member:
            self._state_died.add(awaiting)
            self._wake_state_waiters()
        if self._lost_signal is not None and not self._lost_signal.done():
            self._lost_signal.set_result(None)
        self._log.warning("member_lost", member=member, running=cells, state_lost=sorted(self._state_died))
        return self.status()

    def _lost_future(self) -> asyncio.Future[None]:
        """Resolved by the next ``member_lost``: waits on a dead member wake up at once."""
        if self._lost_signal is None or self._lost_signal.done():
            self._lost_signal = asyncio.get_running_loop().create_future()
        return self._lost_signal

    async def _report_raft_role(self) -> None:
        """Push ``replica.event raft_role`` on every change: the global scheduler prefers the Raft
        leader as executor candidate (its LEAD commits one hop sooner)."""
        last: tuple[Any, ...] | None = None
        while self.peer is not None:
            st = self.peer.status()
            now = (st.role.name, st.leader, st.term)
            if now != last:
                last = now
                self.scheduler.event(
                    "raft_role", None, role=st.role.name.lower(), leader=st.leader, term=st.term
                )
            await asyncio.sleep(self.settings.tick_interval_s * 5)

    async def _stop_requested(self) -> None:
        """``replica.stop``: the kernel stops gracefully on its main thread; if user code holds that
        thread (a long cell), this thread stops Raft and ends the process after a short grace."""
        self._log.info("stop_requested")
        self._post(self.on_stop_requested)
        self._spawn(self._exit_if_stuck())

    async def _exit_if_stuck(self) -> None:
        await asyncio.sleep(STOP_GRACE_S)  # cancelled by stop() when the graceful path runs
        self._log.warning("forced_exit", reason="the main thread is busy (user code) after replica.stop")
        if self.peer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.peer.stop(), 1.0)
        os._exit(0)

    async def stop(self) -> None:
        tail = self._finish_tail
        if tail is not None and not tail.done() and self.peer is not None:
            # the last cell's DONE and STATE, still committing: give them a moment
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(tail), 1.0)
        for task in list(self._background):
            task.cancel()
        if self.peer is not None:
            with contextlib.suppress(Exception):
                await self.peer.stop()
        with contextlib.suppress(Exception):
            await self.scheduler.close()
        self._ctx.destroy(linger=0)

    def status(self) -> dict[str, Any]:
        """This replica's view of its Raft group, for logs and debugging."""
        if self.peer is None:
            return {"configured": False}
        st = self.peer.status()
        stats = self.peer.transport_stats
        return {
            "configured": True,
            "running": st.running,
            "role": st.role.name,
            "leader": st.leader,
            "term": st.term,
            "commit": st.commit,
            "applied": st.applied,
            "voters": list(st.voters),
            "learners": list(st.learners),
            # frames dropped because they did not decode, connections refused by authentication
            "malformed_frames": stats.malformed if stats is not None else 0,
            "refused_connections": stats.refused if stats is not None else 0,
            "skipped_entries": self.skipped_entries,
        }

    def _raft_failed(self, exc: BaseException) -> None:
        """Raft stopped for good (storage failed, or a committed entry or accepted snapshot could
        not be applied: this replica's state may differ from the group's). Lingering would keep a
        member the scheduler counts as alive but that answers nothing; exiting gets it replaced,
        and the replacement catches up from the leader's snapshot and log."""
        self._log.critical(
            "raft_failed_exiting", error=repr(exc), exit_status=RAFT_FATAL_EXIT, status=self.status()
        )
        os._exit(RAFT_FATAL_EXIT)

    # ---- applying the log (called by RaftPeer, in log order) ---------------------------------------
    def _on_apply(self, entry: Entry) -> None:
        """Apply one committed entry. One that does not decode is skipped (every replica decodes
        the same bytes alike, so all skip it: no divergence), counted and logged. One that
        decodes but fails to apply raises: the state machine may be half-changed, so Raft stops
        (``_raft_failed``) rather than go on with state that differs from the group's."""
        try:
            decoded = log_entries.decode(entry.data)
        except LogEntryError as exc:
            self.skipped_entries += 1
            self._log.warning(
                "log_entry_skipped", index=entry.index, reason=str(exc), total=self.skipped_entries
            )
            return
        if self._dead_members and not isinstance(decoded, Lead):  # a stand-in LEAD names the dead one
            self._dead_members.discard(decoded.proposer if isinstance(decoded, Yield) else decoded.replica_id)
        if isinstance(decoded, Progress):
            self._last_progress[decoded.msg_id] = time.monotonic()
            return
        self._applying_live = self._replayed_through is not None and entry.index > self._replayed_through
        try:
            events = self.book.apply(decoded)
            for i, event in enumerate(events):  # the namespace is the state machine's too: applied first
                if isinstance(event, StateAccepted):  # as every replica applies it (a repair narrowed)
                    events[i] = StateAccepted(self.namespace.apply(event.state))
        except Exception:
            self._log.critical(
                "log_entry_not_applied", index=entry.index, kind=type(decoded).__name__, exc_info=True
            )
            raise
        self._handle(events)

    def _on_conf_change(self, change: ConfChange | None, conf: ConfState) -> None:
        """A membership change committed, or (``change`` None) a snapshot restored: the book
        counts LEADs against these voters (a joiner's book restored from the bootstrap snapshot
        has none: it would ignore every LEAD, and every DONE that carries one)."""
        if change is None and self.book.voters == frozenset(conf.voters):
            return
        self._handle(self.book.set_voters(conf.voters))

    def _handle(self, events: list[Any]) -> None:
        """What the book's events mean for waiters, the kernel and the log (the replicated state
        is already changed): a failure here is logged, it cannot make this replica diverge."""
        for event in events:
            try:
                self._react(event)
            except Exception:
                self._log.exception("log_event_failed", event=type(event).__name__)

    def _react(self, event: Any) -> None:
        match event:
            case ElectionDecided(msg_id=msg_id, winner=winner):
                self._resolve(self._election_waiters, msg_id, Outcome(winner))
                if winner != self.replica_id and self._applying_live:
                    # Standbys are not sent the cell: they learn it here, vote for the winner
                    # and watch it until its DONE.
                    self._vote_later(msg_id, winner)
                    if self.book.done(msg_id) is None:  # not a LEAD carried by its DONE
                        self._follow(msg_id, winner)
            case ElectionFailed(msg_id=msg_id):
                self._resolve(self._election_waiters, msg_id, Outcome(None))
            case ExecutorLost(msg_id=msg_id, executor=executor):
                self._wake_state_waiters()
                self._resolve(
                    self._done_waiters,
                    msg_id,
                    f"the executor {executor} was removed from the kernel's Raft group before it finished",
                )
            case CellDone(done=done):
                self._wake_state_waiters()
                self._resolve(self._done_waiters, done.msg_id, done)
                self._leader_follows(done)
                if not self._proposed_here(done):
                    self._post(self.on_done, done)
            case StateAccepted(state=state):  # its namespace change was applied with the entry
                if not self._proposed_here(state):
                    self._post(self.on_state, state)
                self._wake_state_waiters()
            case EntryIgnored(entry=entry, reason=reason):
                self._log.debug(
                    "log_entry_ignored", kind=type(entry).__name__, msg_id=entry.msg_id, reason=reason
                )

    def _leader_follows(self, done: Done) -> None:
        """On the leader: after ``leader_follows_executor`` cells in a row ran on another voter,
        hand leadership to it, off the critical path (its reply went out before this DONE)."""
        if done.replica_id == self._streak[0]:
            self._streak = (done.replica_id, self._streak[1] + 1)
        else:
            self._streak = (done.replica_id, 1)
        wanted = self.settings.leader_follows_executor
        peer = self.peer
        if wanted <= 0 or self._streak[1] < wanted or peer is None or done.replica_id == self.replica_id:
            return
        status = peer.status()
        now = time.monotonic()
        if (
            status.leader != self.replica_id
            or done.replica_id not in status.voters
            or now - self._last_transfer < self.settings.leader_transfer_every_s
        ):
            return
        self._last_transfer = now
        target = done.replica_id

        async def transfer() -> None:
            try:
                await peer.transfer_leadership(target, timeout=2.0)
                self._log.info("leadership_transferred", to=target, reason="executor")
            except RaftError as exc:
                self._log.info("leadership_transfer_failed", to=target, error=str(exc))

        self._spawn(transfer())

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

    @staticmethod
    def _resolve(table: dict[str, list[asyncio.Future[Any]]], msg_id: str, value: Any) -> None:
        for fut in table.pop(msg_id, []):
            if not fut.done():
                fut.set_result(value)

    def _take_snapshot(self) -> bytes:
        return msgpack.packb(
            {"v": SNAPSHOT_VERSION, "book": self.book.to_snapshot(), "ns": self.namespace.to_snapshot()},
            use_bin_type=True,
        )

    @staticmethod
    def _parse_snapshot(data: bytes) -> tuple[ElectionBook, bytes]:
        """A snapshot's election book and namespace data, checked without side effects (no import
        run, nothing unpickled); ValueError naming the problem. ``RaftPeer`` drops a peer's
        snapshot that fails this on arrival, so a malformed one never reaches the state machine."""
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            raise ValueError(f"replica snapshot is not msgpack: {type(exc).__name__}") from None
        if type(raw) is not dict or raw.get("v") != SNAPSHOT_VERSION:
            raise ValueError(
                f"unsupported replica snapshot (version {raw.get('v') if type(raw) is dict else raw!r:.40})"
            )
        if type(raw.get("book")) is not dict or type(raw.get("ns")) is not bytes:
            raise ValueError("a replica snapshot holds a 'book' map and 'ns' bytes")
        ReplicatedNamespace.parse_snapshot(raw["ns"])
        return ElectionBook.from_snapshot(raw["book"]), raw["ns"]

    def _restore_snapshot(self, data: bytes) -> None:
        if not data:
            return
        book, namespace = self._parse_snapshot(data)
        self.namespace.restore(namespace)  # checked: replaces all or nothing
        self.book = book
        self._post(self.on_namespace_restored, (*self.namespace.contents(), self.namespace.gpu_resident()))
        last = self.book.last_done()
        if last is not None:
            self._post(self.on_done, last)
        self._log.info("snapshot_restored", names=len(self.namespace.digests()))

    # ---- proposing ---------------------------------------------------------------------------------
    async def propose(self, entry: LogEntry, *, timeout: float | None = None) -> int:
        """Propose until applied here; retries dropped proposals (a duplicate entry is harmless:
        the book ignores a second LEAD/YIELD/DONE). Raises ``RaftError`` naming the cause."""
        if self.peer is None:
            raise NotRunning("this replica's Raft group is not configured yet")
        if self._pending_votes and not isinstance(entry, Vote | Votes):
            self._flush_votes()  # proposed in this loop turn, so they share this entry's Ready
        if isinstance(entry, Done | State):
            self._own_entries.add((type(entry).__name__, entry.msg_id))
        data = log_entries.encode(entry)
        deadline = time.monotonic() + (timeout or self.settings.propose_timeout_s)
        last: RaftError | None = None
        attempts = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise last or RaftTimeout("proposal timed out")
            attempts += 1
            try:
                return await self.peer.propose(data, timeout=min(remaining, PROPOSE_ATTEMPT_S))
            except ProposalDropped as exc:  # definitely not appended: safe to retry
                last = exc
                await asyncio.sleep(0.02)
            except RaftTimeout as exc:  # lost with a dead leader, or just slow: propose again
                last = exc
            if attempts in (1, 10, 100):
                self._log.info(
                    "proposal_retry",
                    kind=type(entry).__name__,
                    msg_id=entry.msg_id,
                    attempts=attempts,
                    error=str(last),
                )

    def propose_in_background(self, entry: LogEntry, what: str) -> None:
        async def run() -> None:
            try:
                await self.propose(entry)
            except RaftError as exc:
                self._log.warning(
                    "background_proposal_failed", what=what, msg_id=entry.msg_id, error=str(exc)
                )

        self._spawn(run())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _waiter(self, table: dict[str, list[asyncio.Future[Any]]], msg_id: str) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        table.setdefault(msg_id, []).append(fut)
        return fut

    # ---- the execute path (called from the kernel through RaftThread.submit) -----------------------
    async def decide(self, msg_id: str, *, lead: bool, silent: str | None = None) -> Decision:
        """Steps 3-4 of the execute path: election, waiting for the previous state, GPU binding.
        ``silent``: the designated candidate the scheduler found hung (not waited for again)."""
        decision = await self._decide(msg_id, lead=lead, silent=silent)
        self._open_at_death.discard(msg_id)
        if self.scheduler.settle_bound_ahead(msg_id, executing=isinstance(decision, Execute)):
            self._spawn(self._release(msg_id))  # bound ahead for a cell this replica will not run
        return decision

    async def _decide(self, msg_id: str, *, lead: bool, silent: str | None = None) -> Decision:
        log = self._log.bind(msg_id=msg_id)
        started = time.perf_counter()
        if self.peer is None:
            return Unavailable("this replica's Raft group is not configured yet")
        done = self.book.done(msg_id)
        if done is not None:
            return Replay(done)
        outcome = self.book.outcome(msg_id)
        decided_before = outcome is not None
        if outcome is None and not lead:
            outcome = await self._grace_for_lead(msg_id)
        binding: asyncio.Future[list[int]] | None = None
        if outcome is None:
            waiter = self._waiter(self._election_waiters, msg_id)
            entry: LogEntry = (
                Lead(msg_id, self.replica_id) if lead else Yield(msg_id, self.replica_id, self.replica_id)
            )
            if lead:
                # Only the designated candidate proposes LEAD, so it almost always wins: bind the
                # GPUs while the LEAD commits (the local scheduler also tells the global scheduler
                # who executes, before any output); a LEAD that loses gives them back.
                binding = asyncio.ensure_future(self.scheduler.gpu_commit(msg_id, self.settings.gpus))
            try:
                await self.propose(entry)
                outcome = await self._wait_outcome(msg_id, waiter, silent)
            except RaftError as exc:
                self._unbind_later(msg_id, binding or self._late_bindings.pop(msg_id, None))
                return Unavailable(f"Raft could not commit the election for this cell: {exc}")
            binding = binding or self._late_bindings.pop(msg_id, None)
        if outcome.failed:
            self._unbind_later(msg_id, binding)
            log.info("election_failed")
            self.scheduler.event("election_failed", msg_id)
            return Failed()
        winner = outcome.winner
        assert winner is not None
        if winner != self.replica_id:
            self._unbind_later(msg_id, binding)
            return Standby(winner)
        if decided_before:
            # A retry of a cell this replica already won: it ran (or started) here, and its DONE
            # is not in the log. Running it again would break at-most-once.
            return Unavailable(
                f"this cell was already claimed by {self.replica_id} but its completion is not in the log"
            )
        elected = time.perf_counter()
        try:
            if binding is None:
                binding = asyncio.ensure_future(self.scheduler.gpu_commit(msg_id, self.settings.gpus))
            waited, missing = await self._wait_previous_cell(msg_id, log)
            bind_started = time.perf_counter()
            device_ids = await binding
        except (RpcError, RpcTimeout, ValueError) as exc:
            log.warning("gpu_commit_failed", error=str(exc))
            return BindFailed(str(exc))
        self._progress_task = asyncio.ensure_future(self._beat(msg_id))
        return Execute(
            device_ids,
            elect_ms=(elected - started) * 1000,
            state_wait_ms=waited,
            bind_ms=(time.perf_counter() - bind_started) * 1000,
            state_missing=tuple(missing),
        )

    async def outcome_of(self, msg_id: str, executor: str) -> Decision:
        """The scheduler lost ``executor`` while it ran msg_id and asks this survivor what became
        of the cell: its DONE if one is committed (the executor died after finishing it), else
        the ``ExecutorLost`` DONE the standbys commit on its behalf. Never an election that could
        run the cell here: it started on ``executor``, so a LEAD is proposed in its name (a
        duplicate of its own changes nothing) and the first committed LEAD still decides."""
        if self.peer is None:
            return Unavailable("this replica's Raft group is not configured yet")
        done = self.book.done(msg_id)
        if done is not None:
            return Replay(done)
        if executor == self.replica_id:
            return Unavailable("the scheduler asked this replica for the outcome of its own cell")
        outcome = self.book.outcome(msg_id)
        if outcome is None:
            try:
                await self.propose(Lead(msg_id, executor))  # applied here: the election is decided
            except RaftError as exc:
                return Unavailable(f"Raft could not commit the outcome of this cell: {exc}")
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

    def _unbind_later(self, msg_id: str, binding: asyncio.Future[list[int]] | None) -> None:
        """The early gpu.commit of a LEAD that did not win: release whatever it bound."""
        if binding is None:
            return

        async def release() -> None:
            with contextlib.suppress(RpcError, RpcTimeout, ValueError, asyncio.CancelledError):
                await binding
            await self._release(msg_id)

        self._spawn(release())

    async def _grace_for_lead(self, msg_id: str) -> Outcome | None:
        if self.settings.yield_grace_s <= 0:
            return None
        waiter = self._waiter(self._election_waiters, msg_id)
        try:
            return await asyncio.wait_for(waiter, self.settings.yield_grace_s)
        except TimeoutError:
            return self.book.outcome(msg_id)

    async def _wait_outcome(
        self, msg_id: str, waiter: asyncio.Future[Outcome], silent: str | None = None
    ) -> Outcome:
        """After our own LEAD/YIELD applied: a LEAD decides at once; a YIELD waits for the others,
        and after ``election_wait_s`` yields on behalf of voters that stayed silent (at once when
        the only silent one is ``silent``, a candidate the scheduler already waited for)."""
        outcome = self.book.outcome(msg_id)
        if outcome is not None:
            return outcome
        deadline = time.monotonic() + self.settings.election_wait_s
        while not waiter.done() and (remaining := deadline - time.monotonic()) > 0:
            if (
                msg_id in self._open_at_death
                and msg_id not in self._executor_died
                and self.book.silent_voters(msg_id) <= self._dead_members
            ):
                break  # only voters that died during this election are silent, and none ran it
            if silent is not None and self.book.silent_voters(msg_id) <= {silent}:
                break
            await asyncio.wait(
                (waiter, self._lost_future()),
                timeout=remaining if silent is None else min(remaining, SILENT_POLL_S),  # YIELDs wake nothing
                return_when=asyncio.FIRST_COMPLETED,
            )
        if waiter.done():
            return waiter.result()
        silent = sorted(self.book.silent_voters(msg_id))
        self._log.warning("election_waiting_on_silent_voters", msg_id=msg_id, silent=silent)
        # One replica, the first in id order among those that answered, offers to run the cell;
        # the others give it time before yielding for the silent ones (which would fail the cell).
        answered = sorted(self.book.voters - set(silent))
        if answered and answered[0] == self.replica_id:
            if await self._lead_for_silent_candidate(msg_id):
                outcome = self.book.outcome(msg_id)
                if outcome is not None:
                    return outcome
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(waiter), self.settings.propose_timeout_s)
        elif answered:
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(waiter), self.settings.propose_timeout_s)
        for voter in silent:
            await self.propose(Yield(msg_id, voter, self.replica_id))
        outcome = self.book.outcome(msg_id)
        if outcome is not None:
            return outcome
        return await asyncio.wait_for(waiter, self.settings.propose_timeout_s)

    async def _lead_for_silent_candidate(self, msg_id: str) -> bool:
        """The designated candidate stayed silent (it died just before the cell reached it): if
        this replica's host can bind the GPUs now, it proposes LEAD itself rather than yield on
        the candidate's behalf. The first committed LEAD still wins, so the cell runs at most
        once; a losing LEAD gives its GPUs back. True if a LEAD was proposed."""
        if self.book.outcome(msg_id) is not None:
            return False
        binding = asyncio.ensure_future(self.scheduler.gpu_commit(msg_id, self.settings.gpus))
        try:
            await asyncio.shield(binding)
        except (RpcError, RpcTimeout, ValueError) as exc:
            self._log.info("no_lead_for_silent_candidate", msg_id=msg_id, reason=str(exc))
            return False
        self._late_bindings[msg_id] = binding
        try:
            await self.propose(Lead(msg_id, self.replica_id))
        except RaftError:
            self._unbind_later(msg_id, self._late_bindings.pop(msg_id, None))
            raise
        self._log.warning("lead_for_silent_candidate", msg_id=msg_id)
        return True

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

    async def _wait_previous_cell(self, msg_id: str, log: Any) -> tuple[float, list[str]]:
        """The executor must see the namespace the previous cell left: its DONE and STATE must be
        applied (its executor replied before committing them), unless it ran in this process.
        Returns the wait and the cells still missing at the deadline, so the user can be told."""
        if not self._previous_cell_pending(msg_id):
            return 0.0, self._state_lost_before(msg_id)
        started = time.perf_counter()
        deadline = time.monotonic() + self.settings.state_wait_s
        while pending := self._previous_cell_pending(msg_id):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("previous_state_missing", awaiting=pending, waited_s=self.settings.state_wait_s)
                return (time.perf_counter() - started) * 1000, pending
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._state_waiters.append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)
        return (time.perf_counter() - started) * 1000, self._state_lost_before(msg_id)

    def _wake_state_waiters(self) -> None:
        waiters, self._state_waiters = self._state_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _beat(self, msg_id: str) -> None:
        """While this replica executes msg_id: PROGRESS entries tell the standbys it is alive."""
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            with contextlib.suppress(RaftError):
                await self.propose(Progress(msg_id, self.replica_id))

    async def finish(self, done: Done, *, release_gpus: bool) -> None:
        """Step 5: release the GPUs (not on the critical path) and commit DONE."""
        self._stop_beat()
        if release_gpus:
            self._spawn(self._release(done.msg_id))
        await self.propose(done)  # the winner's DONE is also its VOTE (ElectionBook)

    def abandon(self) -> None:
        """An Execute decision whose cell will not run after all (its outcome was committed
        without it): stop the PROGRESS beats. Call on the Raft thread."""
        self._stop_beat()

    def _stop_beat(self) -> None:
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None

    def finishing(self) -> bool:
        """Whether DONE/STATE entries of cells executed here are still in flight (any thread)."""
        return bool(self._finishing)

    def finish_cell(
        self,
        done: Done,
        state: State,
        written: concurrent.futures.Future[State] | None = None,
        replicated: concurrent.futures.Future[None] | None = None,
    ) -> None:
        """Steps 5 and 7 off the critical path: the executor has already replied (the committed
        LEAD guarantees at-most-once); DONE and STATE are proposed together, in order after the
        previous cell's, and the standbys reply once DONE commits. Until both commit the next cell
        on this replica runs without waiting for them (its namespace is current); any other
        executor waits for them (``_wait_previous_cell``). Call on the Raft thread. ``written``:
        the STATE to propose instead, once its large objects are in the data store (write-behind,
        ``state_sync.complete_state``); DONE does not wait for it. ``replicated`` is resolved once
        DONE and STATE are committed (with write-behind, once DONE is: the upload is not waited
        for), or once that has failed: the kernel publishes idle then. The GPUs were released by
        the local scheduler as the reply went by (its ``_release_on_reply``)."""
        self._stop_beat()  # no VOTE of its own: the winner's DONE is that (ElectionBook)
        previous = self._finish_tail
        tail: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._finish_tail = tail
        self._finishing.add(done.msg_id)
        self._spawn(self._finish_cell(done, state, previous, tail, written, replicated))

    async def _finish_cell(
        self,
        done: Done,
        state: State,
        previous: asyncio.Future[None] | None,
        tail: asyncio.Future[None],
        written: concurrent.futures.Future[State] | None = None,
        replicated: concurrent.futures.Future[None] | None = None,
    ) -> None:
        log = self._log.bind(msg_id=done.msg_id)
        started = time.perf_counter()
        try:
            if previous is not None and not previous.done():
                await asyncio.shield(previous)  # keep DONE/STATE in cell order in the log
            proposals = [asyncio.ensure_future(self.propose(done))]
            if written is not None:
                proposals[0].add_done_callback(lambda _: _resolve_once(replicated))
                state = await asyncio.wrap_future(written)  # large objects in the store first
            proposals.append(asyncio.ensure_future(self.propose(state)))
            results = await asyncio.gather(*proposals, return_exceptions=True)
            if isinstance(results[0], BaseException):
                log.error("done_not_committed", error=str(results[0]))
                return
            if isinstance(results[1], BaseException) or self.book.awaiting_state() == done.msg_id:
                # dropped, or retried ahead of its DONE (then the book ignored it): once more
                await self.propose(state)
            self.finish_ms.append((time.perf_counter() - started) * 1000)
            log.debug(
                "cell_finished",
                finish_ms=round(self.finish_ms[-1], 3),
                state_bytes=sum(sum(g.get("sizes", ())) for g in state.groups),
            )
        except RaftError as exc:
            log.warning("state_not_replicated", error=str(exc))
        except Exception:
            log.exception("finish_failed")
        finally:
            _resolve_once(replicated)
            self._finishing.discard(done.msg_id)
            if not tail.done():
                tail.set_result(None)
            self._wake_state_waiters()

    def finish_repair(self, state: State, written: concurrent.futures.Future[State] | None = None) -> None:
        """Propose a repair STATE (values stored after their cell, ``durability.apply_repair``)
        after this replica's cells still in flight, as their STATEs are ordered: what it carries
        is newer than any of them. ``written``: the STATE to propose instead, once its values are
        in the data store (as ``finish_cell``'s). Call on the Raft thread."""
        previous = self._finish_tail
        tail: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._finish_tail = tail

        async def run(state: State) -> None:
            try:
                if previous is not None and not previous.done():
                    await asyncio.shield(previous)
                if written is not None:
                    state = await asyncio.wrap_future(written)
                await self.propose(state)
            except RaftError as exc:
                self._log.warning("repair_not_replicated", msg_id=state.msg_id, error=str(exc))
            finally:
                if not tail.done():
                    tail.set_result(None)

        self._spawn(run(state))

    def _vote_later(self, msg_id: str, winner: str) -> None:
        if not self.settings.propose_votes:
            return
        self._pending_votes.append(Vote(msg_id, self.replica_id, winner))
        if self._vote_timer is None:
            self._vote_timer = asyncio.get_running_loop().call_later(
                self.settings.vote_flush_s, self._flush_votes
            )

    def _flush_votes(self) -> None:
        if self._vote_timer is not None:
            self._vote_timer.cancel()
            self._vote_timer = None
        votes, self._pending_votes = self._pending_votes, []
        if len(votes) == 1:
            self.propose_in_background(votes[0], "vote")
        elif votes:
            batch = Votes(self.replica_id, tuple((v.msg_id, v.winner) for v in votes))
            self.propose_in_background(batch, "votes")

    async def _release(self, msg_id: str) -> None:
        try:
            await self.scheduler.gpu_release(msg_id)
        except (RpcError, RpcTimeout) as exc:
            self._log.warning("gpu_release_failed", msg_id=msg_id, error=str(exc))

    async def wait_done(self, msg_id: str, winner: str, execution_count: int) -> Done | str:
        """A standby's wait for the executor's DONE (see ``_wait_done``)."""
        done = self.book.done(msg_id)
        if done is not None:
            return done
        return await asyncio.shield(self._follow(msg_id, winner, execution_count))

    def _follow(
        self, msg_id: str, winner: str, execution_count: int | None = None
    ) -> asyncio.Task[Done | str]:
        """The one watcher of a cell ``winner`` executes, started when its LEAD commits."""
        task = self._followers.get(msg_id)
        if task is None:
            if execution_count is None:
                last = self.book.last_done()
                execution_count = last.execution_count if last is not None else 0
            task = asyncio.ensure_future(self._wait_done(msg_id, winner, execution_count))
            self._followers[msg_id] = task
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(lambda _: self._followers.pop(msg_id, None))
        return task

    async def _wait_done(self, msg_id: str, winner: str, execution_count: int) -> Done | str:
        """No deadline while the executor shows progress (cells run for minutes), but a group
        without a leader for ``quorum_timeout_s`` ends the wait with the reason, and a silent or
        dead executor gets an ``ExecutorLost`` DONE committed on its behalf. An executor removed
        from the group before its DONE committed (a replacement's membership change) is answered
        with an ``ExecutorLost`` DONE made here, not in the log: every replica applies the same
        change, so each answers the same, and no DONE of the removed member can count after it."""
        waiter = self._waiter(self._done_waiters, msg_id)
        leaderless_since: float | None = None
        gave_up = False
        self._last_progress.setdefault(msg_id, time.monotonic())
        try:
            while True:
                await asyncio.wait(
                    (waiter, self._lost_future()), timeout=0.5, return_when=asyncio.FIRST_COMPLETED
                )
                if waiter.done():
                    result = waiter.result()
                    if isinstance(result, str):  # the executor left the group: no DONE can come
                        return Done(
                            msg_id,
                            self.replica_id,
                            lost_content(result, execution_count),
                            execution_count,
                            False,
                        )
                    return result
                peer = self.peer
                if peer is None or not peer.status().running:
                    return "this replica's Raft peer is not running"
                now = time.monotonic()
                if peer.status().leader is None:
                    leaderless_since = leaderless_since or now
                    if now - leaderless_since > self.settings.quorum_timeout_s:
                        return (
                            f"the kernel's Raft group has had no leader for "
                            f"{self.settings.quorum_timeout_s:g}s (quorum lost: fewer than 2 of 3 "
                            "replicas reachable)"
                        )
                    continue
                leaderless_since = None
                silent_s = now - self._last_progress[msg_id]
                died = msg_id in self._executor_died
                if not gave_up and (died or silent_s > self.settings.executor_silence_s):
                    gave_up = True  # once: the DONE (ours or the executor's) then ends the wait
                    self._log.warning(
                        "executor_silent",
                        msg_id=msg_id,
                        executor=winner,
                        silent_s=round(silent_s, 1),
                        died=died,
                    )
                    reason = (
                        f"the executor {winner}'s process died while running this cell; its outcome is unknown"
                        if died
                        else f"the executor {winner} stopped reporting progress for "
                        f"{self.settings.executor_silence_s:g}s (it probably died); the cell's outcome is unknown"
                    )
                    lost = Done(
                        msg_id, self.replica_id, lost_content(reason, execution_count), execution_count, False
                    )
                    self.propose_in_background(lost, "executor_lost")
        finally:
            self._last_progress.pop(msg_id, None)


def _resolve_once(future: concurrent.futures.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class RaftBridge:
    """The kernel's handle on the Raft thread: builds the core there and carries calls to it."""

    def __init__(self, thread: RaftThread, core: ReplicaCore) -> None:
        self.thread = thread
        self.core = core
        self._stopped = False

    @classmethod
    def start(cls, **core_kwargs: Any) -> RaftBridge:
        thread = RaftThread()
        thread.start()

        async def build() -> ReplicaCore:  # on the Raft thread, so its sockets belong to that loop
            return ReplicaCore(**core_kwargs)

        return cls(thread, thread.submit(build()).result(timeout=10))

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the Raft thread and await its result from the kernel's loop."""
        return await asyncio.wrap_future(self.thread.submit(coro))

    def call_blocking(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """For threads without a loop of their own in use (the launcher, the control thread)."""
        return self.thread.submit(coro).result(timeout)

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop Raft cleanly (closing its WAL and sockets), then the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.call_blocking(self.core.stop(), timeout)
        except Exception as exc:  # shutting down regardless
            structlog.get_logger("replica.raft").warning("raft_stop_failed", error=repr(exc))
        self.thread.stop()
