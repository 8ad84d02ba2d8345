"""Replica placement as filter and score plugins over immutable host views (NotebookOS §3.4.1).

Modelled on the Kubernetes scheduler framework: every filter may veto a host with a reason, the
surviving hosts are ranked by the score plugins (lexicographically, in plugin order) and the best
``replicas`` distinct hosts win. Pure: the live global scheduler and the simulator build
``HostView``s from their own state and call the same ``PlacementPolicy``.

Subscription ratio of a host is S / (G · R): S the GPUs requested by the replicas placed there,
G its GPUs, R the replicas per kernel (only one of R replicas executes at a time).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.resources import Resources

REPLICAS_PER_KERNEL = 3


@dataclass(frozen=True, slots=True)
class HostView:
    """What placement needs to know about one host, at one instant."""

    host_id: str
    gpus: int
    committed_gpus: int = 0  # bound to executing replicas, or tentatively reserved for one
    subscribed_gpus: int = 0  # sum of the GPU requests of every replica placed here
    capacity: Resources = field(default_factory=Resources)  # millicpus, memory, gpus, vram
    subscribed: Resources = field(default_factory=Resources)  # sum of the placed replicas' requests
    cordoned: bool = False
    alive: bool = True
    replicas_per_kernel: int = REPLICAS_PER_KERNEL
    warm_runtimes: int = 0  # ready pre-warmed runtimes there (the host's pool, as last reported)

    @property
    def idle_gpus(self) -> int:
        return max(self.gpus - self.committed_gpus, 0)

    @property
    def subscription_ratio(self) -> float:
        return subscription_ratio(self.subscribed_gpus, self.gpus, self.replicas_per_kernel)

    def ratio_with(self, extra_gpus: int) -> float:
        """The subscription ratio after one more replica asking for ``extra_gpus`` lands here."""
        return subscription_ratio(self.subscribed_gpus + extra_gpus, self.gpus, self.replicas_per_kernel)


def subscription_ratio(
    subscribed_gpus: int, gpus: int, replicas_per_kernel: int = REPLICAS_PER_KERNEL
) -> float:
    if gpus <= 0:
        return 0.0 if subscribed_gpus == 0 else float("inf")
    return subscribed_gpus / (gpus * replicas_per_kernel)


def cluster_subscription_ratio(hosts: Iterable[HostView]) -> float:
    """ΣS / (ΣG · R) over the live hosts: the paper's cluster-wide figure."""
    live = [h for h in hosts if h.alive]
    total_s = sum(h.subscribed_gpus for h in live)
    total_g = sum(h.gpus for h in live)
    r = live[0].replicas_per_kernel if live else REPLICAS_PER_KERNEL
    return subscription_ratio(total_s, total_g, r)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    kernel_id: str
    resources: Resources
    replicas: int = REPLICAS_PER_KERNEL
    exclude_hosts: frozenset[str] = frozenset()  # e.g. hosts that already run a replica of this kernel


@dataclass(frozen=True, slots=True)
class PlacementDecision:
    hosts: tuple[str, ...]  # empty when placement failed
    rejected: dict[str, str]  # host_id -> why a filter vetoed it

    @property
    def ok(self) -> bool:
        return bool(self.hosts)

    def explain(self) -> str:
        if not self.rejected:
            return "no hosts registered"
        return "; ".join(f"{host}: {why}" for host, why in sorted(self.rejected.items()))


class FilterPlugin(Protocol):
    name: str

    def reject(self, request: PlacementRequest, host: HostView) -> str | None:
        """Why ``host`` cannot take a replica of ``request``, or None if it can."""


class ScorePlugin(Protocol):
    name: str

    def score(self, request: PlacementRequest, host: HostView) -> float:
        """Higher is better."""


# ---- filters ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AliveFilter:
    name: str = "alive"

    def reject(self, request: PlacementRequest, host: HostView) -> str | None:
        return None if host.alive else "host is not alive"


@dataclass(frozen=True, slots=True)
class CordonFilter:
    name: str = "cordon"

    def reject(self, request: PlacementRequest, host: HostView) -> str | None:
        return "host is cordoned" if host.cordoned else None


@dataclass(frozen=True, slots=True)
class ExcludeFilter:
    name: str = "exclude"

    def reject(self, request: PlacementRequest, host: HostView) -> str | None:
        return "already hosts a replica of this kernel" if host.host_id in request.exclude_hosts else None


@dataclass(frozen=True, slots=True)
class CapacityFilter:
    """The host could ever run the replica: enough GPUs in total, and CPU/memory left to subscribe."""

    name: str = "capacity"

    def reject(self, request: PlacementRequest, host: HostView) -> str | None:
        need = request.resources
        if need.gpus > host.gpus:
            return f"needs {need.gpus} GPUs, host has {host.gpus}"
        cap = host.capacity
        if cap.vram_gb and need.vram_gb > cap.vram_gb:
            return f"needs {need.vram_gb:g} GB VRAM, host has {cap.vram_gb:g}"
        if cap.millicpus and host.subscribed.millicpus + need.millicpus > cap.millicpus:
            return f"millicpus exhausted ({host.subscribed.millicpus}+{need.millicpus} > {cap.millicpus})"
        if cap.memory_mb and host.subscribed.memory_mb + need.memory_mb > cap.memory_mb:
            return f"memory exhausted ({host.subscribed.memory_mb}+{need.memory_mb} > {cap.memory_mb} MB)"
        return None


@dataclass(frozen=True, slots=True)
class SubscriptionRatioFilter:
    """The per-host high watermark on S/(G·R) that keeps oversubscription (and contention) bounded."""

    watermark: float = 3.0
    name: str = "subscription_ratio"

    def reject(self, request: PlacementRequest, host: HostView) -> str | None:
        if request.resources.gpus == 0:
            return None  # a CPU-only replica adds no GPU subscription
        after = host.ratio_with(request.resources.gpus)
        if after > self.watermark:
            return f"subscription ratio would be {after:.3f} > watermark {self.watermark:g}"
        return None


# ---- scores ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MostIdleGpusScore:
    """Least-loaded first: the host with the most idle (uncommitted) GPUs."""

    name: str = "most_idle_gpus"

    def score(self, request: PlacementRequest, host: HostView) -> float:
        return float(host.idle_gpus)


@dataclass(frozen=True, slots=True)
class LowestSubscriptionScore:
    """Among equally idle hosts, the one whose GPUs are least subscribed (less future contention)."""

    name: str = "lowest_subscription_ratio"

    def score(self, request: PlacementRequest, host: HostView) -> float:
        return -host.ratio_with(request.resources.gpus)


@dataclass(frozen=True, slots=True)
class WarmRuntimeScore:
    """Among hosts equally idle and equally subscribed, one with a ready warm runtime: the
    replica start there hands it over instead of starting an interpreter (issue 20). Only a
    tie-break, so NotebookOS's two scores keep deciding where load goes."""

    name: str = "warm_runtime"

    def score(self, request: PlacementRequest, host: HostView) -> float:
        return 1.0 if host.warm_runtimes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    filters: tuple[FilterPlugin, ...]
    scorers: tuple[ScorePlugin, ...]

    def place(self, request: PlacementRequest, hosts: Sequence[HostView]) -> PlacementDecision:
        """Choose ``request.replicas`` distinct hosts, or none (with every host's rejection reason)."""
        rejected: dict[str, str] = {}
        feasible: list[HostView] = []
        for host in hosts:
            reason = next((r for f in self.filters if (r := f.reject(request, host)) is not None), None)
            if reason is None:
                feasible.append(host)
            else:
                rejected[host.host_id] = reason
        by_host: dict[str, HostView] = {}
        for host in feasible:
            by_host.setdefault(host.host_id, host)  # distinct hosts even if a view is repeated
        if len(by_host) < request.replicas:
            for host_id in by_host:
                rejected.setdefault(host_id, f"only {len(by_host)} feasible hosts, need {request.replicas}")
            return PlacementDecision((), rejected)
        ranked = sorted(by_host.values(), key=lambda h: self._rank_key(request, h))
        return PlacementDecision(tuple(h.host_id for h in ranked[: request.replicas]), rejected)

    def _rank_key(self, request: PlacementRequest, host: HostView) -> tuple[float | str, ...]:
        return (*(-s.score(request, host) for s in self.scorers), host.host_id)


def default_placement_policy(watermark: float = 3.0) -> PlacementPolicy:
    """NotebookOS's default: feasible hosts, most idle GPUs first, then least subscribed, then
    those with a warm runtime."""
    return PlacementPolicy(
        filters=(
            AliveFilter(),
            CordonFilter(),
            ExcludeFilter(),
            CapacityFilter(),
            SubscriptionRatioFilter(watermark),
        ),
        scorers=(MostIdleGpusScore(), LowestSubscriptionScore(), WarmRuntimeScore()),
    )
