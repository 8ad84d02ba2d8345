"""The asyncio shell around the sans-I/O Raft core: clock, disk, network and the application.

``RaftPeer`` owns a ``RaftNode`` (``shared.raft.core``), a ``Storage`` and a ``Transport`` and runs the
etcd-style Ready loop::

    propose / step / tick  ──►  RaftNode  ──►  Ready ──► 1. persist (one write, one fdatasync*)
                                                        2. send messages
                                                        3. restore snapshot, apply committed entries
                                                        4. fail dropped proposals
                                                        5. advance

Processing is event driven: proposals, inbound messages and ticks only mark the node dirty and wake
the loop; everything that arrived in the same turn of the event loop is then handled by one Ready,
so N concurrent proposals cost one fsync, not N. That group commit is where throughput comes from.
(*) With ``PeerConfig.fsync`` off there is no fdatasync at all: the storage directory is fenced by
the machine's boot id instead (``shared.raft.storage`` explains why that keeps Raft safe).
A leader sends its appends before its own fsync (see ``_handle_ready`` for why that is safe).

The application's state machine is in memory: on restart it is rebuilt from the newest snapshot
(``restore_snapshot``) followed by the committed log (``on_apply``), so both must be deterministic.

What peers send is vetted by the transport before the core sees it: frames that do not decode, and
snapshots whose envelope or application data (``check_snapshot``) could not be restored, are
dropped and counted (``transport_stats.malformed``). A failure past that point (storage, or the
application failing to apply a committed entry or an accepted snapshot) stops the peer for good
(fail-stop: continuing would diverge from the group) and calls ``on_fatal``, so the process can
exit and be replaced instead of lingering with a dead Raft.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import structlog

from shared.raft.core import RaftNode
from shared.raft.membership import apply_conf_change
from shared.raft.storage import DEFAULT_SEGMENT_BYTES, Storage, remove_files
from shared.raft.tls import LinkTls
from shared.raft.transport import Transport, TransportOptions, TransportStats, open_transport
from shared.raft.types import (
    ConfChange,
    ConfChangeType,
    ConfState,
    DroppedProposal,
    Entry,
    EntryType,
    HardState,
    Message,
    RaftConfig,
    Ready,
    Role,
    Snapshot,
    decode_conf_change,
)

SNAPSHOT_ENVELOPE_VERSION = 1
_BIG_SNAPSHOT = 1 << 20  # an installed snapshot larger than this is written from a worker thread

ApplyFn = Callable[[Entry], Awaitable[None] | None]
TakeSnapshotFn = Callable[[], bytes | Awaitable[bytes]]
RestoreSnapshotFn = Callable[[bytes], Awaitable[None] | None]
ConfChangeFn = Callable[[ConfChange | None, ConfState], None]
CheckSnapshotFn = Callable[[bytes], None]  # raises ValueError if restore_snapshot would fail; no effects
FatalFn = Callable[[BaseException], None]


# ---------------------------------------------------------------------------- errors


class RaftError(Exception):
    """Base of everything ``RaftPeer`` raises to its callers."""


class NotRunning(RaftError):
    """The peer is not started, is stopping, or stopped after a fatal error."""


class ProposalDropped(RaftError):
    """The proposal was definitely not committed (no leader, leadership lost, back-pressure...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotLeader(RaftError):
    """The operation needs the leader; ``leader`` is who this peer thinks leads (None: unknown)."""

    def __init__(self, leader: str | None) -> None:
        super().__init__(f"not the leader (leader: {leader})")
        self.leader = leader


class RaftTimeout(RaftError, TimeoutError):
    """A wait ran out of time; what was asked for may still happen later."""


class ProposalTimeout(RaftTimeout):
    """Not applied within the timeout. Outcome unknown: the entry may still commit."""


# ---------------------------------------------------------------------------- config / status


@dataclass(frozen=True, slots=True)
class PeerConfig:
    node_id: str
    address: str  # endpoint the transport binds, e.g. "tcp://127.0.0.1:7001" (":0" picks a free port)
    data_dir: str | Path
    # Addresses of other members known at start. A brand-new member needs at least the current
    # members' addresses so it can answer them; it learns the rest from the log and snapshots.
    peers: Mapping[str, str] = field(default_factory=dict)
    bootstrap_voters: tuple[str, ...] = ()  # only for a brand-new group; ignored once storage has state
    tick_interval: float = 0.02  # x RaftConfig.election_ticks (10) = 200-400 ms election timeout
    raft: RaftConfig = field(default_factory=RaftConfig)
    snapshot_every: int = 10_000  # applied entries between automatic snapshots; 0 disables them
    # False: WAL appends are never fdatasync'd and the directory is fenced by the boot id; after a
    # machine reboot ``start()`` raises ``StaleLogAfterReboot`` (replace the member, do not restart it).
    fsync: bool = True
    # fdatasync inline measures ~0.14 ms here; a worker-thread hop adds ~0.06 ms to every commit but
    # frees the loop during the sync. Inline wins on latency and on a 2-core machine on throughput.
    sync_in_thread: bool = False
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    transport: TransportOptions = field(default_factory=TransportOptions)
    transport_kind: str = "tcp"  # shared.raft.transport.TRANSPORT_KINDS
    # Mutual TLS on every link (shared/raft/tls.py): only members of the same group get through.
    # None: plain TCP, for tests and benchmarks of Raft itself (replicas always have one).
    tls: LinkTls | None = None
    seed: int | None = None  # election timeout randomness; None = from the OS
    # A socket already bound to ``address`` and listening, held since the address was chosen so
    # that no other process takes the port before Raft starts (a replica registers its address,
    # then waits for its peers). The TCP transport serves on it; the ZMQ one closes it just before
    # binding. None: the transport binds ``address`` itself.
    listener: socket.socket | None = None
    # With ``raft.eager_commit`` off, how long after a commit the leader tells the followers that
    # hold the entries (one empty append each), unless an append carries it first. Followers apply
    # committed entries (a kernel's STATE) only once told: without this they waited for the next
    # heartbeat, up to ``tick_interval`` (issue #21). 0: right after the Ready that committed.
    commit_notice_delay: float = 0.001


@dataclass(frozen=True, slots=True)
class PeerStatus:
    id: str
    address: str
    term: int
    role: Role
    leader: str | None
    commit: int
    applied: int
    last_index: int
    voters: tuple[str, ...]
    learners: tuple[str, ...]
    members: dict[str, str | None]  # member id -> transport address (None if not known here)
    running: bool


def _noop(*_: Any) -> None:
    return None


# ---------------------------------------------------------------------------- the peer


class RaftPeer:
    """One member of a Raft group on real disk and real ZMQ sockets.

    ``on_apply(entry)`` is called for every committed NORMAL entry that carries data, in log order,
    exactly once per process lifetime (again after a restart for the entries after the snapshot).
    It may be a plain function or a coroutine function; a coroutine is awaited before the next entry
    is applied, which also holds up the Ready loop, so keep it short and hand long work elsewhere.
    The leader's empty no-op entries are not passed on; CONF_CHANGE entries go to
    ``on_conf_change(change, conf)`` instead, with the configuration after it; a restored
    snapshot calls ``on_conf_change(None, conf)`` with the configuration as of the snapshot (a
    member that joins through the bootstrap snapshot learns the voters from nothing else).

    ``restore_snapshot(data)`` replaces the application state (``b""`` means empty: a new group
    starts from the core's bootstrap snapshot); ``take_snapshot()`` returns it as bytes. Either may
    be a coroutine function. ``check_snapshot(data)`` parses snapshot data as ``restore_snapshot``
    would, without applying it, and raises ``ValueError`` if it could not be restored: a peer's
    snapshot that fails it is dropped on arrival instead of stopping this peer.

    ``on_fatal(exc)`` is called once if the peer stops on an error it cannot continue after.
    """

    def __init__(
        self,
        config: PeerConfig,
        *,
        on_apply: ApplyFn = _noop,
        take_snapshot: TakeSnapshotFn = lambda: b"",
        restore_snapshot: RestoreSnapshotFn = _noop,
        on_conf_change: ConfChangeFn = _noop,
        check_snapshot: CheckSnapshotFn | None = None,
        on_fatal: FatalFn = _noop,
        logger: Any = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self._on_apply = on_apply
        self._take_snapshot = take_snapshot
        self._restore_snapshot = restore_snapshot
        self._on_conf_change = on_conf_change
        self._check_app_snapshot = check_snapshot
        self._on_fatal = on_fatal
        self._log = (logger if logger is not None else structlog.get_logger("raft")).bind(node=self.node_id)
        self._node: RaftNode | None = None
        self._storage: Storage | None = None
        self._transport: Transport | None = None
        self._addresses: dict[str, str] = dict(config.peers)
        self._conf = ConfState()
        self._applied = 0
        self._snapshot_index = 0
        self._leader: str | None = None
        self._leader_event = asyncio.Event()
        self._waiters: dict[str, asyncio.Future[int]] = {}
        self._pid_prefix = f"{self.node_id}.{secrets.token_hex(4)}."
        self._pid_seq = 0
        self._wake = asyncio.Event()
        self._commit_notice: asyncio.TimerHandle | None = None
        self._notice_hold_until = 0.0  # loop time: commit notices wait until then (hold_commit_notices)
        self._running = False
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started_once = False
        self._janitor: asyncio.Task[None] | None = None  # deletes files compaction made obsolete
        self._snapshot_job: asyncio.Task[Snapshot | None] | None = None  # writes a snapshot file
        self.address = config.address  # the bound endpoint once started (a ":0" port resolved)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open storage (restoring state), bind the transport and start ticking.

        A peer is started once; to restart one (after ``stop()`` or a crash), build a new
        ``RaftPeer`` over the same directory, as a restarted process would.
        """
        if self._started_once:
            raise RuntimeError("a RaftPeer is started once; create a new one to restart")
        self._started_once = True
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        storage = Storage(cfg.data_dir, segment_bytes=cfg.segment_bytes, fsync=cfg.fsync, logger=self._log)
        transport: Transport | None = None
        try:
            restored = storage.restored()
            snapshot = storage.load_snapshot()
            if snapshot is not None:
                await self._restore_app(snapshot)
            for e in restored.entries:
                if e.type == EntryType.CONF_CHANGE:
                    self._learn_address(e)
            # A brand-new member given voters gets a bootstrap snapshot (index 1) in its first Ready.
            self._node = RaftNode(
                self.node_id,
                restored=restored,
                rand=random.Random(cfg.seed),
                config=cfg.raft,
                bootstrap_voters=tuple(cfg.bootstrap_voters),
            )
            if snapshot is not None:
                self._node.compact(snapshot)  # hands the core the data so it can ship it to followers
            transport = open_transport(
                cfg.transport_kind,
                self.node_id,
                cfg.address,
                self._on_messages,
                options=cfg.transport,
                logger=self._log,
                tls=cfg.tls,
                check_snapshot=self._check_snapshot,
                listener=cfg.listener,
            )
            self.address = await transport.start()
        except BaseException:
            if transport is not None:
                transport.close()
            storage.close()
            raise
        self._storage, self._transport = storage, transport
        self._addresses[self.node_id] = self.address
        for pid, addr in self._addresses.items():
            transport.set_peer(pid, addr)
        self._running, self._stopping = True, False
        loop = self._loop
        self._tasks = [
            loop.create_task(self._ready_loop(), name=f"raft-ready-{self.node_id}"),
            loop.create_task(self._tick_loop(), name=f"raft-tick-{self.node_id}"),
        ]
        self._wake.set()
        self._log.info(
            "raft.started",
            address=self.address,
            term=restored.hard_state.term,
            commit=restored.hard_state.commit,
            snapshot_index=restored.snapshot_meta.index,
            entries=len(restored.entries),
            fsync=storage.fsync,
            tls=cfg.tls is not None,
        )

    async def stop(self) -> None:
        """Stop at a Ready boundary, close sockets and files; pending waiters get ``NotRunning``.

        Sockets and files are closed even if this coroutine is cancelled half way.
        """
        if not self._running and not self._tasks:
            return
        self._running = False
        self._stopping = True
        self._wake.set()
        if self._commit_notice is not None:
            self._commit_notice.cancel()
            self._commit_notice = None
        try:
            ready_task, *others = self._tasks
            for t in others:
                t.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready_task, timeout=2.0)  # cancels it if stuck in on_apply
            # Threads cannot be cancelled: let a snapshot write or file removal finish.
            jobs = [j for j in (self._snapshot_job, self._janitor) if j is not None]
            await asyncio.gather(*others, *jobs, return_exceptions=True)
        finally:
            self._tasks = []
            self._snapshot_job = self._janitor = None
            if self._transport is not None:
                self._transport.close()
                self._transport = None
            if self._storage is not None:
                self._storage.close()
                self._storage = None
            self._fail_all(NotRunning("raft peer stopped"))
            self._leader_event.set()  # wake wait_for_leader / transfer_leadership: they raise NotRunning
            self._log.info("raft.stopped")

    async def __aenter__(self) -> RaftPeer:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ public API

    async def propose(self, data: bytes, *, timeout: float = 5.0) -> int:
        """Replicate ``data``; returns its log index once it is committed and applied here."""
        node = self._require_running()
        self._release_notice_hold()  # its append carries the commit; its own commit is told at once
        pid, fut = self._new_waiter()
        node.propose(data, pid)
        return await self._await_waiter(pid, fut, timeout)

    def hold_commit_notices(self, seconds: float) -> None:
        """Send no commit notice for ``seconds`` or until this peer's next proposal, whichever is
        first: that proposal's append carries the commit, and so does a heartbeat (every tick).
        For a leader that knows it proposes again soon (an executor running a short cell), so
        its followers are not told twice: each notice is a TLS record to every follower."""
        loop = self._loop
        if loop is None or seconds <= 0 or self._node is None or self._node.role != Role.LEADER:
            return
        self._notice_hold_until = loop.time() + seconds
        if self._commit_notice is not None:
            self._commit_notice.cancel()
            self._commit_notice = None
        if self._node.commit_notice_owed():
            self._commit_notice = loop.call_at(self._notice_hold_until, self._send_commit_notices)

    def _release_notice_hold(self) -> None:
        held = self._loop is not None and self._loop.time() < self._notice_hold_until
        self._notice_hold_until = 0.0
        if held and self._commit_notice is not None:  # armed for the hold's end: the Ready loop re-arms it
            self._commit_notice.cancel()
            self._commit_notice = None

    async def add_learner(self, node_id: str, address: str, *, timeout: float = 5.0) -> int:
        """Add a non-voting member reachable at ``address``; returns the conf change's index."""
        return await self._change(ConfChange(ConfChangeType.ADD_LEARNER, node_id, address.encode()), timeout)

    async def promote(self, node_id: str, *, timeout: float = 5.0) -> int:
        """Make a learner a voter (do it once the learner has caught up)."""
        return await self._change(ConfChange(ConfChangeType.PROMOTE, node_id), timeout)

    async def remove(self, node_id: str, *, timeout: float = 5.0) -> int:
        """Remove a member (voter or learner). Removing this peer leaves it running but inert."""
        return await self._change(ConfChange(ConfChangeType.REMOVE, node_id), timeout)

    async def transfer_leadership(self, to: str, *, timeout: float = 5.0) -> None:
        """As leader, hand over to voter ``to``; returns once this peer sees ``to`` lead.

        Raises ``NotLeader`` on a non-leader and ``RaftTimeout`` if the transfer does not finish
        (the core abandons it after one election timeout; proposals are dropped meanwhile).
        """
        node = self._require_running()
        if node.role != Role.LEADER:
            raise NotLeader(node.leader)
        if to == self.node_id:
            return
        node.transfer_leadership(to)
        self._wake.set()
        deadline = time.monotonic() + timeout
        while self._leader != to:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RaftTimeout(
                    f"leadership did not move to {to!r} within {timeout}s (leader: {self._leader})"
                )
            self._leader_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._leader_event.wait(), min(remaining, 0.05))
            self._require_running()

    async def wait_for_leader(self, timeout: float = 5.0) -> str:
        """The current leader's id, waiting up to ``timeout`` for one to be known."""
        deadline = time.monotonic() + timeout
        while True:
            self._require_running()
            if self._leader is not None:
                return self._leader
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RaftTimeout(f"no leader known within {timeout}s")
            self._leader_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._leader_event.wait(), remaining)

    def status(self) -> PeerStatus:
        address = self.address
        if self._node is None:
            return PeerStatus(
                self.node_id, address, 0, Role.FOLLOWER, None, 0, self._applied, 0, (), (), {}, False
            )
        st = self._node.status()
        members = {m: self._addresses.get(m) for m in st.conf.members}
        return PeerStatus(
            self.node_id,
            address,
            st.term,
            st.role,
            st.leader,
            st.commit,
            self._applied,
            st.last_index,
            st.conf.voters,
            st.conf.learners,
            members,
            self._running,
        )

    @property
    def transport_stats(self) -> TransportStats | None:
        return None if self._transport is None else self._transport.stats

    # ------------------------------------------------------------------ waiters

    def _require_running(self) -> RaftNode:
        if not self._running or self._node is None:
            raise NotRunning(f"raft peer {self.node_id} is not running")
        return self._node

    def _new_waiter(self) -> tuple[str, asyncio.Future[int]]:
        self._pid_seq += 1
        pid = f"{self._pid_prefix}{self._pid_seq}"
        assert self._loop is not None
        fut: asyncio.Future[int] = self._loop.create_future()
        self._waiters[pid] = fut
        return pid, fut

    async def _await_waiter(self, pid: str, fut: asyncio.Future[int], timeout: float) -> int:
        self._wake.set()
        assert self._loop is not None
        timer = self._loop.call_later(timeout, self._expire, pid, timeout)
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiters.pop(pid, None)

    def _expire(self, pid: str, timeout: float) -> None:
        fut = self._waiters.pop(pid, None)
        if fut is not None and not fut.done():
            fut.set_exception(ProposalTimeout(f"not applied within {timeout}s; it may still commit"))

    def _fail_all(self, exc: RaftError) -> None:
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _change(self, change: ConfChange, timeout: float) -> int:
        node = self._require_running()
        pid, fut = self._new_waiter()
        node.propose_conf_change(change, pid)
        return await self._await_waiter(pid, fut, timeout)

    # ------------------------------------------------------------------ inputs

    def _on_messages(self, msgs: list[Message]) -> None:
        node = self._node
        if node is None or not self._running:
            return
        for m in msgs:
            try:
                node.step(m)
            except Exception:
                # A message the core cannot handle is a bug or an attack; it must not kill the node.
                self._log.exception("raft.step_failed", type=m.type.name, frm=m.frm, term=m.term)
        self._wake.set()

    async def _tick_loop(self) -> None:
        interval = self.config.tick_interval
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += interval
            delay = due - loop.time()
            if delay < -interval:  # fell behind (loop was busy): do not burst-fire the missed ticks
                due = loop.time()
                delay = 0.0
            await asyncio.sleep(max(delay, 0.0))
            if self._node is not None and self._running:
                self._node.tick()
                self._wake.set()

    # ------------------------------------------------------------------ the Ready loop

    async def _ready_loop(self) -> None:
        wake = self._wake
        try:
            while not self._stopping:
                await wake.wait()
                wake.clear()
                node = self._node
                assert node is not None
                while node.has_ready() and not self._stopping:
                    await self._handle_ready(node, node.ready())
                if (
                    self._commit_notice is None
                    and not self.config.raft.eager_commit
                    and node.commit_notice_owed()
                ):
                    loop = asyncio.get_running_loop()
                    self._commit_notice = loop.call_at(
                        max(loop.time() + self.config.commit_notice_delay, self._notice_hold_until),
                        self._send_commit_notices,
                    )
                self._observe_leader(node)
                await self._maybe_snapshot(node)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Storage or application failure: continuing could diverge from the group. Fail-stop.
            self._log.exception("raft.fatal")
            self._running = False
            self._fail_all(NotRunning(f"raft peer {self.node_id} failed: {exc!r}"))
            self._leader_event.set()
            try:
                self._on_fatal(exc)
            except Exception:
                self._log.exception("raft.on_fatal_failed")

    def _send_commit_notices(self) -> None:
        self._commit_notice = None
        node = self._node
        if node is not None and self._running:
            node.send_commit_notices()
            self._wake.set()

    async def _handle_ready(self, node: RaftNode, rd: Ready) -> None:
        storage, transport = self._storage, self._transport
        assert storage is not None and transport is not None
        if rd.entries:
            for e in rd.entries:
                if e.type == EntryType.CONF_CHANGE:
                    self._learn_address(e)  # so the leader can reach a member it is adding
        # A leader may send before its own write completes (Raft thesis 10.2.1, as etcd does): the
        # core counts the leader's own entries towards commit only after advance(), i.e. once they
        # are durable, and a leader's messages promise nothing else that is not already on disk --
        # provided term and vote are unchanged and no snapshot is pending.
        early = bool(
            rd.messages
            and node.role == Role.LEADER
            and rd.snapshot is None
            and (rd.hard_state is None or _same_term_vote(rd.hard_state, storage.hard_state))
        )
        if early:
            transport.send_all(rd.messages)
        # 1. persist: snapshot, entries (truncating a conflicting suffix), hard state; one fsync.
        if rd.snapshot is not None:
            if len(rd.snapshot.data) > _BIG_SNAPSHOT:  # only this task touches storage meanwhile
                await asyncio.to_thread(storage.install_snapshot, rd.snapshot)
            else:
                storage.install_snapshot(rd.snapshot)
        if storage.append(rd.entries, rd.hard_state):
            if self.config.sync_in_thread:
                await asyncio.get_running_loop().run_in_executor(None, storage.sync)
            else:
                storage.sync()
        # 2. send.
        if rd.messages and not early:
            transport.send_all(rd.messages)
        # 3. apply.
        if rd.snapshot is not None:
            await self._restore_app(rd.snapshot)
        for e in rd.committed_entries:
            await self._apply(e)
        # 4. dropped proposals.
        for d in rd.dropped_proposals:
            self._drop(d)
        # 5.
        node.advance(rd)

    async def _apply(self, e: Entry) -> None:
        if e.index <= self._applied:
            return  # already reflected in a restored snapshot
        if e.type == EntryType.CONF_CHANGE:
            self._apply_conf_change(e)
        elif e.data or e.proposal_id:
            result = self._on_apply(e)
            if result is not None and inspect.isawaitable(result):
                await result
        self._applied = e.index
        if e.proposal_id:
            fut = self._waiters.pop(e.proposal_id, None)
            if fut is not None and not fut.done():
                fut.set_result(e.index)

    def _drop(self, d: DroppedProposal) -> None:
        fut = self._waiters.pop(d.proposal_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(ProposalDropped(d.reason))

    def _apply_conf_change(self, e: Entry) -> None:
        try:
            cc = decode_conf_change(e.data)
        except ValueError:
            self._log.error("raft.bad_conf_change_entry", index=e.index)
            return
        self._conf = apply_conf_change(self._conf, cc)
        if cc.type == ConfChangeType.ADD_LEARNER:
            self._learn_address(e)
        elif cc.type == ConfChangeType.REMOVE and cc.node_id != self.node_id:
            self._addresses.pop(cc.node_id, None)
            if self._transport is not None:
                self._transport.remove_peer(cc.node_id)
        self._log.info(
            "raft.conf_changed",
            change=cc.type.name,
            member=cc.node_id,
            index=e.index,
            voters=self._conf.voters,
            learners=self._conf.learners,
        )
        self._on_conf_change(cc, self._conf)

    def _learn_address(self, e: Entry) -> None:
        try:
            cc = decode_conf_change(e.data)
        except ValueError:
            return
        if cc.type == ConfChangeType.ADD_LEARNER and cc.context:
            address = cc.context.decode("utf-8", "replace")
            self._addresses[cc.node_id] = address
            if self._transport is not None and cc.node_id != self.node_id:
                self._transport.set_peer(cc.node_id, address)

    def _observe_leader(self, node: RaftNode) -> None:
        leader = node.leader
        if leader != self._leader:
            self._log.info("raft.leader_changed", leader=leader, previous=self._leader)
            self._leader = leader
            self._leader_event.set()

    # ------------------------------------------------------------------ snapshots

    def _check_snapshot(self, data: bytes) -> None:
        """Whether a peer's snapshot could be restored (the transport drops it if not)."""
        _addresses, app = _unwrap(data)
        if self._check_app_snapshot is not None and app:
            self._check_app_snapshot(app)

    async def _restore_app(self, snapshot: Snapshot) -> None:
        """Load a snapshot (own on restart, or the leader's) into the application and address book."""
        addresses, app = _unwrap(snapshot.data)
        for pid, addr in addresses.items():
            if pid != self.node_id:
                self._addresses[pid] = addr
                if self._transport is not None:
                    self._transport.set_peer(pid, addr)
        result = self._restore_snapshot(app)
        if result is not None and inspect.isawaitable(result):
            await result
        meta = snapshot.meta
        self._conf = meta.conf
        self._on_conf_change(None, meta.conf)
        self._applied = meta.index
        self._snapshot_index = max(self._snapshot_index, meta.index)
        self._log.info("raft.snapshot_restored", index=meta.index, term=meta.term, bytes=len(app))

    async def _maybe_snapshot(self, node: RaftNode) -> None:
        """Every ``snapshot_every`` applied entries: snapshot the application, then compact the log.

        The application state is captured here, between Readies, so it matches the applied index
        exactly; the file is written in a worker thread while commits go on; once it is durable the
        next pass hands it to the core and compacts the log (a few ms: one small segment rewrite),
        and obsolete files are unlinked off the loop. A failing ``take_snapshot`` or file write only
        postpones compaction (logged; retried after another ``snapshot_every`` entries).
        """
        storage = self._storage
        assert storage is not None
        job = self._snapshot_job
        if job is not None and job.done():
            self._snapshot_job = None
            snap = job.result()
            if snap is not None:
                node.compact(snap)
                obsolete = storage.compact(snap.meta, unlink=False)
                if obsolete:
                    self._collect(obsolete)
                self._log.info("raft.log_compacted", index=snap.meta.index, bytes=len(snap.data))
        every = self.config.snapshot_every
        if self._snapshot_job is not None or every <= 0 or self._stopping:
            return
        index = self._applied
        if index - self._snapshot_index < every:
            return
        self._snapshot_index = index  # also when it fails: retry after another `every` entries
        try:
            app = self._take_snapshot()
            if not isinstance(app, bytes):
                app = await app
            meta = node.snapshot_meta(index)
        except Exception:
            self._log.exception("raft.snapshot_failed", index=index)
            return
        members = set(meta.conf.members)
        snap = Snapshot(meta, _wrap({m: a for m, a in self._addresses.items() if m in members}, app))
        self._snapshot_job = asyncio.get_running_loop().create_task(
            self._write_snapshot(storage, snap), name=f"raft-snapshot-{self.node_id}"
        )

    async def _write_snapshot(self, storage: Storage, snap: Snapshot) -> Snapshot | None:
        started = time.perf_counter()
        try:
            await asyncio.to_thread(storage.write_snapshot_file, snap)
        except Exception:
            self._log.exception("raft.snapshot_failed", index=snap.meta.index)
            return None
        finally:
            self._wake.set()  # the Ready loop compacts on its next pass
        self._log.info(
            "raft.snapshot_written",
            index=snap.meta.index,
            bytes=len(snap.data),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        return snap

    def _collect(self, obsolete: list[Path]) -> None:
        """Unlink files compaction made obsolete in a worker thread (a big segment takes ms)."""
        previous = self._janitor

        async def remove() -> None:
            if previous is not None:
                await previous
            await asyncio.to_thread(remove_files, obsolete)

        self._janitor = asyncio.get_running_loop().create_task(remove(), name=f"raft-gc-{self.node_id}")


def _same_term_vote(a: HardState, b: HardState) -> bool:
    return a.term == b.term and a.vote == b.vote


def _wrap(addresses: Mapping[str, str], app: bytes) -> bytes:
    """The snapshot a peer stores and ships: the address book travels with the application state."""
    return msgpack.packb([SNAPSHOT_ENVELOPE_VERSION, dict(addresses), app], use_bin_type=True)


def _unwrap(data: bytes) -> tuple[dict[str, str], bytes]:
    if not data:
        return {}, b""
    try:
        version, addresses, app = msgpack.unpackb(data, raw=False)
        if version != SNAPSHOT_ENVELOPE_VERSION or type(app) is not bytes:
            raise ValueError(f"unsupported snapshot envelope version {version!r}")
        if type(addresses) is not dict or not all(
            type(k) is str and type(v) is str for k, v in addresses.items()
        ):
            raise ValueError("the address book must map member ids to addresses")
        return dict(addresses), app
    except Exception as exc:
        raise ValueError(f"malformed snapshot envelope: {exc}") from exc
