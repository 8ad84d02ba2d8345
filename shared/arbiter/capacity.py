"""T_id's R: the time-averaged number of GPUs best-effort jobs could use.

GPUs committed to notebook cells are not BE capacity; counting them would make every app look
unfair while notebooks are busy. The instantaneous free count is no better: T_id would jump with
every cell. So the arbiter's caller feeds this meter the BE-usable count (GPUs not committed to a
cell, leased or not) whenever it changes or a round starts, and passes its average as
``be_capacity_gpus``.
"""

from __future__ import annotations


class CapacityMeter:
    """Time average of a step function: each observed count holds until the next observation."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float = 0.0
        self.count: float = 0.0
        self.area: float = 0.0

    def observe(self, now: float, usable_gpus: float) -> float:
        """Record ``usable_gpus`` from ``now`` on; return the average since the first observation
        (the current count when no time has passed yet)."""
        if self.first is None:
            self.first = now
        elif now > self.last:
            self.area += self.count * (now - self.last)
        self.last, self.count = max(now, self.last), usable_gpus
        return self.average(now)

    def average(self, now: float) -> float:
        if self.first is None:
            return 0.0
        span = now - self.first
        if span <= 0:
            return self.count
        area = self.area + self.count * max(0.0, now - self.last)
        return area / span
