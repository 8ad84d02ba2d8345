"""Standard streams whose ``flush()`` skips the IOPub round trip when it cannot change anything.

ipykernel's ``OutStream.flush()`` hands two tasks to the IOPub thread (send this stream's
buffer; set an event) and waits for the event: output or not. That wait is also an ordering
barrier for everything else queued on the thread (a cell's error or execute_result must leave
before its execute_reply, which the kernel sends itself), so a flush may only be skipped when
nothing at all was handed to the thread since the last completed barrier, not merely when this
stream is empty. A cell flushes stdout then stderr after it runs, and ipykernel both again after
the handler: the second of each pair now costs nothing, and so does a quiet standby's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ipykernel.iostream import IOPubThread, OutStream


class _ScheduleCounter:
    """Counts the callbacks handed to one IOPub thread and those it has run (installed on its
    ``schedule``; the thread runs them in order, so equal counts mean nothing is outstanding)."""

    def __init__(self, thread: IOPubThread) -> None:
        self._lock = threading.Lock()
        self.scheduled = 0
        self.completed = 0
        self._schedule = thread.schedule
        thread.schedule = self.schedule  # type: ignore[method-assign]

    def schedule(self, f: Callable[[], Any]) -> None:
        with self._lock:
            self.scheduled += 1

        def run() -> None:
            try:
                f()
            finally:
                with self._lock:
                    self.completed += 1

        self._schedule(run)

    def drained(self) -> bool:
        with self._lock:
            return self.completed == self.scheduled


_COUNTERS: dict[int, _ScheduleCounter] = {}
_COUNTERS_LOCK = threading.Lock()


def _counter(thread: IOPubThread) -> _ScheduleCounter:
    with _COUNTERS_LOCK:
        counter = _COUNTERS.get(id(thread))
        if counter is None:
            counter = _COUNTERS[id(thread)] = _ScheduleCounter(thread)
        return counter


class BarrierOutStream(OutStream):
    """``OutStream`` that knows when its flush would be a no-op (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._schedules = _counter(self.pub_thread) if self.pub_thread is not None else None

    def flush(self) -> None:
        counter = self._schedules
        if (
            counter is not None
            and not (
                self._buffers
                or self._flush_pending
                or getattr(self, "_subprocess_flush_pending", False)
                or self.echo is not None
            )
            and counter.drained()
        ):
            return
        super().flush()
