"""msgpack encoding of Raft values for the wire and the disk.

Everything is encoded as positional arrays (not maps): a Raft message is sent thousands of times a
second and field names would double its size. Decoding is strict because the bytes come from the
network or from a disk that may have been torn: any structural problem raises ``ValueError`` naming
what was wrong, so the caller can log and drop the frame instead of crashing the node.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgpack

from shared.raft.types import (
    ConfState,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)

WIRE_VERSION = 1

# Hoisted lookups: the decoders run once per message/entry on the hot path.
_ENTRY_TYPES = {int(t): t for t in EntryType}
_MESSAGE_TYPES = {int(t): t for t in MessageType}
_MAX_FRAME = 256 * 1024 * 1024  # refuse to even try unpacking anything larger


# --------------------------------------------------------------------------- plain values


def entry_to_wire(e: Entry) -> list[Any]:
    return [e.term, e.index, int(e.type), e.data, e.proposal_id]


def entry_from_wire(raw: Any) -> Entry:
    if type(raw) is not list or len(raw) != 5:
        raise ValueError(f"entry must be a 5-element array, got {_describe(raw)}")
    term, index, etype, data, proposal_id = raw
    if type(term) is not int or term < 0:
        raise ValueError(f"entry term must be a non-negative int, got {term!r}")
    if type(index) is not int or index < 1:
        raise ValueError(f"entry index must be a positive int, got {index!r}")
    kind = _ENTRY_TYPES.get(etype) if type(etype) is int else None
    if kind is None:
        raise ValueError(f"unknown entry type {etype!r}")
    if type(data) is not bytes:
        raise ValueError(f"entry data must be bytes, got {_describe(data)}")
    if type(proposal_id) is not str:
        raise ValueError(f"entry proposal_id must be str, got {_describe(proposal_id)}")
    return Entry(term, index, kind, data, proposal_id)


def entries_from_wire(raw: Any) -> tuple[Entry, ...]:
    if type(raw) is not list:
        raise ValueError(f"entries must be an array, got {_describe(raw)}")
    out = tuple(entry_from_wire(r) for r in raw)
    for prev, nxt in itertools.pairwise(out):
        if nxt.index != prev.index + 1:
            raise ValueError(f"entries are not contiguous: {prev.index} then {nxt.index}")
    return out


def hard_state_to_wire(hs: HardState) -> list[Any]:
    return [hs.term, hs.vote, hs.commit]


def hard_state_from_wire(raw: Any) -> HardState:
    if type(raw) is not list or len(raw) != 3:
        raise ValueError(f"hard state must be a 3-element array, got {_describe(raw)}")
    term, vote, commit = raw
    if type(term) is not int or term < 0:
        raise ValueError(f"hard state term must be a non-negative int, got {term!r}")
    if vote is not None and type(vote) is not str:
        raise ValueError(f"hard state vote must be str or nil, got {_describe(vote)}")
    if type(commit) is not int or commit < 0:
        raise ValueError(f"hard state commit must be a non-negative int, got {commit!r}")
    return HardState(term, vote, commit)


def snapshot_meta_to_wire(meta: SnapshotMeta) -> list[Any]:
    return [meta.index, meta.term, list(meta.conf.voters), list(meta.conf.learners)]


def snapshot_meta_from_wire(raw: Any) -> SnapshotMeta:
    if type(raw) is not list or len(raw) != 4:
        raise ValueError(f"snapshot meta must be a 4-element array, got {_describe(raw)}")
    index, term, voters, learners = raw
    if type(index) is not int or index < 0:
        raise ValueError(f"snapshot index must be a non-negative int, got {index!r}")
    if type(term) is not int or term < 0:
        raise ValueError(f"snapshot term must be a non-negative int, got {term!r}")
    return SnapshotMeta(
        index, term, ConfState(_str_tuple(voters, "voters"), _str_tuple(learners, "learners"))
    )


def snapshot_to_wire(s: Snapshot) -> list[Any]:
    return [snapshot_meta_to_wire(s.meta), s.data]


def snapshot_from_wire(raw: Any) -> Snapshot:
    if type(raw) is not list or len(raw) != 2:
        raise ValueError(f"snapshot must be a 2-element array, got {_describe(raw)}")
    meta, data = raw
    if type(data) is not bytes:
        raise ValueError(f"snapshot data must be bytes, got {_describe(data)}")
    return Snapshot(snapshot_meta_from_wire(meta), data)


# --------------------------------------------------------------------------- messages


def encode_message(m: Message) -> bytes:
    """One Raft message as one msgpack frame: ``[version, type, to, frm, term, ...]``."""
    return msgpack.packb(
        [
            WIRE_VERSION,
            int(m.type),
            m.to,
            m.frm,
            m.term,
            m.log_term,
            m.index,
            [[e.term, e.index, int(e.type), e.data, e.proposal_id] for e in m.entries],
            m.commit,
            m.reject,
            m.reject_hint,
            None if m.snapshot is None else snapshot_to_wire(m.snapshot),
            m.context,
        ],
        use_bin_type=True,
    )


def decode_message(frame: bytes) -> Message:
    """Inverse of ``encode_message``; raises ``ValueError`` (never anything else) on bad input."""
    if len(frame) > _MAX_FRAME:
        raise ValueError(f"frame of {len(frame)} bytes exceeds the {_MAX_FRAME}-byte limit")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ValueError(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    if type(raw) is not list or len(raw) != 13:
        raise ValueError(f"message must be a 13-element array, got {_describe(raw)}")
    (version, mtype, to, frm, term, log_term, index, entries, commit, reject, hint, snap, context) = raw
    if version != WIRE_VERSION:
        raise ValueError(f"unsupported wire version {version!r}")
    kind = _MESSAGE_TYPES.get(mtype) if type(mtype) is int else None
    if kind is None:
        raise ValueError(f"unknown message type {mtype!r}")
    if type(to) is not str or type(frm) is not str:
        raise ValueError("message 'to' and 'frm' must be strings")
    for name, value in (("term", term), ("log_term", log_term), ("index", index), ("commit", commit)):
        if type(value) is not int or value < 0:
            raise ValueError(f"message {name} must be a non-negative int, got {value!r}")
    if type(hint) is not int or hint < 0:
        raise ValueError(f"message reject_hint must be a non-negative int, got {hint!r}")
    if type(reject) is not bool:
        raise ValueError(f"message reject must be a bool, got {_describe(reject)}")
    if type(context) is not bytes:
        raise ValueError(f"message context must be bytes, got {_describe(context)}")
    return Message(
        kind,
        to,
        frm,
        term,
        log_term,
        index,
        entries_from_wire(entries) if entries != [] else (),
        commit,
        reject,
        hint,
        None if snap is None else snapshot_from_wire(snap),
        context,
    )


# --------------------------------------------------------------------------- helpers


def _str_tuple(raw: Any, what: str) -> tuple[str, ...]:
    if type(raw) is not list or any(type(x) is not str for x in raw):
        raise ValueError(f"snapshot {what} must be an array of strings, got {_describe(raw)}")
    return tuple(raw)


def _describe(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__
