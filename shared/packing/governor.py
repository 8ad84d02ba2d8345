"""Squeeze and swell a training job's share of its device, in Gimbal's 10% steps (LGRR, §4.1).

One interface, ``ShareControl``, two implementations:

- ``DutyCycleGovernor`` (portable, CPU): the job runs a step, then sleeps so its busy fraction
  equals its share (precisely: so its step rate is share x its full-speed rate, see ``DutyCycle``);
  optionally caps torch's intra-op threads too. The share is read at every step
  boundary, so a squeeze or swell takes effect on the very next step. The accounting (``DutyCycle``)
  is pure: it carries timer overshoot forward so the long-run busy fraction is the share even when
  ``sleep`` oversleeps.
- ``MpsShareControl`` (``shared.packing.mps``): ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` per client
  and a pool of pre-created contexts; written without a GPU and untested on hardware.

Whoever coordinates (the local scheduler's job runner, ``scripts/bench_packing.py``) writes the
share through ``write_share``; the job reads it through ``FileShare`` at each step boundary.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shared.policies.packing import FULL, MIN_CAP, STEP

REFERENCE_STEPS = 64
# a full-speed step older than this no longer describes the machine (a partner left, the load
# changed): without a fresher one the duty cycle paces to the step's own time
REFERENCE_MAX_AGE_S = 5.0


def quantize(percent: float) -> int:
    """A share in LGRR steps: 10..100%."""
    return int(min(FULL, max(MIN_CAP, STEP * round(percent / STEP))))


class ShareControl(Protocol):
    """Squeeze/swell a worker: the calibrator's side of LGRR, whatever the device."""

    @property
    def share(self) -> int: ...

    def set_share(self, percent: int) -> None: ...


@dataclass(slots=True)
class DutyCycle:
    """Pure accounting of a duty cycle: how long to pause after a step of ``busy_s`` seconds.

    At share s a step's period is ``reference / s``, ``reference`` being the step time the job last
    had at 100% (an average); before the job ever ran at 100% the step's own time stands in. On a
    device the job has to itself both are the same and the busy fraction is s. They differ on a
    CPU that other processes share: a process that sleeps gets its next timeslices sooner (the
    scheduler credits sleepers), so its steps shorten as it is squeezed and "busy fraction = s"
    would overshoot the throughput share; pacing to the full-speed step time keeps throughput at s
    of full speed, which is what the coordination search measures.

    The reference ages (``max_age_s``, when the caller passes ``now``): a job squeezed for good
    never runs at 100% again, and pacing it to a step time measured while its partner still ran
    kept it at that old speed after the partner finished (the live bench's Gimbal runs were 1.4-2.4x
    slower than free competition, the survivor pinned at 80-90% of its contended speed)."""

    share: int = FULL
    max_age_s: float | None = REFERENCE_MAX_AGE_S
    _owed_s: float = 0.0  # pause owed but not yet slept (negative: overslept)
    _full_steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=REFERENCE_STEPS))

    def reference_s(self, now: float | None = None) -> float | None:
        """Mean step time over the last steps at 100% (a mean, as throughput is; not an EMA, which
        one descheduled step would swing), those older than ``max_age_s`` left out."""
        steps = [
            busy
            for at, busy in self._full_steps
            if now is None or self.max_age_s is None or now - at <= self.max_age_s
        ]
        return sum(steps) / len(steps) if steps else None

    def set_share(self, percent: int) -> None:
        percent = quantize(percent)
        if percent != self.share:
            self.share = percent
            self._owed_s = 0.0  # a new share starts a new account: effect on the next step

    def pause_after(self, busy_s: float, now: float | None = None) -> float:
        """Seconds to pause now so the step rate tends to share x the full-speed rate (``now``: a
        monotonic clock, for the reference's age)."""
        if self.share >= FULL:
            self._full_steps.append((0.0 if now is None else now, busy_s))
            self._owed_s = 0.0
            return 0.0
        period = (self.reference_s(now) or busy_s) * FULL / self.share
        self._owed_s += period - busy_s
        return max(0.0, self._owed_s)

    def slept(self, seconds: float) -> None:
        """Record what the pause really took (sleep overshoots; the next pause pays it back)."""
        if self.share < FULL:
            self._owed_s -= seconds


def threads_for(percent: int, cores: int) -> int:
    """Intra-op threads for a share: the cores the share covers, at least one."""
    return max(1, min(cores, round(cores * percent / FULL)))


class FileShare:
    """The share a coordinator wrote to a file; re-read only when the file changes."""

    def __init__(self, path: Path, default: int = FULL) -> None:
        self._path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._value = default

    def read(self) -> int:
        try:
            st = self._path.stat()
        except FileNotFoundError:
            return self._value
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            text = self._path.read_text().strip()
            if text:
                self._value = quantize(float(text))
                self._stamp = stamp
        return self._value


def write_share(path: Path, percent: int) -> None:
    """Atomically publish a share for ``FileShare`` (rename, so a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{quantize(percent)}\n")
    os.replace(tmp, path)


class DutyCycleGovernor:
    """The CPU LGRR: wrap each training step in ``with governor.step():``.

    ``source`` (e.g. ``FileShare(...).read``) is polled at every step boundary; ``scale_threads``
    also sets torch's intra-op threads to the cores the share covers (off by default: thread
    scaling is not linear, so a pure duty cycle hits a throughput share more exactly)."""

    def __init__(
        self,
        source: Callable[[], int] | None = None,
        *,
        cores: int | None = None,
        scale_threads: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._cycle = DutyCycle()
        self._source = source
        self._cores = cores or os.cpu_count() or 1
        self._scale_threads = scale_threads
        self._clock = clock
        self._sleep = sleep
        self._threads: int | None = None
        self.busy_s = 0.0
        self.paused_s = 0.0

    @property
    def share(self) -> int:
        return self._cycle.share

    def set_share(self, percent: int) -> None:
        self._cycle.set_share(percent)
        if self._scale_threads:
            threads = threads_for(self._cycle.share, self._cores)
            if threads != self._threads:
                import torch

                torch.set_num_threads(threads)
                self._threads = threads

    @contextmanager
    def step(self) -> Iterator[None]:
        if self._source is not None:
            self.set_share(self._source())
        t0 = self._clock()
        yield
        busy = self._clock() - t0
        self.busy_s += busy
        pause = self._cycle.pause_after(busy, self._clock())
        if pause > 0:
            t1 = self._clock()
            self._sleep(pause)
            slept = self._clock() - t1
            self._cycle.slept(slept)
            self.paused_s += slept
