"""The trace data model: notebook sessions and the GPU cell tasks they submit.

Times are seconds from the trace's origin. A :class:`Session` is one notebook kernel's life (what
Reservation would hold GPUs for); a :class:`Task` is one GPU cell execution inside it. A
:class:`Trace` keeps sessions as objects (hundreds to thousands) but tasks as columns, because a
90-day trace has ~10^5-10^6 tasks and building that many objects would dominate generation time;
:meth:`Trace.tasks` yields :class:`Task` objects for drivers that want them.

Validation names the offending session or task so a bad generator change or a bad imported trace
fails with a message a person can act on.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shared.resources import Resources

MAX_SESSION_GPUS = 8  # one 8-GPU server (p3.16xlarge in the paper); multi-server sessions are out of scope

# A p3.16xlarge's share per GPU (64 vCPU, 488 GiB, 8 x 16 GB V100): the default request of a
# g-GPU session when a trace does not say, so placement sees sizes proportional to the GPUs asked.
# Slack for float rounding when comparing times (a task's end against the next submit or its
# session's end): end = submit + duration need not round-trip exactly through text.
TIME_EPS_S = 1e-6

PER_GPU_MILLICPUS = 8000
PER_GPU_MEMORY_MB = 61_000
PER_GPU_VRAM_GB = 16.0


def default_resources(gpus: int) -> Resources:
    """A g-GPU session's request when the trace gives only the GPU count: g/8 of an 8-GPU server."""
    return Resources(
        millicpus=PER_GPU_MILLICPUS * gpus,
        memory_mb=PER_GPU_MEMORY_MB * gpus,
        gpus=gpus,
        vram_gb=PER_GPU_VRAM_GB * gpus,
    )


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _gpu_count(gpus: object, where: str) -> int:
    if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral) or not 1 <= gpus <= MAX_SESSION_GPUS:
        raise ValueError(f"{where}: gpus must be an integer 1..{MAX_SESSION_GPUS}, got {gpus!r}")
    return int(gpus)


@dataclass(frozen=True, slots=True)
class Session:
    """One notebook session: open from ``start_s`` to ``end_s``, asking for ``gpus`` (1-8) per cell."""

    session_id: str
    start_s: float
    end_s: float
    gpus: int
    resources: Resources = field(default=Resources())

    def __post_init__(self) -> None:
        where = f"session {self.session_id!r}"
        if not isinstance(self.session_id, str) or not self.session_id:
            raise ValueError(f"session id must be a non-empty string, got {self.session_id!r}")
        if not _finite(self.start_s) or not _finite(self.end_s):
            raise ValueError(
                f"{where}: start/end must be finite numbers, got {self.start_s!r}, {self.end_s!r}"
            )
        if self.end_s < self.start_s:
            raise ValueError(f"{where}: ends at {self.end_s} before it starts at {self.start_s}")
        object.__setattr__(self, "gpus", _gpu_count(self.gpus, where))
        if self.resources == Resources():
            object.__setattr__(self, "resources", default_resources(self.gpus))
        elif self.resources.gpus != self.gpus:
            raise ValueError(
                f"{where}: resource request asks for {self.resources.gpus} GPUs but the session for {self.gpus}"
            )

    @property
    def lifetime_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class Task:
    """One GPU cell execution: submitted at ``submit_s``, runs ``duration_s`` on ``gpus`` GPUs."""

    session_id: str
    submit_s: float
    duration_s: float
    gpus: int

    def __post_init__(self) -> None:
        where = f"task of session {self.session_id!r} at {self.submit_s!r}"
        if not _finite(self.submit_s) or not _finite(self.duration_s):
            raise ValueError(f"{where}: submit/duration must be finite numbers")
        if self.duration_s <= 0:
            raise ValueError(f"{where}: duration must be > 0 s, got {self.duration_s}")
        object.__setattr__(self, "gpus", _gpu_count(self.gpus, where))

    @property
    def end_s(self) -> float:
        return self.submit_s + self.duration_s


@dataclass(frozen=True, eq=False)
class Trace:
    """Sessions plus their tasks in columns (index into ``sessions``, submit, duration, GPUs).

    Invariants, checked on construction: session ids unique; every task inside its session's
    window, using at most the session's GPUs; a session's tasks never overlap (a Jupyter kernel
    runs one cell at a time); tasks sorted by submit time. Arrays are made read-only.
    """

    sessions: tuple[Session, ...]
    task_session: npt.NDArray[np.int64]
    task_submit_s: npt.NDArray[np.float64]
    task_duration_s: npt.NDArray[np.float64]
    task_gpus: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        cols = {
            "task_session": np.asarray(self.task_session, dtype=np.int64),
            "task_submit_s": np.asarray(self.task_submit_s, dtype=np.float64),
            "task_duration_s": np.asarray(self.task_duration_s, dtype=np.float64),
            "task_gpus": np.asarray(self.task_gpus, dtype=np.int64),
        }
        n = len(cols["task_session"])
        for name, col in cols.items():
            if col.ndim != 1 or len(col) != n:
                raise ValueError(f"trace: column {name} has shape {col.shape}, expected ({n},)")
        order = np.argsort(cols["task_submit_s"], kind="stable")
        if n and np.any(order != np.arange(n)):
            cols = {name: col[order] for name, col in cols.items()}
        for name, col in cols.items():
            col.setflags(write=False)
            object.__setattr__(self, name, col)
        object.__setattr__(self, "sessions", tuple(self.sessions))
        self._validate()

    def _task_desc(self, i: int) -> str:
        sid = (
            self.sessions[self.task_session[i]].session_id
            if 0 <= self.task_session[i] < len(self.sessions)
            else "?"
        )
        return f"task #{i} (session {sid!r}, submitted at {self.task_submit_s[i]:g} s)"

    def _validate(self) -> None:
        seen: set[str] = set()
        for s in self.sessions:
            if not isinstance(s, Session):
                raise TypeError(f"trace: sessions must be Session objects, got {type(s).__name__}")
            if s.session_id in seen:
                raise ValueError(f"trace: duplicate session id {s.session_id!r}")
            seen.add(s.session_id)
        if len(self.task_session) == 0:
            return
        idx, submit, dur, gpus = self.task_session, self.task_submit_s, self.task_duration_s, self.task_gpus

        def first(bad: npt.NDArray[np.bool_], why: str) -> None:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(f"trace: {self._task_desc(i)}: {why} ({int(bad.sum())} such task(s))")

        first((idx < 0) | (idx >= len(self.sessions)), "refers to no session")
        first(~np.isfinite(submit) | ~np.isfinite(dur), "non-finite submit time or duration")
        first(dur <= 0, "duration must be > 0")
        start = np.array([s.start_s for s in self.sessions])[idx]
        end = np.array([s.end_s for s in self.sessions])[idx]
        cap = np.array([s.gpus for s in self.sessions])[idx]
        first(submit < start, "submitted before its session starts")
        first(submit + dur > end + TIME_EPS_S, "runs past its session's end")
        first((gpus < 1) | (gpus > cap), "uses fewer than 1 or more GPUs than its session requested")
        by_session = np.lexsort((submit, idx))
        same = idx[by_session][1:] == idx[by_session][:-1]
        prev_end = (submit + dur)[by_session][:-1]
        overlap = same & (submit[by_session][1:] < prev_end - TIME_EPS_S)
        if overlap.any():
            i = int(by_session[1:][np.flatnonzero(overlap)[0]])
            raise ValueError(f"trace: {self._task_desc(i)}: starts before the session's previous task ends")

    @classmethod
    def from_tasks(cls, sessions: Sequence[Session], tasks: Iterable[Task]) -> Trace:
        """Build a trace from task objects (importers, tests); the generator fills columns directly."""
        pos = {s.session_id: i for i, s in enumerate(sessions)}
        idx: list[int] = []
        submit: list[float] = []
        dur: list[float] = []
        gpus: list[int] = []
        for t in tasks:
            if t.session_id not in pos:
                raise ValueError(f"trace: task at {t.submit_s:g} s names unknown session {t.session_id!r}")
            idx.append(pos[t.session_id])
            submit.append(t.submit_s)
            dur.append(t.duration_s)
            gpus.append(t.gpus)
        return cls(
            tuple(sessions),
            np.array(idx, dtype=np.int64),
            np.array(submit, dtype=np.float64),
            np.array(dur, dtype=np.float64),
            np.array(gpus, dtype=np.int64),
        )

    @property
    def n_tasks(self) -> int:
        return len(self.task_submit_s)

    @property
    def task_end_s(self) -> npt.NDArray[np.float64]:
        return self.task_submit_s + self.task_duration_s

    @property
    def horizon_s(self) -> tuple[float, float]:
        """(earliest session start, latest session end): the span a simulator must cover."""
        if not self.sessions:
            return (0.0, 0.0)
        return (min(s.start_s for s in self.sessions), max(s.end_s for s in self.sessions))

    def task_intervals(self) -> npt.NDArray[np.float64]:
        """(submit, end, gpus) rows: the GPUs active trainings need, Figure 8's "oracle" input."""
        return np.column_stack((self.task_submit_s, self.task_end_s, self.task_gpus.astype(np.float64)))

    def session_intervals(self) -> npt.NDArray[np.float64]:
        """(start, end, gpus) rows: what Reservation holds for each session's whole life."""
        if not self.sessions:
            return np.empty((0, 3))
        return np.array([(s.start_s, s.end_s, float(s.gpus)) for s in self.sessions])

    def task(self, i: int) -> Task:
        return Task(
            self.sessions[int(self.task_session[i])].session_id,
            float(self.task_submit_s[i]),
            float(self.task_duration_s[i]),
            int(self.task_gpus[i]),
        )

    def tasks(self) -> Iterator[Task]:
        """All tasks in submit order, as objects."""
        ids = [s.session_id for s in self.sessions]
        for k, t0, d, g in zip(
            self.task_session.tolist(),
            self.task_submit_s.tolist(),
            self.task_duration_s.tolist(),
            self.task_gpus.tolist(),
            strict=True,
        ):
            yield Task(ids[k], t0, d, g)

    def iats_s(self) -> npt.NDArray[np.float64]:
        """Per-session task inter-arrival times, pooled: how the paper measures IAT (§2.3.2)."""
        if self.n_tasks < 2:
            return np.empty(0)
        order = np.lexsort((self.task_submit_s, self.task_session))
        idx, submit = self.task_session[order], self.task_submit_s[order]
        same = idx[1:] == idx[:-1]
        return np.diff(submit)[same]
