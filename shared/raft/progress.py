"""The leader's view of each follower's replication, and the quorum arithmetic over it.

A follower's ``Progress`` is in one of three states (as in etcd):

* PROBE — we do not know where its log ends: send one append, wait for the answer (or the next
  heartbeat response) before sending another. Entered on election, after a rejection, or when a
  snapshot attempt times out.
* REPLICATE — it is known to be in sync: stream appends optimistically, advancing ``next`` as we
  send, up to ``max_inflight_appends`` unacknowledged messages (pipelining).
* SNAPSHOT — it needs entries we compacted away: a snapshot is on its way; send nothing else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from enum import IntEnum

from shared.raft.types import ConfState


class ProgressState(IntEnum):
    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Inflights:
    """Last indices of the appends sent but not yet acknowledged, oldest first (bounded window)."""

    __slots__ = ("_window", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._window: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._window)

    def full(self) -> bool:
        return len(self._window) >= self.capacity

    def add(self, last_index: int) -> None:
        self._window.append(last_index)

    def free_le(self, index: int) -> None:
        """An ack up to ``index`` covers every append that ended at or before it."""
        window = self._window
        while window and window[0] <= index:
            window.popleft()

    def free_first_one(self) -> None:
        """Open one slot when acks may have been lost, so a heartbeat response unblocks us."""
        if self._window:
            self._window.popleft()

    def reset(self) -> None:
        self._window.clear()


class Progress:
    """Replication state of one follower (or learner) as seen by the leader."""

    __slots__ = (
        "heard_since_beat",
        "inflights",
        "is_learner",
        "match",
        "next",
        "pending_snapshot",
        "probe_sent",
        "recent_active",
        "sent_commit",
        "snapshot_elapsed",
        "state",
    )

    def __init__(self, next_index: int, max_inflight: int, *, is_learner: bool, recent_active: bool) -> None:
        self.match = 0
        self.next = next_index
        self.state = ProgressState.PROBE
        self.probe_sent = False  # PROBE: an append is out, wait for its answer or a heartbeat response
        self.pending_snapshot = 0  # SNAPSHOT: index of the snapshot sent
        self.snapshot_elapsed = 0  # SNAPSHOT: ticks since it was sent, to retry a lost one
        self.recent_active = recent_active  # heard from since the last CheckQuorum round
        self.heard_since_beat = False  # answered an append since the last heartbeat (quiet_heartbeats)
        self.sent_commit = 0  # highest commit index advertised in an append
        self.inflights = Inflights(max_inflight)
        self.is_learner = is_learner

    def __repr__(self) -> str:
        return (
            f"Progress({self.state.name}, match={self.match}, next={self.next}, "
            f"inflight={len(self.inflights)}, active={self.recent_active})"
        )

    def is_paused(self) -> bool:
        """Whether we must not send another append now."""
        state = self.state
        if state == ProgressState.REPLICATE:
            return self.inflights.full()
        if state == ProgressState.PROBE:
            return self.probe_sent
        return True

    def become_probe(self) -> None:
        self.state = ProgressState.PROBE
        self.next = self.match + 1
        self.probe_sent = False
        self.pending_snapshot = 0
        self.inflights.reset()

    def become_replicate(self) -> None:
        self.state = ProgressState.REPLICATE
        self.next = self.match + 1
        self.probe_sent = False
        self.pending_snapshot = 0
        self.inflights.reset()

    def become_snapshot(self, snapshot_index: int) -> None:
        self.state = ProgressState.SNAPSHOT
        self.pending_snapshot = snapshot_index
        self.snapshot_elapsed = 0
        self.probe_sent = False
        self.inflights.reset()

    def sent_entries(self, last_index: int) -> None:
        """An append carrying entries up to ``last_index`` went out."""
        if self.state == ProgressState.REPLICATE:
            self.next = last_index + 1
            self.inflights.add(last_index)
        else:
            self.probe_sent = True

    def maybe_update(self, index: int) -> bool:
        """The follower holds our log up to ``index``. Returns whether that is news."""
        if index <= self.match:
            return False
        self.match = index
        if self.next <= index:
            self.next = index + 1
        self.probe_sent = False
        return True

    def maybe_decr_to(self, rejected: int, match_hint: int) -> bool:
        """The follower rejected an append whose previous index was ``rejected``.

        Returns False for a stale rejection (one about an append we have since moved past).
        ``match_hint`` is the highest index that may match, from the follower's reject hint.
        """
        if self.state == ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        self.next = max(min(rejected, match_hint + 1), self.match + 1)
        self.probe_sent = False
        return True


class VoteResult(IntEnum):
    PENDING = 0
    WON = 1
    LOST = 2


def quorum_size(voter_count: int) -> int:
    return voter_count // 2 + 1


class ProgressTracker:
    """All followers' progress, the leader's own durable match, and the votes of an election."""

    __slots__ = ("_max_inflight", "progress", "self_id", "self_match", "votes")

    def __init__(self, self_id: str, max_inflight: int) -> None:
        self.self_id = self_id
        self._max_inflight = max_inflight
        self.progress: dict[str, Progress] = {}
        self.self_match = 0  # the leader's own log, as far as it is persisted
        self.votes: dict[str, bool] = {}

    def reset(self, conf: ConfState, next_index: int, self_match: int) -> None:
        """Fresh state for a new term as leader: everyone PROBE at ``next_index``."""
        self.self_match = self_match
        self.progress = {}
        self._add_members(conf, next_index, recent_active=False)

    def apply_conf(self, conf: ConfState, next_index: int) -> None:
        """Track exactly ``conf``'s members (other than ourselves) after a conf change."""
        members = set(conf.voters) | set(conf.learners)
        for node in [n for n in self.progress if n not in members]:
            del self.progress[node]
        learners = set(conf.learners)
        for node, pr in self.progress.items():
            pr.is_learner = node in learners
        # A member just added is presumed alive so a snapshot goes out to it without delay.
        self._add_members(conf, next_index, recent_active=True)

    def _add_members(self, conf: ConfState, next_index: int, *, recent_active: bool) -> None:
        for nodes, is_learner in ((conf.voters, False), (conf.learners, True)):
            for node in nodes:
                if node != self.self_id and node not in self.progress:
                    self.progress[node] = Progress(
                        next_index, self._max_inflight, is_learner=is_learner, recent_active=recent_active
                    )

    def committed_index(self, voters: tuple[str, ...]) -> int:
        """The highest index held by a majority of ``voters`` (0 without voters)."""
        if not voters:
            return 0
        progress = self.progress
        self_id = self.self_id
        matches = []
        for v in voters:
            if v == self_id:
                matches.append(self.self_match)
            else:
                pr = progress.get(v)
                matches.append(pr.match if pr is not None else 0)
        matches.sort(reverse=True)
        return matches[quorum_size(len(matches)) - 1]

    def quorum_active(self, voters: tuple[str, ...]) -> bool:
        """Whether a majority of ``voters`` (ourselves included) was heard from recently."""
        progress = self.progress
        active = 0
        for v in voters:
            if v == self.self_id:
                active += 1
            else:
                pr = progress.get(v)
                if pr is not None and pr.recent_active:
                    active += 1
        return active >= quorum_size(len(voters))

    def reset_recent_active(self) -> None:
        for pr in self.progress.values():
            pr.recent_active = False

    def record_vote(self, node: str, granted: bool) -> None:
        self.votes.setdefault(node, granted)

    def tally(self, voters: Iterable[str]) -> VoteResult:
        voter_list = list(voters)
        granted = rejected = 0
        for v in voter_list:
            vote = self.votes.get(v)
            if vote is True:
                granted += 1
            elif vote is False:
                rejected += 1
        quorum = quorum_size(len(voter_list))
        if granted >= quorum:
            return VoteResult.WON
        if rejected > len(voter_list) - quorum:
            return VoteResult.LOST
        return VoteResult.PENDING
