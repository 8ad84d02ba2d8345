"""Wire codec: every message survives a round trip, and any malformed frame is a ValueError."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.raft.codec import WIRE_VERSION, decode_message, encode_message
from shared.raft.types import (
    ConfState,
    Entry,
    EntryType,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)

ids = st.text(min_size=1, max_size=8)
nat = st.integers(min_value=0, max_value=2**63 - 1)


@st.composite
def messages(draw: st.DrawFn) -> Message:
    first = draw(st.integers(min_value=1, max_value=1000))
    count = draw(st.integers(min_value=0, max_value=4))
    entries = tuple(
        Entry(
            draw(nat),
            first + i,
            draw(st.sampled_from(list(EntryType))),
            draw(st.binary(max_size=64)),
            draw(st.text(max_size=12)),
        )
        for i in range(count)
    )
    snap = draw(
        st.none()
        | st.builds(
            Snapshot,
            st.builds(SnapshotMeta, nat, nat, st.builds(ConfState, st.tuples(ids, ids), st.tuples(ids))),
            st.binary(max_size=64),
        )
    )
    return Message(
        draw(st.sampled_from(list(MessageType))),
        draw(ids),
        draw(ids),
        draw(nat),
        draw(nat),
        draw(nat),
        entries,
        draw(nat),
        draw(st.booleans()),
        draw(nat),
        snap,
        draw(st.binary(max_size=16)),
    )


@given(messages())
def test_every_message_round_trips(msg: Message) -> None:
    assert decode_message(encode_message(msg)) == msg


def test_encoding_is_a_compact_array() -> None:
    m = Message(MessageType.HEARTBEAT, "b", "a", 7, commit=3)
    frame = encode_message(m)
    assert len(frame) < 24
    assert msgpack.unpackb(frame)[0] == WIRE_VERSION


@given(st.binary(max_size=200))
def test_random_bytes_raise_value_error_only(frame: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode_message(frame)


@given(messages(), st.data())
def test_flipped_bytes_raise_value_error_or_decode(msg: Message, data: st.DataObject) -> None:
    frame = bytearray(encode_message(msg))
    pos = data.draw(st.integers(min_value=0, max_value=len(frame) - 1))
    frame[pos] ^= data.draw(st.integers(min_value=1, max_value=255))
    with contextlib.suppress(ValueError):
        decode_message(bytes(frame))


def _fields(**over: object) -> list[object]:
    base: list[object] = [WIRE_VERSION, 4, "b", "a", 1, 0, 0, [], 0, False, 0, None, b""]
    names = ["version", "type", "to", "frm", "term", "log_term", "index", "entries", "commit", "reject"]
    names += ["hint", "snap", "context"]
    for k, v in over.items():
        base[names.index(k)] = v
    return base


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"version": 99}, "wire version"),
        ({"type": 42}, "message type"),
        ({"term": -1}, "term"),
        ({"term": "1"}, "term"),
        ({"to": 5}, "'to'"),
        ({"reject": 1}, "reject"),
        ({"entries": [[1, 1, 0, b"", ""], [1, 3, 0, b"", ""]]}, "contiguous"),
        ({"entries": [[1, 1, 7, b"", ""]]}, "entry type"),
        ({"entries": [[1, 0, 0, b"", ""]]}, "index"),
        ({"entries": "nope"}, "entries"),
        ({"snap": [[1, 1, ["a"], [2]], b""]}, "learners"),
        ({"context": "text"}, "context"),
    ],
)
def test_malformed_fields_are_named_in_the_error(over: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        decode_message(msgpack.packb(_fields(**over), use_bin_type=True))


def test_wrong_arity_and_non_msgpack_are_value_errors() -> None:
    with pytest.raises(ValueError, match="13-element"):
        decode_message(msgpack.packb([1, 2, 3]))
    with pytest.raises(ValueError, match="msgpack"):
        decode_message(b"\xc1")
    with pytest.raises(ValueError):
        decode_message(msgpack.packb({"a": 1}))
