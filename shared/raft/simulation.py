"""Deterministic fault-injection simulation of a Raft group, checking safety at every step.

One seed fixes everything: the scenario's knobs, every fault, every message delay and each node's
election-timer randomness, so a failing seed replays exactly (``scripts/raft_torture.py --seeds 1
--start SEED``). It drives real ``RaftNode``s the way the asyncio driver does (persist the Ready,
send, apply, advance) over a network that drops, duplicates, delays and reorders messages, splits
into symmetric or one-way partitions, and crashes and restarts members, which keep only what they
persisted. Clients propose through random members; membership changes (add learner, promote,
remove), leadership transfers and compactions happen during the run.

Checked at every step: Election Safety (one leader per term), Log Matching (per (index, term) a
single entry and predecessor, on every disk), Leader Completeness (a new leader holds every entry
known committed; and whenever the commit index advances, no member lacking the newest committed
entry could win an election in any future, which catches an unsafe commit such as Figure 8's the
moment it happens rather than only if a bad leader later arises), State Machine Safety (every
apply at an index is the same entry, every state the same digest, applies in order),
durable-state sanity (term and commit never go back, one vote per term) and that a proposal
reported dropped never commits. After the faults stop (all partitions healed, crashed members
restarted, no loss): liveness — a leader within a bounded number of ticks and every proposal
committed (clients retry dropped ones) and applied on every member.

This is a test harness (it is imported by the suite and the torture script), not product code.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.raft.core import LEADERSHIP_LOST, RaftNode
from shared.raft.log import RaftLog
from shared.raft.membership import apply_conf_change
from shared.raft.types import (
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    RaftConfig,
    Ready,
    RestoredState,
    Role,
    Snapshot,
    SnapshotMeta,
    decode_conf_change,
)

_LEADER = Role.LEADER
DEFAULT_CHAOS_TICKS = 200
_PROPOSE = MessageType.PROPOSE


class SafetyViolation(AssertionError):
    """A Raft invariant did not hold; the message says which, where and when."""


# ====================================================================== durable state


class MemoryDisk:
    """A member's storage: exactly what it persisted from Readies (and its own snapshots)."""

    __slots__ = ("entries", "hard_state", "snapshot")

    def __init__(self) -> None:
        self.hard_state = HardState()
        self.snapshot = Snapshot(SnapshotMeta())
        self.entries: list[Entry] = []

    def last_index(self) -> int:
        return self.snapshot.meta.index + len(self.entries)

    def term(self, index: int) -> int | None:
        base = self.snapshot.meta.index
        if index == base:
            return self.snapshot.meta.term
        if base < index <= base + len(self.entries):
            return self.entries[index - base - 1].term
        return None

    def persist(self, rd: Ready) -> None:
        """Step 1 of the Ready contract: snapshot, then entries (overwriting a suffix), then hard state."""
        if rd.snapshot is not None:
            meta = rd.snapshot.meta
            if self.term(meta.index) == meta.term:
                self.entries = self.entries[meta.index - self.snapshot.meta.index :]
            else:
                self.entries = []
            self.snapshot = rd.snapshot
        if rd.entries:
            first = rd.entries[0].index
            base = self.snapshot.meta.index
            if first <= base or first > self.last_index() + 1:
                raise SafetyViolation(
                    f"Ready entries start at {first}, disk holds {base + 1}..{self.last_index()}"
                )
            del self.entries[first - base - 1 :]
            self.entries.extend(rd.entries)
        if rd.hard_state is not None:
            self.hard_state = rd.hard_state

    def save_snapshot(self, snapshot: Snapshot) -> None:
        """The application's own snapshot, then log compaction (what the driver does)."""
        meta = snapshot.meta
        del self.entries[: meta.index - self.snapshot.meta.index]
        self.snapshot = snapshot

    def restored(self) -> RestoredState:
        return RestoredState(self.hard_state, self.snapshot.meta, tuple(self.entries))


class ChainApp:
    """A state machine whose whole state is a hash chain over the applied entries."""

    __slots__ = ("applied", "digest")

    def __init__(self) -> None:
        self.applied = 0
        self.digest = 0

    def apply(self, e: Entry) -> None:
        self.applied = e.index
        self.digest = hash((self.digest, e.index, e.term, int(e.type), e.data, e.proposal_id))

    def snapshot_data(self) -> bytes:
        return f"{self.applied}:{self.digest}".encode()

    def restore(self, snapshot: Snapshot) -> None:
        if snapshot.data:
            index, digest = snapshot.data.decode().split(":")
            self.applied, self.digest = int(index), int(digest)
        else:  # the bootstrap snapshot: empty state
            self.applied, self.digest = snapshot.meta.index, 0


# ====================================================================== scenario


@dataclass(frozen=True, slots=True)
class Scenario:
    """The knobs of one run; ``Scenario.for_seed`` draws them so seeds explore different regimes."""

    initial_voters: int = 3
    max_added: int = 4  # members added over a run, so membership changes stay bounded
    chaos_ticks: int = DEFAULT_CHAOS_TICKS
    # Liveness bounds after healing. Election rounds take up to 2E ticks and, in a two-voter
    # group, two timers reset together collide with probability 1/E: 150 ticks is ~8 rounds.
    leader_ticks: int = 150  # a leader within this many ticks
    heal_ticks: int = 250  # every proposal committed and applied everywhere within this...
    # ...plus one tick per ``retries_per_tick`` proposals the clients still have open at healing.
    substeps: int = 3  # message-delivery rounds per tick
    max_delay: int = 3  # in substeps
    drop_rate: float = 0.05
    dup_rate: float = 0.02
    crash_rate: float = 0.01  # per live node per tick
    leader_crash_rate: float = 0.02  # per tick: crash whoever leads (drives Figure-8 histories)
    crash_in_ready_rate: float = 0.002  # per Ready: crash before/while handling it
    restart_rate: float = 0.15  # per crashed node per tick
    partition_rate: float = 0.03  # per tick: a new partition (or heal)
    propose_rate: float = 0.5  # per tick
    conf_change_rate: float = 0.04
    transfer_rate: float = 0.02
    compact_rate: float = 0.05  # per live node per tick
    stop_removed: bool = False  # shut a member down once its removal committed (as an orchestrator would)
    retry_ticks: int = 12  # clients retry a proposal this long after it was reported dropped...
    unknown_ticks: int = 60  # ...or when its outcome is still unknown after this long...
    retries_per_tick: int = 16  # ...at most this many per tick (they back off, they do not flood)
    raft: RaftConfig = field(
        default_factory=lambda: RaftConfig(
            election_ticks=10,
            heartbeat_ticks=1,
            max_entries_per_append=4,
            max_bytes_per_append=256,
            max_inflight_appends=4,
            max_uncommitted_entries=64,
        )
    )

    @staticmethod
    def for_seed(seed: int, *, chaos_ticks: int = DEFAULT_CHAOS_TICKS) -> Scenario:
        r = random.Random(f"scenario-{seed}")
        pre_vote = r.random() < 0.8
        raft = RaftConfig(
            election_ticks=10,
            heartbeat_ticks=r.choice((1, 1, 3)),
            pre_vote=pre_vote,
            check_quorum=r.random() < 0.8,
            # (entries per append, appends in flight): small batches and windows, but at least
            # 16 entries per round trip so a healed cluster can drain its backlog in the bound.
            **dict(
                zip(
                    ("max_entries_per_append", "max_inflight_appends"),
                    r.choice(((1, 16), (1, 64), (2, 8), (4, 4), (4, 64), (16, 1), (64, 1), (64, 64))),
                    strict=True,
                )
            ),
            max_bytes_per_append=r.choice((1024, 4 * 1024 * 1024)),
            max_uncommitted_entries=r.choice((16, 64, 256)),
            eager_commit=r.random() < 0.5,
            # its own stream: the scenarios drawn before this option existed stay the same
            quiet_heartbeats=random.Random(f"quiet-{seed}").random() < 0.5,
        )
        return Scenario(
            raft=raft,
            # Without PreVote a removed member that missed its removal disrupts elections forever
            # (the reason PreVote exists), so those runs shut removed members down.
            stop_removed=not pre_vote or r.random() < 0.5,
            leader_crash_rate=r.choice((0.0, 0.02, 0.05, 0.15)),
            restart_rate=r.choice((0.15, 0.5)),
            initial_voters=r.choice((1, 3, 3, 3, 3, 5)),
            chaos_ticks=chaos_ticks,
            max_delay=r.choice((1, 2, 3, 6)),
            drop_rate=r.choice((0.0, 0.02, 0.1, 0.25)),
            dup_rate=r.choice((0.0, 0.05)),
            crash_rate=r.choice((0.0, 0.01, 0.03)),
            crash_in_ready_rate=r.choice((0.0, 0.003, 0.02)),
            partition_rate=r.choice((0.0, 0.03, 0.08)),
            propose_rate=r.choice((0.3, 0.8, 2.0)),
            conf_change_rate=r.choice((0.0, 0.05, 0.12)),
            transfer_rate=r.choice((0.0, 0.03)),
            compact_rate=r.choice((0.02, 0.1)),
        )


@dataclass(slots=True)
class SimResult:
    seed: int
    violations: list[str]
    ticks: int = 0
    heal_ticks: int = 0  # ticks after healing until liveness held (-1: it did not)
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


# ====================================================================== nodes and checker


class _LogView:
    """What an election would see of one node: its log's tail, its configurations."""

    __slots__ = ("conf", "conf_at_commit", "last_index", "last_term", "log_term")

    def __init__(
        self,
        last_index: int,
        last_term: int,
        conf: ConfState,
        conf_at_commit: ConfState,
        log_term: Callable[[int], int | bool | None],
    ) -> None:
        self.last_index = last_index
        self.last_term = last_term
        self.conf = conf
        self.conf_at_commit = conf_at_commit
        self.log_term = log_term  # index -> term (None if not held); below the snapshot: held

    def holds(self, index: int, term: int) -> bool:
        held = self.log_term(index)
        return held is True or held == term

    def may_campaign(self, node_id: str) -> bool:
        return node_id in self.conf.voters or node_id in self.conf_at_commit.voters

    def at_least_as_up_to_date(self, other: _LogView) -> bool:
        return self.last_term > other.last_term or (
            self.last_term == other.last_term and self.last_index >= other.last_index
        )


def _log_view(node: SimNode) -> _LogView:
    raft = node.raft
    if raft is not None:
        log = raft.log

        def log_term(index: int, log: RaftLog = log) -> int | bool | None:
            return True if index <= log.snapshot_index else log.term(index)

        return _LogView(
            log.last_index(), log.last_term(), raft.conf, raft.conf_state_at(log.committed), log_term
        )
    disk = node.disk
    meta = disk.snapshot.meta
    conf = meta.conf
    at_commit = conf
    for e in disk.entries:
        if e.type == EntryType.CONF_CHANGE:
            conf = apply_conf_change(conf, decode_conf_change(e.data))
            if e.index <= disk.hard_state.commit:
                at_commit = conf

    def disk_term(index: int, disk: MemoryDisk = disk) -> int | bool | None:
        return True if index <= disk.snapshot.meta.index else disk.term(index)

    last_term = disk.entries[-1].term if disk.entries else meta.term
    return _LogView(disk.last_index(), last_term, conf, at_commit, disk_term)


class SimNode:
    __slots__ = ("app", "disk", "id", "original", "raft", "restarts")

    def __init__(self, node_id: str, *, original: bool) -> None:
        self.id = node_id
        self.original = original  # started with the bootstrap voters
        self.disk = MemoryDisk()
        self.app = ChainApp()
        self.raft: RaftNode | None = None
        self.restarts = 0


class Checker:
    """The global invariants, fed by every persist, apply, step and election."""

    def __init__(self) -> None:
        self.leaders: dict[int, str] = {}
        self.committed: dict[int, Entry] = {}  # index -> the entry every replica must apply there
        self.digests: dict[int, int] = {}  # index -> state digest after applying it
        self.max_committed = 0
        self.log_registry: dict[tuple[int, int], tuple[int, bytes, str, int | None]] = {}
        self.committed_pids: set[str] = set()
        self.dropped_pids: dict[str, str] = {}
        self.commit_advanced = False
        self.now = 0

    def fail(self, what: str) -> None:
        raise SafetyViolation(f"tick {self.now}: {what}")

    def on_leader(self, node: SimNode, raft: RaftNode) -> None:
        term = raft.term
        holder = self.leaders.get(term)
        if holder == node.id:
            return
        if holder is not None:
            self.fail(f"election safety: {holder} and {node.id} both lead term {term}")
        self.leaders[term] = node.id
        # Leader completeness: every entry known committed is in the new leader's log.
        log = raft.log
        if log.last_index() < self.max_committed:
            self.fail(
                f"leader completeness: {node.id} leads term {term} with last index "
                f"{log.last_index()} < committed {self.max_committed}"
            )
        for index in range(log.snapshot_index + 1, self.max_committed + 1):
            entry = self.committed.get(index)
            if entry is not None and log.term(index) != entry.term:
                self.fail(
                    f"leader completeness: {node.id} (term {term}) has term {log.term(index)} at "
                    f"{index}, committed term {entry.term}"
                )

    def on_persist(self, node: SimNode, rd: Ready, before: HardState) -> None:
        disk = node.disk
        hs = rd.hard_state
        if hs is not None:
            if hs.term < before.term:
                self.fail(f"{node.id} persisted term {hs.term} after {before.term}")
            if hs.term == before.term and before.vote is not None and hs.vote != before.vote:
                self.fail(f"{node.id} changed its vote in term {hs.term}: {before.vote} -> {hs.vote}")
            if hs.commit < before.commit:
                self.fail(f"{node.id} persisted commit {hs.commit} after {before.commit}")
            if hs.commit > disk.last_index():
                self.fail(f"{node.id} persisted commit {hs.commit} beyond its log {disk.last_index()}")
        registry = self.log_registry
        for e in rd.entries:
            # Log Matching by induction: one entry and one predecessor term per (index, term).
            key = (e.index, e.term)
            seen = (int(e.type), e.data, e.proposal_id, disk.term(e.index - 1))
            known = registry.get(key)
            if known is None:
                registry[key] = seen
            elif known != seen:
                self.fail(f"log matching: {node.id} holds {seen} at {key}, another log {known}")

    def on_restore(self, node: SimNode, snapshot: Snapshot) -> None:
        meta = snapshot.meta
        expected = self.digests.get(meta.index)
        if meta.index > 1 and expected is None:
            self.fail(f"{node.id} restored a snapshot at {meta.index} that nobody applied")
        if expected is not None and node.app.digest != expected:
            self.fail(f"state machine safety: {node.id}'s snapshot at {meta.index} differs")

    def on_commit_advanced(self, nodes: dict[str, SimNode], retired: set[str]) -> None:
        """Nobody lacking the newest committed entry may be electable (the heart of Raft safety).

        A node X lacking it could win an election if X may campaign and X's log is at least as
        up to date as the logs of a majority of its latest configuration's voters (each would
        grant its vote in some future term). Correct Raft rules that out in every future; a
        commit made by counting an old-term entry (Figure 8) breaks it at once. Logs are the
        in-memory ones of live nodes and the disks of crashed ones.
        """
        index = self.max_committed
        entry = self.committed[index]
        views = {node_id: _log_view(node) for node_id, node in nodes.items() if node_id not in retired}
        for node_id, view in views.items():
            if view.holds(index, entry.term) or not view.may_campaign(node_id):
                continue
            voters = view.conf.voters
            supporters = sum(
                1
                for voter in voters
                # A retired member never votes again; every other one might, in some future term.
                if voter == node_id
                or ((v := views.get(voter)) is not None and view.at_least_as_up_to_date(v))
            )
            if supporters >= len(voters) // 2 + 1:
                self.fail(
                    f"leader completeness at risk: {node_id} lacks committed entry {index} (term "
                    f"{entry.term}) yet is as up to date as a majority of {voters}"
                )

    def on_apply(self, node: SimNode, e: Entry) -> None:
        app = node.app
        if e.index != app.applied + 1:
            self.fail(f"{node.id} applied {e.index} after {app.applied}: out of order")
        app.apply(e)
        known = self.committed.get(e.index)
        if known is None:
            self.committed[e.index] = e
            self.digests[e.index] = app.digest
            if e.index > self.max_committed:
                self.max_committed = e.index
                self.commit_advanced = True
            if e.proposal_id:
                if e.proposal_id in self.dropped_pids:
                    self.fail(f"proposal {e.proposal_id} committed after being reported dropped")
                self.committed_pids.add(e.proposal_id)
        elif known != e:
            self.fail(f"state machine safety: {node.id} applied {e} at {e.index}, others {known}")
        elif self.digests[e.index] != app.digest:
            self.fail(f"state machine safety: {node.id}'s state after {e.index} differs")

    def on_dropped(self, proposal_id: str, reason: str) -> None:
        if proposal_id in self.committed_pids:
            self.fail(f"proposal {proposal_id} reported dropped ({reason}) but it committed")
        self.dropped_pids[proposal_id] = reason


# ====================================================================== the simulation


class Simulation:
    """One seeded run; ``run()`` returns a ``SimResult`` (violations empty when all held)."""

    def __init__(self, seed: int, scenario: Scenario | None = None) -> None:
        self.seed = seed
        self.scenario = scenario if scenario is not None else Scenario.for_seed(seed)
        self.rng = random.Random(seed)
        self.check = Checker()
        self.nodes: dict[str, SimNode] = {}
        self.bootstrap = tuple(f"n{i}" for i in range(1, self.scenario.initial_voters + 1))
        self.next_id = len(self.bootstrap) + 1
        self.network: list[tuple[int, int, Message]] = []
        self.seq = 0
        self.now = 0  # substeps
        self.blocked: set[tuple[str, str]] = set()
        self.stopped: set[str] = set()  # retired for good after their removal
        self.lossy = True
        # Client: a logical proposal is retried under a fresh pid until one attempt commits.
        self.logical_seq = 0
        self.open: dict[str, str] = {}  # logical -> its latest attempt's pid
        self.retry_due: list[tuple[int, int, str, str]] = []  # heap of (tick, seq, logical, pid)
        self.pid_owner: dict[str, str] = {}
        self.stats = {
            "elections": 0,
            "messages": 0,
            "crashes": 0,
            "snapshots_installed": 0,
            "compactions": 0,
            "conf_changes": 0,
            "transfers": 0,
            "proposals": 0,
            "dropped": 0,
            "dropped_leadership_lost": 0,
        }
        for node_id in self.bootstrap:
            self.nodes[node_id] = SimNode(node_id, original=True)
            self._start(self.nodes[node_id])

    # ------------------------------------------------------------------ run

    def run(self) -> SimResult:
        sc = self.scenario
        tick = 0
        heal_ticks = leader_after_heal = -1
        deadline = sc.chaos_ticks + sc.heal_ticks
        violations: list[str] = []
        try:
            while tick < deadline:
                self.check.now = tick
                healing = tick >= sc.chaos_ticks
                if tick == sc.chaos_ticks:
                    self._heal()
                    deadline += len(self.open) // sc.retries_per_tick
                if not healing:
                    self._inject_faults()
                self._client(tick, healing)
                for node in list(self.nodes.values()):
                    raft = node.raft
                    if raft is not None:
                        raft.tick()
                        if raft.role == _LEADER:
                            self._observe_leader(node, raft)
                            if raft.commit_notice_owed():  # the driver's commit notice (#21)
                                raft.send_commit_notices()
                        self._drain(node)
                for _ in range(sc.substeps):
                    self._deliver()
                if healing:
                    since_heal = tick - sc.chaos_ticks
                    if leader_after_heal < 0 and self._current_leader() is not None:
                        leader_after_heal = since_heal
                    if self._converged():
                        heal_ticks = since_heal
                        break
                    if since_heal == sc.leader_ticks and leader_after_heal < 0:
                        violations.append(
                            f"liveness: no leader {sc.leader_ticks} ticks after healing ({self._describe()})"
                        )
                        break
                tick += 1
            else:
                violations.append(
                    f"liveness: not converged {deadline - sc.chaos_ticks} ticks after healing "
                    f"({self._describe()})"
                )
        except SafetyViolation as exc:
            violations.append(str(exc))
        self.stats["leader_after_heal_ticks"] = leader_after_heal
        self.stats["leaders"] = len(self.check.leaders)
        self.stats["committed"] = self.check.max_committed
        return SimResult(self.seed, violations, tick, heal_ticks, self.stats)

    # ------------------------------------------------------------------ nodes

    def _start(self, node: SimNode) -> None:
        restored = node.disk.restored()
        node.app = ChainApp()
        node.app.restore(node.disk.snapshot)
        raft = RaftNode(
            node.id,
            restored=restored,
            rand=random.Random(self.rng.getrandbits(32)),
            config=self.scenario.raft,
            bootstrap_voters=self.bootstrap if node.original else (),
        )
        if node.disk.snapshot.meta.index > 0:
            raft.compact(node.disk.snapshot)  # give the core its snapshot's data back
        node.raft = raft
        self._drain(node)

    def _crash(self, node: SimNode) -> None:
        node.raft = None
        self.stats["crashes"] += 1

    def _restart(self, node: SimNode) -> None:
        node.restarts += 1
        self._start(node)

    def _drain(self, node: SimNode) -> None:
        """The driver's Ready loop, with crashes possible at every point of it."""
        check = self.check
        crash_rate = self.scenario.crash_in_ready_rate if self.lossy else 0.0
        rng = self.rng
        while True:
            raft = node.raft
            if raft is None or not raft.has_ready():
                return
            rd = raft.ready()
            if crash_rate and rng.random() < crash_rate:
                point = rng.randrange(3)
                if point == 0:  # before anything of this Ready reached the disk
                    self._crash(node)
                    return
                before = node.disk.hard_state
                node.disk.persist(rd)
                check.on_persist(node, rd, before)
                if point == 2:  # after sending, before applying and advancing
                    self._send_all(rd.messages)
                self._crash(node)
                return
            before = node.disk.hard_state
            node.disk.persist(rd)
            check.on_persist(node, rd, before)
            self._send_all(rd.messages)
            if rd.snapshot is not None:
                node.app.restore(rd.snapshot)
                check.on_restore(node, rd.snapshot)
                if rd.snapshot.meta.index > 1:  # not the bootstrap snapshot
                    self.stats["snapshots_installed"] += 1
            removed: list[str] = []
            for e in rd.committed_entries:
                check.on_apply(node, e)
                if e.proposal_id:
                    self._on_committed(e.proposal_id)
                if e.type == EntryType.CONF_CHANGE:
                    change = decode_conf_change(e.data)
                    if change.type == ConfChangeType.REMOVE:
                        removed.append(change.node_id)
            if check.commit_advanced:
                check.commit_advanced = False
                check.on_commit_advanced(self.nodes, self.stopped)
            for d in rd.dropped_proposals:
                check.on_dropped(d.proposal_id, d.reason)
                self._on_dropped(d.proposal_id)
                self.stats["dropped"] += 1
                if d.reason == LEADERSHIP_LOST:
                    self.stats["dropped_leadership_lost"] += 1
            raft.advance(rd)
            if raft.role == _LEADER:
                self._observe_leader(node, raft)
            for node_id in removed:
                self._on_removed(node_id)

    def _observe_leader(self, node: SimNode, raft: RaftNode) -> None:
        if self.check.leaders.get(raft.term) != node.id:
            self.stats["elections"] += 1
        self.check.on_leader(node, raft)

    # ------------------------------------------------------------------ network

    def _send_all(self, messages: list[Message]) -> None:
        if not messages:
            return
        rng = self.rng
        sc = self.scenario
        lossy = self.lossy
        max_delay = sc.max_delay if lossy else 1
        network = self.network
        self.stats["messages"] += len(messages)
        for m in messages:
            if lossy and sc.drop_rate and rng.random() < sc.drop_rate:
                continue
            # PROPOSE is never duplicated: "dropped" means "definitely not committed" only under
            # at-most-once delivery of proposals, which ZMQ over TCP provides (raft messages
            # proper must and do tolerate duplicates).
            copies = 2 if lossy and sc.dup_rate and m.type != _PROPOSE and rng.random() < sc.dup_rate else 1
            for _ in range(copies):
                self.seq += 1
                heapq.heappush(network, (self.now + rng.randint(1, max_delay), self.seq, m))

    def _deliver(self) -> None:
        self.now += 1
        network = self.network
        nodes = self.nodes
        blocked = self.blocked
        touched: dict[str, SimNode] = {}
        while network and network[0][0] <= self.now:
            m = heapq.heappop(network)[2]
            if blocked and (m.frm, m.to) in blocked:
                continue
            node = nodes.get(m.to)
            if node is None or node.raft is None:
                continue
            raft = node.raft
            raft.step(m)
            if raft.role == _LEADER:
                self._observe_leader(node, raft)
            touched[node.id] = node
        for node in touched.values():
            self._drain(node)

    # ------------------------------------------------------------------ faults

    def _inject_faults(self) -> None:
        sc = self.scenario
        rng = self.rng
        for node in list(self.nodes.values()):
            if node.raft is not None:
                if sc.crash_rate and rng.random() < sc.crash_rate:
                    self._crash(node)
            elif node.id not in self.stopped and rng.random() < sc.restart_rate:
                self._restart(node)
        if sc.leader_crash_rate and rng.random() < sc.leader_crash_rate:
            leader = self._current_leader()
            if leader is not None:
                self._crash(leader)
        if sc.partition_rate and rng.random() < sc.partition_rate:
            self._repartition()
        if sc.compact_rate:
            for node in self.nodes.values():
                if node.raft is not None and rng.random() < sc.compact_rate:
                    self._compact(node)
        if sc.transfer_rate and rng.random() < sc.transfer_rate:
            self._transfer()

    def _repartition(self) -> None:
        rng = self.rng
        ids = sorted(self.nodes)
        kind = rng.randrange(4)
        self.blocked = set()
        if kind == 0 or len(ids) < 2:
            return  # heal
        if kind == 1:  # isolate one node both ways
            lone = rng.choice(ids)
            for other in ids:
                if other != lone:
                    self.blocked |= {(lone, other), (other, lone)}
        elif kind == 2:  # split in two
            side = {i for i in ids if rng.random() < 0.5}
            for a in ids:
                for b in ids:
                    if (a in side) != (b in side):
                        self.blocked.add((a, b))
        else:  # one-way link failures
            for a in ids:
                for b in ids:
                    if a != b and rng.random() < 0.25:
                        self.blocked.add((a, b))

    def _compact(self, node: SimNode) -> None:
        raft = node.raft
        assert raft is not None
        applied = node.app.applied
        if applied - node.disk.snapshot.meta.index < 3 or applied != raft.log.applied:
            return
        snapshot = Snapshot(raft.snapshot_meta(applied), node.app.snapshot_data())
        node.disk.save_snapshot(snapshot)
        raft.compact(snapshot)
        self.stats["compactions"] += 1

    def _transfer(self) -> None:
        leaders = [n for n in self.nodes.values() if n.raft is not None and n.raft.role == _LEADER]
        if not leaders:
            return
        leader = self.rng.choice(leaders)
        assert leader.raft is not None
        voters = [v for v in leader.raft.conf.voters if v != leader.id]
        if voters:
            leader.raft.transfer_leadership(self.rng.choice(voters))
            self.stats["transfers"] += 1
            self._drain(leader)

    def _heal(self) -> None:
        self.blocked = set()
        self.lossy = False
        for node in self.nodes.values():
            if node.raft is None and node.id not in self.stopped:
                self._restart(node)

    def _on_removed(self, node_id: str) -> None:
        """A REMOVE committed: with ``stop_removed`` the orchestrator retires that replica."""
        node = self.nodes.get(node_id)
        if node is not None and self.scenario.stop_removed and node_id not in self.stopped:
            self.stopped.add(node_id)
            node.raft = None

    # ------------------------------------------------------------------ clients

    def _client(self, tick: int, healing: bool) -> None:
        sc = self.scenario
        rng = self.rng
        if not healing:
            count = int(sc.propose_rate) + (1 if rng.random() < sc.propose_rate % 1 else 0)
            for _ in range(count):
                self.logical_seq += 1
                self._propose(f"p{self.logical_seq}", tick)
            if sc.conf_change_rate and rng.random() < sc.conf_change_rate:
                self._change_membership()
        due = self.retry_due
        retried = 0
        while due and due[0][0] <= tick and retried < sc.retries_per_tick:
            _, _, logical, pid = heapq.heappop(due)
            if self.open.get(logical) == pid:  # still the latest attempt, and not committed
                self._propose(logical, tick)
                retried += 1

    def _members_up(self) -> list[SimNode]:
        """Live nodes that believe they are members: where a client would send a request."""
        return [n for n in self.nodes.values() if n.raft is not None and n.id in n.raft.conf.members]

    def _propose(self, logical: str, tick: int) -> None:
        live = self._members_up()
        if not live:  # nobody to ask: the client tries again later
            pid = self.open.setdefault(logical, f"{logical}.0")
            self.pid_owner[pid] = logical
            self._retry_at(tick + self.scenario.retry_ticks, logical, pid)
            return
        node = self.rng.choice(live)
        if not self.lossy:  # after healing a client follows "not leader" redirects to the leader
            node = self._current_leader() or node
        previous = self.open.get(logical)
        attempt = 0 if previous is None else int(previous.rsplit(".", 1)[1]) + 1
        pid = f"{logical}.{attempt}"
        self.open[logical] = pid
        self.pid_owner[pid] = logical
        self._retry_at(tick + self.scenario.unknown_ticks, logical, pid)
        self.stats["proposals"] += 1
        assert node.raft is not None
        node.raft.propose(pid.encode(), pid)
        self._drain(node)

    def _retry_at(self, tick: int, logical: str, pid: str) -> None:
        self.seq += 1
        heapq.heappush(self.retry_due, (tick, self.seq, logical, pid))

    def _on_committed(self, pid: str) -> None:
        logical = self.pid_owner.get(pid)
        if logical is not None:
            self.open.pop(logical, None)

    def _on_dropped(self, pid: str) -> None:
        logical = self.pid_owner.get(pid)
        if logical is not None and self.open.get(logical) == pid:
            self._retry_at(self.check.now + self.scenario.retry_ticks, logical, pid)

    def _change_membership(self) -> None:
        rng = self.rng
        live = self._members_up()
        if not live:
            return
        proposer = rng.choice(live)
        raft = proposer.raft
        assert raft is not None
        conf = raft.conf
        options: list[ConfChange] = []
        if self.next_id <= len(self.bootstrap) + self.scenario.max_added:
            options.append(ConfChange(ConfChangeType.ADD_LEARNER, f"n{self.next_id}"))
        options += [ConfChange(ConfChangeType.PROMOTE, n) for n in conf.learners]
        if len(conf.voters) >= 3:
            options += [ConfChange(ConfChangeType.REMOVE, n) for n in conf.voters]
        options += [ConfChange(ConfChangeType.REMOVE, n) for n in conf.learners]
        if not options:
            return
        change = rng.choice(options)
        if change.type == ConfChangeType.ADD_LEARNER:
            self.next_id += 1
            self.nodes[change.node_id] = new = SimNode(change.node_id, original=False)
            self._start(new)
        self.stats["conf_changes"] += 1
        raft.propose_conf_change(change, f"cc{self.stats['conf_changes']}")
        self._drain(proposer)

    # ------------------------------------------------------------------ liveness

    def _current_leader(self) -> SimNode | None:
        best: SimNode | None = None
        best_term = -1
        for node in self.nodes.values():
            raft = node.raft
            if raft is not None and raft.role == _LEADER and (best is None or raft.term > best_term):
                best, best_term = node, raft.term
        return best

    def _converged(self) -> bool:
        if self.open:
            return False
        leader_node = self._current_leader()
        if leader_node is None:
            return False
        leader = leader_node.raft
        assert leader is not None
        commit = leader.log.committed
        if commit != leader.log.last_index():
            return False
        conf = leader.conf
        for member in conf.voters + conf.learners:
            node = self.nodes.get(member)
            if node is None or node.raft is None:
                return False
            raft = node.raft
            if raft.term != leader.term or raft.leader != leader.id or node.app.applied != commit:
                return False
        return True

    def _describe(self) -> str:
        parts = []
        for node in self.nodes.values():
            raft = node.raft
            if raft is None:
                parts.append(f"{node.id}: down")
                continue
            st = raft.status()
            parts.append(
                f"{node.id}: {st.role.name} t{st.term} lead={st.leader} commit={st.commit} "
                f"applied={node.app.applied} last={st.last_index} voters={','.join(st.conf.voters)}"
                f" learners={','.join(st.conf.learners)}"
            )
        return f"open proposals {len(self.open)}; " + "; ".join(parts)


def run_seed(seed: int, scenario: Scenario | None = None) -> SimResult:
    """Run one seed (its scenario drawn from the seed unless given) and report what broke."""
    return Simulation(seed, scenario).run()


def reproduce_command(seed: int, chaos_ticks: int = DEFAULT_CHAOS_TICKS) -> str:
    """The one command that replays ``seed`` (same scenario, same faults, same outcome)."""
    extra = "" if chaos_ticks == DEFAULT_CHAOS_TICKS else f" --chaos-ticks {chaos_ticks}"
    return f"python scripts/raft_torture.py --seeds 1 --start {seed}{extra} --verbose"


__all__ = [
    "DEFAULT_CHAOS_TICKS",
    "ChainApp",
    "Checker",
    "MemoryDisk",
    "SafetyViolation",
    "Scenario",
    "SimResult",
    "Simulation",
    "reproduce_command",
    "run_seed",
]
