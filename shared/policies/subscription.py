"""The cluster-wide, dynamic subscription-ratio limit and watermark checks (NotebookOS §3.4.1).

Per-host SR = S/(G·R) and the cluster figure ΣS/(ΣG·R) already live in ``placement`` (reused here,
not duplicated). What this module adds is the *limit* a placement must respect: the paper rejects a
host when one more replica would push its SR past the cluster-wide ratio, which is recomputed for
every decision. Taken literally that rejects every host of a balanced cluster (adding anything
puts a host above the average), so the limit is the cluster ratio *after* the new kernel's
replicas, clamped between ``floor`` (SR ≤ 1 guarantees a replica can always bind: never refuse below
it) and ``ceiling`` (the configured hard watermark). The limit is then just the watermark of
``SubscriptionRatioFilter`` for that one decision, so no new filter is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.policies.placement import REPLICAS_PER_KERNEL, HostView, subscription_ratio


@dataclass(frozen=True, slots=True)
class SubscriptionTotals:
    """ΣS and ΣG over live hosts: the two numbers every cluster-wide figure needs."""

    subscribed_gpus: int = 0
    gpus: int = 0
    replicas_per_kernel: int = REPLICAS_PER_KERNEL

    @classmethod
    def of(
        cls, hosts: Iterable[HostView], replicas_per_kernel: int = REPLICAS_PER_KERNEL
    ) -> SubscriptionTotals:
        s = g = 0
        for h in hosts:
            if h.alive:
                s += h.subscribed_gpus
                g += h.gpus
        return cls(s, g, replicas_per_kernel)

    @property
    def ratio(self) -> float:
        return subscription_ratio(self.subscribed_gpus, self.gpus, self.replicas_per_kernel)


def dynamic_limit(
    totals: SubscriptionTotals,
    *,
    request_gpus: int = 0,
    replicas: int = REPLICAS_PER_KERNEL,
    floor: float = 1.0,
    ceiling: float = 3.0,
) -> float:
    """The per-host SR limit for placing one kernel of ``replicas`` x ``request_gpus`` now."""
    after = subscription_ratio(
        totals.subscribed_gpus + replicas * request_gpus, totals.gpus, totals.replicas_per_kernel
    )
    return min(max(after, floor), ceiling)
