"""The output history (``_``, ``Out[n]``) as the log carries it (kernel_replica/output_history.py):
what the executor records for an output, and how another replica enters it."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from kernel_replica.log_entries import LogEntryError, State, decode, encode
from kernel_replica.output_history import (
    CellOutput,
    Unreplicated,
    capture_output,
    enter_outputs,
    output_loaded,
    reads_outputs,
    resolve_output,
)


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real IPython shell (its display hook is what enters outputs), writing nothing to ~."""
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell(config=config)
    shell.execution_count = 10
    return shell


def _capture(namespace: dict[str, Any], count: int, max_bytes: int = 1000) -> CellOutput | None:
    return capture_output(
        namespace, count, lambda: [n for n in namespace if not n.startswith("_")], max_bytes=max_bytes
    )


def test_an_output_held_by_a_variable_travels_as_its_name_and_a_new_value_pickled() -> None:
    items = [1, 2, 3]
    namespace = {"items": items, "_oh": {4: items, 5: 42}}
    assert _capture(namespace, 4) == CellOutput(4, alias="items")
    small = _capture(namespace, 5)
    assert small is not None and small.value is not None and small.alias is None
    assert _capture(namespace, 6) is None  # the cell showed nothing


def test_an_output_too_large_or_unpicklable_travels_as_the_reason() -> None:
    namespace = {"_oh": {1: bytes(5000), 2: threading.Lock(), 3: np.zeros(10**6), 4: np.zeros(10)}}
    large, lock, array, small = (_capture(namespace, n) for n in (1, 2, 3, 4))
    assert large is not None and large.missing == "its bytes is over 1,000 bytes pickled"
    assert lock is not None and lock.missing is not None and "lock cannot be pickled" in lock.missing
    assert array is not None and array.missing == "its ndarray is over 1,000 bytes pickled"
    long_list = _capture({"_oh": {5: list(range(5000))}}, 5)
    assert long_list is not None and long_list.missing == "its list is over 1,000 bytes pickled"
    assert (
        small is not None
        and small.value is not None
        and np.array_equal(pickle.loads(small.value), np.zeros(10))
    )


def test_outputs_enter_in_order_as_the_display_hook_would_and_name_what_is_missing(shell: Any) -> None:
    items = shell.user_ns["items"] = [1, 2, 3]
    outputs = [
        _capture({"_oh": {1: 42}}, 1),
        CellOutput(2, alias="items"),
        CellOutput(3, missing="its bytes is 3,000,000 bytes pickled, over 1,048,576"),
    ]
    taken = [(o.count, resolve_output(shell.user_ns, o, "r2")) for o in outputs if o is not None]
    shell.user_ns["items"] = "rebound by a later cell"  # after the outputs' STATEs applied
    enter_outputs(shell, taken)
    ns = shell.user_ns
    assert ns["___"] == 42 and ns["__"] is items and ns["_2"] is items and ns["Out"][1] == 42
    assert isinstance(ns["_"], Unreplicated) and ns["_"] is ns["_3"] is shell.displayhook._
    assert repr(ns["_"]) == (
        "<Out[3] is not on this replica: its bytes is 3,000,000 bytes pickled, over 1,048,576; it is on replica r2>"
    )
    assert shell.execution_count == 10  # this replica's own counter, as it was


def test_an_underscore_the_notebook_assigned_itself_is_left_alone(shell: Any) -> None:
    shell.user_ns["_"] = "the notebook's own"  # for _ in ...: IPython stops updating _, __, ___
    enter_outputs(shell, [(4, 42)])
    assert shell.user_ns["_"] == "the notebook's own" and shell.user_ns["_4"] == 42


def test_an_output_whose_variable_still_loads_is_replaced_when_it_is_in(shell: Any) -> None:
    marker = resolve_output(shell.user_ns, CellOutput(7, alias="model"), "r1", loading={"model"})
    assert isinstance(marker, Unreplicated) and marker.awaiting == "model" and "still loading" in repr(marker)
    enter_outputs(shell, [(7, marker)])
    model = object()
    output_loaded(shell, marker, model)
    assert (
        shell.user_ns["_"] is shell.user_ns["_7"] is shell.user_ns["_oh"][7] is shell.displayhook._ is model
    )


def test_cells_reading_the_history_are_told_apart() -> None:
    assert reads_outputs({"print", "_"}) and reads_outputs({"Out"}) and reads_outputs({"_12"})
    assert not reads_outputs({"df", "_private", "x_1"})


@pytest.mark.parametrize(
    ("ou", "problem"),
    [
        ([1, "a", None], "must be \\[count"),
        ([-1, "a", None, None], "count must be an int"),
        ([1, 7, None, None], "alias, value and missing"),
        ([1, "a", b"x", None], "exactly one"),
        ([1, None, None, None], "exactly one"),
    ],
)
def test_a_malformed_output_in_the_log_is_refused_naming_the_field(ou: list[Any], problem: str) -> None:
    body = msgpack.unpackb(encode(State("m", "r1")), raw=False)
    body["ou"] = ou  # as a faulty or hostile peer would have written it
    with pytest.raises(LogEntryError, match=f"'ou'.*{problem}"):
        decode(msgpack.packb(body, use_bin_type=True))


def test_an_output_survives_the_log_encoding() -> None:
    state = State("m", "r1", output=CellOutput(3, value=b"\x80\x05K*."))
    assert decode(encode(state)).output == state.output  # type: ignore[union-attr]


def test_the_output_history_is_in_the_snapshot_with_what_a_later_cell_rebound_named(shell: Any) -> None:
    """A replica rebuilt from a snapshot or a hibernation image had an empty history: ``_ * 2``
    after a resume gave ``''``. The log's record of the outputs is in the snapshot; an output
    held by a variable that a later cell changed cannot be the object the cell showed any more,
    and says so rather than stand for the later value."""
    from kernel_replica.state_sync import ReplicatedNamespace

    log = ReplicatedNamespace()
    group = {"names": ["df"], "sizes": [], "data": b""}
    log.apply(State("m1", "r1", groups=(group,), output=CellOutput(1, alias="df")))
    log.apply(State("m2", "r2", output=CellOutput(2, value=pickle.dumps(42))))
    log.apply(State("m3", "r2", output=CellOutput(3, alias="df")))
    log.apply(State("m4", "r1", groups=({"names": ["other"], "sizes": [], "data": b""},)))
    restored = ReplicatedNamespace()
    restored.restore(log.to_snapshot())
    assert (
        restored.outputs()
        == log.outputs()
        == [
            (CellOutput(1, alias="df"), "r1"),
            (CellOutput(2, value=pickle.dumps(42)), "r2"),
            (CellOutput(3, alias="df"), "r2"),
        ]
    )
    log.apply(State("m5", "r2", deleted=("df",)))
    (first, _), (_, _), (third, _) = log.outputs()
    assert first.missing is not None and "'df'" in first.missing and third.missing == first.missing

    namespace = {"df": "the frame"}
    enter_outputs(shell, [(o.count, resolve_output(namespace, o, e)) for o, e in restored.outputs()])
    assert shell.user_ns["_"] == "the frame" and shell.user_ns["__"] == 42 and shell.user_ns["_2"] == 42


def test_the_replicated_history_is_bounded_in_entries_and_in_copied_bytes() -> None:
    from kernel_replica.output_history import KEPT_COPY_BYTES, KEPT_OUTPUTS, ReplicatedOutputs

    outputs = ReplicatedOutputs()
    big = b"x" * (KEPT_COPY_BYTES // 3)
    for count in range(1, KEPT_OUTPUTS + 6):
        outputs.add(CellOutput(count, value=big if count > KEPT_OUTPUTS else b"v"), "r1")
    entries = outputs.entries()
    assert len(entries) == KEPT_OUTPUTS and entries[0][0].count == 6
    copies = [o for o, _ in entries if o.value is not None]
    assert sum(len(o.value or b"") for o in copies) <= KEPT_COPY_BYTES
    assert [o.count for o, _ in entries[-3:]] == [KEPT_OUTPUTS + 3, KEPT_OUTPUTS + 4, KEPT_OUTPUTS + 5]
    assert all(o.value == big for o, _ in entries[-2:])  # the newest copies are the ones kept
    dropped = [o for o, _ in entries if o.missing is not None]
    assert dropped and all("dropped from the replicated history" in (o.missing or "") for o in dropped)
    with pytest.raises(ValueError, match="list of \\[output, executor\\]"):
        ReplicatedOutputs.from_wire([[CellOutput(1, alias="x").to_wire()]])
