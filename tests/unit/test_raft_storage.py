"""Durable storage: what is written comes back after a restart, and damage is cut off, never applied."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.raft.storage import HEADER, WAL_MAGIC, Storage, StorageError
from shared.raft.types import ConfState, Entry, EntryType, HardState, Snapshot, SnapshotMeta


def entries(first: int, last: int, term: int = 1, size: int = 8) -> list[Entry]:
    return [
        Entry(term, i, EntryType.NORMAL, bytes([i % 256]) * size, f"p{i}") for i in range(first, last + 1)
    ]


def segment_files(d: Path) -> list[Path]:
    return sorted(d.glob("wal-*.log"))


def reopen(d: Path, **kw: object) -> Storage:
    s = Storage(d, **kw)  # type: ignore[arg-type]
    return s


def test_round_trip_restores_entries_hard_state_and_proposal_ids(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    written = [*entries(1, 3), Entry(1, 4, EntryType.CONF_CHANGE, b"\x93\x00\xa1n\xc4\x00", "cc")]
    s.save(written, HardState(term=1, vote="a", commit=2))
    s.close()

    r = reopen(tmp_path).restored()
    assert r.entries == tuple(written)
    assert r.hard_state == HardState(1, "a", 2)
    assert r.snapshot_meta == SnapshotMeta()


def test_empty_directory_restores_empty_state(tmp_path: Path) -> None:
    s = Storage(tmp_path / "new")
    assert s.restored().entries == ()
    assert s.restored().hard_state == HardState()
    assert s.recovery.clean
    assert s.load_snapshot() is None


def test_restart_appends_after_previous_contents(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 5), HardState(1, "a", 3))
    s.close()
    s = reopen(tmp_path)
    s.save(entries(6, 8, term=2), HardState(2, "b", 7))
    s.close()

    r = reopen(tmp_path).restored()
    assert [e.index for e in r.entries] == list(range(1, 9))
    assert r.entries[-1].term == 2
    assert r.hard_state == HardState(2, "b", 7)


def test_commit_only_hard_state_needs_no_fsync_but_term_change_does(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    assert s.append(entries(1, 1), HardState(1, "a", 0)) is True
    s.sync()
    assert s.append([], HardState(1, "a", 1)) is False
    assert s.append([], HardState(2, None, 1)) is True
    assert s.append([], None) is False


def test_conflicting_suffix_is_overwritten(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 5, term=1), HardState(1, "a", 2))
    s.save(entries(3, 4, term=2), HardState(2, "b", 2))
    assert s.last_index == 4
    s.close()

    r = reopen(tmp_path).restored()
    assert [(e.index, e.term) for e in r.entries] == [(1, 1), (2, 1), (3, 2), (4, 2)]


def test_append_refuses_a_gap_or_rewriting_compacted_entries(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 3), None)
    with pytest.raises(ValueError, match="gap"):
        s.append(entries(5, 6), None)
    s.save_snapshot(Snapshot(SnapshotMeta(2, 1), b"state"))
    s.compact()
    with pytest.raises(ValueError, match="compacted"):
        s.append(entries(2, 2), None)


def _write_two_records(d: Path) -> tuple[Path, int]:
    """Two records; returns the segment and the offset where the last record starts."""
    s = Storage(d)
    s.save(entries(1, 2), HardState(1, "a", 1))
    size_before = segment_files(d)[0].stat().st_size
    s.save(entries(3, 3), HardState(1, "a", 2))
    s.close()
    return segment_files(d)[0], size_before


def test_torn_last_record_at_every_byte_offset_is_truncated(tmp_path: Path) -> None:
    seg, last_start = _write_two_records(tmp_path / "orig")
    full = seg.read_bytes()
    assert len(full) > last_start
    for cut in range(last_start, len(full)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / seg.name).write_bytes(full[:cut])

        s = Storage(d)
        r = s.restored()
        assert [e.index for e in r.entries] == [1, 2], cut
        assert r.hard_state == HardState(1, "a", 1), cut
        if cut == last_start:
            assert s.recovery.clean
        else:
            assert s.recovery.problem is not None and "torn" in s.recovery.problem, cut
            assert s.recovery.truncated_bytes == cut - last_start
        assert (d / seg.name).stat().st_size == last_start  # cut back to the last good record

        # The log is usable after the repair: a new record lands after the good ones.
        s.save(entries(3, 4, term=2), HardState(2, "b", 3))
        s.close()
        again = Storage(d)
        assert [e.index for e in again.restored().entries] == [1, 2, 3, 4], cut
        assert again.recovery.clean
        again.close()


def test_corrupted_crc_in_the_middle_stops_at_last_good_record_and_says_so(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    offsets = []
    for i in range(1, 6):
        offsets.append(segment_files(tmp_path)[0].stat().st_size)
        s.save(entries(i, i), HardState(1, "a", i - 1))
    s.close()
    seg = segment_files(tmp_path)[0]
    data = bytearray(seg.read_bytes())
    data[offsets[2] + HEADER.size + 3] ^= 0xFF  # flip a payload byte of record 3
    seg.write_bytes(bytes(data))

    events: list[tuple[str, dict[str, object]]] = []

    class Capture:
        def __getattr__(self, level: str):  # type: ignore[no-untyped-def]
            return lambda event, **kw: events.append((f"{level}:{event}", kw))

    s = Storage(tmp_path, logger=Capture())
    assert [e.index for e in s.restored().entries] == [1, 2]
    assert s.recovery.problem is not None
    assert "CRC mismatch" in s.recovery.problem
    assert f"byte {offsets[2]}" in s.recovery.problem
    assert any(name.endswith("raft.storage.wal_truncated") for name, _ in events)


def test_corruption_in_an_older_segment_discards_later_segments_loudly(tmp_path: Path) -> None:
    s = Storage(tmp_path, segment_bytes=200)
    for i in range(1, 20):
        s.save(entries(i, i, size=64), HardState(1, "a", i))
    s.close()
    segs = segment_files(tmp_path)
    assert len(segs) >= 3
    data = bytearray(segs[1].read_bytes())
    data[len(WAL_MAGIC) + HEADER.size + 1] ^= 0x55
    segs[1].write_bytes(bytes(data))

    s = Storage(tmp_path, segment_bytes=200)
    assert s.recovery.discarded_segments == tuple(p.name for p in segs[2:])
    assert all((tmp_path / (p.name + ".discarded")).exists() for p in segs[2:])
    last = s.last_index
    assert 1 <= last < 19
    assert [e.index for e in s.restored().entries] == list(range(1, last + 1))
    assert s.restored().hard_state.commit <= last


def test_segments_rotate_and_replay_in_order(tmp_path: Path) -> None:
    s = Storage(tmp_path, segment_bytes=300)
    for i in range(1, 30):
        s.save(entries(i, i, size=50), HardState(3, "c", i))
    s.close()
    assert len(segment_files(tmp_path)) > 3
    r = Storage(tmp_path, segment_bytes=300).restored()
    assert [e.index for e in r.entries] == list(range(1, 30))
    assert r.hard_state == HardState(3, "c", 29)


def test_a_term_and_vote_written_by_the_record_that_fills_a_segment_survive_reopen(tmp_path: Path) -> None:
    s = Storage(tmp_path, segment_bytes=64)  # each of these records fills its segment
    s.save([Entry(1, 1, EntryType.NORMAL, b"x" * 80, "")], HardState(1, "a", 0))
    s.save([Entry(2, 2, EntryType.NORMAL, b"y" * 80, "")], HardState(2, "b", 1))
    s.close()
    restored = Storage(tmp_path).restored()
    assert restored.hard_state == HardState(2, "b", 1)  # not the term-1 vote the rotation repeated
    assert [e.index for e in restored.entries] == [1, 2]


def test_snapshot_and_compaction_bound_the_disk(tmp_path: Path) -> None:
    s = Storage(tmp_path, segment_bytes=4096)
    conf = ConfState(voters=("a", "b", "c"))
    for round_ in range(5):
        base = round_ * 100
        for i in range(base + 1, base + 101):
            s.save(entries(i, i, size=100), HardState(1, "a", i))
        s.save_snapshot(Snapshot(SnapshotMeta(base + 90, 1, conf), f"state@{base + 90}".encode()))
        s.compact()
    s.close()

    assert len(list(tmp_path.glob("snap-*.snap"))) == 1
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total < 4 * 4096  # 500 entries of 100 bytes would be far more
    s = Storage(tmp_path)
    r = s.restored()
    assert r.snapshot_meta == SnapshotMeta(490, 1, conf)
    assert [e.index for e in r.entries] == list(range(491, 501))
    assert r.hard_state.commit == 500
    snap = s.load_snapshot()
    assert snap is not None and snap.data == b"state@490"


def test_snapshot_file_is_written_atomically(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 10), HardState(1, "a", 10))
    s.save_snapshot(Snapshot(SnapshotMeta(10, 1), b"x" * 1000))
    s.close()
    (tmp_path / "snap-00000000000000ff-0000000000000001.snap.tmp").write_bytes(b"half written")
    s = Storage(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    assert s.snapshot_meta.index == 10


def test_corrupt_snapshot_falls_back_to_an_older_one(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 10), HardState(1, "a", 10))
    s.save_snapshot(Snapshot(SnapshotMeta(5, 1), b"five"))
    s.save_snapshot(Snapshot(SnapshotMeta(8, 1), b"eight"))
    s.close()
    newest = tmp_path / "snap-0000000000000008-0000000000000001.snap"
    newest.write_bytes(newest.read_bytes()[:-2] + b"!!")
    s = Storage(tmp_path)
    assert s.snapshot_meta.index == 5
    assert [e.index for e in s.restored().entries] == list(range(6, 11))
    assert (tmp_path / (newest.name + ".corrupt")).exists()


def test_installed_snapshot_replaces_a_log_that_does_not_contain_it(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 5, term=1), HardState(1, "a", 3))
    s.install_snapshot(Snapshot(SnapshotMeta(20, 3, ConfState(("a", "b"))), b"leader state"))
    assert s.last_index == 20
    s.save(entries(21, 22, term=3), HardState(3, None, 21))
    s.close()

    s = Storage(tmp_path)
    r = s.restored()
    assert r.snapshot_meta.index == 20
    assert [(e.index, e.term) for e in r.entries] == [(21, 3), (22, 3)]
    assert r.hard_state == HardState(3, None, 21)


def test_installed_snapshot_keeps_a_matching_suffix(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 10, term=2), HardState(2, "a", 4))
    s.install_snapshot(Snapshot(SnapshotMeta(6, 2), b"s"))
    s.close()
    r = Storage(tmp_path).restored()
    assert [e.index for e in r.entries] == [7, 8, 9, 10]
    assert r.hard_state.commit == 6


def test_crash_between_installed_snapshot_and_reset_drops_the_unconnected_log(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 30, term=1), HardState(1, "a", 10))
    # As if the process died right after the snapshot file became durable, before the RESET record.
    s.save_snapshot(Snapshot(SnapshotMeta(20, 4), b"newer"))
    s.close()
    r = Storage(tmp_path).restored()
    assert r.snapshot_meta.index == 20
    assert r.entries == ()  # entry 20 had term 1, not 4: 21..30 do not continue the snapshot
    assert r.hard_state.commit == 20


def test_reset_without_its_snapshot_refuses_to_start(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 3), HardState(1, "a", 3))
    s.install_snapshot(Snapshot(SnapshotMeta(50, 2), b"s"))
    s.close()
    for snap in tmp_path.glob("snap-*.snap"):
        snap.unlink()
    with pytest.raises(StorageError, match="snapshot"):
        Storage(tmp_path)


def test_no_fsync_mode_still_round_trips(tmp_path: Path) -> None:
    s = Storage(tmp_path, fsync=False)
    s.save(entries(1, 2), HardState(1, None, 0))
    s.close()
    assert len(Storage(tmp_path).restored().entries) == 2


def test_garbage_segment_is_reset_to_empty(tmp_path: Path) -> None:
    (tmp_path / "wal-0000000000000000.log").write_bytes(os.urandom(5))
    s = Storage(tmp_path)
    assert s.restored().entries == ()
    assert s.recovery.problem is not None and "magic" in s.recovery.problem
    s.save(entries(1, 1), None)
    s.close()
    assert len(Storage(tmp_path).restored().entries) == 1


def test_zero_filled_tail_from_a_crash_is_truncated(tmp_path: Path) -> None:
    s = Storage(tmp_path)
    s.save(entries(1, 2), HardState(1, "a", 1))
    s.close()
    seg = segment_files(tmp_path)[0]
    good = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\0" * 4096)  # size grew but the data blocks never made it to disk
    s = Storage(tmp_path)
    assert [e.index for e in s.restored().entries] == [1, 2]
    assert s.recovery.problem is not None
    assert seg.stat().st_size == good


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 4), st.integers(1, 5), st.integers(1, 3)),
        st.tuples(st.just("hard_state"), st.integers(0, 5), st.integers(0, 50)),
        st.tuples(st.just("snapshot"), st.floats(0, 1)),
        st.tuples(st.just("install"), st.integers(0, 6), st.booleans()),
        st.tuples(st.just("reopen")),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_any_sequence_of_writes_survives_reopen_like_an_in_memory_model(ops: list[tuple]) -> None:
    with tempfile.TemporaryDirectory() as d:
        s = Storage(d, segment_bytes=512)
        base, base_term, log, hs = 0, 0, [], HardState()
        term = 1
        for op in ops:
            last = base + len(log)
            if op[0] == "append":
                _, back, count, bump = op
                term += bump - 1
                # Raft never overwrites a committed entry (the storage clamps a commit index
                # beyond its log when it reopens, so a model that did would expect a stale one)
                first = max(base + 1, last + 1 - back, hs.commit + 1)
                new = [
                    Entry(term, i, EntryType.NORMAL, f"{term}:{i}".encode(), "")
                    for i in range(first, first + count)
                ]
                s.save(new, None)
                log = log[: first - base - 1] + new
            elif op[0] == "hard_state":
                hs = HardState(max(term, op[1]), None, min(op[2], last))
                s.save([], hs)
            elif op[0] == "snapshot" and log:
                index = base + 1 + int(op[1] * (len(log) - 1))
                t = log[index - base - 1].term
                s.save_snapshot(Snapshot(SnapshotMeta(index, t), b"app"))
                s.compact()
                log, base, base_term = log[index - base :], index, t
            elif op[0] == "install":
                _, ahead, matching = op
                index = last + ahead if not matching or not log else base + 1 + ahead % len(log)
                if index <= base:
                    continue
                t = log[index - base - 1].term if base < index <= last and matching else term + 1
                term = max(term, t)
                s.install_snapshot(Snapshot(SnapshotMeta(index, t), b"leader"))
                keeps = base < index <= last and log[index - base - 1].term == t
                log = log[index - base :] if keeps else []
                base, base_term = index, t
            elif op[0] == "reopen":
                s.close()
                s = Storage(d, segment_bytes=512)
                assert s.recovery.clean
            r = s.restored()
            assert r.snapshot_meta.index == base and (base == 0 or r.snapshot_meta.term == base_term)
            assert list(r.entries) == log
        s.close()
        reopened = Storage(d)
        r = reopened.restored()
        reopened.close()
        assert r.snapshot_meta.index == base
        assert list(r.entries) == log
        assert r.hard_state.term == hs.term
        assert r.hard_state.commit == max(min(hs.commit, base + len(log)), base)
