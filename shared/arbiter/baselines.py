"""Baseline BE allocation policies, with the arbiter's interface (``auction(now, apps, available,
be_capacity_gpus) -> AuctionOutcome``).

App-level greedy baselines, as Themis §6.1 ("Baselines") implements them: on each round every
app reports one number and the free GPUs go to apps greedily in that order, each up to what it
can use. Leases are the same as Themis's. As in Themis (§3.1.2, Theorem 3.1), only the
placement-aware baselines (Gandiva, and SRTF, whose remaining-time reports see the allocation)
pick co-located GPUs (best fit); the others (app-level LAS, SRSF, SLAQ, FIFO) take whichever free
GPUs come, drawn in a seeded random order. Within what an app gets, its own scheduler still packs
each job's share on as few hosts as it can.

* ``gandiva`` (§6.1 "Ideal Efficiency Baseline"): highest placement preference (sensitivity)
  first, packing it (placement greedy).
* ``las_app`` (§6.1 "Ideal Fairness Baseline - Tiresias"): the app with the least attained GPU
  service first, re-decided at every lease, which is what §6.1 describes and calls Tiresias. It is
  per app, with no queues: Tiresias proper is ``tiresias`` below.
* ``slaq`` (§6.1 "Ideal Aggregate Model Quality"): largest loss decrease per GPU over one lease
  first, on a common convex loss curve of training progress.
* ``srtf`` (§6.1 "Ideal Average App Completion Time"): shortest remaining time with an allocation
  from the free GPUs first (``SrtfPolicy``); ``srsf``: shortest remaining service (remaining GPU-seconds) first, §6.1's
  "one GPU at a time" in SRSF order (an app's remaining service does not change within a round,
  so that is each app in turn up to what it can use).
* ``optimus`` (§6.1 "Ideal Aggregate Throughput"): one GPU at a time to the highest throughput
  scaling (``OptimusPolicy``).
* ``fifo``: earliest submitted app first (not in Themis; the plain reference).

Job-level baselines from their own papers (``shared.arbiter.job_baselines``): ``tiresias``
(Tiresias's discretized 2D-LAS over jobs) and ``gandiva_fair`` (ticket-based stride scheduling
between users).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from shared.arbiter.agent import AppAgent, pack
from shared.arbiter.arbiter import Arbiter, AuctionOutcome
from shared.arbiter.config import ArbiterConfig
from shared.arbiter.job_baselines import GandivaFairPolicy, TiresiasParams, TiresiasPolicy
from shared.arbiter.lease import Lease
from shared.arbiter.reports import AppReport
from shared.arbiter.slots import GpuSlot


def loss_at(progress: float) -> float:
    """Normalised training loss at a fraction of training done: 1 at start, convex, ~0.09 at the end
    (the shape SLAQ fits: fast early improvement, diminishing returns)."""
    p = min(1.0, max(0.0, progress))
    return 1.0 / (1.0 + 10.0 * p)


class GreedyPolicy:
    """Free GPUs to apps in the order of ``key`` (lowest first), each up to what it can use."""

    name = "greedy"

    def __init__(
        self,
        key: Callable[[AppAgent, float], float],
        name: str,
        config: ArbiterConfig | None = None,
        *,
        placement_aware: bool,
    ):
        self.key = key
        self.name = name
        self.placement_aware = placement_aware
        self.config = config or ArbiterConfig()
        self._visibility = Arbiter(self.config)

    def auction(
        self, now: float, apps: Sequence[AppReport], available: Sequence[GpuSlot], be_capacity_gpus: float
    ) -> AuctionOutcome:
        start = time.perf_counter()
        agents = self._visibility.agents(now, apps, be_capacity_gpus)
        rho = {a.app_id: a.rho_current for a in agents}
        shares = self.shares(now, agents, sorted(available))
        by_id = {a.app_id: a for a in agents}
        leases = [
            Lease(app_id, job_id, slots, now, now + self.config.lease_s)
            for app_id, got in sorted(shares.items())
            for job_id, slots in sorted(by_id[app_id].assign(got).items())
        ]
        won = {app_id: len(got) for app_id, got in shares.items()}
        return AuctionOutcome(leases, rho, won_by_app=won, auction_ms=(time.perf_counter() - start) * 1e3)

    def shares(
        self, now: float, agents: Sequence[AppAgent], left: list[GpuSlot]
    ) -> dict[str, tuple[GpuSlot, ...]]:
        """The GPUs each app gets this round: in ``key`` order, each up to what it can use."""
        rng = random.Random(f"{self.config.seed}:{now!r}")
        out: dict[str, tuple[GpuSlot, ...]] = {}
        order = self.order(agents, len(left))
        for agent in sorted(agents, key=lambda a: (order(a), a.app_id)):
            if not left:
                break
            need = min(agent.wants, len(left))
            if need <= 0:
                continue
            if self.placement_aware:
                got = pack({agent.app_id: need}, left)[agent.app_id]
            else:
                got = tuple(rng.sample(left, need))
            taken = set(got)
            left = [s for s in left if s not in taken]
            out[agent.app_id] = got
        return out

    def order(self, agents: Sequence[AppAgent], free: int) -> Callable[[AppAgent], float]:
        """Each app's one reported number this round (lowest served first)."""
        return lambda a: self.key(a, self.config.lease_s)


class OptimusPolicy(GreedyPolicy):
    """Themis §6.1 "Ideal Aggregate Throughput Baseline - Optimus": "all apps report their
    throughput scaling and we allocate resources in order of highest throughput scaling metric
    first", one GPU at a time. An app's throughput scaling for one more GPU is its remaining time
    on g GPUs over its remaining time on g + 1 (the agent's work model: the ratio of new to old
    throughput); an app holding nothing scales infinitely and comes first (least GPU time first
    among those). Each app's GPUs are then packed on as few hosts as possible (Optimus places an
    app's tasks on the fewest servers)."""

    def __init__(self, config: ArbiterConfig | None = None) -> None:
        super().__init__(_placement, "optimus", config, placement_aware=True)

    def shares(
        self, now: float, agents: Sequence[AppAgent], left: list[GpuSlot]
    ) -> dict[str, tuple[GpuSlot, ...]]:
        """One GPU at a time to the highest scaling, then each app's count packed."""
        by_id = {a.app_id: a for a in agents}
        counts = {a.app_id: 0 for a in agents if a.wants > 0}

        def scaling(agent: AppAgent) -> float:
            g = agent.held + counts[agent.app_id]
            if g == 0:
                return math.inf
            after = agent.model.remaining(g + 1)
            return agent.model.remaining(g) / after if after > 0 else 1.0

        heap = [(-scaling(by_id[a]), by_id[a].report.gpu_seconds_used, a) for a in counts]
        heapq.heapify(heap)
        for _ in range(len(left)):
            if not heap:
                break
            _, _, app_id = heapq.heappop(heap)
            counts[app_id] += 1
            agent = by_id[app_id]
            if counts[app_id] < agent.wants:
                heapq.heappush(heap, (-scaling(agent), agent.report.gpu_seconds_used, app_id))
        return pack({a: n for a, n in counts.items() if n > 0}, left)


class SrtfPolicy(GreedyPolicy):
    """Themis §6.1 "Ideal Average App Completion Time - SRTF": "all apps report their remaining
    time with allocations from the available resource and we allocate these resources using SRTF
    policy". Each app reports, once per round, its remaining time if it got what it can use of
    the GPUs free now on top of what it holds (the agent's work model); the shortest goes first,
    packed. Until 2026-11-26 it reported remaining work / app demand, which ignores the offer
    (with few free GPUs, an app of wide demand is no nearer its end than a narrow one)."""

    def __init__(self, config: ArbiterConfig | None = None) -> None:
        super().__init__(lambda _a, _lease_s: 0.0, "srtf", config, placement_aware=True)  # see order()

    def order(self, agents: Sequence[AppAgent], free: int) -> Callable[[AppAgent], float]:
        remaining = {a.app_id: a.model.remaining(a.held + min(a.wants, free)) for a in agents}
        return lambda a: remaining[a.app_id]


def _remaining_service(agent: AppAgent, _lease_s: float) -> float:
    return sum(w.seconds for p in agent.model.phases for w in p)


def _loss_decrease(agent: AppAgent, lease_s: float) -> float:
    """Minus the loss decrease per GPU one more lease would bring the app (so lowest sorts first)."""
    best = 0.0
    for job in agent.report.jobs:
        if job.iterations_total in (None, 0) or job.seconds_per_iteration is None:
            continue
        p = job.iterations_done / job.iterations_total
        step = lease_s / (job.seconds_per_iteration * job.iterations_total)
        best = max(best, loss_at(p) - loss_at(p + step))
    return -best


def _placement(agent: AppAgent, _lease_s: float) -> float:
    sens = [w.sensitivity for p in agent.model.phases for w in p if w.max_gpus > 1]
    return -max(sens, default=1.0)


def fifo(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> GreedyPolicy:
    return GreedyPolicy(lambda a, _: a.report.submitted_at, "fifo", config, placement_aware=False)


def srtf(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> SrtfPolicy:
    return SrtfPolicy(config)


def srsf(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> GreedyPolicy:
    return GreedyPolicy(_remaining_service, "srsf", config, placement_aware=False)


def las_app(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> GreedyPolicy:
    return GreedyPolicy(lambda a, _: a.report.gpu_seconds_used, "las_app", config, placement_aware=False)


def gandiva(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> GreedyPolicy:
    return GreedyPolicy(_placement, "gandiva", config, placement_aware=True)


def slaq(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> GreedyPolicy:
    return GreedyPolicy(_loss_decrease, "slaq", config, placement_aware=False)


def optimus(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> OptimusPolicy:
    return OptimusPolicy(config)


def tiresias(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> TiresiasPolicy:
    """``time_scale``: the trace's time scale (the bench's 5% tasks): queue thresholds follow it."""
    return TiresiasPolicy(config, TiresiasParams().scaled(time_scale))


def gandiva_fair(config: ArbiterConfig | None = None, time_scale: float = 1.0) -> GandivaFairPolicy:
    return GandivaFairPolicy(config)


class BaselinePolicy(Protocol):
    """What the simulator and the live service call: one round's leases."""

    def auction(
        self, now: float, apps: Sequence[AppReport], available: Sequence[GpuSlot], be_capacity_gpus: float
    ) -> AuctionOutcome: ...


#: name -> factory(config, time_scale): every baseline the simulator and the bench run.
BASELINES: dict[str, Callable[[ArbiterConfig | None, float], BaselinePolicy]] = {
    "tiresias": tiresias,
    "gandiva_fair": gandiva_fair,
    "las_app": las_app,
    "gandiva": gandiva,
    "slaq": slaq,
    "optimus": optimus,
    "srtf": srtf,
    "srsf": srsf,
    "fifo": fifo,
}

#: The six baselines Themis §6.1 evaluates, as §6.1 describes them (its "Tiresias" is ``las_app``,
#: app-level least attained service); the paper's "2.2X to 3.25X better maximum rho compared to
#: all baselines" (§6.2) is against these. ``tiresias`` (job-level, Tiresias's own paper),
#: ``gandiva_fair`` (not in Themis) and ``fifo`` are extra references.
PAPER_BASELINES: tuple[str, ...] = ("gandiva", "las_app", "optimus", "slaq", "srtf", "srsf")


def make_policy(name: str, config: ArbiterConfig | None = None, time_scale: float = 1.0) -> BaselinePolicy:
    """``themis`` (the arbiter) or a baseline by name, for the simulator and the live service
    (``arbiter.policy``); ``time_scale`` scales a baseline's time constants with a scaled trace."""
    if name == "themis":
        return Arbiter(config or ArbiterConfig())
    if name not in BASELINES:
        raise ValueError(f"unknown BE policy {name!r}; one of {('themis', *BASELINES)}")
    return BASELINES[name](config, time_scale)
