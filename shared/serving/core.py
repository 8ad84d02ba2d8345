"""The serving controller's decisions, pure: how many warm runtimes each host keeps, decided for
the whole cluster at once, and the answer to the scheduler's "a runtime on host H, now".

Each host's local scheduler owns its runtime processes (it starts them and hands one to a replica
start) and reports its pool: ready runtimes, runtimes warming up, idle GPUs, and its counts of
runtimes taken and of starts that found none. The core keeps those views and answers each report
with the host's target, computed by the existing prewarm policies (``shared/policies/prewarm.py``)
over every host's view together: fixed and minimum per host give the same numbers as before,
Little's law sizes one pool from the cluster's rate of runtime demand (λ: every host's takes and
misses) and the median warm-up time (W), spread over the hosts with the most idle GPUs first,
where migrations and resumes go.

``acquire(H)`` is the scheduler asking for a runtime on H before a replica start (migration,
scale-out, replacement, hibernation resume): a ready runtime is promised (the view drops it at
once, so the next decision already starts its replacement) or the answer is a cold start. A
promise is settled by the host's next report that counts the take.

No clock, no sockets: the service passes ``now`` and carries the targets to the hosts; the
simulator (``shared/simulator/engine.py``) steps the same object for its hosts' warm pools.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.policies.prewarm import (
    ArrivalRate,
    FixedCapacity,
    LittlesLaw,
    MinCapacity,
    PoolView,
    PrewarmPolicy,
)

POLICIES = ("none", "fixed", "min", "littles_law")
DEFAULT_WARMUP_S = 5.0  # W before any host has reported a warm-up time
WARMUP_SAMPLES = 50


@dataclass(frozen=True, slots=True)
class ServingConfig:
    policy: str = "none"  # none | fixed | min | littles_law (prewarm.policy)
    per_host: int = 1  # fixed: exactly; min and littles_law: at least
    max_per_host: int = 4
    headroom: float = 1.0
    half_life_s: float = 300.0
    stale_s: float = 10.0  # a host silent this long is left out of the decisions

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown prewarm policy {self.policy!r}; known: {', '.join(POLICIES)}")


@dataclass(frozen=True, slots=True)
class HostReport:
    """What a local scheduler reports of its pool (``pool.report``)."""

    host_id: str
    warm: int  # ready to hand over
    starting: int  # warming up
    idle_gpus: int = 0
    taken: int = 0  # runtimes handed to replica starts since the host started (a counter)
    misses: int = 0  # replica starts that found no ready runtime (a counter)
    warmup_s: float | None = None  # the host's median warm-up time, if it has seen one


@dataclass(frozen=True, slots=True)
class Grant:
    """The answer to "a runtime on host H, now": ``warm`` True, a ready runtime is promised to
    this start; False, the start will be cold (none is ready there, or H is unknown)."""

    host_id: str
    warm: bool
    reason: str = ""


@dataclass(slots=True)
class _Host:
    report: HostReport
    seen_at: float
    promised: int = 0  # acquired since the last report that counted them
    demand_seen: int = field(default=0)  # taken + misses already counted in λ


class ServingCore:
    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        self.arrivals = ArrivalRate(half_life_s=config.half_life_s)
        self._hosts: dict[str, _Host] = {}
        self._warmups: list[float] = []
        self.grants = 0
        self.cold = 0

    @property
    def enabled(self) -> bool:
        return self.config.policy != "none"

    # ---- events -------------------------------------------------------------------------------

    def report(self, report: HostReport, now: float) -> int:
        """A host's pool as it is now; returns its target (warm plus warming runtimes to keep)."""
        host = self._hosts.get(report.host_id)
        demand = report.taken + report.misses
        if host is None:
            host = self._hosts[report.host_id] = _Host(report, now, demand_seen=demand)
        else:
            new = max(0, demand - host.demand_seen)  # a restarted host counts from 0 again: none new
            if new:
                self.arrivals.observe(now, new)
            settled = max(0, report.taken - host.report.taken)
            host.promised = max(0, host.promised - settled)
            host.report, host.seen_at, host.demand_seen = report, now, demand
        if report.warmup_s is not None and report.warmup_s > 0:
            self._warmups.append(report.warmup_s)
            del self._warmups[:-WARMUP_SAMPLES]
        return self.target(report.host_id, now)

    def target(self, host_id: str, now: float) -> int:
        """One host's target: fixed and minimum per host need only its view (the simulator asks
        for thousands of hosts); Little's law is decided over every host together."""
        policy = self.policy(now)
        host = self._hosts.get(host_id)
        if policy is None or host is None or not self._fresh(host, now):
            return 0
        if isinstance(policy, LittlesLaw):
            return self.targets(now).get(host_id, 0)
        return policy.targets([self._view(host)]).get(host_id, 0)

    def acquire(self, host_id: str, now: float) -> Grant:
        """Promise a ready runtime on ``host_id`` to a replica start, if it has one not promised."""
        host = self._hosts.get(host_id)
        if host is None or not self._fresh(host, now):
            self.cold += 1
            return Grant(host_id, False, "no recent report from this host")
        if host.report.warm - host.promised <= 0:
            self.cold += 1
            return Grant(host_id, False, f"no ready runtime ({host.report.starting} warming up)")
        host.promised += 1
        self.grants += 1
        return Grant(host_id, True)

    def forget(self, host_id: str) -> None:
        """The host is gone (released, or dead)."""
        self._hosts.pop(host_id, None)

    # ---- decisions ----------------------------------------------------------------------------

    def views(self, now: float) -> list[PoolView]:
        """Every live host's pool as decisions see it: promised runtimes are already gone."""
        return [self._view(h) for h in self._hosts.values() if self._fresh(h, now)]

    def _view(self, h: _Host) -> PoolView:
        return PoolView(
            h.report.host_id,
            warm=max(0, h.report.warm - h.promised),
            starting=h.report.starting,
            idle_gpus=h.report.idle_gpus,
            max_warm=self.config.max_per_host,
        )

    def policy(self, now: float) -> PrewarmPolicy | None:
        c = self.config
        if c.policy == "fixed":
            return FixedCapacity(c.per_host)
        if c.policy == "min":
            return MinCapacity(c.per_host)
        if c.policy == "littles_law":
            return LittlesLaw(
                self.arrivals.rate(now), self.warmup_s(), headroom=c.headroom, min_per_host=c.per_host
            )
        return None

    def targets(self, now: float) -> dict[str, int]:
        """Warm plus warming runtimes each live host should hold, decided over all of them."""
        policy = self.policy(now)
        if policy is None:
            return {}
        return policy.targets(self.views(now))

    def warmup_s(self) -> float:
        return statistics.median(self._warmups) if self._warmups else DEFAULT_WARMUP_S

    def status(self, now: float) -> dict[str, object]:
        targets = self.targets(now)
        return {
            "policy": self.config.policy,
            "arrival_rate_per_s": round(self.arrivals.rate(now), 6),
            "warmup_s": round(self.warmup_s(), 3),
            "grants": self.grants,
            "cold": self.cold,
            "hosts": [
                {
                    "host": h.report.host_id,
                    "warm": h.report.warm,
                    "starting": h.report.starting,
                    "promised": h.promised,
                    "target": targets.get(h.report.host_id, 0),
                    "fresh": self._fresh(h, now),
                }
                for h in sorted(self._hosts.values(), key=lambda h: h.report.host_id)
            ],
        }

    def _fresh(self, host: _Host, now: float) -> bool:
        return now - host.seen_at <= self.config.stale_s

    def hosts(self) -> Iterable[str]:
        return list(self._hosts)
