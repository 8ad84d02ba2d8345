"""NotebookOS's kernel placement decision: one object for the live global scheduler and the simulator.

A kernel start asks for R replicas on distinct hosts. The per-host subscription-ratio limit for
that one decision is the dynamic cluster-wide limit (``subscription.dynamic_limit``: ΣS/(ΣG·R)
after the new kernel, clamped between ``floor`` and the configured ``watermark``), and the hosts are
the default filter-and-score policy's choice, found through the ``PlacementIndex`` rather than a
scan of every host. The caller owns the index and keeps it current; this object holds only the
knobs, so the live scheduler (index kept by ``ClusterState``) and the simulator's replicated kernels (their own
index) run exactly this code. A failed decision carries every host's veto (the index falls back to
the full filter pass), so an error message can name why each host said no.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.policies.placement import REPLICAS_PER_KERNEL, PlacementDecision, PlacementRequest
from shared.policies.placement_index import PlacementIndex
from shared.policies.subscription import SubscriptionTotals, dynamic_limit


@dataclass(frozen=True, slots=True)
class KernelPlacement:
    """Place a kernel's replicas under the dynamic subscription-ratio limit, via the index."""

    watermark: float = 3.0  # the hard per-host ceiling on S/(G·R) (scheduler.subscription_ratio_watermark)
    replicas_per_kernel: int = REPLICAS_PER_KERNEL  # R in every ratio
    floor: float = 1.0  # never refuse a host below SR 1: a replica there can always bind

    def __post_init__(self) -> None:
        if self.replicas_per_kernel < 1:
            raise ValueError(f"replicas_per_kernel must be at least 1, got {self.replicas_per_kernel}")
        if self.watermark <= 0:
            raise ValueError(f"the subscription-ratio watermark must be positive, got {self.watermark}")

    def limit(self, index: PlacementIndex, request: PlacementRequest) -> float:
        """The per-host SR limit for placing ``request`` now (O(1): the index keeps ΣS and ΣG)."""
        totals = SubscriptionTotals(index.live_subscribed_gpus, index.live_gpus, self.replicas_per_kernel)
        return dynamic_limit(
            totals,
            request_gpus=request.resources.gpus,
            replicas=request.replicas,
            floor=self.floor,
            ceiling=self.watermark,
        )

    def place(
        self, index: PlacementIndex, request: PlacementRequest, *, can_add_hosts: bool = True
    ) -> PlacementDecision:
        """Where a new kernel's ``request.replicas`` replicas go, or every host's reason why not.

        The dynamic limit is there to grow the cluster before contention does (§3.4.2: a refused
        placement scales out). Where no host can be added (a fixed cluster, or one at its
        maximum) it would only refuse room the watermark allows, so then the watermark alone rules.
        """
        limit = self.limit(index, request) if can_add_hosts else self.watermark
        return index.place(request, watermark=limit)

    def relocate(self, index: PlacementIndex, request: PlacementRequest) -> PlacementDecision:
        """Where replicas that move off a host (a drain) go: only the per-host watermark applies.

        A move adds no subscription, and a drain before a scale-in shrinks ΣG, so the current
        cluster ratio would understate the limit; the autoscaler bounds the ratio after a scale-in.
        """
        return index.place(request, watermark=self.watermark)
