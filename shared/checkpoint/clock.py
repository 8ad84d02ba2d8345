"""What a checkpoint costs the training thread, in wall time and in CPU time.

Wall time is what the step waits for. On a shared machine it also counts time the thread spent
runnable but without a core; CPU time (``time.thread_time``) is the work the checkpoint put on the
training thread. Benchmarks report both.
"""

from __future__ import annotations

import time


class StallClock:
    __slots__ = ("cpu_s", "wall_s")

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0

    @staticmethod
    def start() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def stop(self, mark: tuple[float, float]) -> None:
        self.wall_s += time.perf_counter() - mark[0]
        self.cpu_s += time.thread_time() - mark[1]

    def add(self, other: StallClock) -> None:
        self.wall_s += other.wall_s
        self.cpu_s += other.cpu_s
