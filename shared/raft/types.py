"""Value types shared by the Raft core, its durable storage and its asyncio driver.

They are the contract between the sans-I/O core (``shared.raft.core``) and the shells around it:
the core consumes ``Message``s and produces ``Ready`` batches; storage persists ``Entry``,
``HardState`` and ``Snapshot``; the transport moves ``Message``s as msgpack (``shared.raft.codec``).
All are immutable so a batch handed to the driver cannot change under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class EntryType(IntEnum):
    NORMAL = 0  # application data (an empty NORMAL entry is the leader's no-op at term start)
    CONF_CHANGE = 1  # data is an encoded ``ConfChange``


@dataclass(frozen=True, slots=True)
class Entry:
    term: int
    index: int
    type: EntryType = EntryType.NORMAL
    data: bytes = b""
    # Set by whoever proposed the entry so it can learn when (and whether) it committed.
    proposal_id: str = ""


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be on disk before any message that depends on it is sent."""

    term: int = 0
    vote: str | None = None
    commit: int = 0


@dataclass(frozen=True, slots=True)
class ConfState:
    voters: tuple[str, ...] = ()
    learners: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        return self.voters + self.learners


class ConfChangeType(IntEnum):
    ADD_LEARNER = 0
    PROMOTE = 1
    REMOVE = 2


@dataclass(frozen=True, slots=True)
class ConfChange:
    type: ConfChangeType
    node_id: str
    # Opaque to the core; the driver uses it to carry the new member's transport address.
    context: bytes = b""


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    index: int = 0
    term: int = 0
    conf: ConfState = field(default_factory=ConfState)


@dataclass(frozen=True, slots=True)
class Snapshot:
    meta: SnapshotMeta
    data: bytes = b""  # supplied and restored by the application


class MessageType(IntEnum):
    PRE_VOTE = 0
    PRE_VOTE_RESP = 1
    VOTE = 2
    VOTE_RESP = 3
    APPEND = 4
    APPEND_RESP = 5
    HEARTBEAT = 6
    HEARTBEAT_RESP = 7
    SNAPSHOT = 8  # InstallSnapshot
    PROPOSE = 9  # a follower forwarding proposals to the leader
    PROPOSE_DROPPED = 10  # the leader telling a forwarder its proposals were not appended
    TIMEOUT_NOW = 11  # leadership transfer: campaign now, skipping pre-vote


@dataclass(frozen=True, slots=True)
class Message:
    type: MessageType
    to: str
    frm: str
    term: int
    log_term: int = 0  # APPEND: prev entry's term; VOTE/PRE_VOTE: candidate's last log term
    index: int = 0  # APPEND: prev entry's index; VOTE: last log index; *_RESP: match/reject index
    entries: tuple[Entry, ...] = ()
    commit: int = 0
    reject: bool = False
    reject_hint: int = 0  # APPEND_RESP on reject: follower's last index, to back off quickly
    snapshot: Snapshot | None = None
    context: bytes = b""  # e.g. b"transfer" on a campaign caused by TIMEOUT_NOW


class Role(IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3
    LEARNER = 4  # a non-voting member (follower that cannot campaign or vote)


@dataclass(frozen=True, slots=True)
class Status:
    id: str
    term: int
    role: Role
    leader: str | None
    commit: int
    applied: int
    last_index: int
    conf: ConfState


@dataclass(frozen=True, slots=True)
class DroppedProposal:
    proposal_id: str
    reason: (
        str  # human readable: "no leader", "not leader", "leadership lost", "conf change in progress", ...
    )


@dataclass(slots=True)
class Ready:
    """One batch of work for the driver, in this order:

    1. persist ``snapshot`` (if any), then ``entries`` (truncating any stored suffix from
       ``entries[0].index`` on), then ``hard_state`` (if not None) — durably (fsync);
    2. send ``messages``;
    3. restore ``snapshot`` into the application, then apply ``committed_entries`` in order;
    4. fail the waiters in ``dropped_proposals``;
    5. call ``RaftNode.advance(ready)``.
    """

    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    messages: list[Message] = field(default_factory=list)
    committed_entries: list[Entry] = field(default_factory=list)
    dropped_proposals: list[DroppedProposal] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.hard_state is not None
            or self.entries
            or self.snapshot is not None
            or self.messages
            or self.committed_entries
            or self.dropped_proposals
        )


@dataclass(frozen=True, slots=True)
class RestoredState:
    """What storage hands back on restart (or an empty one for a brand-new member)."""

    hard_state: HardState = field(default_factory=HardState)
    snapshot_meta: SnapshotMeta = field(default_factory=SnapshotMeta)
    entries: tuple[Entry, ...] = ()  # contiguous, starting at snapshot_meta.index + 1


@dataclass(frozen=True, slots=True)
class RaftConfig:
    election_ticks: int = 10  # a follower campaigns after a random timeout in [E, 2E) ticks
    heartbeat_ticks: int = 1
    pre_vote: bool = True
    check_quorum: bool = True
    max_entries_per_append: int = 256
    max_bytes_per_append: int = 4 * 1024 * 1024
    max_inflight_appends: int = 64  # pipelining window per follower
    max_uncommitted_entries: int = 10_000  # back-pressure: proposals beyond this are dropped
    # True: a commit advance goes to every follower at once (an empty append each, and its
    # response). False: only to followers whose forwarded proposals committed; the others learn it
    # from the next append or heartbeat (heartbeat_ticks), for groups where followers rarely propose.
    eager_commit: bool = True
    # True: no heartbeat to a follower that answered an append since the last heartbeat and was
    # sent the commit index it may apply: that append reset its election timer and its answer
    # keeps it counted as active, so while entries flow (a busy kernel: an append and its answer
    # per cell) no heartbeat round goes out, each a message (on the replicas' links, a TLS record)
    # each way per follower. An idle group still beats every ``heartbeat_ticks``.
    quiet_heartbeats: bool = False


def encode_conf_change(change: ConfChange) -> bytes:
    """CONF_CHANGE entries carry this encoding in ``Entry.data``."""
    import msgpack

    return msgpack.packb([int(change.type), change.node_id, change.context], use_bin_type=True)


def decode_conf_change(data: bytes) -> ConfChange:
    import msgpack

    try:
        kind, node_id, context = msgpack.unpackb(data, raw=False)
        return ConfChange(ConfChangeType(kind), str(node_id), bytes(context))
    except Exception as exc:
        raise ValueError(f"malformed conf change entry: {exc}") from exc
