"""Sealed records (the Raft links' messages after the TLS hello), without sockets: whatever way the
wire bytes are cut, the reader gets the writer's plaintext in order; a record altered, replayed,
reordered, dropped, sealed under another key or announced with an impossible length is refused
and nothing of it comes out; a key stops after its last record. And the TLS side of the switch:
a reader stops at the end of the hello's record, leaving the sealed bytes after it unread."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_raft_tls import CA

from shared.raft import sealed
from shared.raft.sealed import (
    HEADER,
    MAX_RECORD_BYTES,
    MAX_RECORD_PLAINTEXT,
    Opener,
    RecordRefused,
    Sealer,
    new_key,
)
from shared.raft.tls import LinkTls, TlsSession


def pair() -> tuple[Sealer, Opener]:
    key = new_key()
    return Sealer(key), Opener(key)


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=4), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=1, max_value=64), max_size=20),
)
def test_any_cutting_of_the_wire_gives_back_the_plaintext_in_order(
    messages: list[list[bytes]], cuts: list[int]
) -> None:
    sealer, opener = pair()
    wire = b"".join(record for parts in messages for record in sealer.seal_all(parts))
    got, offset = bytearray(), 0
    for cut in cuts:
        got += opener.open(wire[offset : offset + cut])
        offset += cut
    got += opener.open(wire[offset:])
    assert bytes(got) == b"".join(part for parts in messages for part in parts)


def test_a_large_plaintext_is_sealed_in_chunks_and_comes_back_whole() -> None:
    sealer, opener = pair()
    big = bytes(range(256)) * (3 * MAX_RECORD_PLAINTEXT // 256 + 7)
    records = sealer.seal_all([b"head", big])
    assert len(records) == 5 and all(len(r) <= 4 + MAX_RECORD_BYTES for r in records)
    assert opener.open(b"".join(records)) == b"head" + big


def _refused(key: bytes, wire: bytes) -> None:
    with pytest.raises(RecordRefused):
        Opener(key).open(wire)


def test_an_altered_record_is_refused() -> None:
    key = new_key()
    record = Sealer(key).seal(b"append entries")
    for position in (3, 4, len(record) - 1):  # the length, the ciphertext, the tag
        altered = bytearray(record)
        altered[position] ^= 1
        _refused(key, bytes(altered) + b"\0")  # a length one longer: its last byte is here too
    assert Opener(key).open(record) == b"append entries"


def test_a_record_under_another_key_is_refused() -> None:
    _refused(new_key(), Sealer(new_key()).seal(b"hello"))


def test_replayed_reordered_and_dropped_records_are_refused() -> None:
    key = new_key()
    sealer = Sealer(key)
    first, second, third = (sealer.seal(m) for m in (b"one", b"two", b"three"))
    opener = Opener(key)
    assert opener.open(first) == b"one"
    with pytest.raises(RecordRefused):
        opener.open(first)  # replayed
    _refused(key, second + first)  # reordered
    _refused(key, first + third)  # one dropped


def test_an_impossible_length_is_refused_before_anything_is_buffered() -> None:
    _refused(new_key(), HEADER.pack(MAX_RECORD_BYTES + 1))
    _refused(new_key(), HEADER.pack(sealed.TAG_BYTES - 1) + b"x" * 20)


def test_nothing_after_a_refused_record_comes_out() -> None:
    key = new_key()
    sealer = Sealer(key)
    good, bad, later = sealer.seal(b"good"), bytearray(sealer.seal(b"bad")), sealer.seal(b"later")
    bad[-1] ^= 1
    opener = Opener(key)
    assert opener.open(good) == b"good"
    with pytest.raises(RecordRefused):
        opener.open(bytes(bad) + later)


def test_a_key_seals_no_more_than_its_last_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealed, "MAX_RECORDS", 3)
    key = new_key()
    sealer, opener = Sealer(key), Opener(key)
    records = [sealer.seal(b"m") for _ in range(3)]
    assert sealer.spent
    with pytest.raises(RecordRefused):
        sealer.seal(b"one too many")
    assert opener.open(b"".join(records)) == b"mmm"
    forged_fourth = Sealer(key)
    for _ in range(3):
        forged_fourth.seal(b"m")
    monkeypatch.setattr(sealed, "MAX_RECORDS", 4)
    extra = forged_fourth.seal(b"m")
    monkeypatch.setattr(sealed, "MAX_RECORDS", 3)
    with pytest.raises(RecordRefused):
        opener.open(extra)


def test_a_tls_reader_stops_after_the_hello_s_record_leaving_the_records_after_it() -> None:
    """The switch from TLS to sealed records: OpenSSL reads no further than the record it needs,
    so the bytes after the hello (here in the same read as the handshake's last flight) stay
    unread for the record opener."""
    client = TlsSession(LinkTls.from_identity(CA.issue("k", "r1")).client, server_side=False)
    server = TlsSession(LinkTls.from_identity(CA.issue("k", "r2")).server, server_side=True)
    hello_flight = client.start()
    assert not server.feed(hello_flight)
    client.receive(server.pending())
    assert client.established
    sealer = Sealer(new_key())
    after = sealer.seal(b"first message")
    assert server.feed(client.pending() + client.encrypt(b"the hello") + after)
    assert server.read_record() == b"the hello"
    assert server.unread() == after
    assert server.read_record() == b""
