"""Change detection and the replicated namespace (pure parts of state sync)."""

from __future__ import annotations

import threading

from kernel_replica.log_entries import State
from kernel_replica.state_sync import (
    PickleDiffDetector,
    ReplicatedNamespace,
    StateDiff,
    load_into,
    replicable_names,
)


def as_state(diff: StateDiff, msg_id: str = "m") -> State:
    return State(msg_id, "r1", diff.digests, diff.namespace, tuple(diff.deleted), diff.skipped)


def test_only_user_names_are_replicated() -> None:
    ns = {"x": 1, "_": 2, "_i1": "", "__builtins__": None, "In": [], "Out": {}, "get_ipython": None, "h": 3}
    assert replicable_names(ns, hidden=["h"]) == ["x"]


def test_diff_reports_changed_and_deleted_names_then_nothing() -> None:
    replicated = ReplicatedNamespace()
    detector = PickleDiffDetector()
    ns: dict[str, object] = {"x": 1, "f": lambda v: v + 1}
    diff = detector.detect(ns, replicated.digests())
    assert sorted(diff.changed) == ["f", "x"] and diff.deleted == [] and diff.namespace
    replicated.apply(as_state(diff))
    unchanged = detector.detect(ns, replicated.digests())
    assert not unchanged and unchanged.namespace == b""
    ns["x"] = 2
    del ns["f"]
    diff = detector.detect(ns, replicated.digests())
    assert diff.changed == ["x"] and diff.deleted == ["f"]


def test_objects_shared_between_names_stay_shared_on_the_standby() -> None:
    # an optimizer holding the model's parameters: copies made name by name would diverge
    params = [1.0, 2.0]
    ns: dict[str, object] = {"model": {"params": params}, "optimizer": {"params": params}}
    diff = PickleDiffDetector().detect(ns, {})
    standby: dict[str, object] = {}
    assert load_into(standby, diff.namespace, diff.digests, diff.deleted) is None
    standby["optimizer"]["params"].append(3.0)  # type: ignore[index]
    assert standby["model"]["params"] == [1.0, 2.0, 3.0]  # type: ignore[index]


def test_unpicklable_values_are_skipped_with_one_notice() -> None:
    notices: list[tuple[str, str]] = []
    detector = PickleDiffDetector(warn=lambda name, why: notices.append((name, why)))
    ns = {"lock": threading.Lock(), "y": [1, 2]}
    for _ in range(2):
        diff = detector.detect(ns, {})
        assert diff.changed == ["y"] and "lock" in diff.skipped and "lock" not in diff.digests
    assert len(notices) == 1 and notices[0][0] == "lock"


def test_oversized_values_are_skipped() -> None:
    diff = PickleDiffDetector(max_object_bytes=100).detect({"big": b"x" * 1000, "small": 1}, {})
    assert diff.changed == ["small"] and "too large" in diff.skipped["big"]


def test_snapshot_round_trip_rebuilds_the_namespace() -> None:
    source = ReplicatedNamespace()
    source.apply(as_state(PickleDiffDetector().detect({"x": 41, "s": "hi", "gone": 0}, {})))
    deletion = PickleDiffDetector().detect({"x": 41, "s": "hi"}, source.digests())
    source.apply(as_state(deletion))
    restored = ReplicatedNamespace()
    restored.restore(source.to_snapshot())
    assert restored.digests() == source.digests()
    ns: dict[str, object] = {}
    blob, names = restored.contents()
    assert load_into(ns, blob, names, ()) is None
    assert ns == {"x": 41, "s": "hi"}


def test_load_reports_a_blob_that_fails_to_unpickle() -> None:
    ns: dict[str, object] = {"keep": 1}
    failure = load_into(ns, b"not a pickle", ["bad"], ["keep"])
    assert failure is not None and ns == {}
