"""GPU slots: the unit the arbiter leases, and the host layout that placement sensitivity sees."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class GpuSlot:
    """One physical GPU: a device index on a host. Two slots on one host talk over NVLink/PCIe,
    slots on two hosts over the network, which is what slows a placement-sensitive job."""

    host_id: str
    device: int


def host_counts(slots: Iterable[GpuSlot]) -> Counter[str]:
    """GPUs per host: all a bid's valuation depends on (GPUs on one host are interchangeable)."""
    return Counter(s.host_id for s in slots)


def spans_hosts(slots: Iterable[GpuSlot]) -> bool:
    """Whether a set of slots crosses the network (the case Themis's S(G) > 1 penalises)."""
    return len({s.host_id for s in slots}) > 1
