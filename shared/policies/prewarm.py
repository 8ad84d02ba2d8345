"""Container Prewarmer policies: how many warm runtimes each host should hold (NotebookOS §3.2.3).

A warm runtime (an interpreter with the common imports done) turns a migration's or scale-out's
cold start into a hand-over. All policies answer one question, ``targets(pools) -> {host: n}``,
and ``reconcile`` turns targets and current counts into start/stop actions, so the serving
controller and the simulator apply the same arithmetic:

* ``FixedCapacity``: exactly n per host (start the missing, stop the extra);
* ``MinCapacity``: at least n per host, never stops (the paper's default);
* ``LittlesLaw``: L = λ·W warm runtimes cluster-wide, λ the observed rate of warm-runtime demand
  (migrations + scale-outs + LCP cells) and W how long a consumed runtime takes to be replaced,
  spread over hosts with the most idle GPUs first (migrations go where GPUs are free).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PoolView:
    host_id: str
    warm: int = 0  # ready to hand over
    starting: int = 0  # being warmed, will be ready
    idle_gpus: int = 0
    max_warm: int | None = None  # what the host can hold (memory), None: no limit

    @property
    def total(self) -> int:
        return self.warm + self.starting


@dataclass(frozen=True, slots=True)
class PrewarmAction:
    host_id: str
    start: int = 0  # warm runtimes to start
    stop: int = 0  # idle warm runtimes to stop


class PrewarmPolicy(Protocol):
    def targets(self, pools: Sequence[PoolView]) -> dict[str, int]:
        """The desired number of warm (or warming) runtimes per host."""

    @property
    def may_stop(self) -> bool:
        """Whether runtimes above target are stopped (False: only ever start)."""


def _clamp(n: int, pool: PoolView) -> int:
    return max(0, n if pool.max_warm is None else min(n, pool.max_warm))


@dataclass(frozen=True, slots=True)
class FixedCapacity:
    per_host: int = 1
    may_stop: bool = True

    def targets(self, pools: Sequence[PoolView]) -> dict[str, int]:
        return {p.host_id: _clamp(self.per_host, p) for p in pools}


@dataclass(frozen=True, slots=True)
class MinCapacity:
    per_host: int = 1
    may_stop: bool = False

    def targets(self, pools: Sequence[PoolView]) -> dict[str, int]:
        return {p.host_id: max(p.total, _clamp(self.per_host, p)) for p in pools}


@dataclass(frozen=True, slots=True)
class LittlesLaw:
    """Size the whole pool as L = ceil(λ·W · headroom), at least ``min_per_host`` on every host."""

    arrival_rate_per_s: float  # λ: warm runtimes consumed per second (see ArrivalRate)
    lifetime_s: float  # W: seconds a consumed runtime takes to be replaced by a new warm one
    headroom: float = 1.0
    min_per_host: int = 0
    may_stop: bool = True

    @property
    def total(self) -> int:
        return max(0, math.ceil(self.arrival_rate_per_s * self.lifetime_s * self.headroom - 1e-9))

    def targets(self, pools: Sequence[PoolView]) -> dict[str, int]:
        out = {p.host_id: _clamp(self.min_per_host, p) for p in pools}
        left = self.total - sum(out.values())
        order = sorted(pools, key=lambda p: (-p.idle_gpus, p.host_id))
        while left > 0:
            progressed = False
            for p in order:  # round robin, most idle GPUs first
                if left == 0:
                    break
                if p.max_warm is None or out[p.host_id] < p.max_warm:
                    out[p.host_id] += 1
                    left -= 1
                    progressed = True
            if not progressed:
                break  # every host is full
        return out


def reconcile(policy: PrewarmPolicy, pools: Sequence[PoolView]) -> list[PrewarmAction]:
    """Start/stop actions that move every host to its target; hosts already there are omitted.

    Only ready (``warm``) runtimes are stopped: runtimes still starting are left to finish.
    """
    targets = policy.targets(pools)
    actions: list[PrewarmAction] = []
    for p in pools:
        want = targets.get(p.host_id, 0)
        if p.total < want:
            actions.append(PrewarmAction(p.host_id, start=want - p.total))
        elif policy.may_stop and p.total > want and p.warm > 0:
            actions.append(PrewarmAction(p.host_id, stop=min(p.total - want, p.warm)))
    return actions


@dataclass(slots=True)
class ArrivalRate:
    """λ as an exponentially weighted rate of events; time is a parameter, never read from a clock."""

    half_life_s: float = 300.0
    _rate: float = 0.0
    _last: float | None = None

    def _decay(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self._rate *= 0.5 ** ((now - self._last) / self.half_life_s)
        self._last = now if self._last is None else max(self._last, now)

    def observe(self, now: float, count: int = 1) -> None:
        self._decay(now)
        self._rate += count * math.log(2) / self.half_life_s

    def rate(self, now: float) -> float:
        self._decay(now)
        return self._rate
