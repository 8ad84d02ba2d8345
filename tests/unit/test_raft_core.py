"""Unit tests of the sans-I/O Raft core (``shared.raft.core``) and its pure parts.

Each test names the behaviour it proves. ``Net`` below is a hand-driven network: messages are
delivered only when a test says so, so every interleaving here is chosen, not sampled (the random
ones live in ``tests/sim``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.raft.core import (
    COMMIT_NOTICE_CONTEXT,
    CONF_CHANGE_PENDING,
    LEADERSHIP_LOST,
    NO_LEADER,
    NOT_LEADER,
    TERM_NOT_COMMITTED,
    TOO_MANY_UNCOMMITTED,
    TRANSFER_CONTEXT,
    TRANSFER_IN_PROGRESS,
    RaftNode,
)
from shared.raft.log import RaftLog
from shared.raft.membership import ConfHistory, apply_conf_change
from shared.raft.progress import Inflights, ProgressState, ProgressTracker
from shared.raft.simulation import MemoryDisk
from shared.raft.types import (
    ConfChange,
    ConfChangeType,
    ConfState,
    DroppedProposal,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    RaftConfig,
    RestoredState,
    Role,
    Snapshot,
    SnapshotMeta,
    decode_conf_change,
    encode_conf_change,
)

E = 10
CFG = RaftConfig(election_ticks=E, heartbeat_ticks=1)
MT = MessageType


# ====================================================================== harness


def new_node(
    node_id: str,
    voters: Iterable[str] = ("a", "b", "c"),
    *,
    config: RaftConfig = CFG,
    restored: RestoredState | None = None,
) -> RaftNode:
    return RaftNode(
        node_id,
        restored=restored if restored is not None else RestoredState(),
        rand=random.Random(node_id),
        config=config,
        bootstrap_voters=tuple(voters) if restored is None else (),
    )


def restored_log(
    terms: list[int],
    *,
    term: int,
    voters: tuple[str, ...] = ("a", "b", "c"),
    commit: int = 1,
    vote: str | None = None,
) -> RestoredState:
    """A node that holds the bootstrap snapshot (index 1) then entries 2.. with these terms."""
    meta = SnapshotMeta(1, 1, ConfState(voters))
    entries = tuple(Entry(t, i + 2, data=f"{i + 2}@{t}".encode()) for i, t in enumerate(terms))
    return RestoredState(HardState(term, vote, commit), meta, entries)


class Net:
    """Nodes plus a queue of sent messages that tests deliver explicitly."""

    def __init__(self, nodes: Iterable[RaftNode]) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.disks: dict[str, MemoryDisk] = {i: self._disk_of(n) for i, n in self.nodes.items()}
        self.applied: dict[str, list[Entry]] = defaultdict(list)
        self.dropped: dict[str, list[DroppedProposal]] = defaultdict(list)
        self.snapshots: dict[str, list[Snapshot]] = defaultdict(list)
        self.queue: list[Message] = []
        self.blocked: set[tuple[str, str]] = set()
        self.down: set[str] = set()

    @classmethod
    def cluster(cls, ids: Iterable[str] = ("a", "b", "c"), config: RaftConfig = CFG) -> Net:
        ids = tuple(ids)
        return cls(new_node(i, ids, config=config) for i in ids)

    @staticmethod
    def _disk_of(node: RaftNode) -> MemoryDisk:
        """What storage holds for a node built from a ``RestoredState`` (nothing for a new one)."""
        disk = MemoryDisk()
        log = node.log
        if log.pending_snapshot is None and log.snapshot_index:
            disk.snapshot = Snapshot(node.snapshot_meta(log.snapshot_index))
            disk.entries = list(log.entries)
            disk.hard_state = HardState(node.term, node.vote, log.committed)
        return disk

    def add(self, node: RaftNode) -> None:
        self.nodes[node.id] = node
        self.disks.setdefault(node.id, self._disk_of(node))

    def drain(self, ids: Iterable[str] | None = None) -> None:
        """Run the Ready loop of these nodes (all by default) the way the driver does."""
        for node_id in list(ids if ids is not None else self.nodes):
            if node_id in self.down:
                continue
            node = self.nodes[node_id]
            while node.has_ready():
                rd = node.ready()
                self.disks[node_id].persist(rd)
                self.queue.extend(rd.messages)
                if rd.snapshot is not None:
                    self.snapshots[node_id].append(rd.snapshot)
                self.applied[node_id].extend(rd.committed_entries)
                self.dropped[node_id].extend(rd.dropped_proposals)
                node.advance(rd)

    def take(self, pred: Callable[[Message], bool] = lambda m: True) -> list[Message]:
        """Remove and return the queued messages matching ``pred``."""
        self.drain()
        taken = [m for m in self.queue if pred(m)]
        self.queue = [m for m in self.queue if not pred(m)]
        return taken

    def deliver(self, keep: Callable[[Message], bool] = lambda m: True) -> int:
        """Deliver every queued message ``keep`` accepts (others are lost); returns how many."""
        self.drain()
        batch, self.queue = self.queue, []
        delivered = 0
        for m in batch:
            if m.to in self.down or m.to not in self.nodes or (m.frm, m.to) in self.blocked or not keep(m):
                continue
            self.nodes[m.to].step(m)
            delivered += 1
        self.drain()
        return delivered

    def settle(self, keep: Callable[[Message], bool] = lambda m: True, rounds: int = 100) -> None:
        for _ in range(rounds):
            if not self.deliver(keep) and not self.queue:
                return
        raise AssertionError("network did not settle")

    def tick(self, ids: Iterable[str] | None = None, times: int = 1, *, settle: bool = True) -> None:
        for _ in range(times):
            for node_id in list(ids if ids is not None else self.nodes):
                if node_id not in self.down:
                    self.nodes[node_id].tick()
            if settle:
                self.settle()
            else:
                self.drain()

    def campaign(self, node_id: str) -> None:
        """Tick only ``node_id`` until its election timer fires."""
        node = self.nodes[node_id]
        for _ in range(2 * E):
            node.tick()
            if node.role != Role.FOLLOWER:
                break
        assert node.role != Role.FOLLOWER, f"{node_id} did not campaign"
        self.drain([node_id])

    def elect(self, node_id: str) -> RaftNode:
        self.campaign(node_id)
        self.settle()
        node = self.nodes[node_id]
        assert node.role == Role.LEADER, f"{node_id} is {node.role.name}"
        return node

    def isolate(self, node_id: str) -> None:
        for other in self.nodes:
            if other != node_id:
                self.blocked |= {(node_id, other), (other, node_id)}

    def heal(self) -> None:
        self.blocked = set()

    def restart(self, node_id: str, config: RaftConfig = CFG) -> RaftNode:
        """A crash and restart: the node keeps exactly what it persisted."""
        disk = self.disks[node_id]
        node = RaftNode(node_id, restored=disk.restored(), rand=random.Random(node_id + "'"), config=config)
        if disk.snapshot.meta.index > 1:
            node.compact(disk.snapshot)
        self.nodes[node_id] = node
        self.applied[node_id] = []
        return node

    def data(self, node_id: str) -> list[bytes]:
        """Application data applied at ``node_id`` (no no-ops, no conf changes)."""
        return [e.data for e in self.applied[node_id] if e.data and e.type == EntryType.NORMAL]


def entries_of(messages: Iterable[Message], to: str) -> list[list[int]]:
    return [[e.index for e in m.entries] for m in messages if m.type == MT.APPEND and m.to == to]


def cc(kind: ConfChangeType, node: str) -> ConfChange:
    return ConfChange(kind, node)


# ====================================================================== bootstrap, Ready, restart


def test_bootstrap_snapshot_makes_the_initial_conf_durable_in_the_first_ready() -> None:
    node = new_node("a")
    rd = node.ready()
    assert rd.snapshot is not None
    assert rd.snapshot.meta == SnapshotMeta(1, 1, ConfState(("a", "b", "c")))
    assert rd.snapshot.data == b""
    assert rd.hard_state == HardState(1, None, 1)
    node.advance(rd)
    assert node.status().applied == 1
    assert not node.has_ready()


def test_bootstrap_voters_are_ignored_once_storage_has_state() -> None:
    restored = restored_log([2], term=2, voters=("x", "y", "z"))
    node = RaftNode("x", restored=restored, rand=random.Random(0), bootstrap_voters=("a", "b"))
    assert node.conf == ConfState(("x", "y", "z"))
    assert node.ready().snapshot is None


def test_new_member_without_conf_never_campaigns() -> None:
    node = RaftNode("d", restored=RestoredState(), rand=random.Random(0), config=CFG)
    for _ in range(5 * E):
        node.tick()
    assert node.role == Role.FOLLOWER
    assert not node.ready().messages


def test_single_voter_elects_itself_and_commits_once_its_log_is_persisted() -> None:
    net = Net.cluster(["a"])
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.drain()
    assert net.data("a") == [b"x"]
    assert a.status().commit == a.status().applied == 3


def test_ready_must_be_advanced_before_the_next_ready() -> None:
    node = new_node("a")
    rd = node.ready()
    with pytest.raises(RuntimeError):
        node.ready()
    node.advance(rd)
    with pytest.raises(RuntimeError):
        node.advance(rd)


def test_hard_state_in_ready_carries_the_commit_index() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.settle()
    assert net.disks["a"].hard_state.commit == a.status().commit == 3
    assert net.disks["b"].hard_state.commit == 3


def test_status_reports_applied_index_after_advance() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.settle()
    for node in net.nodes.values():
        status = node.status()
        assert status.applied == status.commit == status.last_index == 3


def test_restart_restores_term_vote_log_and_conf_and_redelivers_committed_entries() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "d"), "cc1")
    net.settle()
    a.propose(b"x", "p1")
    net.settle()
    before = net.nodes["b"].status()
    b = net.restart("b")
    after = b.status()
    assert (after.term, after.last_index, after.commit, after.conf) == (
        before.term,
        before.last_index,
        before.commit,
        before.conf,
    )
    assert b.vote == "a"
    assert after.applied == 1  # only the snapshot is applied; the rest is redelivered
    net.drain(["b"])
    assert [e.index for e in net.applied["b"]] == [2, 3, 4]
    assert b.status().applied == 4


def test_entries_handed_out_then_replaced_before_advance_are_persisted_again() -> None:
    b = RaftNode("b", restored=restored_log([2], term=2), rand=random.Random(0), config=CFG)
    b.step(
        Message(MT.APPEND, "b", "a", 2, log_term=2, index=2, entries=(Entry(2, 3, data=b"old"),), commit=1)
    )
    rd = b.ready()
    assert [e.data for e in rd.entries] == [b"old"]
    # A newer leader overwrites index 3 while the driver is still persisting ``rd``.
    b.step(
        Message(MT.APPEND, "b", "c", 3, log_term=2, index=2, entries=(Entry(3, 3, data=b"new"),), commit=1)
    )
    b.advance(rd)
    assert b.log.persisted == 2  # the persisted copy of index 3 is the stale one
    rd2 = b.ready()
    assert [(e.index, e.data) for e in rd2.entries] == [(3, b"new")]
    b.advance(rd2)
    assert b.log.persisted == 3


def test_messages_for_another_node_are_ignored() -> None:
    b = new_node("b")
    b.ready()
    b.step(Message(MT.VOTE, "zz", "a", 9, log_term=9, index=9))
    assert b.term == 1
    assert not b._msgs


def test_structurally_impossible_messages_raise_value_error() -> None:
    b = new_node("b")
    bad_gap = Message(MT.APPEND, "b", "a", 2, log_term=1, index=1, entries=(Entry(2, 3),))
    with pytest.raises(ValueError):
        b.step(bad_gap)
    future_term = Message(MT.APPEND, "b", "a", 2, log_term=1, index=1, entries=(Entry(5, 2),))
    with pytest.raises(ValueError):
        b.step(future_term)
    with pytest.raises(ValueError):
        b.step(Message(MT.SNAPSHOT, "b", "a", 2))


def test_invalid_config_is_rejected() -> None:
    with pytest.raises(ValueError):
        new_node("a", config=RaftConfig(election_ticks=2, heartbeat_ticks=2))
    with pytest.raises(ValueError):
        new_node("a", config=RaftConfig(max_inflight_appends=0))


# ====================================================================== elections


def test_election_timeout_is_randomized_within_e_to_2e() -> None:
    timeouts = set()
    for seed in range(40):
        node = RaftNode(
            "a", restored=RestoredState(), rand=random.Random(seed), bootstrap_voters=("a", "b", "c")
        )
        ticks = 0
        while node.role == Role.FOLLOWER:
            node.tick()
            ticks += 1
        timeouts.add(ticks)
    assert min(timeouts) >= E
    assert max(timeouts) < 2 * E
    assert len(timeouts) > 3


def test_three_nodes_elect_one_leader_which_commits_a_noop() -> None:
    net = Net.cluster()
    net.elect("a")
    roles = {i: n.role for i, n in net.nodes.items()}
    assert roles == {"a": Role.LEADER, "b": Role.FOLLOWER, "c": Role.FOLLOWER}
    for node_id in "abc":
        assert [(e.index, e.term, e.data) for e in net.applied[node_id]] == [(2, 2, b"")]
        assert net.nodes[node_id].leader == "a"


def test_vote_is_granted_to_one_candidate_per_term() -> None:
    c = RaftNode("c", restored=restored_log([], term=1), rand=random.Random(0), config=CFG)
    c.step(Message(MT.VOTE, "c", "a", 2, log_term=1, index=1))
    c.step(Message(MT.VOTE, "c", "b", 2, log_term=1, index=1))
    responses = c.ready().messages
    assert [(m.to, m.reject) for m in responses] == [("a", False), ("b", True)]
    assert c.vote == "a"


def test_candidate_with_a_stale_log_is_denied_the_vote() -> None:
    c = RaftNode("c", restored=restored_log([2, 2], term=2), rand=random.Random(0), config=CFG)
    c.step(Message(MT.VOTE, "c", "a", 3, log_term=2, index=2))  # shorter log, same last term
    c.step(Message(MT.VOTE, "c", "b", 3, log_term=1, index=9))  # longer log, older last term
    assert all(m.reject for m in c.ready().messages)
    assert c.vote is None


def test_prevote_does_not_bump_term_of_partitioned_node() -> None:
    net = Net.cluster()
    net.elect("a")
    term = net.nodes["a"].term
    net.isolate("c")
    net.tick(["c"], times=5 * E)
    c = net.nodes["c"]
    assert c.term == term
    assert c.role == Role.PRE_CANDIDATE
    net.heal()
    net.tick(["a"], times=1)
    assert c.role == Role.FOLLOWER and c.leader == "a"
    assert net.nodes["a"].role == Role.LEADER and net.nodes["a"].term == term


def test_without_prevote_a_partitioned_node_inflates_its_term() -> None:
    config = RaftConfig(election_ticks=E, pre_vote=False, check_quorum=False)
    net = Net.cluster(config=config)
    net.elect("a")
    net.isolate("c")
    net.tick(["c"], times=5 * E)
    assert net.nodes["c"].term > net.nodes["a"].term + 1  # what pre-vote prevents


def test_follower_with_a_live_leader_ignores_vote_requests() -> None:
    net = Net.cluster()
    net.elect("a")
    b = net.nodes["b"]
    term = b.term
    disruptive = Message(MT.VOTE, "b", "c", term + 1, log_term=9, index=99)
    b.step(disruptive)
    assert b.term == term and not b._msgs  # inside the leader lease: not even an answer
    for _ in range(E):
        b.tick()
    b.step(disruptive)
    assert b.term == term + 1 and b.vote == "c"


def test_leader_steps_down_when_a_quorum_is_silent_for_an_election_timeout() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.isolate("a")
    # Quorum activity is judged every E ticks over the window just ended: the window in which
    # a was cut off may still hold answers, so it steps down at the next check (<= 2E ticks).
    ticks = 0
    while a.role == Role.LEADER and ticks < 3 * E:
        net.tick(["a"], times=1)
        ticks += 1
    assert a.role == Role.FOLLOWER and a.leader is None
    assert E <= ticks <= 2 * E


def test_leader_keeps_leading_while_a_quorum_answers() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.down.add("c")
    net.tick(["a", "b"], times=5 * E)
    assert a.role == Role.LEADER


def test_stale_leader_learns_the_new_term_from_any_append_response() -> None:
    b = RaftNode("b", restored=restored_log([2], term=5), rand=random.Random(0), config=CFG)
    b.step(Message(MT.APPEND, "b", "a", 3, log_term=2, index=2, commit=1))
    (reply,) = b.ready().messages
    assert (reply.type, reply.to, reply.term) == (MT.APPEND_RESP, "a", 5)


def test_removed_voter_holding_the_only_complete_log_campaigns_until_its_removal_commits() -> None:
    # a leads {a, b} and appends its own removal; b never receives it. a then restarts. Under
    # its latest conf a is not a voter, b still counts a's vote, and a's longer log makes a
    # refuse b: only a can break the tie, by leading long enough to commit its removal.
    net = Net.cluster(["a", "b"])
    a = net.elect("a")
    a.propose_conf_change(cc(ConfChangeType.REMOVE, "a"), "rm-a")
    net.drain()
    net.take()  # b never hears of it
    a = net.restart("a")
    assert a.conf.voters == ("b",)
    net.tick(["b"], times=3 * E)  # b campaigns and is refused
    b = net.nodes["b"]
    assert b.role != Role.LEADER
    net.campaign("a")  # a may: it is a voter of the configuration at its commit index
    net.settle()
    # a led just long enough to commit its removal, then handed over with TIMEOUT_NOW.
    assert a.role == Role.FOLLOWER and a.status().commit >= 3
    assert b.role == Role.LEADER and b.conf.voters == ("b",)
    net.tick(["a"], times=3 * E)
    assert a.role == Role.FOLLOWER  # removal committed: a never campaigns again


# ====================================================================== replication


def test_follower_rejects_append_with_mismatched_prev_term() -> None:
    b = RaftNode("b", restored=restored_log([2, 2], term=3), rand=random.Random(0), config=CFG)
    b.step(Message(MT.APPEND, "b", "a", 3, log_term=3, index=3, entries=(Entry(3, 4),), commit=1))
    (reply,) = b.ready().messages
    assert reply.type == MT.APPEND_RESP and reply.reject
    assert reply.index == 3
    assert (reply.reject_hint, reply.log_term) == (3, 2)  # the last index whose term may match
    assert b.log.last_index() == 3


def test_follower_truncates_a_conflicting_uncommitted_suffix() -> None:
    b = RaftNode("b", restored=restored_log([2, 2, 2], term=3), rand=random.Random(0), config=CFG)
    b.step(Message(MT.APPEND, "b", "a", 3, log_term=2, index=2, entries=(Entry(3, 3, data=b"n"),), commit=1))
    assert [(e.index, e.term) for e in b.log.entries] == [(2, 2), (3, 3)]
    rd = b.ready()
    assert [(e.index, e.term) for e in rd.entries] == [(3, 3)]
    assert rd.messages[0].index == 3 and not rd.messages[0].reject


def test_follower_does_not_commit_past_what_it_shares_with_the_leader() -> None:
    # b holds a stale suffix 3..4 from term 2; the leader's commit index (4) covers different
    # entries there. An append that only proves index 2 may commit no further than 2.
    b = RaftNode("b", restored=restored_log([2, 2, 2], term=3), rand=random.Random(0), config=CFG)
    b.step(Message(MT.APPEND, "b", "a", 3, log_term=2, index=2, commit=4))
    assert b.status().commit == 2
    b.step(Message(MT.HEARTBEAT, "b", "a", 3, commit=2))
    assert b.status().commit == 2


def test_reject_hint_skips_a_divergent_term_in_one_round_trip() -> None:
    a = RaftNode("a", restored=restored_log([2, 4, 4], term=4), rand=random.Random(0), config=CFG)
    b = RaftNode("b", restored=restored_log([2, 3, 3, 3, 3, 3], term=4), rand=random.Random(1), config=CFG)
    c = RaftNode("c", restored=restored_log([2, 4, 4], term=4), rand=random.Random(2), config=CFG)
    net = Net([a, b, c])
    net.campaign("a")
    rejections = 0
    for _ in range(20):
        rejections += sum(1 for m in net.queue if m.type == MT.APPEND_RESP and m.reject and m.frm == "b")
        if not net.deliver():
            break
    assert a.role == Role.LEADER
    assert rejections == 1
    assert [(e.index, e.term) for e in b.log.entries] == [(e.index, e.term) for e in a.log.entries]


def test_appends_are_batched_by_entry_count_and_pipelined() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, max_entries_per_append=2))
    a = net.elect("a")
    for i in range(5):
        a.propose(b"x", f"p{i}")
    sent = net.take()
    assert entries_of(sent, "b") == [[3, 4], [5, 6], [7]]


def test_lazy_commit_reaches_followers_with_the_next_heartbeat_not_an_empty_append() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, heartbeat_ticks=1, eager_commit=False))
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.deliver()  # the append reaches b and c
    net.deliver()  # their responses commit it at a
    assert a.log.committed == 3
    assert [m for m in net.take() if m.type == MT.APPEND] == []  # no commit-only append
    assert net.nodes["b"].log.committed == 2
    net.tick(["a"])  # the heartbeat carries it
    assert net.nodes["b"].log.committed == net.nodes["c"].log.committed == 3


def test_lazy_commit_still_tells_a_follower_whose_proposal_committed_at_once() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, heartbeat_ticks=1, eager_commit=False))
    net.elect("a")
    net.nodes["b"].propose(b"from-b", "pb")
    net.settle()  # no tick: no heartbeat
    assert net.data("b") == [b"from-b"]  # b's proposer learns the commit without waiting a tick
    assert net.nodes["c"].log.committed < net.nodes["a"].log.committed


def _lazy_leader_with_a_new_commit() -> tuple[Net, RaftNode]:
    """A group without eager commits whose leader "a" just committed entry 3 (not told yet)."""
    net = Net.cluster(config=RaftConfig(election_ticks=E, heartbeat_ticks=1, eager_commit=False))
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.deliver()  # the append reaches b and c
    net.deliver()  # their responses commit it at a
    return net, a


def test_lazy_commit_notice_tells_followers_when_the_driver_asks_and_only_then() -> None:
    net, a = _lazy_leader_with_a_new_commit()
    assert a.commit_notice_owed()
    assert not net.nodes["b"].commit_notice_owed()  # a follower owes nobody
    a.send_commit_notices()
    notices = net.take()
    assert sorted(m.to for m in notices) == ["b", "c"]
    assert all(m.type == MT.APPEND and not m.entries and m.commit == 3 for m in notices)
    for m in notices:
        net.nodes[m.to].step(m)
    assert net.nodes["b"].log.committed == net.nodes["c"].log.committed == 3
    assert not a.commit_notice_owed()


def test_a_commit_notice_is_applied_without_an_answer() -> None:
    net, a = _lazy_leader_with_a_new_commit()
    a.send_commit_notices()
    notices = net.take()
    assert notices and all(m.context == COMMIT_NOTICE_CONTEXT for m in notices)
    for m in notices:
        net.nodes[m.to].step(m)
    assert net.nodes["b"].log.committed == net.nodes["c"].log.committed == 3
    assert net.take() == []  # each answer would only repeat the match index the leader sent


def test_a_commit_notice_that_does_not_match_the_followers_log_is_still_rejected() -> None:
    b = RaftNode("b", restored=restored_log([1, 1], term=2), rand=random.Random(0), config=CFG)
    b.step(Message(MT.APPEND, "b", "a", 2, log_term=2, index=3, commit=3, context=COMMIT_NOTICE_CONTEXT))
    (reply,) = b.ready().messages
    assert (reply.type, reply.reject) == (MT.APPEND_RESP, True)


def test_a_leader_whose_commit_notices_go_unanswered_keeps_leading_on_heartbeats() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, heartbeat_ticks=1, eager_commit=False))
    a = net.elect("a")
    for i in range(5 * E):
        a.propose(f"x{i}".encode(), f"p{i}")
        net.deliver()
        net.deliver()
        a.send_commit_notices()
        net.tick()
    assert a.role == Role.LEADER
    assert net.nodes["b"].log.committed == net.nodes["c"].log.committed == a.log.committed


def test_lazy_commit_notice_is_not_owed_once_an_append_carried_the_commit() -> None:
    net, a = _lazy_leader_with_a_new_commit()
    a.propose(b"y", "p2")
    appends = net.take()  # the Ready: its appends carry commit 3 to both followers
    assert sorted(m.to for m in appends if m.entries and m.commit == 3) == ["b", "c"]
    assert not a.commit_notice_owed()


QUIET = RaftConfig(election_ticks=E, heartbeat_ticks=1, eager_commit=False, quiet_heartbeats=True)


def _beats(messages: Iterable[Message]) -> list[str]:
    return sorted(m.to for m in messages if m.type == MT.HEARTBEAT)


def test_quiet_heartbeats_skip_a_follower_that_answered_an_append_and_knows_the_commit() -> None:
    net = Net.cluster(config=QUIET)
    a = net.elect("a")
    net.tick(["a"])  # settles the election's own traffic
    a.propose(b"x", "p1")
    net.deliver()  # the append reaches b and c
    net.deliver(lambda m: m.frm != "c")  # only b's answer arrives: it commits x at a
    a.send_commit_notices()  # b is told the commit (c is owed it too)
    net.deliver()
    a.tick()
    assert _beats(net.take()) == ["c"]  # b answered an append and holds the commit: no beat
    a.tick()
    assert _beats(net.take()) == ["b", "c"]  # nothing answered since the last beat


def test_quiet_heartbeats_still_beat_a_follower_not_told_the_commit_yet() -> None:
    net = Net.cluster(config=QUIET)
    a = net.elect("a")
    net.tick(["a"])
    a.propose(b"x", "p1")
    net.deliver()
    net.deliver()  # both answered; x is committed at a, the followers were not told
    a.tick()
    beats = [m for m in net.take() if m.type == MT.HEARTBEAT]
    assert sorted(m.to for m in beats) == ["b", "c"]
    assert all(m.commit == a.log.committed for m in beats)  # the beat carries the commit


def test_quiet_heartbeats_keep_an_idle_group_beating_and_a_busy_one_leading() -> None:
    net = Net.cluster(config=QUIET)
    a = net.elect("a")
    net.tick(["a"])
    for _ in range(3):
        a.tick()
        assert _beats(net.take()) == ["b", "c"]  # idle: a beat every tick
    for i in range(5 * E):  # busy: an answered append and a commit notice per tick
        a.propose(f"x{i}".encode(), f"p{i}")
        net.deliver()
        net.deliver()
        a.send_commit_notices()
        net.deliver()
        a.tick()
        assert _beats(net.take()) == []
        net.tick(["b", "c"], settle=False)  # their election timers run too
    assert a.role == Role.LEADER
    assert net.nodes["b"].role == net.nodes["c"].role == Role.FOLLOWER
    assert net.nodes["b"].log.committed == net.nodes["c"].log.committed == a.log.committed


def test_without_quiet_heartbeats_every_tick_beats_every_follower() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, heartbeat_ticks=1, eager_commit=False))
    a = net.elect("a")
    net.tick(["a"])
    a.propose(b"x", "p1")
    net.deliver()
    net.deliver()
    a.send_commit_notices()
    net.deliver()
    a.tick()
    assert _beats(net.take()) == ["b", "c"]


def test_appends_are_batched_by_bytes() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, max_bytes_per_append=260))
    a = net.elect("a")
    for i in range(3):
        a.propose(b"y" * 100, f"p{i}")  # 100 + 2 (id) + 24 (overhead) = 126 bytes each
    assert entries_of(net.take(), "b") == [[3, 4], [5]]


def test_oversized_entry_still_goes_out_alone() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, max_bytes_per_append=10))
    a = net.elect("a")
    a.propose(b"z" * 1000, "big")
    assert entries_of(net.take(), "b") == [[3]]


def test_pipelining_stops_at_the_inflight_window_and_resumes_on_acks() -> None:
    config = RaftConfig(election_ticks=E, max_entries_per_append=1, max_inflight_appends=2)
    net = Net.cluster(config=config)
    a = net.elect("a")
    for i in range(5):
        a.propose(b"x", f"p{i}")
    first = net.take(lambda m: m.to == "b")
    assert entries_of(first, "b") == [[3], [4]]
    net.take()  # c's share: lost
    net.nodes["b"].step(first[0])
    net.deliver(lambda m: m.to == "a")  # b's ack frees one slot
    assert entries_of(net.take(lambda m: m.to == "b"), "b") == [[5]]


def test_rejection_moves_the_follower_to_probe_one_append_at_a_time() -> None:
    config = RaftConfig(election_ticks=E, max_entries_per_append=1)
    net = Net.cluster(config=config)
    a = net.elect("a")
    a.propose(b"lost", "p0")
    net.take(lambda m: m.to == "b")  # lost on the way to b
    a.propose(b"x", "p1")
    net.deliver(lambda m: m.to == "b")  # b rejects: it lacks index 3
    net.deliver(lambda m: m.to == "a")
    assert a._tracker.progress["b"].state == ProgressState.PROBE
    probes = net.take(lambda m: m.to == "b")
    assert entries_of(probes, "b") == [[3]]
    a.propose(b"y", "p2")
    assert entries_of(net.take(lambda m: m.to == "b"), "b") == []  # paused until the probe answers
    net.nodes["b"].step(probes[0])
    net.settle()
    assert a._tracker.progress["b"].state == ProgressState.REPLICATE
    assert net.data("b") == [b"lost", b"x", b"y"]


def test_heartbeat_response_recovers_a_lost_tail() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.settle(keep=lambda m: not (m.to == "b" and m.type == MT.APPEND))
    assert net.nodes["b"].log.last_index() == 2
    net.tick(["a"], times=1)
    assert net.data("b") == [b"x"]


def test_commit_reaches_followers_without_waiting_for_a_heartbeat() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.nodes["b"].propose(b"from-b", "pb")
    net.settle()  # no tick anywhere: forwarding, replication, commit and its broadcast
    assert net.data("b") == [b"from-b"]
    assert net.data("c") == [b"from-b"]
    assert a.status().commit == net.nodes["b"].status().commit == 3


def test_leader_announces_a_new_commit_index_right_away() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.deliver(lambda m: m.to == "b")
    net.deliver(lambda m: m.to == "a" and m.frm == "b")  # b's ack commits index 3
    announcements = [m for m in net.take() if m.type == MT.APPEND and m.commit == 3]
    assert {m.to for m in announcements} == {"b", "c"}


def test_figure8_leader_does_not_commit_an_old_term_entry_by_counting_replicas() -> None:
    voters = ("s1", "s2", "s3", "s4", "s5")
    config = RaftConfig(election_ticks=E, max_entries_per_append=1)

    def node(node_id: str, terms: list[int]) -> RaftNode:
        restored = restored_log(terms, term=3, voters=voters)
        return RaftNode(node_id, restored=restored, rand=random.Random(node_id), config=config)

    # Figure 8 (c): index 2 holds term 2 on s1, s2; s5 wrote its own term-3 entry there.
    s1, s2, s3, s4, s5 = node("s1", [2]), node("s2", [2]), node("s3", []), node("s4", []), node("s5", [3])
    net = Net([s1, s2, s3, s4, s5])
    net.down.add("s5")
    net.campaign("s1")

    def noop_lost(m: Message) -> bool:  # the no-op (index 3) never lands where it would fit
        return m.type == MT.APPEND and m.index == 2 and bool(m.entries) and net.nodes[m.to].log.term(2) == 2

    # s1 wins term 4 and brings s3 and s4 the old entry (index 2); its no-op is lost.
    net.settle(keep=lambda m: not noop_lost(m))
    assert s1.role == Role.LEADER and s1.term == 4
    assert s3.log.term(2) == 2
    assert sum(n.log.term(2) == 2 for n in (s1, s2, s3)) == 3  # a majority holds it...
    assert s1.status().commit == 1  # ...but counting is no proof for an entry of an older term
    # Why: s5 (last term 3) can still win s2, s3 and s4 and overwrite index 2 (Figure 8 (d)).
    net.down = {"s1"}
    net.tick(["s2", "s3", "s4"], times=E, settle=False)  # s1's lease runs out
    net.tick(["s5"], times=4 * E)  # its first try only teaches it term 4; the next one wins
    assert s5.role == Role.LEADER
    assert s3.log.term(2) == 3


def test_figure8_old_term_entry_commits_with_the_leaders_own_entry() -> None:
    voters = ("s1", "s2", "s3", "s4", "s5")
    restored = {n: restored_log([2] if n in ("s1", "s2") else [], term=3, voters=voters) for n in voters}
    net = Net(RaftNode(n, restored=restored[n], rand=random.Random(n), config=CFG) for n in voters)
    s1 = net.elect("s1")
    net.settle()
    assert s1.status().commit == 3  # index 2 (term 2) commits indirectly through the term-4 no-op
    assert [e.index for e in net.applied["s3"]] == [2, 3]


def test_committed_entries_are_applied_in_order_exactly_once() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, max_entries_per_append=1))
    a = net.elect("a")
    for i in range(20):
        a.propose(str(i).encode(), f"p{i}")
    net.settle()
    for node_id in "abc":
        assert [e.index for e in net.applied[node_id]] == list(range(2, 23))


# ====================================================================== proposals


def test_follower_forwards_a_proposal_to_the_leader() -> None:
    net = Net.cluster()
    net.elect("a")
    b = net.nodes["b"]
    b.propose(b"x", "pb")
    (forward,) = net.take()
    assert (forward.type, forward.to, [e.proposal_id for e in forward.entries]) == (MT.PROPOSE, "a", ["pb"])


def test_forwarded_proposals_made_between_readies_travel_in_one_message() -> None:
    net = Net.cluster()
    net.elect("a")
    b = net.nodes["b"]
    for i in range(3):
        b.propose(b"x", f"p{i}")
    (forward,) = net.take()
    assert [(e.index, e.proposal_id) for e in forward.entries] == [(1, "p0"), (2, "p1"), (3, "p2")]


def test_proposal_without_a_known_leader_is_dropped_with_reason() -> None:
    node = new_node("a")
    node.propose(b"x", "p1")
    assert node.ready().dropped_proposals == [DroppedProposal("p1", NO_LEADER)]


def test_non_leader_answers_a_forwarded_proposal_with_propose_dropped() -> None:
    net = Net.cluster()
    net.elect("a")
    net.nodes["c"].step(Message(MT.PROPOSE, "c", "b", 2, entries=(Entry(0, 1, proposal_id="pb"),)))
    (reply,) = net.take()
    assert (reply.type, reply.to, reply.context) == (MT.PROPOSE_DROPPED, "b", NOT_LEADER.encode())
    net.nodes["b"].step(reply)
    net.drain()
    assert net.dropped["b"] == [DroppedProposal("pb", NOT_LEADER)]


def test_proposals_beyond_the_uncommitted_limit_are_dropped() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, max_uncommitted_entries=3))
    a = net.elect("a")
    net.isolate("a")
    for i in range(5):
        a.propose(b"x", f"p{i}")
    net.drain()
    assert net.dropped["a"] == [
        DroppedProposal("p3", TOO_MANY_UNCOMMITTED),
        DroppedProposal("p4", TOO_MANY_UNCOMMITTED),
    ]


def test_forwarded_proposal_dropped_by_the_leader_is_reported_to_the_forwarder() -> None:
    net = Net.cluster(config=RaftConfig(election_ticks=E, max_uncommitted_entries=1))
    a = net.elect("a")
    a.propose(b"fills-the-budget", "pa")
    net.take()
    net.nodes["b"].propose(b"x", "pb")
    net.settle(keep=lambda m: m.type in (MT.PROPOSE, MT.PROPOSE_DROPPED))
    assert net.dropped["b"] == [DroppedProposal("pb", TOO_MANY_UNCOMMITTED)]


def test_duplicated_forwarded_proposal_is_appended_once_and_never_reported_dropped() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.nodes["b"].propose(b"x", "pb")
    (forward,) = net.take()
    a.step(forward)
    a.step(forward)
    net.settle()
    assert [e.proposal_id for e in net.applied["b"] if e.proposal_id] == ["pb"]
    assert not net.dropped["b"]


def test_overwritten_proposal_is_reported_lost_once_its_index_commits() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.isolate("a")
    a.propose(b"doomed", "pa")  # index 3 on a only
    net.drain()
    net.tick(["c"], times=E)  # c's lease on a runs out
    net.campaign("b")
    net.settle()
    b = net.nodes["b"]
    assert b.role == Role.LEADER
    b.propose(b"winner", "pb")  # index 4 on b and c; b's no-op took index 3
    net.settle()
    net.heal()
    assert not net.dropped["a"]
    net.tick(["b"], times=1)
    assert net.dropped["a"] == [DroppedProposal("pa", LEADERSHIP_LOST)]
    assert net.data("a") == [b"winner"]


# ====================================================================== leadership transfer


def test_leadership_transfer_catches_up_the_target_then_sends_timeout_now() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.settle(keep=lambda m: m.to != "c")  # c falls behind
    a.transfer_leadership("c")
    c = net.nodes["c"]
    for _ in range(10):
        net.drain()
        timeout_now = [m for m in net.queue if m.type == MT.TIMEOUT_NOW]
        if timeout_now:
            break
        assert [m.type for m in net.queue if m.to == "c"] in ([MT.APPEND], [])  # catching up
        net.deliver()
    assert [m.to for m in timeout_now] == ["c"]
    assert c.log.last_index() == a.log.last_index()  # only once the target is caught up
    net.settle()
    assert net.nodes["c"].role == Role.LEADER
    assert a.role == Role.FOLLOWER and a.leader == "c"


def test_transfer_campaign_skips_prevote_and_bypasses_the_leader_lease() -> None:
    net = Net.cluster()
    net.elect("a")
    net.nodes["a"].transfer_leadership("b")
    net.deliver()  # TIMEOUT_NOW reaches b at once: it is up to date
    votes = [m for m in net.queue if m.frm == "b"]
    assert {m.type for m in votes} == {MT.VOTE} and all(m.context == TRANSFER_CONTEXT for m in votes)
    assert net.nodes["c"]._election_elapsed < E  # c has a live leader, yet votes
    net.settle()
    assert net.nodes["b"].role == Role.LEADER


def test_proposals_are_dropped_while_a_transfer_is_in_progress() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.down.add("c")
    a.transfer_leadership("c")
    a.propose(b"x", "p1")
    net.drain()
    assert net.dropped["a"] == [DroppedProposal("p1", TRANSFER_IN_PROGRESS)]


def test_transfer_is_abandoned_after_an_election_timeout() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.down.add("c")
    a.transfer_leadership("c")
    net.tick(["a", "b"], times=E)
    assert a.role == Role.LEADER
    a.propose(b"x", "p1")
    net.settle()
    assert net.data("a") == [b"x"]


# ====================================================================== snapshots


def test_lagging_follower_receives_a_snapshot_after_compaction() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.isolate("c")
    for i in range(5):
        a.propose(f"v{i}".encode(), f"p{i}")
        net.settle()
    applied = a.status().applied
    snapshot = Snapshot(a.snapshot_meta(applied), b"state@" + str(applied).encode())
    a.compact(snapshot)
    assert a.log.snapshot_index == applied and not a.log.entries
    net.heal()
    net.tick(["a"], times=2)
    c = net.nodes["c"]
    assert net.snapshots["c"][-1] == snapshot
    assert c.log.snapshot_index == applied and c.status().applied == applied
    a.propose(b"after", "p-after")
    net.settle()
    assert net.data("c") == [b"after"]


def test_follower_ignores_a_snapshot_not_newer_than_its_commit() -> None:
    b = RaftNode("b", restored=restored_log([2, 2, 2], term=2, commit=4), rand=random.Random(0), config=CFG)
    old = Snapshot(SnapshotMeta(3, 2, ConfState(("a", "b", "c"))), b"old")
    b.step(Message(MT.SNAPSHOT, "b", "a", 2, snapshot=old))
    rd = b.ready()
    assert rd.snapshot is None
    assert [(m.type, m.index) for m in rd.messages] == [(MT.APPEND_RESP, 4)]
    assert b.log.last_index() == 4


def test_snapshot_matching_the_log_only_advances_the_commit_index() -> None:
    b = RaftNode("b", restored=restored_log([2, 2, 2], term=2, commit=1), rand=random.Random(0), config=CFG)
    same = Snapshot(SnapshotMeta(3, 2, ConfState(("a", "b", "c"))), b"s")
    b.step(Message(MT.SNAPSHOT, "b", "a", 2, snapshot=same))
    assert b.ready().snapshot is None
    assert b.status().commit == 3 and b.log.last_index() == 4


def test_compact_rejects_an_unapplied_or_inconsistent_snapshot() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.settle()
    meta = a.snapshot_meta(3)
    with pytest.raises(ValueError):
        a.compact(Snapshot(SnapshotMeta(4, 2, meta.conf)))  # beyond applied
    with pytest.raises(ValueError):
        a.compact(Snapshot(SnapshotMeta(3, 1, meta.conf)))  # wrong term
    with pytest.raises(ValueError):
        a.compact(Snapshot(SnapshotMeta(3, 2, ConfState(("a",)))))  # wrong conf
    a.compact(Snapshot(meta, b"s"))
    a.compact(Snapshot(SnapshotMeta(2, 2, meta.conf)))  # older than what we have: ignored
    assert a.log.snapshot_index == 3


def test_restarted_leader_ships_a_snapshot_only_once_given_its_data() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose(b"x", "p1")
    net.settle()
    snapshot = Snapshot(a.snapshot_meta(3), b"state")
    net.disks["a"].save_snapshot(snapshot)
    a.compact(snapshot)
    # a restarts but its driver does not hand the snapshot back; d joins and needs it.
    a = RaftNode("a", restored=net.disks["a"].restored(), rand=random.Random(5), config=CFG)
    net.nodes["a"] = a
    net.tick(["b", "c"], times=E, settle=False)  # their lease on the old a runs out
    net.elect("a")
    net.add(RaftNode("d", restored=RestoredState(), rand=random.Random(1), config=CFG))
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "d"), "add-d")
    net.settle()
    net.tick(["a"], times=2)
    assert not net.snapshots["d"]
    a.compact(net.disks["a"].snapshot)  # the driver hands the stored snapshot back
    net.tick(["a"], times=2)
    assert net.snapshots["d"] == [snapshot]


def test_new_member_learns_the_initial_conf_from_the_bootstrap_snapshot() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.add(RaftNode("d", restored=RestoredState(), rand=random.Random(1), config=CFG))
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "d"), "add-d")
    net.settle()
    d = net.nodes["d"]
    assert net.snapshots["d"][0].meta == SnapshotMeta(1, 1, ConfState(("a", "b", "c")))
    assert d.conf == ConfState(("a", "b", "c"), ("d",))
    assert d.status().role == Role.LEARNER
    assert d.status().applied == a.status().applied


# ====================================================================== membership


def test_conf_change_takes_effect_on_append_and_rolls_back_when_truncated() -> None:
    b = RaftNode("b", restored=restored_log([2], term=2), rand=random.Random(0), config=CFG)
    add_d = Entry(2, 3, EntryType.CONF_CHANGE, encode_conf_change(cc(ConfChangeType.ADD_LEARNER, "d")))
    b.step(Message(MT.APPEND, "b", "a", 2, log_term=2, index=2, entries=(add_d,), commit=1))
    assert b.conf.learners == ("d",)  # before it commits
    b.step(Message(MT.APPEND, "b", "c", 3, log_term=2, index=2, entries=(Entry(3, 3),), commit=1))
    assert b.conf == ConfState(("a", "b", "c"))


def test_second_conf_change_is_rejected_while_one_is_uncommitted() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "d"), "cc1")
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "e"), "cc2")
    net.drain()
    assert net.dropped["a"] == [DroppedProposal("cc2", CONF_CHANGE_PENDING)]
    net.settle()
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "e"), "cc3")
    net.settle()
    assert a.conf.learners == ("d", "e")


def test_conf_change_waits_for_the_leader_to_commit_an_entry_of_its_term() -> None:
    net = Net.cluster()
    net.campaign("a")
    a = net.nodes["a"]
    while a.role != Role.LEADER:
        net.deliver()  # pre-votes, then votes; a's no-op goes out but is not acknowledged yet
    assert a.role == Role.LEADER and a.status().commit == 1
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "d"), "cc1")
    net.drain(["a"])
    assert net.dropped["a"] == [DroppedProposal("cc1", TERM_NOT_COMMITTED)]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (cc(ConfChangeType.ADD_LEARNER, "b"), "b is already a member"),
        (cc(ConfChangeType.PROMOTE, "b"), "b is not a learner"),
        (cc(ConfChangeType.REMOVE, "zz"), "zz is not a member"),
    ],
)
def test_invalid_conf_change_is_dropped_with_its_reason(change: ConfChange, reason: str) -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose_conf_change(change, "cc")
    net.drain()
    assert net.dropped["a"] == [DroppedProposal("cc", reason)]


def test_removing_the_last_voter_is_refused() -> None:
    net = Net.cluster(["a"])
    a = net.elect("a")
    a.propose_conf_change(cc(ConfChangeType.REMOVE, "a"), "cc")
    net.drain()
    assert net.dropped["a"] == [DroppedProposal("cc", "cannot remove the last voter")]


def _with_learner_d(net: Net) -> RaftNode:
    a = net.nodes["a"]
    net.add(RaftNode("d", restored=RestoredState(), rand=random.Random(1), config=CFG))
    a.propose_conf_change(cc(ConfChangeType.ADD_LEARNER, "d"), "add-d")
    net.settle()
    return net.nodes["d"]


def test_learner_receives_the_log_but_does_not_count_for_commit() -> None:
    net = Net.cluster()
    a = net.elect("a")
    d = _with_learner_d(net)
    net.down |= {"b", "c"}
    a.propose(b"x", "p1")
    net.settle()
    assert d.log.last_index() == a.log.last_index()
    assert a.status().commit < a.log.last_index()


def test_learner_never_campaigns_and_reports_the_learner_role() -> None:
    net = Net.cluster()
    net.elect("a")
    d = _with_learner_d(net)
    net.down.add("a")
    net.tick(["d"], times=5 * E)
    assert d.status().role == Role.LEARNER
    assert d.term == net.nodes["a"].term


def test_promoted_learner_counts_for_commit() -> None:
    net = Net.cluster()
    a = net.elect("a")
    _with_learner_d(net)
    a.propose_conf_change(cc(ConfChangeType.PROMOTE, "d"), "promote-d")
    net.settle()
    assert a.conf.voters == ("a", "b", "c", "d")
    net.down |= {"b"}
    a.propose(b"x", "p1")
    net.settle()
    assert net.data("a") == [b"x"]  # a, c, d: a majority of four


def test_membership_change_while_a_member_is_partitioned() -> None:
    net = Net.cluster()
    a = net.elect("a")
    net.isolate("c")
    _with_learner_d(net)
    for change, pid in ((cc(ConfChangeType.PROMOTE, "d"), "p-d"), (cc(ConfChangeType.REMOVE, "c"), "rm-c")):
        a.propose_conf_change(change, pid)
        net.settle()
    assert a.conf == ConfState(("a", "b", "d"))
    a.propose(b"x", "p1")
    net.settle()
    assert net.data("d") == [b"x"]
    # c never heard of its removal; back on the network it cannot disturb the new group.
    net.heal()
    term = a.term
    net.tick(times=5 * E)
    assert a.role == Role.LEADER and a.term == term
    assert net.nodes["c"].term == term


def test_removed_leader_steps_down_after_its_removal_commits_and_hands_over() -> None:
    net = Net.cluster()
    a = net.elect("a")
    a.propose_conf_change(cc(ConfChangeType.REMOVE, "a"), "rm-a")
    net.drain()
    assert a.role == Role.LEADER  # still leads (not counting itself) until the change commits
    net.settle()
    assert a.role == Role.FOLLOWER
    new_leaders = [n for n in ("b", "c") if net.nodes[n].role == Role.LEADER]
    assert len(new_leaders) == 1  # TIMEOUT_NOW: no election timeout to wait for
    assert net.nodes[new_leaders[0]].conf.voters == ("b", "c")
    term = a.term
    net.tick(times=5 * E)
    assert a.role == Role.FOLLOWER and a.term == term  # out of the group: it never campaigns


# ====================================================================== pure parts (properties)


log_terms = st.lists(st.integers(1, 5), max_size=30).map(sorted)


@given(log_terms, st.integers(0, 35), st.integers(0, 6))
def test_find_conflict_by_term_returns_the_last_index_whose_term_may_match(
    terms: list[int], index: int, term: int
) -> None:
    log = RaftLog(0, 0, [Entry(t, i + 1) for i, t in enumerate(terms)], 0)
    found, found_term = log.find_conflict_by_term(index, term)
    if index > log.last_index():
        assert (found, found_term) == (index, 0)
        return
    assert found <= index
    assert (log.term(found) or 0) <= term and found_term == (log.term(found) or 0)
    assert all((log.term(j) or 0) > term for j in range(found + 1, index + 1))


@given(st.lists(st.integers(1, 5), min_size=1, max_size=40), st.integers(1, 8), st.integers(1, 200))
def test_slice_respects_count_and_bytes_but_always_makes_progress(
    sizes: list[int], max_count: int, max_bytes: int
) -> None:
    log = RaftLog(0, 0, [Entry(1, i + 1, data=b"x" * n) for i, n in enumerate(sizes)], 0)
    batch = log.slice(1, max_count, max_bytes)
    assert 1 <= len(batch) <= max_count
    assert [e.index for e in batch] == list(range(1, len(batch) + 1))
    if len(batch) > 1:
        assert sum(len(e.data) + 24 for e in batch) <= max_bytes


@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 6))
def test_inflights_hold_only_unacknowledged_appends_within_capacity(ops: list[int], capacity: int) -> None:
    inflights = Inflights(capacity)
    model: list[int] = []
    last = 0
    for op in ops:
        if op < 2 and not inflights.full():
            last += 1
            inflights.add(last)
            model.append(last)
        elif op == 2 and model:
            acked = model[len(model) // 2]
            inflights.free_le(acked)
            model = [i for i in model if i > acked]
        elif op == 3:
            inflights.free_first_one()
            model = model[1:]
        assert len(inflights) == len(model) <= capacity
        assert inflights.full() == (len(model) >= capacity)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=7))
def test_committed_index_is_the_highest_index_a_majority_holds(matches: list[int]) -> None:
    voters = tuple(f"v{i}" for i in range(len(matches)))
    tracker = ProgressTracker("v0", 8)
    tracker.reset(ConfState(voters), 1, matches[0])
    for voter, match in zip(voters[1:], matches[1:], strict=True):
        tracker.progress[voter].match = match
    committed = tracker.committed_index(voters)
    majority = len(voters) // 2 + 1
    assert sum(m >= committed for m in matches) >= majority
    assert sum(m >= committed + 1 for m in matches) < majority


@given(st.sampled_from(list(ConfChangeType)), st.text(min_size=1, max_size=20), st.binary(max_size=40))
def test_conf_change_encoding_roundtrips(kind: ConfChangeType, node_id: str, context: bytes) -> None:
    change = ConfChange(kind, node_id, context)
    assert decode_conf_change(encode_conf_change(change)) == change


changes = st.lists(
    st.tuples(st.sampled_from(list(ConfChangeType)), st.sampled_from(["a", "b", "c", "d", "e"])), max_size=12
)


@settings(max_examples=200)
@given(changes, st.integers(0, 13))
def test_conf_history_equals_replaying_the_changes_up_to_an_index(
    seq: list[tuple[ConfChangeType, str]], cut: int
) -> None:
    base = ConfState(("a", "b", "c"))
    history = ConfHistory(1, base)
    confs = [base]
    for offset, (kind, node) in enumerate(seq):
        confs.append(apply_conf_change(confs[-1], ConfChange(kind, node)))
        history.record(2 + offset, confs[-1])
    for index in range(1, 2 + len(seq)):
        assert history.at(index) == confs[index - 1]
    history.truncate_from(2 + cut)
    assert history.current == confs[min(cut, len(seq))]
    history.compact_to(1 + min(cut, len(seq)) // 2)
    for index in range(1 + min(cut, len(seq)) // 2, 2 + min(cut, len(seq))):
        assert history.at(index) == confs[index - 1]


def test_append_reaching_below_the_commit_index_cannot_rewrite_committed_entries() -> None:
    b = RaftNode("b", restored=restored_log([2, 2], term=3, commit=3), rand=random.Random(0), config=CFG)
    rogue = Message(MT.APPEND, "b", "x", 3, log_term=2, index=2, entries=(Entry(3, 3, data=b"rogue"),))
    b.step(rogue)
    assert b.log.term(3) == 2 and b.status().commit == 3
    (reply,) = b.ready().messages
    assert (reply.type, reply.index, reply.reject) == (MT.APPEND_RESP, 3, False)  # "I hold up to 3"
