"""Read and write traces as CSV, so a user can replay their own notebook workload.

One row per task; the session's columns repeat on each of its rows. A session with no tasks is one
row with ``task_start`` and ``task_end`` empty. Columns::

    session_id, session_start, session_end, task_start, task_end, gpus[, millicpus, memory_mb, vram_gb]

Times are seconds (any origin) or ISO-8601 timestamps (naive ones read as UTC). With ``rebase``
(default) the earliest session start becomes 0. Missing resource columns default to the GPU
count's share of an 8-GPU server. Any bad row raises :class:`TraceCsvError` naming the line and the
column, since a replay that silently drops rows would misstate every result built on it.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from shared.resources import Resources
from shared.workload.model import MAX_SESSION_GPUS, TIME_EPS_S, Session, Task, Trace, default_resources

REQUIRED = ("session_id", "session_start", "session_end", "task_start", "task_end", "gpus")
OPTIONAL = ("millicpus", "memory_mb", "vram_gb")
COLUMNS = REQUIRED + OPTIONAL


class TraceCsvError(ValueError):
    """A CSV trace that cannot be read; ``line`` is 1-based as an editor shows it, header is line 1."""

    def __init__(self, line: int, column: str | None, message: str) -> None:
        self.line = line
        self.column = column
        where = f"line {line}" + (f", column {column!r}" if column else "")
        super().__init__(f"{where}: {message}")


def _parse_time(text: str, line: int, column: str) -> float:
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        try:
            ts = datetime.fromisoformat(text)
        except ValueError:
            raise TraceCsvError(line, column, f"expected seconds or an ISO-8601 time, got {text!r}") from None
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=UTC)
        return ts.timestamp()
    if not math.isfinite(value):
        raise TraceCsvError(line, column, f"expected a finite time, got {text!r}")
    return value


def _parse_int(text: str, line: int, column: str, lo: int, hi: int | None = None) -> int:
    try:
        value = float(text.strip())
    except ValueError:
        raise TraceCsvError(line, column, f"expected a whole number, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise TraceCsvError(line, column, f"expected a whole number, got {text!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise TraceCsvError(line, column, f"must be {bound}, got {text!r}")
    return int(value)


def _parse_float(text: str, line: int, column: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise TraceCsvError(line, column, f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TraceCsvError(line, column, f"expected a finite number >= 0, got {text!r}")
    return value


def checked_rows(
    source: TextIO, required: Sequence[str], optional: Sequence[str]
) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, row) for each row of a CSV stream whose header has every ``required`` column and no
    column outside ``required`` + ``optional``, and whose rows have as many fields as the header."""
    columns = [*required, *optional]
    reader = csv.DictReader(source)
    header = [h.strip() for h in (reader.fieldnames or [])]
    if not header:
        raise TraceCsvError(1, None, "empty file: no header row")
    reader.fieldnames = header
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceCsvError(1, None, f"header lacks required column(s) {missing}; expected {columns}")
    unknown = [c for c in header if c not in columns]
    if unknown:
        raise TraceCsvError(1, None, f"unknown column(s) {unknown}; expected {columns}")
    for row in reader:
        if None in row or any(v is None for v in row.values()):
            raise TraceCsvError(reader.line_num, None, f"expected {len(header)} fields")
        yield reader.line_num, row


@dataclass
class _SessionRow:
    line: int
    start: float
    end: float
    gpus: int
    resources: Resources


def read_trace_csv(source: str | Path | TextIO, *, rebase: bool = True) -> Trace:
    """Parse a CSV trace (a path or an open text stream) into a validated :class:`Trace`."""
    if isinstance(source, str | Path):
        with open(source, newline="", encoding="utf-8") as fh:
            return read_trace_csv(fh, rebase=rebase)
    sessions: dict[str, _SessionRow] = {}
    raw_tasks: list[tuple[int, str, float, float, int]] = []
    for line, row in checked_rows(source, REQUIRED, OPTIONAL):
        sid = row["session_id"].strip()
        if not sid:
            raise TraceCsvError(line, "session_id", "empty session id")
        start = _parse_time(row["session_start"], line, "session_start")
        end = _parse_time(row["session_end"], line, "session_end")
        if end < start:
            raise TraceCsvError(line, "session_end", f"session ends ({end:g}) before it starts ({start:g})")
        gpus = _parse_int(row["gpus"], line, "gpus", 1, MAX_SESSION_GPUS)
        res = default_resources(gpus)
        extra: dict[str, int | float] = {}
        for col in OPTIONAL:
            text = (row.get(col) or "").strip()
            if text:
                extra[col] = (
                    _parse_float(text, line, col) if col == "vram_gb" else _parse_int(text, line, col, 0)
                )
        if extra:
            res = Resources(
                millicpus=int(extra.get("millicpus", res.millicpus)),
                memory_mb=int(extra.get("memory_mb", res.memory_mb)),
                gpus=gpus,
                vram_gb=float(extra.get("vram_gb", res.vram_gb)),
            )
        known = sessions.get(sid)
        if known is None:
            sessions[sid] = _SessionRow(line, start, end, gpus, res)
        else:
            for col, a, b in (
                ("session_start", known.start, start),
                ("session_end", known.end, end),
                ("gpus", known.gpus, gpus),
                ("millicpus", known.resources.millicpus, res.millicpus),
                ("memory_mb", known.resources.memory_mb, res.memory_mb),
                ("vram_gb", known.resources.vram_gb, res.vram_gb),
            ):
                if a != b:
                    raise TraceCsvError(
                        line, col, f"session {sid!r} has {b!r} here but {a!r} on line {known.line}"
                    )
        t_start_text, t_end_text = row["task_start"].strip(), row["task_end"].strip()
        if not t_start_text and not t_end_text:
            continue  # a session without tasks
        if not t_start_text or not t_end_text:
            col = "task_start" if not t_start_text else "task_end"
            raise TraceCsvError(line, col, "task_start and task_end must both be set or both empty")
        t0 = _parse_time(t_start_text, line, "task_start")
        t1 = _parse_time(t_end_text, line, "task_end")
        if t1 <= t0:
            raise TraceCsvError(line, "task_end", f"task ends ({t1:g}) at or before it starts ({t0:g})")
        if t0 < start:
            raise TraceCsvError(line, "task_start", f"task starts ({t0:g}) before its session ({start:g})")
        if t1 > end:
            raise TraceCsvError(line, "task_end", f"task ends ({t1:g}) after its session ({end:g})")
        raw_tasks.append((line, sid, t0, t1, gpus))

    origin = min((s.start for s in sessions.values()), default=0.0) if rebase else 0.0
    session_objs = [
        Session(sid, s.start - origin, s.end - origin, s.gpus, s.resources) for sid, s in sessions.items()
    ]
    # Overlap within a session is a trace error too; report it with the offending line.
    last_end: dict[str, tuple[float, int]] = {}
    for line, sid, t0, t1, _ in sorted(raw_tasks, key=lambda r: (r[1], r[2])):
        prev = last_end.get(sid)
        if prev is not None and t0 < prev[0] - TIME_EPS_S:
            raise TraceCsvError(
                line,
                "task_start",
                f"task overlaps the session's task on line {prev[1]} (a kernel runs one cell at a time)",
            )
        last_end[sid] = (t1, line)
    tasks = (Task(sid, t0 - origin, t1 - t0, g) for _, sid, t0, t1, g in raw_tasks)
    return Trace.from_tasks(session_objs, tasks)


def _fmt(value: float) -> str:
    """Shortest text that reads back to the same float (exact round trip)."""
    return repr(float(value))


def _rows(trace: Trace) -> Iterable[list[str]]:
    by_session: list[list[Task]] = [[] for _ in trace.sessions]
    pos = {s.session_id: i for i, s in enumerate(trace.sessions)}
    for t in trace.tasks():
        by_session[pos[t.session_id]].append(t)
    for s, tasks in zip(trace.sessions, by_session, strict=True):
        head = [s.session_id, _fmt(s.start_s), _fmt(s.end_s)]
        tail = [str(s.resources.millicpus), str(s.resources.memory_mb), _fmt(s.resources.vram_gb)]
        if not tasks:
            yield [*head, "", "", str(s.gpus), *tail]
        for t in tasks:
            if t.gpus != s.gpus:
                raise ValueError(
                    f"session {s.session_id!r}: a task on {t.gpus} of its {s.gpus} GPUs has no CSV form "
                    "(the gpus column is the session's; every task uses all of them)"
                )
            yield [*head, _fmt(t.submit_s), _fmt(t.end_s), str(s.gpus), *tail]


def write_trace_csv(trace: Trace, dest: str | Path | TextIO) -> None:
    """Write ``trace`` with every column; :func:`read_trace_csv` (``rebase=False``) reads it back equal."""
    if isinstance(dest, str | Path):
        with open(dest, "w", newline="", encoding="utf-8") as fh:
            write_trace_csv(trace, fh)
        return
    w = csv.writer(dest, lineterminator="\n")
    w.writerow(COLUMNS)
    w.writerows(_rows(trace))


def trace_to_csv_text(trace: Trace) -> str:
    buf = io.StringIO()
    write_trace_csv(trace, buf)
    return buf.getvalue()
