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


def renews_a_start(*, stepped: bool, starts_lost: int, run_age_s: float, allowance_s: float) -> bool:
    """Whether an expired lease, held alone by one run, is renewed rather than auctioned: the run
    has not reached its first step boundary, is younger than ``allowance_s``, and its job already
    lost a start (a lease ended before its run stepped). Its start (imports, data, a checkpoint
    read) is all it has done; ended again, the next lease elsewhere starts it from nothing, and a
    start longer than a lease never steps (live: a job started 15 times in two minutes of 2.5 s
    leases, 0 iterations). A first lease ends as any other: renewing every start let the app
    that won the first round hold its GPUs through all its jobs' imports, and GPU time between
    apps drifted apart (0.73:1 in a suite run of test_batch_jobs)."""
    return not stepped and starts_lost > 0 and run_age_s < allowance_s
