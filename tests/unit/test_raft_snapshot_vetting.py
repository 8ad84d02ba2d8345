"""A peer's snapshot is parsed before the Raft core sees it: whatever the bytes, parsing either
returns what a restore would install or raises ``ValueError`` (never another exception, never a
half-restored state machine), and the transport drops and counts a message whose snapshot fails."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_replica.election import ElectionBook
from kernel_replica.log_entries import Done, Lead
from kernel_replica.raft_bridge import ReplicaCore
from kernel_replica.state_sync import ReplicatedNamespace
from shared.raft.codec import encode_message
from shared.raft.driver import _unwrap, _wrap
from shared.raft.transport import RejectLog, TransportStats, vet_message
from shared.raft.types import ConfState, Message, MessageType, Snapshot, SnapshotMeta

# msgpack-able values like the ones a snapshot holds, nested a little
leaves = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4) | st.binary(max_size=4)
values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=12,
)


def a_book() -> ElectionBook:
    book = ElectionBook(("r1", "r2", "r3"))
    book.apply(Lead("m1", "r1"))
    book.apply(Lead("m1", "r2"))
    book.apply(Done("m1", "r1", {"status": "ok"}, 1, False))
    return book


def a_replica_snapshot(book: dict[str, Any] | None = None, ns: bytes | None = None) -> bytes:
    return msgpack.packb(
        {
            "v": 1,
            "book": a_book().to_snapshot() if book is None else book,
            "ns": ReplicatedNamespace().to_snapshot() if ns is None else ns,
        },
        use_bin_type=True,
    )


def test_a_real_snapshot_parses_to_what_was_taken() -> None:
    book, ns = ReplicaCore._parse_snapshot(a_replica_snapshot())
    assert book.to_snapshot() == a_book().to_snapshot()
    assert ReplicatedNamespace.parse_snapshot(ns)[0] == {}


@settings(max_examples=300, deadline=None)
@given(values)
def test_any_election_book_snapshot_is_restored_or_refused_with_a_value_error(raw: Any) -> None:
    try:
        book = ElectionBook.from_snapshot(raw)
    except ValueError:
        return
    assert ElectionBook.from_snapshot(book.to_snapshot()).to_snapshot() == book.to_snapshot()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["fps", "records", "groups", "next", "gr"]), values))
def test_any_namespace_snapshot_is_parsed_or_refused_with_a_value_error(raw: dict[str, Any]) -> None:
    namespace = ReplicatedNamespace()
    before = namespace.to_snapshot()
    try:
        namespace.restore(msgpack.packb(raw, use_bin_type=True))
    except ValueError:
        assert namespace.to_snapshot() == before  # all or nothing
        return
    namespace.contents()  # a restored namespace can be read back


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_any_replica_snapshot_bytes_are_parsed_or_refused_with_a_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        ReplicaCore._parse_snapshot(data)


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        msgpack.packb([1, {}, "not bytes"]),
        msgpack.packb([1, {"r1": 7}, b""]),
        msgpack.packb([1, [], b""]),
    ],
)
def test_a_malformed_snapshot_envelope_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        _unwrap(data)


def test_the_envelope_round_trips() -> None:
    assert _unwrap(_wrap({"r1": "tcp://h:1"}, b"app")) == ({"r1": "tcp://h:1"}, b"app")


def snapshot_frame(data: bytes) -> bytes:
    meta = SnapshotMeta(9, 2, ConfState(voters=("r1", "r2")))
    return encode_message(Message(MessageType.SNAPSHOT, "r1", "r2", 2, snapshot=Snapshot(meta, data)))


def test_the_transport_drops_and_counts_a_snapshot_that_could_not_be_restored() -> None:
    stats = TransportStats()
    reject = RejectLog(stats, structlog.get_logger("test"))

    def check(data: bytes) -> None:
        ReplicaCore._parse_snapshot(_unwrap(data)[1])

    good = snapshot_frame(_wrap({}, a_replica_snapshot()))
    bad_book = snapshot_frame(_wrap({}, a_replica_snapshot(book={"voters": "r1"})))
    bad_ns = snapshot_frame(_wrap({}, a_replica_snapshot(ns=b"\xc1")))
    with structlog.testing.capture_logs() as logs:
        assert vet_message("r1", b"r2", good, reject, check) is not None
        assert vet_message("r1", b"r2", bad_book, reject, check) is None
        assert vet_message("r1", b"r2", bad_ns, reject, check) is None
    assert stats.malformed == 2
    assert "cannot be restored" in logs[0]["reason"]
