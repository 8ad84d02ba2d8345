"""Finish-time-fair arbiter for best-effort GPU jobs (Themis, NSDI'20), as a pure core.

``Arbiter(config).auction(now, apps, available, be_capacity_gpus)`` runs one round; the live
service (``services/arbiter``) and the BE simulator (``shared.simulator.be``) both drive it.
"""

from shared.arbiter.agent import AppAgent, Bid, Bundle
from shared.arbiter.arbiter import Arbiter, AuctionOutcome
from shared.arbiter.capacity import CapacityMeter
from shared.arbiter.config import ArbiterConfig
from shared.arbiter.lease import Lease
from shared.arbiter.reports import APP_JOBS, APP_SUCCESSIVE_HALVING, AppReport, JobReport
from shared.arbiter.slots import GpuSlot

__all__ = [
    "APP_JOBS",
    "APP_SUCCESSIVE_HALVING",
    "AppAgent",
    "AppReport",
    "Arbiter",
    "ArbiterConfig",
    "AuctionOutcome",
    "Bid",
    "Bundle",
    "CapacityMeter",
    "GpuSlot",
    "JobReport",
    "Lease",
]
