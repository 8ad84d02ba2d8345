"""Leases: an auction's outcome binds only until expiry (Themis §3.3.2, round-by-round auctions)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.arbiter.slots import GpuSlot


@dataclass(frozen=True)
class Lease:
    """GPUs granted to one job of one app until ``expires_at`` (then re-auctioned)."""

    app_id: str
    job_id: str
    slots: tuple[GpuSlot, ...]
    granted_at: float
    expires_at: float

    def expired(self, now: float) -> bool:
        return now >= self.expires_at
