"""The job-side API of Tandem's best-effort training jobs (``tandem job submit``).

    import tandem_job

    with tandem_job.session(total=10_000) as job:
        model.load_state_dict(...)            # resume from your own checkpoint if job.start > 0
        for step in job.steps():              # job.start, job.start + 1, ..., total - 1
            train_one_step(step)
        if job.stopped:                       # the lease ended or the job was cancelled
            save_checkpoint(step)

Each step boundary reports progress (iterations done and total, seconds per iteration: what the
arbiter's finish-time-fairness estimates are made of) and honours the local scheduler's control
word: ``run``, ``pause`` (block here until ``run`` or ``stop``) or ``stop`` (the loop ends; the
job resumes later, possibly on other GPUs, from ``job.start`` = the iterations it reported).

The channel is two small files in the job's directory (``$TANDEM_JOB_DIR``), each replaced
atomically: ``control`` written by the local scheduler, ``progress.json`` by the job. Why files,
not a socket or a pipe: either side may restart without the other noticing a broken link, the
job needs no keys and no event loop, any language can speak it, and the cost per step is one
``stat``. Outside Tandem (no ``$TANDEM_JOB_DIR``) the loop simply runs.

Packing (issue #18, Gimbal): when the local scheduler packs two jobs on one GPU it writes a third
file, ``share`` (10..100, LGRR steps), which the loop reads at each step boundary like the control
word (one ``stat``): below 100 a duty cycle (``shared.packing.governor``) pauses after each step so
the job runs at that share of its full-speed step rate, and, when the job has imported torch, its
intra-op threads shrink to the cores the share covers. The share in force is in each progress
report (``share``), so the scheduler's runtime monitor sees what it measured. A fourth file,
``packing.json``, says with whom the job is packed and which of its GPUs it shares (``packing()``;
empty when it has its GPUs alone): a data-parallel job steals samples across its workers (LISS,
``shared.packing.liss.DataParallelLiss``) only while it is packed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

CONTROL_FILE = "control"
PROGRESS_FILE = "progress.json"
SHARE_FILE = "share"
PACKING_FILE = "packing.json"
RUN, PAUSE, STOP = "run", "pause", "stop"
CONTROL_WORDS = (RUN, PAUSE, STOP)
# progress.json is rewritten at most this often (and at every state change)
REPORT_INTERVAL_S = 0.5
PAUSE_POLL_S = 0.1
# weight of the newest step in the seconds-per-iteration average
EWMA_ALPHA = 0.2


def gpu_ids() -> list[int]:
    """The host GPU ids this job's lease holds (also ``CUDA_VISIBLE_DEVICES``)."""
    raw = os.environ.get("TANDEM_GPU_IDS", "")
    return [int(part) for part in raw.split(",") if part.strip()]


def packing(job_dir: Path | None = None) -> dict[str, Any]:
    """With whom this job is packed now, as the local scheduler wrote it (``jmax``, ``with``,
    ``shared_device_ids``: its GPUs another job runs on too); empty when it runs alone or outside
    Tandem. Any process of the job may read it (the ranks of a data-parallel job)."""
    if job_dir is None:
        raw = os.environ.get("TANDEM_JOB_DIR")
        if not raw:
            return {}
        job_dir = Path(raw)
    try:
        found = json.loads((job_dir / PACKING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_control(job_dir: Path) -> str:
    """The control word in ``job_dir`` (``run`` when absent or unreadable)."""
    try:
        word = (job_dir / CONTROL_FILE).read_text().strip()
    except OSError:
        return RUN
    return word if word in CONTROL_WORDS else RUN


def write_atomically(path: Path, text: str) -> None:
    """Readers never see a half-written file: write beside it, then rename over it (0600)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class StepHook(Protocol):
    """Called by ``Job.steps`` on the training thread (``tandem_job.checkpoints`` is one)."""

    def boundary(self, done: int) -> None:
        """``done`` steps are complete (of this run and earlier ones)."""

    def stopping(self, done: int) -> None:
        """The loop is about to end on a stop word, after ``done`` steps."""


class Job:
    """One run of a training loop under Tandem; see the module docstring."""

    def __init__(self, total: int | None, *, job_dir: Path | None, start: int = 0) -> None:
        self.total = total
        self.start = start
        self.done = start  # iterations completed, counting those of earlier runs
        self.stopped = False  # the loop ended on a stop (not at ``total``)
        self.job_id = os.environ.get("TANDEM_JOB_ID", "")
        self.seconds_per_iteration: float | None = None
        self._dir = job_dir
        self._control_seen: tuple[int, int] | None = None
        self._control = RUN
        self._reported_at = 0.0
        self._state = "running"
        self._governor: _Governor | None = None if job_dir is None else _Governor(job_dir / SHARE_FILE)
        self.hooks: list[StepHook] = []
        self.reported: dict[str, Any] = {}  # extra progress fields (a hook's measurements)

    @property
    def share(self) -> int:
        """The share of its GPU this job runs at (100 unless packed and squeezed)."""
        return 100 if self._governor is None else self._governor.share

    def steps(self) -> Iterator[int]:
        """Step indices from ``start`` to ``total - 1`` (forever when ``total`` is None). Between
        two steps: progress is reported and the control word obeyed."""
        step = self.start
        while self.total is None or step < self.total:
            if self._obey() == STOP:
                self.stopped = True
                for hook in self.hooks:
                    hook.stopping(self.done)
                break
            if self._governor is not None:
                self._governor.poll()
            began = time.monotonic()
            yield step
            busy = time.monotonic() - began
            if self._governor is not None:
                self._governor.pace(busy)
            self._finished_step(busy)
            step += 1
        self._report("stopped" if self.stopped else "finished", force=True)

    def _finished_step(self, seconds: float) -> None:
        self.done += 1
        previous = self.seconds_per_iteration
        self.seconds_per_iteration = (
            seconds if previous is None else EWMA_ALPHA * seconds + (1 - EWMA_ALPHA) * previous
        )
        for hook in self.hooks:
            hook.boundary(self.done)
        self._report("running")

    def _obey(self) -> str:
        """The control word now; ``pause`` blocks until it changes."""
        word = self._read()
        if word == PAUSE:
            self._report("paused", force=True)
            while word == PAUSE:
                time.sleep(PAUSE_POLL_S)
                word = self._read()
            self._report("running", force=True)
        return word

    def _read(self) -> str:
        if self._dir is None:
            return RUN
        try:
            st = (self._dir / CONTROL_FILE).stat()
            seen = (st.st_mtime_ns, st.st_ino)
        except OSError:
            return RUN
        if seen != self._control_seen:  # one stat per step; the file is read only when replaced
            self._control_seen = seen
            self._control = read_control(self._dir)
        return self._control

    def report(self) -> None:
        """Write progress now (a hook's new measurement should not wait for the next interval)."""
        self._report(self._state, force=True)

    def _report(self, state: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self._dir is None or (
            not force and state == self._state and now - self._reported_at < REPORT_INTERVAL_S
        ):
            return
        self._state, self._reported_at = state, now
        progress = {
            "state": state,
            "iterations_done": self.done,
            "iterations_total": self.total,
            "seconds_per_iteration": self.seconds_per_iteration,
            "share": self.share,
            "pid": os.getpid(),
            "updated_at": time.time(),
            **self.reported,
        }
        with contextlib.suppress(OSError):  # a full disk must not kill the training
            write_atomically(self._dir / PROGRESS_FILE, json.dumps(progress))


class _Governor:
    """The job's side of squeeze/swell: the share file, read when replaced, drives a duty cycle
    (pure accounting in ``shared.packing.governor.DutyCycle``) and torch's thread count."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._seen: tuple[int, int] | None = None
        self._cycle: Any = None  # a DutyCycle, created at the first share below 100
        self._threads: int | None = None  # torch's intra-op threads at 100%
        self.share = 100

    def poll(self) -> None:
        try:
            st = self._path.stat()
        except OSError:
            return
        seen = (st.st_mtime_ns, st.st_ino)
        if seen == self._seen:
            return
        self._seen = seen
        try:
            share = round(float(self._path.read_text().strip()))
        except (OSError, ValueError):
            return
        self._apply(max(10, min(100, share)))

    def _apply(self, share: int) -> None:
        if self._cycle is None:
            from shared.packing.governor import DutyCycle  # only packed jobs need it

            self._cycle = DutyCycle()
        self._cycle.set_share(share)
        self.share = self._cycle.share
        torch = sys.modules.get("torch")
        if torch is not None:  # the job's own threads: scale them, never raise them above its own
            from shared.packing.governor import threads_for

            if self._threads is None:
                self._threads = int(torch.get_num_threads())
            torch.set_num_threads(threads_for(self.share, self._threads))

    def pace(self, busy_s: float) -> None:
        """After a step of ``busy_s``: sleep what the duty cycle owes (nothing at 100%)."""
        if self._cycle is None:
            return
        pause = self._cycle.pause_after(busy_s, time.monotonic())
        if pause > 0:
            t0 = time.monotonic()
            time.sleep(pause)
            self._cycle.slept(time.monotonic() - t0)


@contextlib.contextmanager
def session(total: int | None = None) -> Iterator[Job]:
    """A ``Job`` for this process: resumes at ``$TANDEM_JOB_START`` iterations (what an earlier
    run of the job reported before its lease ended)."""
    raw_dir = os.environ.get("TANDEM_JOB_DIR")
    job_dir = Path(raw_dir) if raw_dir else None
    start = int(os.environ.get("TANDEM_JOB_START", "0") or 0)
    if total is not None:
        start = min(start, total)
    job = Job(total, job_dir=job_dir, start=start)
    job._report("starting", force=True)  # the arbiter learns the total before the first step
    yield job
