"""The global scheduler's held queues on disk (services/global_scheduler/held_journal.py)."""

from __future__ import annotations

from pathlib import Path

import msgpack

from services.global_scheduler.held_journal import HeldJournal, HeldQueue

QUEUE = HeldQueue(
    "m1", 2, True, ((b"sig", b"{}", b"{}", b"{}", b"{}"), (b"sig2", b"{}", b"{}", b"{}", b"{}"))
)


def test_a_saved_queue_reads_back_the_same_and_none_removes_it(tmp_path: Path) -> None:
    journal = HeldJournal(tmp_path / "held")
    assert journal.load("k1") is None
    journal.save("k1", QUEUE)
    assert HeldJournal(tmp_path / "held").load("k1") == QUEUE  # what a restarted scheduler reads
    journal.save("k1", None)
    assert journal.load("k1") is None
    journal.save("k1", None)  # nothing to remove: fine


def test_an_odd_kernel_id_cannot_escape_the_directory(tmp_path: Path) -> None:
    journal = HeldJournal(tmp_path / "held")
    journal.save("../../etc/passwd", QUEUE)
    assert [p.parent for p in tmp_path.rglob("*.msgpack")] == [tmp_path / "held"]
    assert journal.load("../../etc/passwd") == QUEUE


def test_a_damaged_or_foreign_file_is_ignored_with_a_reason(tmp_path: Path) -> None:
    journal = HeldJournal(tmp_path / "held")
    journal.save("k1", QUEUE)
    path = next((tmp_path / "held").glob("*.msgpack"))
    path.write_bytes(b"\x93not msgpack at all")
    assert journal.load("k1") is None
    path.write_bytes(
        msgpack.packb(
            {"kernel_id": "k2", "msg_id": "m", "round": 0, "busy_sent": False, "requests": [[b"x"]]}
        )
    )
    assert journal.load("k1") is None  # another kernel's queue
    path.write_bytes(msgpack.packb({"kernel_id": "k1", "msg_id": "m"}))
    assert journal.load("k1") is None  # fields missing
