"""Arbiter knobs (Themis §3.3.2 and §6.4's sensitivity analysis: f = 0.8, 10-minute leases)."""

from __future__ import annotations

from dataclasses import dataclass

#: ``ArbiterConfig.starving_priority`` values
STARVING_PRIORITIES = ("all", "at_risk", "none")


@dataclass(frozen=True)
class ArbiterConfig:
    """``fairness_knob`` is Themis's f in (0, 1): each round the ceil((1 - f) * N) apps with the
    worst (highest) rho bid; see ``shared.arbiter.arbiter`` for why (1 - f) and not f.

    Unknown jobs (no measured iteration time or no total): such a job takes its app's median
    measured seconds-per-iteration and median known total (siblings are alike: one sweep); with no
    measured sibling, the priors ``unknown_seconds_per_iteration`` and ``unknown_job_gpu_s`` (one
    GPU-hour of work, the order of a short training run: not "nearly done", which would make its
    rho ~1 and keep it out of every auction). A job already past its estimated total is assumed
    ``unknown_remaining_fraction`` from its end.
    ``single_host_jobs``: each job's GPUs on one host (a live job is one process); the simulator
    keeps the multi-host model (placement sensitivity) with False.
    ``leftovers_to_bidders``: after non-bidders have taken what they can use, give what is still
    left to bidders with unmet demand, so a round never leaves a GPU idle that some app wants
    (the paper's "work conserving"); off means strict PA hidden payments to non-bidders only.
    ``max_bundle_sizes``: how many bundle sizes (powers of two up to what the app can use) a bid
    lists; ``packed_hosts_per_size``: for a placement-sensitive app, on how many hosts (the
    tightest fits) it bids for each packed size. Themis's agent values "all possible subsets";
    that is exponential, so a bid lists these representatives and the MILP picks among them.
    ``lifetime_contention``: rho estimates take N_avg over the app's whole life, the part still to
    come at today's count (``AppAgent.rho``); off, the average so far.
    ``starving_priority``: which starving apps (no GPU, work left: rho(0) is unbounded by Themis
    Eq. 1, §4.3.1) rank before every app that holds GPUs in the visibility phase's filter
    (§3.3.2). ``"at_risk"`` (default): those whose fair-share rho is >= 1 (at risk of not meeting
    sharing incentive, the apps §3.3.2's filter is for) and new arrivals with no GPU time yet;
    other starving apps rank by that finite rho among all. ``"all"``: every one, the paper's
    literal reading (the default until 2026-11-27). ``"none"``: all rank by their finite rho. The
    PF objective values a starving bidder's getting nothing as ``STARVING_RHO`` in every mode, and
    only the starving bidders the offer can reach bid (``admit_starving_worst_first``). Measured in
    docs/arbiter.md ("Why equal sharing beats our Themis on the bench", "Starving bidders").
    ``seed``: leftovers go to non-bidders "at random" (Themis §3.3.2), drawn from this seed and
    the round's time, so a round is reproducible.
    """

    fairness_knob: float = 0.8
    lease_s: float = 600.0
    leftovers_to_bidders: bool = True
    unknown_seconds_per_iteration: float = 1.0
    unknown_remaining_fraction: float = 0.5
    unknown_job_gpu_s: float = 3600.0
    single_host_jobs: bool = False
    max_bundle_sizes: int = 8
    packed_hosts_per_size: int = 4
    lifetime_contention: bool = True
    starving_priority: str = "at_risk"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fairness_knob < 1.0:
            raise ValueError(f"fairness_knob f must be in [0, 1), got {self.fairness_knob}")
        if self.starving_priority not in STARVING_PRIORITIES:
            raise ValueError(
                f"starving_priority must be one of {STARVING_PRIORITIES}, got {self.starving_priority!r}"
            )
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
