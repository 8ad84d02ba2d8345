"""No ``ok`` without durability: what is unstored, what the log marks, what each replica is told.

The pure parts (``kernel_replica.durability``), the codec and planner around them with a store
that fails the way an unwritable one does, and the replicated record every replica keeps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_replica import log_entries
from kernel_replica.cell_analysis import analyse_cell
from kernel_replica.durability import (
    Backoff,
    ExecutorRecord,
    Marker,
    apply_markers,
    missing_here,
    missing_notice,
    protected_again,
    unprotected_warning,
)
from kernel_replica.election import ElectionBook, StateAccepted
from kernel_replica.log_entries import State
from kernel_replica.object_codec import ObjectCodec
from kernel_replica.state_sync import ReplicatedNamespace, apply_state, complete_state, plan_state
from shared.datastore.local_backend import LocalStore

BIG = "import numpy as np\nbig = np.arange(20_000.0)\nsmall = [1, 2]"


def _group(*names: str, pointer: bool = False) -> dict[str, Any]:
    return {"names": list(names), "sizes": [1], "pointer": {"k": 1} if pointer else None}


def _unwritable(tmp_path: Path) -> LocalStore:
    """A local store whose writes fail as they do on an unwritable volume, even for root: its
    ``tmp/`` directory, where a write starts, is a regular file (ENOTDIR)."""
    store = LocalStore(tmp_path / "store", fsync=False)
    (store.root / "tmp").rmdir()
    (store.root / "tmp").write_text("")
    return store


def _writable_again(store: LocalStore) -> None:
    (store.root / "tmp").unlink()
    (store.root / "tmp").mkdir()


def _plan(
    ns: dict[str, Any], code: str, codec: ObjectCodec, replicated: ReplicatedNamespace, **kw: Any
) -> Any:
    exec(code, ns)
    return asyncio.run(plan_state(analyse_cell(code, {}), ns, replicated.digests(), codec, **kw))


# ---- the codec and the planner with a failing store ----------------------------------------------


def test_a_store_write_that_fails_leaves_the_name_unstored_and_the_rest_of_the_cell_replicated(
    tmp_path: Path,
) -> None:
    codec = ObjectCodec(_unwritable(tmp_path), large_object_bytes=1024)
    plan = _plan({"__name__": "__main__"}, BIG, codec, ReplicatedNamespace())
    assert [g["names"] for g in plan.groups] == [["small"]]
    assert set(plan.unstored) == {"big"} and "NotADirectoryError" in plan.unstored["big"]
    assert "big" not in plan.fingerprints  # the log keeps no fingerprint of a value it lacks
    state = log_entries.decode(log_entries.encode(plan.state("m1", "r1")))
    assert isinstance(state, State) and state.unstored == plan.unstored and not state.skipped


def test_without_a_store_a_group_too_large_for_the_raft_log_is_unstored_not_sent_inline() -> None:
    codec = ObjectCodec(None, large_object_bytes=1024, max_inline_bytes=100_000)
    codec.store_error = "DataStoreUnavailable: cannot use directory /x"
    plan = _plan({"__name__": "__main__"}, BIG + "\nmid = np.zeros(2_000)", codec, ReplicatedNamespace())
    assert sorted(n for g in plan.groups for n in g["names"]) == ["mid", "small"]  # mid: inline, 16 kB
    assert "too large for the Raft log" in plan.unstored["big"] and "/x" in plan.unstored["big"]


def test_the_next_cell_stores_an_unstored_name_again_and_protects_it(tmp_path: Path) -> None:
    store = _unwritable(tmp_path)
    codec = ObjectCodec(store, large_object_bytes=1024)
    replicated, record, ns = ReplicatedNamespace(), ExecutorRecord(), {"__name__": "__main__"}
    first = _plan(ns, BIG, codec, replicated)
    replicated.apply(first.state("m1", "r1"))
    record.settle(first.state("m1", "r1"), first.retried, now=0.0)
    assert record.unstored().keys() == {"big"} and replicated.unprotected()["big"].replica_id == "r1"
    _writable_again(store)
    retry = record.retry_names(now=0.0)  # the first attempt after a failure is not delayed
    second = _plan(ns, "n = 1", codec, replicated, retry=retry, unprotected=record.names)
    assert sorted(n for g in second.groups for n in g["names"]) == ["big", "n"]
    assert second.retried == ("big",) and not second.unstored
    replicated.apply(second.state("m2", "r1"))
    record.settle(second.state("m2", "r1"), second.retried, now=1.0)
    assert record.unstored() == {} and replicated.unprotected() == {} and not record.backoff.failing
    standby: dict[str, Any] = {"__name__": "__main__"}
    imports, groups = replicated.contents()
    assert asyncio.run(apply_state(standby, ObjectCodec(store), imports, groups)) == []
    assert standby["big"][-1] == 19_999.0


def test_an_unstored_name_deleted_by_a_later_cell_is_not_reported_missing(tmp_path: Path) -> None:
    codec = ObjectCodec(_unwritable(tmp_path), large_object_bytes=1024)
    replicated, ns = ReplicatedNamespace(), {"__name__": "__main__"}
    replicated.apply(_plan(ns, BIG, codec, replicated).state("m1", "r1"))
    later = _plan(ns, "del big", codec, replicated, unprotected=replicated.unprotected())
    assert later.deleted == ["big"]
    replicated.apply(later.state("m2", "r1"))
    assert replicated.unprotected() == {}


# ---- the committed marks -------------------------------------------------------------------------


def test_marks_follow_the_log_and_survive_a_snapshot() -> None:
    replicated = ReplicatedNamespace()
    replicated.apply(State("m1", "r1", skipped={"lock": "not picklable"}, unstored={"big": "disk full"}))
    replicated.apply(State("m2", "r1", groups=(_group("x"),)))  # other names: marks kept
    assert replicated.unprotected() == {
        "big": Marker("disk full", "m1", "r1"),
        "lock": Marker("not picklable", "m1", "r1"),
    }
    restored = ReplicatedNamespace()
    restored.restore(replicated.to_snapshot())
    assert restored.unprotected() == replicated.unprotected()
    replicated.apply(State("m3", "r1", groups=(_group("big", pointer=True),), deleted=("lock",)))
    assert replicated.unprotected() == {}


def test_a_state_from_another_executor_clears_the_marks_it_told_its_user_about() -> None:
    marks = apply_markers({}, State("m1", "r1", unstored={"big": "disk full"}))
    assert apply_markers(marks, State("m2", "r1")) == marks
    assert apply_markers(marks, State("m2", "r2")) == {}
    again = apply_markers(marks, State("m2", "r2", unstored={"other": "disk full"}))
    assert again == {"other": Marker("disk full", "m2", "r2")}


def test_a_snapshot_with_malformed_marks_is_refused() -> None:
    bad = msgpack.packb({"fps": {}, "records": {}, "groups": [], "up": {"x": ["only a reason"]}})
    with pytest.raises(ValueError, match="'up'"):
        ReplicatedNamespace().restore(bad)


def test_a_state_entry_with_malformed_unstored_names_is_refused() -> None:
    good = log_entries.encode(State("m", "r1", unstored={"x": "why"}))
    raw = msgpack.unpackb(good, raw=False)
    raw["us"] = {"x": 3}
    with pytest.raises(log_entries.LogEntryError, match="'us'"):
        log_entries.decode(msgpack.packb(raw, use_bin_type=True))


_NAMES = st.sampled_from(["a", "b", "c", "d"])
_STATES = st.builds(
    lambda replica, carried, deleted, unstored, skipped: State(
        "m",
        replica,
        groups=tuple(_group(n) for n in sorted(carried)),
        deleted=tuple(sorted(deleted - carried)),
        unstored={n: "store" for n in unstored - carried - deleted},
        skipped={n: "pickle" for n in skipped - carried - deleted - unstored},
    ),
    st.sampled_from(["r1", "r2", "r3"]),
    *(st.frozensets(_NAMES) for _ in range(4)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_STATES, max_size=12))
def test_a_name_is_marked_exactly_when_its_last_news_is_a_failure_by_the_latest_executor(
    states: list[State],
) -> None:
    """Model: a mark stays while the STATEs after the failure come from the same executor and
    neither carry nor delete the name; a replica that restores a snapshot agrees."""
    marks: dict[str, Marker] = {}
    replicated = ReplicatedNamespace()
    for state in states:
        marks = apply_markers(marks, state)
        replicated.apply(state)
    restored = ReplicatedNamespace()
    restored.restore(replicated.to_snapshot())
    assert replicated.unprotected() == restored.unprotected() == marks
    expected: dict[str, str] = {}
    for name in ["a", "b", "c", "d"]:
        for index in range(len(states) - 1, -1, -1):
            state = states[index]
            carried = {n for g in state.groups for n in g["names"]} | set(state.deleted)
            failed = {**state.skipped, **state.unstored}
            if name in carried:
                break
            if name in failed:
                if all(later.replica_id == state.replica_id for later in states[index + 1 :]):
                    expected[name] = failed[name]
                break
    assert {name: m.reason for name, m in marks.items()} == expected


# ---- repairs: values stored after their cell -----------------------------------------------------


def test_a_repair_protects_only_what_its_executor_still_holds_unprotected() -> None:
    replicated = ReplicatedNamespace()
    replicated.apply(State("m1", "r1", unstored={"big": "disk full", "other": "disk full"}))
    replicated.apply(State("m2", "r1", groups=(_group("other"),)))  # a later cell stored other
    repair = State(
        "repair-1",
        "r1",
        {"big": b"fp", "other": b"old", "friend": b"f"},
        groups=(_group("big", "friend", pointer=True), _group("other", pointer=True)),
        repair=True,
    )
    applied = replicated.apply(repair)
    assert [g["names"] for g in applied.groups] == [["big"]] and applied.digests == {"big": b"fp"}
    assert replicated.unprotected() == {} and replicated.digests()["big"] == b"fp"
    assert [names for _, names in replicated.contents()[1]] == [["other"], ["big"]]


def test_a_repair_after_another_executor_took_over_changes_nothing() -> None:
    replicated = ReplicatedNamespace()
    replicated.apply(State("m1", "r1", unstored={"big": "disk full"}))
    replicated.apply(State("m2", "r2", unstored={"mine": "disk full"}))  # r2 told its user
    applied = replicated.apply(State("repair-1", "r1", {"big": b"fp"}, groups=(_group("big"),), repair=True))
    assert applied.groups == () and applied.digests == {}
    assert replicated.unprotected() == {"mine": Marker("disk full", "m2", "r2")}


def test_a_repair_that_failed_again_keeps_the_mark_of_the_cell_that_changed_the_value() -> None:
    replicated = ReplicatedNamespace()
    replicated.apply(State("m1", "r1", unstored={"big": "disk full"}))
    replicated.apply(State("repair-1", "r1", unstored={"big": "read-only"}, repair=True))
    assert replicated.unprotected() == {"big": Marker("read-only", "m1", "r1")}


def test_the_book_accepts_a_repair_between_a_done_and_its_state() -> None:
    book = ElectionBook(["r1", "r2", "r3"])
    book.apply(log_entries.Lead("m1", "r1"))
    book.apply(log_entries.Lead("m1", "r1"))
    book.apply(log_entries.Done("m1", "r1", {"status": "ok"}, 1))
    repair = State("repair-1", "r1", repair=True)
    assert book.apply(repair) == [StateAccepted(repair)] and book.awaiting_state() == "m1"
    decoded = log_entries.decode(log_entries.encode(repair))
    assert isinstance(decoded, State) and decoded.repair


# ---- the executor's record, its backoff, and what users read -------------------------------------


def test_backoff_doubles_up_to_its_cap_and_a_success_resets_it() -> None:
    backoff = Backoff(initial_s=1.0, max_s=5.0)
    waits = []
    for now in range(5):
        backoff.failed(float(now))
        waits.append(backoff.next_at - now)
    assert waits == [0.0, 1.0, 2.0, 4.0, 5.0] and backoff.failing
    assert not backoff.due(5.0) and backoff.due(9.0)
    backoff.succeeded()
    assert backoff.due(0.0) and not backoff.failing


def test_the_record_settles_in_cell_order_and_does_not_retry_unpicklable_names() -> None:
    record = ExecutorRecord(Backoff(initial_s=1.0))
    record.settle(State("m1", "r1", unstored={"big": "disk full"}, skipped={"lock": "pickle"}), (), now=0.0)
    assert record.retry_names(now=1.0) == ["big"] and set(record.names) == {"big", "lock"}
    record.settle(State("m2", "r1", unstored={"big": "disk full"}), ("big",), now=1.0)  # failed again
    assert record.retry_names(now=1.5) == [] and record.retry_names(now=2.0) == ["big"]
    # a cell that wrote nothing to the store says nothing about it: the backoff stays
    record.settle(State("m3", "r1", groups=(_group("n"),)), (), now=3.0)
    assert record.backoff.failures == 2
    record.settle(State("m4", "r1", groups=(_group("big", pointer=True),)), ("big",), now=3.0)
    assert record.unstored() == {} and not record.backoff.failing and set(record.names) == {"lock"}
    assert record.take_recovered() == ["big"] and record.take_recovered() == []  # said once
    assert record.drop_all() == ["lock"] and record.names == {}


def test_a_new_executor_is_told_each_mark_once_except_for_values_it_holds() -> None:
    marks = {"big": Marker("disk full", "m1", "r1"), "mine": Marker("disk full", "m5", "r2")}
    missing = missing_here(marks, own={"mine"}, told=set())
    assert list(missing) == ["big"]
    assert missing_here(marks, own={"mine"}, told={("big", "m1")}) == {}
    text = missing_notice(missing, {"kept": "could not be loaded here: store down"}, {"kept"}, "r2")
    assert "replica r2" in text and "'big' is missing" in text and "replica r1" in text
    assert "disk full" in text and "'kept' has an older value here: could not be loaded here" in text


def test_the_warning_names_every_unprotected_variable_with_its_reason_and_when_it_retries() -> None:
    text = unprotected_warning({"b": "disk full", "a": "disk full", "c": "too large"}, retry_in_s=2.0)
    assert "variables 'a' and 'b' NOT protected (disk full)" in text
    assert "variable 'c' NOT protected (too large)" in text and "again in 2 s" in text
    assert "again now" in unprotected_warning({"a": "x"}, retry_in_s=0.0)
    assert protected_again(["b", "a"]) == (
        "Tandem: variables 'a' and 'b' now protected (stored after an earlier attempt failed)."
    )


# ---- a standby that could not load a value -------------------------------------------------------


def test_names_a_replica_could_not_load_are_remembered_until_loaded_or_deleted(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store", fsync=False)
    codec = ObjectCodec(store, large_object_bytes=1024)
    replicated = ReplicatedNamespace()
    state = _plan({"__name__": "__main__"}, BIG, codec, replicated).state("m1", "r1")
    replicated.apply(state)
    standby: dict[str, Any] = {"__name__": "__main__"}
    not_loaded: dict[str, str] = {}
    groups = [(g, None) for g in state.groups]
    asyncio.run(apply_state(standby, ObjectCodec(None), state.imports, groups, (), not_loaded))
    assert set(not_loaded) == {"big"} and "needs a store" in not_loaded["big"] and standby["small"] == [1, 2]
    imports, again = replicated.contents_of(not_loaded)
    assert [names for _, names in again] == [["big"]]
    asyncio.run(apply_state(standby, ObjectCodec(store), imports, again, (), not_loaded))
    assert not_loaded == {} and standby["big"][-1] == 19_999.0
    not_loaded["gone"] = "why"
    asyncio.run(apply_state(standby, ObjectCodec(store), [], [], ["gone"], not_loaded))
    assert not_loaded == {}


def test_a_failed_write_behind_is_unstored_and_settles_like_a_failed_write(tmp_path: Path) -> None:
    codec = ObjectCodec(LocalStore(tmp_path / "ok", fsync=False), large_object_bytes=1024)
    plan = _plan({"__name__": "__main__"}, BIG, codec, ReplicatedNamespace(), defer_large=True)
    written = asyncio.run(
        complete_state(plan.state("m1", "r1"), plan.deferred, _unwritable(tmp_path), structlog.get_logger())
    )
    record = ExecutorRecord()
    assert "big" in written.unstored and "big" not in written.digests
    record.settle(written, (), now=0.0)
    assert record.unstored().keys() == {"big"} and record.backoff.failing
