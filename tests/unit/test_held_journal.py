"""The global scheduler's held queues on disk (services/global_scheduler/held_journal.py)."""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import msgpack

from services.global_scheduler.held_journal import (
    HeldJournal,
    HeldQueue,
    encode_record,
    read_records,
)


def request(n: int, size: int = 8) -> tuple[bytes, ...]:
    return (b"sig%d" % n, b"{}", b"{}", b"{}", bytes([n % 256]) * size)


def queue(*numbers: int, msg_id: str = "m1", round_: int = 0, busy_sent: bool = False) -> HeldQueue:
    return HeldQueue(msg_id, round_, busy_sent, tuple(request(n) for n in numbers))


def reopened(journal: HeldJournal, directory: Path, kernel_id: str = "k1") -> HeldQueue | None:
    """What a restarted scheduler reads, once this one's writes are on disk."""
    assert journal.flush(timeout=10)
    return HeldJournal(directory).load(kernel_id)


def test_a_saved_queue_reads_back_the_same_and_none_removes_it(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    assert journal.load("k1") is None
    journal.save("k1", queue(1, 2, round_=2, busy_sent=True))
    assert reopened(journal, directory) == queue(1, 2, round_=2, busy_sent=True)
    journal.save("k1", None)
    assert HeldJournal(directory).load("k1") is None  # durable as soon as save returns
    journal.save("k1", None)  # nothing to remove: fine
    journal.close()


def test_requests_queued_behind_the_head_are_appended_not_rewritten(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    held: list[tuple[bytes, ...]] = []
    sizes = []
    for n in range(1, 6):
        held.append(request(n, size=1000))
        journal.save("k1", HeldQueue("m1", 0, False, tuple(held)))
        assert journal.flush(timeout=10)
        sizes.append(journal.path("k1").stat().st_size)
    growth = [b - a for a, b in itertools.pairwise(sizes)]
    assert all(1000 < step < 1200 for step in growth), growth  # one record each, not the queue
    assert reopened(journal, directory) == HeldQueue("m1", 0, False, tuple(held))
    journal.close()


def test_a_cell_put_back_at_the_front_and_a_new_head_replay_in_order(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    journal.save("k1", queue(2, 3, msg_id="m2"))
    journal.save("k1", queue(1, 2, 3, msg_id="m1", round_=1, busy_sent=True))  # a failed election
    assert reopened(journal, directory) == queue(1, 2, 3, msg_id="m1", round_=1, busy_sent=True)
    journal.close()


def test_a_removal_is_durable_before_save_returns_and_pending_writes_never_land(tmp_path: Path) -> None:
    """The at-most-once rule: cells released to be sent on never come back after a crash."""
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    journal.save("k1", queue(1, 2))
    journal.save("k1", queue(1, 2, 3))
    journal.save("k1", None)  # sent on right after this returns: nothing may bring them back
    assert not journal.path("k1").exists()
    assert journal.flush(timeout=10)
    assert HeldJournal(directory).load("k1") is None
    journal.save("k1", queue(3, 4))  # the head sent on; the rest held again (a partial removal)
    journal.save("k1", queue(4))
    assert reopened(journal, directory) == queue(4)
    journal.close()


def test_a_torn_tail_record_is_ignored(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    journal.save("k1", queue(1, 2))
    assert journal.flush(timeout=10)
    journal.close()
    path = journal.path("k1")
    whole = path.read_bytes()
    path.write_bytes(whole + encode_record({"op": "held", "frames": list(request(3))})[:-5])
    assert HeldJournal(directory).load("k1") == queue(1, 2)
    damaged = bytearray(whole + encode_record({"op": "held", "frames": list(request(3))}))
    damaged[-1] ^= 0xFF  # a checksum mismatch: the record is not trusted
    path.write_bytes(bytes(damaged))
    assert HeldJournal(directory).load("k1") == queue(1, 2)


def test_after_a_torn_tail_new_changes_still_replay(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    first = HeldJournal(directory)
    first.save("k1", queue(1, 2))
    first.close()
    path = first.path("k1")
    path.write_bytes(path.read_bytes() + b"\x00\x00\x10")  # a crash mid-header
    restarted = HeldJournal(directory)
    assert restarted.load("k1") == queue(1, 2)
    restarted.save("k1", queue(1, 2, 3))
    assert reopened(restarted, directory) == queue(1, 2, 3)
    restarted.close()


def test_a_log_grown_past_its_live_content_is_compacted(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory, compact_min_bytes=1)
    journal.save("k1", queue(1, 2))
    for n in range(50):  # head records pile up: the log outgrows the queue
        journal.save("k1", queue(1, 2, round_=n))
    assert journal.flush(timeout=10)
    records, _, problem = read_records(journal.path("k1").read_bytes())
    assert problem == ""
    assert len(records) < 10
    assert HeldJournal(directory).load("k1") == queue(1, 2, round_=49)
    journal.close()


def test_a_restarted_scheduler_appends_to_the_log_it_read(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    first = HeldJournal(directory)
    first.save("k1", queue(1))
    first.close()
    second = HeldJournal(directory)
    assert second.load("k1") == queue(1)
    second.save("k1", queue(1, 2))
    assert reopened(second, directory) == queue(1, 2)
    second.save("k1", None)
    assert HeldJournal(directory).load("k1") is None
    second.close()


def test_files_are_private_to_the_scheduler(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    journal.save("k1", queue(1))
    assert journal.flush(timeout=10)
    assert stat.S_IMODE(journal.path("k1").stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    journal.close()


def test_an_odd_kernel_id_cannot_escape_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    journal.save("../../etc/passwd", queue(1))
    assert journal.flush(timeout=10)
    assert [p.parent for p in tmp_path.rglob("*.held.log")] == [directory]
    assert HeldJournal(directory).load("../../etc/passwd") == queue(1)
    journal.close()


def test_a_damaged_or_foreign_log_is_ignored_with_a_reason(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    journal.save("k1", queue(1))
    journal.close()
    path = journal.path("k1")
    path.write_bytes(b"\x93not a log at all")
    assert HeldJournal(directory).load("k1") is None
    other = HeldJournal(directory)
    other.save("k2", queue(1))
    other.close()
    path.write_bytes(other.path("k2").read_bytes())
    assert HeldJournal(directory).load("k1") is None  # another kernel's queue
    path.write_bytes(encode_record({"op": "held"}))
    assert HeldJournal(directory).load("k1") is None  # fields missing


def test_a_queue_in_the_former_one_file_format_is_still_read(tmp_path: Path) -> None:
    directory = tmp_path / "held"
    directory.mkdir()
    legacy = directory / "k1.msgpack"
    legacy.write_bytes(
        msgpack.packb(
            {
                "kernel_id": "k1",
                "msg_id": "m1",
                "round": 0,
                "busy_sent": False,
                "requests": [list(request(1))],
            }
        )
    )
    journal = HeldJournal(directory)
    assert journal.load("k1") == queue(1)
    assert reopened(journal, directory) == queue(1)
    journal.save("k1", None)
    assert not legacy.exists()
    assert HeldJournal(directory).load("k1") is None
    journal.close()


def test_writes_of_several_kernels_keep_each_kernels_order(tmp_path: Path) -> None:
    kernels = 3
    directory = tmp_path / "held"
    journal = HeldJournal(directory)
    held: dict[str, list[tuple[bytes, ...]]] = {f"k{i}": [] for i in range(kernels)}
    for n in range(30):
        kernel_id = f"k{n % kernels}"
        held[kernel_id].append(request(n))
        journal.save(kernel_id, HeldQueue("m", 0, False, tuple(held[kernel_id])))
    assert journal.flush(timeout=10)
    for kernel_id, requests in held.items():
        assert HeldJournal(directory).load(kernel_id) == HeldQueue("m", 0, False, tuple(requests))
    journal.close()
