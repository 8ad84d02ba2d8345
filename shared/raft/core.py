"""``RaftNode``: the sans-I/O Raft state machine (ticks, messages and proposals in; ``Ready`` out).

Modelled on etcd-io/raft's ``raft.go`` + ``RawNode``: the caller feeds ``tick()``, ``step(msg)``
and proposals, then drains ``ready()`` / ``advance()`` in the order documented on ``Ready``. The
node owns no clock, socket, thread or randomness besides the injected ``rand``.

Features: randomized election timeouts in ``[E, 2E)``; PreVote; CheckQuorum with leader lease;
pipelined, batched replication with probe/replicate/snapshot progress and term-based fast
backoff; prompt commit propagation; a no-op at the start of each term and Figure-8-safe commit;
proposal forwarding with drop reasons and back-pressure; leadership transfer; InstallSnapshot;
learners and single-server membership changes that take effect on append (see
``shared.raft.membership`` for why).

Lifecycle notes for the driver:

* A brand-new group member given ``bootstrap_voters`` starts from a *bootstrap snapshot* at index
  1, term 1, carrying the initial configuration and empty data. It is in the first ``Ready`` so
  storage persists it like any snapshot; the application must accept ``b""`` as "empty state".
  This keeps the initial configuration durable and lets a member added later learn it from the
  leader's snapshot.
* On restart the application restores its own snapshot and the node re-delivers the committed
  entries after it; then hand the stored snapshot to ``compact()`` so the node can ship it to a
  lagging follower (only the metadata is in ``RestoredState``).
* ``ready()`` and ``advance()`` alternate; ``step``/``tick``/``propose`` may be called in between.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from shared.raft.log import RaftInvariantError, RaftLog
from shared.raft.membership import ConfHistory, apply_conf_change, conf_change_refusal, same_conf
from shared.raft.progress import Progress, ProgressState, ProgressTracker, VoteResult
from shared.raft.types import (
    ConfChange,
    ConfState,
    DroppedProposal,
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
    Status,
    decode_conf_change,
    encode_conf_change,
)

__all__ = [
    "BOOTSTRAP_INDEX",
    "BOOTSTRAP_TERM",
    "COMMIT_NOTICE_CONTEXT",
    "TRANSFER_CONTEXT",
    "RaftInvariantError",
    "RaftNode",
]

TRANSFER_CONTEXT = b"transfer"  # on VOTE: a campaign caused by TIMEOUT_NOW; bypasses the leader lease
# On an empty APPEND anchored at the follower's known match index (a commit notice): the follower
# applies the commit and answers nothing, since its answer (that same index) would be no news to
# the leader; its heartbeat responses keep it counted as active. A rejection is still answered.
COMMIT_NOTICE_CONTEXT = b"commit"
BOOTSTRAP_INDEX = 1
BOOTSTRAP_TERM = 1

# Drop reasons, worded for the person reading a failed proposal.
NO_LEADER = "no leader"
NOT_LEADER = "not leader"
TRANSFER_IN_PROGRESS = "leadership transfer in progress"
TOO_MANY_UNCOMMITTED = "too many uncommitted entries"
CONF_CHANGE_PENDING = "conf change in progress"
TERM_NOT_COMMITTED = "leader has not committed an entry of its term yet"
MALFORMED_CONF_CHANGE = "malformed conf change"
LEADERSHIP_LOST = "leadership lost"

_NORMAL = EntryType.NORMAL
_CONF_CHANGE = EntryType.CONF_CHANGE
_APPEND = MessageType.APPEND
_APPEND_RESP = MessageType.APPEND_RESP
_HEARTBEAT = MessageType.HEARTBEAT
_HEARTBEAT_RESP = MessageType.HEARTBEAT_RESP
_SNAPSHOT = MessageType.SNAPSHOT
_VOTE = MessageType.VOTE
_VOTE_RESP = MessageType.VOTE_RESP
_PRE_VOTE = MessageType.PRE_VOTE
_PRE_VOTE_RESP = MessageType.PRE_VOTE_RESP
_PROPOSE = MessageType.PROPOSE
_PROPOSE_DROPPED = MessageType.PROPOSE_DROPPED
_TIMEOUT_NOW = MessageType.TIMEOUT_NOW
_FOLLOWER = Role.FOLLOWER
_PRE_CANDIDATE = Role.PRE_CANDIDATE
_CANDIDATE = Role.CANDIDATE
_LEADER = Role.LEADER
_REPLICATE = ProgressState.REPLICATE
_PROBE = ProgressState.PROBE
_SNAPSHOT_STATE = ProgressState.SNAPSHOT
_FROM_LEADER = frozenset({_APPEND, _HEARTBEAT, _SNAPSHOT})
_KNOWN_TYPES = frozenset(MessageType)


def _validate_config(config: RaftConfig) -> None:
    if config.heartbeat_ticks < 1:
        raise ValueError("heartbeat_ticks must be >= 1")
    if config.election_ticks <= config.heartbeat_ticks:
        raise ValueError("election_ticks must be greater than heartbeat_ticks")
    for name in ("max_entries_per_append", "max_bytes_per_append", "max_inflight_appends"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1")
    if config.max_uncommitted_entries < 1:
        raise ValueError("max_uncommitted_entries must be >= 1")


def _is_blank(restored: RestoredState) -> bool:
    return (
        not restored.entries
        and restored.snapshot_meta.index == 0
        and not restored.snapshot_meta.conf.voters
        and not restored.snapshot_meta.conf.learners
        and restored.hard_state == HardState()
    )


class RaftNode:
    """One member of a Raft group, as a pure state machine. See the module docstring."""

    __slots__ = (
        "_awaiting_commit",
        "_bcast_pending",
        "_conf",
        "_config",
        "_dropped",
        "_election_elapsed",
        "_heartbeat_elapsed",
        "_lead_transferee",
        "_leader",
        "_local_proposals",
        "_msgs",
        "_outstanding",
        "_overwritten",
        "_prev_hard_state",
        "_rand",
        "_randomized_timeout",
        "_recent_proposals",
        "_role",
        "_snapshot",
        "_term",
        "_tracker",
        "_vote",
        "id",
        "log",
    )

    def __init__(
        self,
        node_id: str,
        *,
        restored: RestoredState,
        rand: random.Random,
        config: RaftConfig = RaftConfig(),  # noqa: B008 - frozen, so sharing the default is safe
        bootstrap_voters: Sequence[str] = (),
    ) -> None:
        if not node_id:
            raise ValueError("node_id must be a non-empty string")
        _validate_config(config)
        self.id = node_id
        self._rand = rand
        self._config = config
        hard_state = restored.hard_state
        meta = restored.snapshot_meta
        self._prev_hard_state = hard_state  # what storage holds
        bootstrap: Snapshot | None = None
        if bootstrap_voters and _is_blank(restored):
            voters = tuple(dict.fromkeys(bootstrap_voters))
            meta = SnapshotMeta(BOOTSTRAP_INDEX, BOOTSTRAP_TERM, ConfState(voters=voters))
            hard_state = HardState(BOOTSTRAP_TERM, None, BOOTSTRAP_INDEX)
            bootstrap = Snapshot(meta)
        # The log under a snapshot of the bootstrap index is empty, so its data is known: b"".
        self._snapshot: Snapshot | None = Snapshot(meta) if meta.index <= BOOTSTRAP_INDEX else None
        self.log = RaftLog(meta.index, meta.term, restored.entries, max(hard_state.commit, meta.index))
        if bootstrap is not None:
            self.log.pending_snapshot = bootstrap
            self.log.applied = 0  # until the driver has the bootstrap snapshot
        self._conf = ConfHistory(meta.index, meta.conf)
        for e in restored.entries:
            if e.type == _CONF_CHANGE:
                self._record_conf_entry(e)
        self._term = hard_state.term
        self._vote = hard_state.vote
        self._role = _FOLLOWER
        self._leader: str | None = None
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = 0
        self._lead_transferee: str | None = None
        self._tracker = ProgressTracker(node_id, config.max_inflight_appends)
        self._msgs: list[Message] = []
        self._dropped: list[DroppedProposal] = []
        # Proposals made here (appended as leader, or forwarded) whose fate we may still report.
        self._local_proposals: dict[str, None] = {}
        # index -> (term, proposal id) of our own proposals cut from the log by a new leader. Such
        # an entry may still commit from another replica's copy, so the verdict waits for the
        # commit index to pass its index (then the committed entry there tells).
        self._overwritten: dict[int, tuple[int, str]] = {}
        # Proposal ids appended in this term as leader: a duplicate PROPOSE is ignored, not re-appended.
        self._recent_proposals: dict[str, None] = {}
        self._bcast_pending = False
        # Followers whose forwarded proposals wait to commit: member -> the last such index. With
        # ``eager_commit`` off they alone hear of a commit advance at once (their proposers wait).
        self._awaiting_commit: dict[str, int] = {}
        self._outstanding = False
        self._reset_election_timer()

    # ================================================================== read-only views

    @property
    def term(self) -> int:
        return self._term

    @property
    def vote(self) -> str | None:
        return self._vote

    @property
    def role(self) -> Role:
        return self._role

    @property
    def leader(self) -> str | None:
        return self._leader

    @property
    def conf(self) -> ConfState:
        return self._conf.current

    def status(self) -> Status:
        role = self._role
        conf = self._conf.current
        if role == _FOLLOWER and self.id in conf.learners:
            role = Role.LEARNER
        log = self.log
        return Status(
            self.id, self._term, role, self._leader, log.committed, log.applied, log.last_index(), conf
        )

    def conf_state_at(self, index: int) -> ConfState:
        """The configuration in force once the log is appended up to ``index`` (>= snapshot)."""
        return self._conf.at(index)

    def snapshot_meta(self, index: int) -> SnapshotMeta:
        """The metadata a snapshot of the application at ``index`` must carry for ``compact()``."""
        term = self.log.term(index)
        if term is None:
            raise ValueError(f"index {index} is not in the log")
        return SnapshotMeta(index, term, self._conf.at(index))

    # ================================================================== inputs

    def tick(self) -> None:
        """One logical clock tick: drives elections, heartbeats and leader checks."""
        if self._role == _LEADER:
            self._tick_leader()
        else:
            self._election_elapsed += 1
            if self._election_elapsed >= self._randomized_timeout and self._promotable():
                self._election_elapsed = 0
                self._campaign(pre_vote=self._config.pre_vote, transfer=False)

    def step(self, m: Message) -> None:
        """Process one message from a peer."""
        if m.to != self.id:
            return
        mtype = m.type
        self._check_structure(m)
        if mtype == _PROPOSE:
            self._on_propose(m)
            return
        if mtype == _PROPOSE_DROPPED:
            self._on_propose_dropped(m)
            return
        term = self._term
        if m.term > term:
            if mtype in (_VOTE, _PRE_VOTE):
                in_lease = (
                    self._config.check_quorum
                    and self._leader is not None
                    and self._election_elapsed < self._config.election_ticks
                )
                if in_lease and m.context != TRANSFER_CONTEXT:
                    return  # a live leader exists: do not let a disruptive node unseat it
            if mtype == _PRE_VOTE or (mtype == _PRE_VOTE_RESP and not m.reject):
                pass  # pre-votes are about a future term; they never change ours
            elif mtype == _VOTE and self._role == _FOLLOWER:
                # Adopt the term but keep our election clock (Raft Figure 2 resets it only on
                # granting a vote): a stale candidate that keeps timing out first must not hold
                # back the up-to-date nodes that could win.
                elapsed = self._election_elapsed
                self._become_follower(m.term, None)
                self._election_elapsed = elapsed
            else:
                self._become_follower(m.term, m.frm if mtype in _FROM_LEADER else None)
        elif m.term < term:
            if mtype in (_APPEND, _HEARTBEAT):
                # A stale leader (or one cut off while we moved on): tell it our term so it steps
                # down, or, with CheckQuorum/PreVote, we could never hear a vote that raises ours.
                self._send(Message(_APPEND_RESP, m.frm, self.id, term))
            elif mtype == _PRE_VOTE:
                self._send(Message(_PRE_VOTE_RESP, m.frm, self.id, term, reject=True))
            return
        if mtype in (_VOTE, _PRE_VOTE):
            self._on_vote_request(m)
            return
        role = self._role
        if role == _LEADER:
            if mtype == _APPEND_RESP:
                self._on_append_response(m)
            elif mtype == _HEARTBEAT_RESP:
                self._on_heartbeat_response(m)
        elif role == _FOLLOWER:
            if mtype == _APPEND:
                self._election_elapsed = 0
                self._leader = m.frm
                self._on_append(m)
            elif mtype == _HEARTBEAT:
                self._election_elapsed = 0
                self._leader = m.frm
                self._on_heartbeat(m)
            elif mtype == _SNAPSHOT:
                self._election_elapsed = 0
                self._leader = m.frm
                self._on_snapshot(m)
            elif mtype == _TIMEOUT_NOW:
                self._campaign(pre_vote=False, transfer=True)
        else:  # PRE_CANDIDATE or CANDIDATE
            if mtype in _FROM_LEADER:
                self._become_follower(self._term, m.frm)
                self.step(m)
            elif (mtype == _PRE_VOTE_RESP and role == _PRE_CANDIDATE) or (
                mtype == _VOTE_RESP and role == _CANDIDATE
            ):
                self._on_vote_response(m)

    def propose(self, data: bytes, proposal_id: str) -> None:
        """Replicate ``data``; the outcome is a committed entry or a ``DroppedProposal`` in a Ready."""
        self._propose(Entry(0, 1, _NORMAL, data, proposal_id))

    def propose_conf_change(self, change: ConfChange, proposal_id: str) -> None:
        """Propose one single-server membership change (one may be pending at a time)."""
        self._propose(Entry(0, 1, _CONF_CHANGE, encode_conf_change(change), proposal_id))

    def transfer_leadership(self, to: str) -> None:
        """As leader, hand leadership to voter ``to``: catch it up, then send TIMEOUT_NOW.

        Proposals are dropped until the transfer completes or an election timeout passes. A
        no-op on a non-leader, for ourselves, or for a non-voter.
        """
        if self._role != _LEADER or to == self.id or to not in self._conf.current.voters:
            return
        if self._lead_transferee == to:
            return
        self._lead_transferee = to
        self._election_elapsed = 0  # the transfer gets one election timeout to finish
        pr = self._tracker.progress[to]
        if pr.match == self.log.last_index():
            self._send_timeout_now(to)
        else:
            self._send_append(to)

    def compact(self, snapshot: Snapshot) -> None:
        """Take an application snapshot covering the log up to ``snapshot.meta.index``.

        Its metadata must match the log (use ``snapshot_meta()``). Entries up to there are
        dropped; the snapshot is kept to ship to followers that need them. A snapshot at the
        current snapshot index only supplies the data (how a restarted node gets it back).
        """
        meta = snapshot.meta
        log = self.log
        if meta.index < log.snapshot_index:
            return
        if meta.index == log.snapshot_index:
            if meta.term != log.snapshot_term:
                raise ValueError(f"snapshot term {meta.term} != log's {log.snapshot_term} at {meta.index}")
            self._snapshot = snapshot
            return
        if meta.index > log.applied:
            raise ValueError(f"cannot compact to {meta.index}: only {log.applied} is applied")
        expected = self.snapshot_meta(meta.index)
        if meta.term != expected.term:
            raise ValueError(f"snapshot term {meta.term} != log's {expected.term} at {meta.index}")
        if not same_conf(meta.conf, expected.conf):
            raise ValueError(f"snapshot conf {meta.conf} != {expected.conf} at index {meta.index}")
        log.compact_to(meta.index, meta.term)
        self._conf.compact_to(meta.index)
        self._snapshot = snapshot

    # ================================================================== Ready cycle

    def has_ready(self) -> bool:
        """Whether ``ready()`` would return any work."""
        log = self.log
        prev = self._prev_hard_state
        return bool(
            self._msgs
            or self._dropped
            or self._bcast_pending
            or log.pending_snapshot is not None
            or log.last_index() > log.handed_out
            or log.committed > log.applying
            or self._term != prev.term
            or self._vote != prev.vote
            or log.committed != prev.commit
        )

    def ready(self) -> Ready:
        """Everything to persist, send and apply since the last ``Ready``. Pair with ``advance()``."""
        if self._outstanding:
            raise RuntimeError("ready() called again before advance() of the previous Ready")
        if self._bcast_pending:
            self._bcast_pending = False
            if self._role == _LEADER:
                self._bcast_append()
        log = self.log
        rd = Ready()
        prev = self._prev_hard_state
        if self._term != prev.term or self._vote != prev.vote or log.committed != prev.commit:
            rd.hard_state = self._prev_hard_state = HardState(self._term, self._vote, log.committed)
        if log.pending_snapshot is not None:
            rd.snapshot = log.pending_snapshot
            log.pending_snapshot = None
        if log.last_index() > log.handed_out:
            rd.entries = log.unstable()
            log.handed_out = log.last_index()
        if self._msgs:
            rd.messages = self._msgs
            self._msgs = []
        if log.committed > log.applying:
            committed = log.committed_to_apply()
            rd.committed_entries = committed
            log.applying = log.committed
            local = self._local_proposals
            if local:
                for e in committed:
                    if e.proposal_id:
                        local.pop(e.proposal_id, None)
            if self._overwritten:
                self._settle_overwritten(committed)
        if self._dropped:
            rd.dropped_proposals = self._dropped
            self._dropped = []
        self._outstanding = True
        return rd

    def advance(self, ready: Ready) -> None:
        """The driver finished ``ready``: it is persisted, sent and applied."""
        if not self._outstanding:
            raise RuntimeError("advance() without a matching ready()")
        self._outstanding = False
        log = self.log
        if ready.snapshot is not None and ready.snapshot.meta.index > log.applied:
            log.applied = ready.snapshot.meta.index
        if ready.committed_entries:
            last_applied = ready.committed_entries[-1].index
            if last_applied > log.applied:
                log.applied = last_applied
        if ready.entries:
            last = ready.entries[-1]
            log.stable_to(last.index, last.term)
            if self._role == _LEADER and log.persisted > self._tracker.self_match:
                self._tracker.self_match = log.persisted
                if self._maybe_commit():
                    self._on_commit_advanced()

    # ================================================================== elections

    def _promotable(self) -> bool:
        """Whether this node may campaign.

        A voter of its latest configuration may; so may a voter of the configuration in force at
        its commit index while a change removing it is still uncommitted (dissertation §4.2.2):
        it can hold the only complete log, and the remaining voters, still under the old
        configuration, may need it to lead long enough to commit its own removal. Votes are
        always counted against the latest configuration.
        """
        conf = self._conf
        if self.id in conf.current.voters:
            return True
        return conf.last_change_index > self.log.committed and self.id in conf.at(self.log.committed).voters

    def _reset_election_timer(self) -> None:
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        election = self._config.election_ticks
        self._randomized_timeout = election + self._rand.randrange(election)

    def _become_follower(self, term: int, leader: str | None) -> None:
        if term != self._term:
            self._term = term
            self._vote = None
        self._role = _FOLLOWER
        self._leader = leader
        self._lead_transferee = None
        self._reset_election_timer()

    def _campaign(self, *, pre_vote: bool, transfer: bool) -> None:
        if not self._promotable():
            return
        log = self.log
        tracker = self._tracker
        tracker.votes = {}
        if pre_vote:
            self._role = _PRE_CANDIDATE
            self._leader = None
            self._reset_election_timer()
            request, vote_term = _PRE_VOTE, self._term + 1
        else:
            self._become_follower(self._term + 1, None)
            self._role = _CANDIDATE
            self._vote = self.id
            request, vote_term = _VOTE, self._term
        tracker.record_vote(self.id, True)
        voters = self._conf.current.voters
        if tracker.tally(voters) == VoteResult.WON:  # a single voter: no one to ask
            if pre_vote:
                self._campaign(pre_vote=False, transfer=transfer)
            else:
                self._become_leader()
            return
        context = TRANSFER_CONTEXT if transfer else b""
        last_index, last_term = log.last_index(), log.last_term()
        for voter in voters:
            if voter != self.id:
                self._send(
                    Message(request, voter, self.id, vote_term, last_term, last_index, context=context)
                )

    def _on_vote_request(self, m: Message) -> None:
        pre_vote = m.type == _PRE_VOTE
        can_vote = (
            self._vote == m.frm
            or (self._vote is None and self._leader is None)
            or (pre_vote and m.term > self._term)
        )
        response = _PRE_VOTE_RESP if pre_vote else _VOTE_RESP
        if can_vote and self.log.is_up_to_date(m.index, m.log_term):
            self._send(Message(response, m.frm, self.id, m.term))
            if not pre_vote:
                self._election_elapsed = 0
                self._vote = m.frm
        else:
            self._send(Message(response, m.frm, self.id, self._term, reject=True))

    def _on_vote_response(self, m: Message) -> None:
        tracker = self._tracker
        tracker.record_vote(m.frm, not m.reject)
        result = tracker.tally(self._conf.current.voters)
        if result == VoteResult.WON:
            if self._role == _PRE_CANDIDATE:
                self._campaign(pre_vote=False, transfer=False)
            else:
                self._become_leader()
        elif result == VoteResult.LOST:
            self._become_follower(self._term, None)

    def _become_leader(self) -> None:
        self._role = _LEADER
        self._leader = self.id
        self._lead_transferee = None
        self._reset_election_timer()
        log = self.log
        self._tracker.reset(self._conf.current, log.last_index() + 1, log.persisted)
        self._recent_proposals = {}
        self._awaiting_commit = {}
        # The no-op commits every earlier-term entry (Figure 8) and opens conf changes.
        self._append_as_leader(_NORMAL, b"", "")
        self._bcast_append()

    # ================================================================== leader

    def _tick_leader(self) -> None:
        self._heartbeat_elapsed += 1
        self._election_elapsed += 1
        config = self._config
        for pr in self._tracker.progress.values():
            if pr.state == _SNAPSHOT_STATE:
                pr.snapshot_elapsed += 1
                if pr.snapshot_elapsed >= config.election_ticks:
                    pr.become_probe()  # presume the snapshot lost; the next response retries
        if self._election_elapsed >= config.election_ticks:
            self._election_elapsed = 0
            if config.check_quorum:
                if not self._tracker.quorum_active(self._conf.current.voters):
                    self._become_follower(self._term, None)
                    return
                self._tracker.reset_recent_active()
            self._lead_transferee = None  # a transfer that took an election timeout failed
        if self._heartbeat_elapsed >= config.heartbeat_ticks:
            self._heartbeat_elapsed = 0
            self._bcast_heartbeat()

    def _append_as_leader(self, entry_type: EntryType, data: bytes, proposal_id: str) -> None:
        log = self.log
        entry = Entry(self._term, log.last_index() + 1, entry_type, data, proposal_id)
        log.append(entry)
        if entry_type == _CONF_CHANGE:
            self._record_conf_entry(entry)
            self._tracker.apply_conf(self._conf.current, entry.index)
            if self._lead_transferee not in self._tracker.progress:
                self._lead_transferee = None
            if self._maybe_commit():  # removing a lagging voter can complete a quorum
                self._on_commit_advanced()

    def _send_append(self, to: str, *, send_if_empty: bool = True) -> bool:
        """Send ``to`` what it lacks (or a snapshot). Returns whether a message went out."""
        pr = self._tracker.progress[to]
        if pr.is_paused():
            return False
        log = self.log
        prev_index = pr.next - 1
        prev_term = log.term(prev_index)
        if prev_term is None:
            return self._send_snapshot(to, pr)
        if pr.next <= log.last_index():
            config = self._config
            entries = log.slice(pr.next, config.max_entries_per_append, config.max_bytes_per_append)
        else:
            if not send_if_empty:
                return False
            entries = []
        commit = log.committed
        self._msgs.append(
            Message(_APPEND, to, self.id, self._term, prev_term, prev_index, tuple(entries), commit)
        )
        pr.sent_commit = commit
        if entries:
            pr.sent_entries(entries[-1].index)
        elif pr.state == _PROBE:
            pr.probe_sent = True
        return True

    def _send_snapshot(self, to: str, pr: Progress) -> bool:
        snapshot = self._snapshot
        if not pr.recent_active or snapshot is None or snapshot.meta.index != self.log.snapshot_index:
            # Not to a node that may be down; and without the data (restart, before the driver
            # handed it back through compact()) there is nothing to send yet.
            return False
        self._msgs.append(Message(_SNAPSHOT, to, self.id, self._term, snapshot=snapshot))
        pr.become_snapshot(snapshot.meta.index)
        return True

    def _send_commit_nudge(self, to: str, pr: Progress) -> None:
        """Tell a follower we may not stream to right now that its entries committed.

        An empty append anchored at its match index is always accepted and cannot disturb the
        appends in flight; without it the commit would wait for the next heartbeat. It is marked
        ``COMMIT_NOTICE_CONTEXT``: its response could only repeat that match index, so none is
        sent (on the replicas' TLS links a record each way per follower and commit otherwise).
        """
        log = self.log
        commit = log.committed
        if pr.state == _SNAPSHOT_STATE or pr.sent_commit >= commit or pr.match == 0:
            return
        match_term = log.term(pr.match)
        if match_term is None:
            return
        notice = Message(
            _APPEND,
            to,
            self.id,
            self._term,
            match_term,
            pr.match,
            commit=commit,
            context=COMMIT_NOTICE_CONTEXT,
        )
        self._msgs.append(notice)
        pr.sent_commit = commit

    def _replicate(self, to: str) -> None:
        """Send ``to`` an append (even an empty one, for the commit index), then keep streaming
        while its window allows: a backlog bigger than one batch goes out pipelined at once."""
        if self._send_append(to):
            while self._send_append(to, send_if_empty=False):
                pass

    def _bcast_append(self) -> None:
        for node in self._tracker.progress:
            self._replicate(node)

    def _bcast_heartbeat(self) -> None:
        commit = self.log.committed
        term = self._term
        quiet = self._config.quiet_heartbeats
        for node, pr in self._tracker.progress.items():
            # Never past what the follower is known to hold: it may still have a stale suffix.
            known = min(pr.match, commit)
            heard, pr.heard_since_beat = pr.heard_since_beat, False
            if quiet and heard and pr.state == _REPLICATE and pr.sent_commit >= known:
                continue  # this beat's work is done (RaftConfig.quiet_heartbeats)
            self._msgs.append(Message(_HEARTBEAT, node, self.id, term, commit=known))

    def _send_timeout_now(self, to: str) -> None:
        self._msgs.append(Message(_TIMEOUT_NOW, to, self.id, self._term))

    def _maybe_commit(self) -> bool:
        """Advance the commit index to what a quorum holds, but only via an entry of our term.

        Counting replicas of an older-term entry is unsafe (Raft Figure 8); such entries commit
        indirectly once an entry of the current term above them does.
        """
        log = self.log
        candidate = self._tracker.committed_index(self._conf.current.voters)
        if candidate > log.committed and log.term(candidate) == self._term:
            log.commit_to(candidate)
            return True
        return False

    def _on_commit_advanced(self) -> None:
        """Tell followers right away (followers' proposers wait on it); maybe step down. With
        ``eager_commit`` off only followers whose own proposals just committed are told now; the
        others learn it from the next append or heartbeat (one tick), which spares every entry an
        empty append and its response per follower."""
        eager = self._config.eager_commit
        committed = self.log.committed
        awaiting = self._awaiting_commit
        for node, pr in self._tracker.progress.items():
            if not eager:
                index = awaiting.get(node)
                if index is None or index > committed:
                    continue
                del awaiting[node]
            if pr.is_paused():
                self._send_commit_nudge(node, pr)
            else:
                self._replicate(node)
        conf = self._conf
        if self.id not in conf.current.voters and conf.last_change_index <= self.log.committed:
            self._step_down_after_removal()

    def commit_notice_owed(self) -> bool:
        """With ``eager_commit`` off: whether a follower holds entries that committed since it was
        last told. The driver answers with ``send_commit_notices`` a moment later, so followers
        apply within that moment instead of at the next heartbeat, and an append that goes out
        meanwhile (the next proposal's) carries the commit instead."""
        if self._role != _LEADER:
            return False
        committed = self.log.committed
        return any(pr.sent_commit < min(pr.match, committed) for pr in self._tracker.progress.values())

    def send_commit_notices(self) -> None:
        """Tell every follower that holds newly committed entries of the commit (an empty append
        anchored at its match index, as ``_send_commit_nudge``). A no-op unless leader."""
        if self._role != _LEADER:
            return
        committed = self.log.committed
        for node, pr in self._tracker.progress.items():
            if pr.sent_commit < min(pr.match, committed):
                self._send_commit_nudge(node, pr)

    def _step_down_after_removal(self) -> None:
        """Our removal committed: hand over to the most up-to-date voter and stop leading."""
        last = self.log.last_index()
        best: str | None = None
        best_match = -1
        progress = self._tracker.progress
        for voter in self._conf.current.voters:
            pr = progress.get(voter)
            if pr is not None and pr.match > best_match:
                best, best_match = voter, pr.match
        if best is not None and best_match == last:
            self._send_timeout_now(best)
        self._become_follower(self._term, None)

    def _on_append_response(self, m: Message) -> None:
        pr = self._tracker.progress.get(m.frm)
        if pr is None:
            return
        pr.recent_active = True
        pr.heard_since_beat = not m.reject
        log = self.log
        if m.reject:
            hint = m.reject_hint
            if m.log_term > 0:
                hint = log.find_conflict_by_term(hint, m.log_term)[0]
            if pr.maybe_decr_to(m.index, hint):
                if pr.state == _REPLICATE:
                    pr.become_probe()
                self._send_append(m.frm)
            return
        if m.index > log.last_index():
            return  # acknowledges entries we never had: not from this term's leader
        was_paused = pr.is_paused()
        if not pr.maybe_update(m.index):
            return
        state = pr.state
        if state == _REPLICATE:
            pr.inflights.free_le(m.index)
        elif state == _PROBE or pr.match >= log.snapshot_index:
            pr.become_replicate()
        if self._maybe_commit():
            self._on_commit_advanced()
            if self._role != _LEADER:
                return
        elif was_paused:
            self._send_append(m.frm)
        while self._send_append(m.frm, send_if_empty=False):
            pass
        if pr.sent_commit < log.committed and not pr.is_paused() and self._config.eager_commit:
            self._send_append(m.frm)
        if m.frm == self._lead_transferee and pr.match == log.last_index():
            self._send_timeout_now(m.frm)

    def _on_heartbeat_response(self, m: Message) -> None:
        pr = self._tracker.progress.get(m.frm)
        if pr is None:
            return
        pr.recent_active = True
        pr.probe_sent = False
        if pr.state == _REPLICATE and pr.inflights.full():
            pr.inflights.free_first_one()
        # Lagging (or lost appends): resend. An empty append at ``next`` detects a lost tail.
        if pr.match < self.log.last_index():
            self._send_append(m.frm)

    # ================================================================== follower

    def _on_append(self, m: Message) -> None:
        log = self.log
        if m.index < log.committed:
            # Everything up to our commit index is settled; tell the leader where we are.
            self._send(Message(_APPEND_RESP, m.frm, self.id, self._term, index=log.committed))
            return
        result = log.maybe_append(m.index, m.log_term, m.commit, m.entries)
        if result is None:
            hint_index, hint_term = log.find_conflict_by_term(min(m.index, log.last_index()), m.log_term)
            self._send(
                Message(
                    _APPEND_RESP,
                    m.frm,
                    self.id,
                    self._term,
                    log_term=hint_term,
                    index=m.index,
                    reject=True,
                    reject_hint=hint_index,
                )
            )
            return
        last_new, first_written, removed = result
        if first_written:
            if removed:
                self._conf.truncate_from(first_written)
                self._note_overwritten(removed)
            for e in m.entries[first_written - m.index - 1 :]:
                if e.type == _CONF_CHANGE:
                    self._record_conf_entry(e)
        if m.context == COMMIT_NOTICE_CONTEXT and not m.entries:
            return  # the leader already knows we hold m.index (see COMMIT_NOTICE_CONTEXT)
        self._send(Message(_APPEND_RESP, m.frm, self.id, self._term, index=last_new))

    def _on_heartbeat(self, m: Message) -> None:
        log = self.log
        log.commit_to(min(m.commit, log.last_index()))
        self._send(Message(_HEARTBEAT_RESP, m.frm, self.id, self._term))

    def _on_snapshot(self, m: Message) -> None:
        snapshot = m.snapshot
        assert snapshot is not None  # _check_structure
        meta = snapshot.meta
        log = self.log
        if meta.index > log.committed:
            if log.term(meta.index) == meta.term:
                log.commit_to(meta.index)  # we hold its last entry: the log continues it
            else:
                log.restore(snapshot)
                self._conf.reset(meta.index, meta.conf)
                self._snapshot = snapshot
                if self._overwritten:
                    self._forget_overwritten_upto(meta.index)
        self._send(Message(_APPEND_RESP, m.frm, self.id, self._term, index=log.committed))

    # ================================================================== proposals

    def _propose(self, entry: Entry) -> None:
        if self._role == _LEADER:
            if self._admit(entry, forwarder=None):
                self._bcast_pending = True
        elif self._leader is not None:
            self._track_local(entry.proposal_id)
            self._forward(entry)
        else:
            self._dropped.append(DroppedProposal(entry.proposal_id, NO_LEADER))

    def _admit(self, entry: Entry, forwarder: str | None) -> bool:
        """Append a proposal as leader, or drop it with the reason. Returns whether appended."""
        recent = self._recent_proposals
        proposal_id = entry.proposal_id
        if proposal_id and proposal_id in recent:
            return False  # a duplicate of one we appended: dropping it would be a lie
        reason: str | None = None
        log = self.log
        if self._lead_transferee is not None:
            reason = TRANSFER_IN_PROGRESS
        elif log.last_index() - log.committed >= self._config.max_uncommitted_entries:
            reason = TOO_MANY_UNCOMMITTED
        elif entry.type == _CONF_CHANGE:
            reason = self._conf_change_refusal(entry.data)
        elif entry.type != _NORMAL:
            reason = f"unknown entry type {entry.type!r}"
        if reason is not None:
            if forwarder is None:
                self._dropped.append(DroppedProposal(entry.proposal_id, reason))
            else:
                self._send_dropped(forwarder, entry, reason)
            return False
        if forwarder is None:
            self._track_local(proposal_id)
        else:
            self._awaiting_commit[forwarder] = self.log.last_index() + 1
        if proposal_id:
            recent[proposal_id] = None
            if len(recent) > self._config.max_uncommitted_entries:
                del recent[next(iter(recent))]
        self._append_as_leader(entry.type, entry.data, proposal_id)
        return True

    def _conf_change_refusal(self, data: bytes) -> str | None:
        log = self.log
        if self._conf.last_change_index > log.committed:
            return CONF_CHANGE_PENDING
        if log.term(log.committed) != self._term:
            return TERM_NOT_COMMITTED
        try:
            change = decode_conf_change(data)
        except ValueError:
            return MALFORMED_CONF_CHANGE
        return conf_change_refusal(self._conf.current, change)

    def _forward(self, entry: Entry) -> None:
        leader = self._leader
        assert leader is not None
        msgs = self._msgs
        if msgs:
            last = msgs[-1]
            if last.type == _PROPOSE and last.to == leader:
                # Coalesce: proposals made between two Readies travel in one message.
                entries = (
                    *last.entries,
                    Entry(0, len(last.entries) + 1, entry.type, entry.data, entry.proposal_id),
                )
                msgs[-1] = Message(_PROPOSE, leader, self.id, self._term, entries=entries)
                return
        msgs.append(Message(_PROPOSE, leader, self.id, self._term, entries=(entry,)))

    def _send_dropped(self, to: str, entry: Entry, reason: str) -> None:
        context = reason.encode()
        msgs = self._msgs
        if msgs:
            last = msgs[-1]
            if last.type == _PROPOSE_DROPPED and last.to == to and last.context == context:
                dropped = Entry(0, len(last.entries) + 1, entry.type, b"", entry.proposal_id)
                msgs[-1] = Message(
                    _PROPOSE_DROPPED,
                    to,
                    self.id,
                    self._term,
                    entries=(*last.entries, dropped),
                    context=context,
                )
                return
        dropped = Entry(0, 1, entry.type, b"", entry.proposal_id)
        msgs.append(Message(_PROPOSE_DROPPED, to, self.id, self._term, entries=(dropped,), context=context))

    def _on_propose(self, m: Message) -> None:
        if self._role != _LEADER:
            for e in m.entries:
                self._send_dropped(m.frm, e, NOT_LEADER)
            return
        appended = False
        for e in m.entries:
            appended = self._admit(e, forwarder=m.frm) or appended
        if appended:
            self._bcast_pending = True

    def _on_propose_dropped(self, m: Message) -> None:
        reason = m.context.decode("utf-8", "replace") or "dropped by the leader"
        local = self._local_proposals
        for e in m.entries:
            local.pop(e.proposal_id, None)
            self._dropped.append(DroppedProposal(e.proposal_id, reason))

    def _track_local(self, proposal_id: str) -> None:
        if not proposal_id:
            return
        local = self._local_proposals
        local[proposal_id] = None
        if len(local) > self._config.max_uncommitted_entries:
            del local[next(iter(local))]  # forgotten: its waiter falls back to its timeout

    def _note_overwritten(self, removed: list[Entry]) -> None:
        """Our own proposals were cut from the log; judge them once their index commits."""
        local = self._local_proposals
        if not local:
            return
        for e in removed:
            if e.proposal_id and e.proposal_id in local:
                del local[e.proposal_id]
                self._overwritten[e.index] = (e.term, e.proposal_id)

    def _settle_overwritten(self, committed: list[Entry]) -> None:
        """A different entry committed where our proposal was: it is definitely lost."""
        overwritten = self._overwritten
        for e in committed:
            lost = overwritten.pop(e.index, None)
            if lost is not None and lost[0] != e.term:
                self._dropped.append(DroppedProposal(lost[1], LEADERSHIP_LOST))

    def _forget_overwritten_upto(self, index: int) -> None:
        """A snapshot covers these indices: the entries there are unknown, so is the verdict."""
        overwritten = self._overwritten
        for i in [i for i in overwritten if i <= index]:
            del overwritten[i]

    # ================================================================== helpers

    def _record_conf_entry(self, entry: Entry) -> None:
        try:
            change = decode_conf_change(entry.data)
        except ValueError:
            return  # never admitted by a leader; treat as a no-op rather than diverge
        conf = self._conf
        conf.record(entry.index, apply_conf_change(conf.current, change))

    def _send(self, m: Message) -> None:
        self._msgs.append(m)

    def _check_structure(self, m: Message) -> None:
        """Reject messages no correct peer could send; everything else is handled per Raft."""
        if m.type not in _KNOWN_TYPES:
            raise ValueError(f"unknown message type {m.type!r}")
        if m.term < 0 or m.index < 0 or m.commit < 0 or m.log_term < 0:
            raise ValueError("negative term, index or commit")
        entries = m.entries
        if entries and m.type == _APPEND:
            if entries[0].index != m.index + 1 or entries[-1].index != m.index + len(entries):
                raise ValueError(f"append entries are not contiguous after index {m.index}")
            if entries[-1].term > m.term or entries[0].term < m.log_term:
                raise ValueError("append entries carry terms outside [prev term, message term]")
        elif m.type == _SNAPSHOT and m.snapshot is None:
            raise ValueError("snapshot message without a snapshot")
