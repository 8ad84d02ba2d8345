"""The paper's billing model (NotebookOS §5.5.1): what the provider pays, what users pay, the margin.

The provider pays the cloud's VM rate for every provisioned server. Users pay ``markup`` (1.15x)
times the provider's rate in proportion to what they use: a replica training on g of a server's G
GPUs pays g/G of the VM rate x 1.15; a standby replica pays ``standby_fraction`` (12.5%) of it
x 1.15; Reservation pays the same 1.15x for the GPUs it holds, whether it uses them or not.
Worked example from the paper, $10/h 8-GPU VM: standby $1.4375/h (~$1.44), 4-GPU training $5.75/h.

Pure functions over usage intervals, so the simulator and the live cluster's accounting share them.
Which replicas count as standby (all three while idle, two while one trains) is the caller's call:
the paper does not say, so the model takes replica counts rather than guessing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from shared.workload.metrics import Interval, level_on_grid

SECONDS_PER_HOUR = 3600.0


class UsageKind(StrEnum):
    TRAINING = "training"  # units = GPUs a replica has bound while it executes
    STANDBY = "standby"  # units = standby replicas
    RESERVED = "reserved"  # units = GPUs held by a Reservation-style session


@dataclass(frozen=True)
class Rates:
    """Prices, configurable; defaults are the paper's example."""

    vm_rate_per_hour: float = 10.0  # what the provider pays the cloud per server-hour
    gpus_per_vm: int = 8
    markup: float = 1.15
    standby_fraction: float = 0.125  # of the VM rate, per standby replica

    def __post_init__(self) -> None:
        for name in ("vm_rate_per_hour", "markup", "standby_fraction"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"rates: {name} must be a finite number >= 0, got {v}")
        if self.gpus_per_vm < 1:
            raise ValueError(f"rates: gpus_per_vm must be >= 1, got {self.gpus_per_vm}")

    @property
    def gpu_rate_per_hour(self) -> float:
        """The provider's cost of one GPU-hour (a VM's rate shared over its GPUs)."""
        return self.vm_rate_per_hour / self.gpus_per_vm

    def price_per_hour(self, kind: UsageKind | str, units: float) -> float:
        """What a user pays per hour for ``units`` of ``kind``."""
        kind = UsageKind(kind)
        if units < 0:
            raise ValueError(f"units must be >= 0, got {units}")
        if kind is UsageKind.STANDBY:
            return self.vm_rate_per_hour * self.markup * self.standby_fraction * units
        return self.gpu_rate_per_hour * self.markup * units


def training_price_per_hour(rates: Rates, gpus: int) -> float:
    """A replica training on ``gpus`` GPUs: $5.75/h for 4 GPUs at the paper's rates."""
    return rates.price_per_hour(UsageKind.TRAINING, gpus)


def standby_price_per_hour(rates: Rates) -> float:
    """One standby replica: $1.4375/h (the paper's $1.44) at the paper's rates."""
    return rates.price_per_hour(UsageKind.STANDBY, 1)


def reservation_price_per_hour(rates: Rates, gpus: int) -> float:
    """A Reservation session holding ``gpus`` GPUs: the same 1.15x on every reserved GPU."""
    return rates.price_per_hour(UsageKind.RESERVED, gpus)


@dataclass(frozen=True)
class Usage:
    """``units`` of ``kind`` from ``start_s`` to ``end_s``."""

    start_s: float
    end_s: float
    kind: UsageKind
    units: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", UsageKind(self.kind))
        if not (math.isfinite(self.start_s) and math.isfinite(self.end_s)) or self.end_s < self.start_s:
            raise ValueError(f"usage {self}: needs finite start <= end")
        if not math.isfinite(self.units) or self.units < 0:
            raise ValueError(f"usage {self}: units must be a finite number >= 0")


def revenue(usages: Iterable[Usage], rates: Rates) -> float:
    """Total user payments in dollars."""
    return sum(
        rates.price_per_hour(u.kind, u.units) * (u.end_s - u.start_s) / SECONDS_PER_HOUR for u in usages
    )


def provider_cost(servers: Iterable[Interval], rates: Rates) -> float:
    """What the provider pays: (start_s, end_s, servers) intervals of provisioned VMs, at the VM rate."""
    total = 0.0
    for start, end, n in servers:
        if not (math.isfinite(start) and math.isfinite(end)) or end < start or n < 0:
            raise ValueError(f"server interval {(start, end, n)} needs finite start <= end and count >= 0")
        total += (end - start) / SECONDS_PER_HOUR * n * rates.vm_rate_per_hour
    return total


@dataclass(frozen=True)
class BillingSummary:
    cost: float
    revenue: float

    @property
    def profit(self) -> float:
        return self.revenue - self.cost

    @property
    def margin(self) -> float:
        """Profit as a share of revenue (Figure 12(b)); NaN when there is no revenue."""
        return self.profit / self.revenue if self.revenue > 0 else math.nan


def summarize(usages: Iterable[Usage], servers: Iterable[Interval], rates: Rates) -> BillingSummary:
    return BillingSummary(cost=provider_cost(servers, rates), revenue=revenue(usages, rates))


def _cumulative_dollars(
    level_per_hour: npt.NDArray[np.float64], grid: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Integrate a $/h step curve sampled on ``grid``: dollars accrued by each grid time."""
    dt_h = np.diff(grid) / SECONDS_PER_HOUR
    return np.concatenate(([0.0], np.cumsum(level_per_hour[:-1] * dt_h)))


def cumulative_on_grid(
    grid: npt.ArrayLike, usages: Iterable[Usage], servers: Iterable[Interval], rates: Rates
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(cost, revenue) accrued by each grid time: the timelines of Figure 12(a).

    Exact when every interval boundary lies on the grid; otherwise a left-Riemann sum of the grid.
    """
    t = np.asarray(grid, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or np.any(np.diff(t) <= 0):
        raise ValueError("grid must be a non-empty, strictly increasing 1-D array")
    priced = [(u.start_s, u.end_s, rates.price_per_hour(u.kind, u.units)) for u in usages]
    revenue_rate = level_on_grid(priced, t)
    cost_rate = level_on_grid(list(servers), t) * rates.vm_rate_per_hour
    return _cumulative_dollars(cost_rate, t), _cumulative_dollars(revenue_rate, t)
