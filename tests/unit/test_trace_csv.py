"""CSV traces: an exact round trip, and bad rows rejected with their line and column."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.resources import Resources
from shared.workload.idlt import excerpt_17_5h
from shared.workload.model import Session, Task, Trace
from shared.workload.trace_csv import TraceCsvError, read_trace_csv, trace_to_csv_text, write_trace_csv

HEADER = "session_id,session_start,session_end,task_start,task_end,gpus\n"


def _read(text: str, **kw: bool) -> Trace:
    return read_trace_csv(io.StringIO(text), **kw)


def _assert_same(a: Trace, b: Trace) -> None:
    assert a.sessions == b.sessions
    assert np.array_equal(a.task_session, b.task_session)
    assert np.array_equal(a.task_submit_s, b.task_submit_s)
    assert np.allclose(a.task_duration_s, b.task_duration_s, rtol=0, atol=1e-6)
    assert np.array_equal(a.task_gpus, b.task_gpus)


def test_generated_trace_round_trips(tmp_path: Path) -> None:
    trace = excerpt_17_5h(seed=2)
    path = tmp_path / "t.csv"
    write_trace_csv(trace, path)
    _assert_same(trace, read_trace_csv(path, rebase=False))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1e6, allow_nan=False),
            st.lists(st.tuples(st.floats(0, 1e4), st.floats(0.5, 1e4)), max_size=5),
            st.integers(1, 8),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_round_trip_property(spec: list[tuple[float, list[tuple[float, float]], int]]) -> None:
    sessions, tasks = [], []
    for i, (start, gaps, gpus) in enumerate(spec):
        t = start
        for gap, dur in gaps:
            tasks.append(Task(f"s{i}", t + gap, dur, gpus))
            t += gap + dur
        sessions.append(Session(f"s{i}", start, t + 1.0, gpus, Resources(1500 * gpus, 700, gpus, 2.5)))
    trace = Trace.from_tasks(sessions, tasks)
    _assert_same(trace, _read(trace_to_csv_text(trace), rebase=False))


def test_session_without_tasks_and_rebase_and_defaults() -> None:
    trace = _read(HEADER + "a,100,200,,,2\nb,150,400,160,170,1\nb,150,400,180,190.5,1\n")
    assert [s.session_id for s in trace.sessions] == ["a", "b"]
    assert trace.sessions[0].start_s == 0.0 and trace.sessions[1].end_s == 300.0
    assert trace.n_tasks == 2 and trace.task(1) == Task("b", 80.0, 10.5, 1)
    assert trace.sessions[0].resources.gpus == 2 and trace.sessions[0].resources.millicpus > 0


def test_iso_timestamps() -> None:
    text = (
        HEADER + "a,2021-06-01T00:00:00,2021-06-01T01:00:00,2021-06-01T00:10:00,2021-06-01T00:12:00+00:00,1\n"
    )
    trace = _read(text)
    assert trace.task(0) == Task("a", 600.0, 120.0, 1)


def test_optional_resource_columns() -> None:
    text = "session_id,session_start,session_end,task_start,task_end,gpus,millicpus,memory_mb,vram_gb\n"
    trace = _read(text + "a,0,10,1,2,4,2000,4096,40.5\n")
    assert trace.sessions[0].resources == Resources(2000, 4096, 4, 40.5)


@pytest.mark.parametrize(
    ("body", "line", "column", "why"),
    [
        ("a,0,10,1,2,x\n", 2, "gpus", "whole number"),
        ("a,0,10,1,2,9\n", 2, "gpus", "1..8"),
        ("a,0,10,1,2,1\nb,zero,10,1,2,1\n", 3, "session_start", "seconds or an ISO-8601"),
        ("a,0,10,1,2,1\na,0,11,3,4,1\n", 3, "session_end", "on line 2"),
        ("a,0,10,5,4,1\n", 2, "task_end", "at or before it starts"),
        ("a,0,10,1,,1\n", 2, "task_end", "both be set"),
        ("a,5,10,1,2,1\n", 2, "task_start", "before its session"),
        ("a,0,10,1,12,1\n", 2, "task_end", "after its session"),
        ("a,0,10,1,5,1\na,0,10,4,6,1\n", 3, "task_start", "overlaps the session's task on line 2"),
        (",0,10,1,2,1\n", 2, "session_id", "empty"),
        ("a,0,10,1,2\n", 2, None, "expected 6 fields"),
        ("a,0,nan,1,2,1\n", 2, "session_end", "finite"),
        ("a,10,0,,,1\n", 2, "session_end", "before it starts"),
    ],
)
def test_bad_rows_name_line_and_column(body: str, line: int, column: str | None, why: str) -> None:
    with pytest.raises(TraceCsvError, match=why) as err:
        _read(HEADER + body)
    assert err.value.line == line and err.value.column == column
    assert f"line {line}" in str(err.value)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty file"),
        ("session_id,session_start\n", "lacks required"),
        (HEADER.strip() + ",colour\n", "unknown"),
    ],
)
def test_bad_header(text: str, why: str) -> None:
    with pytest.raises(TraceCsvError, match=why) as err:
        _read(text)
    assert err.value.line == 1


def test_partial_gpu_task_has_no_csv_form() -> None:
    trace = Trace.from_tasks([Session("a", 0, 10, 4)], [Task("a", 1.0, 2.0, 2)])
    with pytest.raises(ValueError, match="no CSV form"):
        trace_to_csv_text(trace)
