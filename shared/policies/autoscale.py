"""Cluster autoscaling (NotebookOS §3.4.2): when to add hosts, how many, and which idle ones to release.

Two triggers for scale-out:

1. A kernel's placement failed. Enough hosts are requested for its missing replicas, and a replica
   slot is *reserved* on each host being added, before it registers, so a burst of kernel starts
   cannot claim the same arriving host twice; when the host registers, ``on_host_registered``
   says which replicas to place on it.
2. The periodic check: expected capacity ΣG' = f·ΣC (ΣC GPUs committed to executing replicas,
   f = 1.05) plus a *scaling buffer* of extra hosts for bursts. Fewer provisioned → scale out; more
   → release idle hosts (nothing committed; the caller marks a host not ``releasable`` while a
   kernel with a replica there has a cell in flight), 1-2 at a time, fewest subscribed GPUs first
   and then fewest replicas (each one is a migration the caller carries out before the release),
   and never so many that the remaining hosts' cluster subscription ratio would pass
   ``max_ratio_after_scale_in`` (the released hosts' replicas move, their subscriptions stay).

Stateful only in what it has asked for and not yet seen (pending hosts and their reservations);
the caller passes the cluster's loads. No clock: the caller decides how often ``evaluate`` runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.policies.placement import PlacementDecision, PlacementRequest, subscription_ratio
from shared.resources import Resources


@dataclass(frozen=True, slots=True)
class HostLoad:
    host_id: str
    gpus: int
    committed_gpus: int = 0  # ΣC's share: GPUs bound to executing replicas here
    subscribed_gpus: int = 0  # S: what would have to move elsewhere if the host is released
    releasable: bool = True  # False: never a scale-in candidate (e.g. a host the provider did not start)
    replicas: int = 0  # replicas a release would migrate away first (its cost, after S)


@dataclass(frozen=True, slots=True)
class ScaleOut:
    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class ScaleIn:
    host_ids: tuple[str, ...]
    reason: str  # the caller migrates these hosts' replicas away, then releases them


@dataclass(frozen=True, slots=True)
class NoScale:
    reason: str


ScaleDecision = ScaleOut | ScaleIn | NoScale


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    scaling_factor: float = 1.05  # f in ΣG' = f·ΣC
    gpus_per_host: int = 8  # GPUs of a host that scale-out would add
    buffer_hosts: int = 1  # the scaling buffer: extra hosts kept for bursts
    min_hosts: int = 3  # enough for the 3 replicas of one kernel
    max_hosts: int = 1_000
    max_release: int = 2  # hosts released per evaluation
    replicas_per_kernel: int = 3
    max_ratio_after_scale_in: float = 3.0  # cluster ΣS/(ΣG·R) must stay under this after a release

    def __post_init__(self) -> None:
        if self.gpus_per_host <= 0 or self.min_hosts < 0 or self.max_hosts < self.min_hosts:
            raise ValueError(f"bad autoscale config: {self}")


@dataclass(slots=True)
class _PendingHost:
    slot: int
    reservations: list[tuple[str, Resources]] = field(default_factory=list)


# A host whose release failed is judged again only after its idle period times 2^(failures in a
# row), at most this many times: a drain that cannot finish (no host can take a replica) costs
# migrations each try, so it must not repeat every idle period while nothing has changed.
SCALE_IN_BACKOFF_MAX = 16


def scale_in_idle_wanted(idle_s: float, failures: int) -> float:
    """How long a host must be idle before a release is tried, after ``failures`` failed in a row."""
    return idle_s * min(2**failures, SCALE_IN_BACKOFF_MAX)


def feasible_hosts(decision: PlacementDecision) -> int:
    """Hosts that passed every filter of a failed placement (they were too few)."""
    return sum(1 for why in decision.rejected.values() if why.startswith("only "))


class Autoscaler:
    def __init__(self, config: AutoscaleConfig | None = None) -> None:
        self.config = config or AutoscaleConfig()
        self._pending: list[_PendingHost] = []
        self._next_slot = 0
        self._exclusive: set[str] = set()  # keys whose reservations bind GPUs on arrival
        self._asked: set[str] = set()  # kernels that asked before (until ``cancel``)

    @property
    def pending_hosts(self) -> int:
        return len(self._pending)

    def reserved_for(self, kernel_id: str) -> int:
        """Replica slots of ``kernel_id`` still waiting for their host to register."""
        return sum(1 for p in self._pending for k, _ in p.reservations if k == kernel_id)

    def _add_pending(self, n: int) -> list[_PendingHost]:
        added = [_PendingHost(self._next_slot + i) for i in range(n)]
        self._next_slot += n
        self._pending.extend(added)
        return added

    def _room(self, live_hosts: int) -> int:
        return max(self.config.max_hosts - live_hosts - len(self._pending), 0)

    def on_placement_failed(
        self, request: PlacementRequest, feasible: int, live_hosts: int, *, exclusive: bool = False
    ) -> ScaleDecision:
        """Reserve the missing replicas of ``request`` on hosts being added, requesting new ones as needed.

        ``feasible``: hosts that could take a replica now (``feasible_hosts(decision)``); those get
        the other replicas once the new hosts arrive, since placement is retried then.
        ``exclusive``: the replica binds its GPUs on arrival (a held cell's migration), so a pending
        host is shared only while the exclusive reservations on it fit its GPUs.
        """
        cfg = self.config
        if request.kernel_id in self._asked and self.reserved_for(request.kernel_id) == 0:
            # Its hosts came and it still does not fit: the subscription watermark is the cluster's
            # mean ratio, so the empty hosts that arrived lowered it and pushed hosts that were
            # feasible over it. Asking again for the same few would repeat that until the start's
            # deadline: this time every replica gets a new host.
            feasible = 0
        self._asked.add(request.kernel_id)
        missing = max(request.replicas - feasible, 0)
        if missing == 0:
            return NoScale("placement can succeed without new hosts")
        if request.resources.gpus > cfg.gpus_per_host:
            return NoScale(f"needs {request.resources.gpus} GPUs, new hosts have {cfg.gpus_per_host}")
        limit = cfg.gpus_per_host * cfg.replicas_per_kernel * cfg.max_ratio_after_scale_in
        reusable = [
            p
            for p in self._pending
            if all(k != request.kernel_id for k, _ in p.reservations)
            and sum(r.gpus for _, r in p.reservations) + request.resources.gpus <= limit
            and (
                not exclusive
                or sum(r.gpus for k, r in p.reservations if k in self._exclusive) + request.resources.gpus
                <= cfg.gpus_per_host
            )
        ][:missing]
        new = missing - len(reusable)
        if new > self._room(live_hosts):
            return NoScale(
                f"kernel {request.kernel_id} needs {new} more hosts; at max_hosts={cfg.max_hosts} "
                f"({live_hosts} live, {len(self._pending)} pending)"
            )
        for p in [*reusable, *self._add_pending(new)]:
            p.reservations.append((request.kernel_id, request.resources))
        if exclusive:
            self._exclusive.add(request.kernel_id)
        if new == 0:
            return NoScale(
                f"reserved {missing} replica(s) of {request.kernel_id} on hosts already being added"
            )
        return ScaleOut(new, f"placement of {request.kernel_id} failed: {missing} replica host(s) missing")

    def on_host_registered(self, host_id: str) -> tuple[tuple[str, Resources], ...]:
        """A new host arrived: the (kernel_id, resources) replicas reserved on it, to place there now.

        Reserved hosts are consumed first (oldest first); an unexpected host consumes nothing.
        """
        if not self._pending:
            return ()
        self._pending.sort(key=lambda p: (not p.reservations, p.slot))
        return tuple(self._pending.pop(0).reservations)

    def cancel(self, kernel_id: str) -> None:
        """``kernel_id`` no longer waits (placed elsewhere, timed out, shut down): free its
        reservations; the hosts being added stay pending and serve whoever comes next."""
        for p in self._pending:
            p.reservations = [(k, r) for k, r in p.reservations if k != kernel_id]
        self._exclusive.discard(kernel_id)
        self._asked.discard(kernel_id)

    def expect_hosts(self, count: int) -> None:
        """The caller asked its provider for ``count`` hosts after an ``evaluate`` ScaleOut: count them
        as pending (unreserved) so the next evaluation does not ask again before they register."""
        self._add_pending(max(count, 0))

    def on_scale_out_failed(self, count: int) -> tuple[str, ...]:
        """``count`` requested hosts will never come: the kernels whose reservations are lost."""
        lost: list[str] = []
        self._pending.sort(key=lambda p: (bool(p.reservations), -p.slot))  # drop unreserved, newest first
        for p in self._pending[:count]:
            lost.extend(k for k, _ in p.reservations)
        del self._pending[:count]
        return tuple(dict.fromkeys(lost))

    def evaluate(self, hosts: Sequence[HostLoad]) -> ScaleDecision:
        """The periodic check over the registered, live hosts."""
        cfg = self.config
        committed = sum(h.committed_gpus for h in hosts)
        expected_gpus = cfg.scaling_factor * committed
        wanted = math.ceil(expected_gpus / cfg.gpus_per_host - 1e-9) + cfg.buffer_hosts
        wanted = min(max(wanted, cfg.min_hosts), cfg.max_hosts)
        have = len(hosts) + len(self._pending)
        provisioned = sum(h.gpus for h in hosts) + len(self._pending) * cfg.gpus_per_host
        if have < wanted:
            return ScaleOut(
                wanted - have,
                f"provisioned {provisioned} GPUs on {have} hosts; f·ΣC = {expected_gpus:.1f} "
                f"+ {cfg.buffer_hosts} buffer host(s) needs {wanted} hosts",
            )
        if have == wanted or self._pending:
            return NoScale(
                f"{have} hosts match the {wanted} wanted" if have == wanted else "scale-out pending"
            )
        total_s = sum(h.subscribed_gpus for h in hosts)
        total_g = sum(h.gpus for h in hosts)
        candidates = sorted(
            (h for h in hosts if h.committed_gpus == 0 and h.releasable),
            key=lambda h: (h.subscribed_gpus, h.replicas, h.host_id),
        )
        release: list[str] = []
        for h in candidates:
            if len(release) >= min(cfg.max_release, have - wanted):
                break
            if (
                subscription_ratio(total_s, total_g - h.gpus, cfg.replicas_per_kernel)
                > cfg.max_ratio_after_scale_in
            ):
                continue
            total_g -= h.gpus
            release.append(h.host_id)
        if not release:
            return NoScale(f"{have - wanted} host(s) over target, but none idle that can be released")
        moving = sum(h.replicas for h in hosts if h.host_id in release)
        return ScaleIn(
            tuple(release),
            f"f·ΣC = {expected_gpus:.1f} GPUs + buffer needs {wanted} hosts, {have} provisioned"
            + (f"; {moving} replica(s) to migrate first" if moving else ""),
        )
