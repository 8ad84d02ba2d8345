"""Migration after a failed executor election: which replica moves, where, and when to give up.

NotebookOS §3.2.3: when every replica YIELDs, the global scheduler moves ONE replica to a host
that can bind the cell's GPUs *now*, then resubmits the cell there. If no host can, the migration is
retried on a backoff schedule until a deadline, then aborted and the client gets an error
``execute_reply`` carrying ``GiveUp.reason``.

Which replica: a dead one first (it has to be replaced anyway), never the Raft leader while a
follower can go (moving the leader costs an election on top of the migration), then the one on
the most subscribed host (moving it relieves the most contended host), then replica id.
Where: alive, uncordoned, not already holding a replica of this kernel, enough idle GPUs now and
CPU/memory/VRAM room; ranked by a pre-warmed runtime available (no cold start), then most idle GPUs,
then lowest subscription ratio after the move, then host id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.policies.executor_choice import ReplicaView
from shared.policies.placement import HostView
from shared.resources import Resources


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    replica_id: str  # the replica to persist its state and stop
    source_host: str
    target_host: str
    use_prewarmed: bool  # the target has a warm runtime: take it instead of a cold start


@dataclass(frozen=True, slots=True)
class NoTarget:
    reason: str  # why no host qualifies now (retry later)
    rejected: dict[str, str]  # host_id -> why


def choose_replica(replicas: Sequence[ReplicaView], hosts: Mapping[str, HostView]) -> ReplicaView | None:
    """The replica to migrate, or None if the kernel has no replicas."""
    if not replicas:
        return None

    def key(r: ReplicaView) -> tuple[bool, bool, float, str]:
        host = hosts.get(r.host_id)
        ratio = host.subscription_ratio if host is not None else float("inf")
        return (r.alive, r.raft_role == "leader", -ratio, r.replica_id)

    return min(replicas, key=key)


def target_rejection(
    host: HostView,
    need: Resources,
    kernel_hosts: frozenset[str],
    watermark: float | None,
    *,
    bind_now: bool = True,
) -> str | None:
    """Why ``host`` cannot receive the migrating replica (and, with ``bind_now``, bind
    ``need.gpus`` now), or None."""
    if not host.alive:
        return "host is not alive"
    if host.cordoned:
        return "host is cordoned"
    if host.host_id in kernel_hosts:
        return "already hosts a replica of this kernel"
    if bind_now and need.gpus > host.idle_gpus:
        return f"needs {need.gpus} GPUs now, {host.idle_gpus} idle"
    cap, sub = host.capacity, host.subscribed
    if cap.vram_gb and need.vram_gb > cap.vram_gb:
        return f"needs {need.vram_gb:g} GB VRAM, host has {cap.vram_gb:g}"
    if cap.millicpus and sub.millicpus + need.millicpus > cap.millicpus:
        return "millicpus exhausted"
    if cap.memory_mb and sub.memory_mb + need.memory_mb > cap.memory_mb:
        return "memory exhausted"
    if watermark is not None and need.gpus and host.ratio_with(need.gpus) > watermark:
        return f"subscription ratio would be {host.ratio_with(need.gpus):.3f} > {watermark:g}"
    return None


def plan_migration(
    replicas: Sequence[ReplicaView],
    need: Resources,
    hosts: Iterable[HostView],
    *,
    prewarmed: Mapping[str, int] | None = None,
    watermark: float | None = None,
    replica_id: str | None = None,
    bind_now: bool = True,
) -> MigrationPlan | NoTarget:
    """Choose the replica and its target. ``hosts`` may be ``PlacementIndex.hosts_that_can_bind``.

    ``prewarmed``: warm runtimes available per host (from the prewarmer). ``watermark``: also keep
    the target under this SR (None: the paper only requires the GPUs to be bindable now).
    ``replica_id``: move this replica rather than ``choose_replica``'s pick (a dead replica being
    replaced, a drained host's). ``bind_now=False``: the target need not have the GPUs idle now
    (a replacement or a drain moves a replica, not a cell waiting for GPUs).
    """
    views = list(hosts)
    by_id = {h.host_id: h for h in views}
    if replica_id is not None:
        replica = next((r for r in replicas if r.replica_id == replica_id), None)
        if replica is None:
            return NoTarget(f"kernel has no replica {replica_id!r}", {})
    else:
        replica = choose_replica(replicas, by_id)
    if replica is None:
        return NoTarget("kernel has no replicas", {})
    # never back onto its own host: a dead replica's host may be what killed it
    kernel_hosts = frozenset(r.host_id for r in replicas if r.alive) | {replica.host_id}
    warm = prewarmed or {}
    rejected: dict[str, str] = {}
    best: tuple[tuple[bool, int, float, str], HostView] | None = None
    for host in views:
        why = target_rejection(host, need, kernel_hosts, watermark, bind_now=bind_now)
        if why is not None:
            rejected[host.host_id] = why
            continue
        key = (warm.get(host.host_id, 0) <= 0, -host.idle_gpus, host.ratio_with(need.gpus), host.host_id)
        if best is None or key < best[0]:
            best = (key, host)
    if best is None:
        if not bind_now:
            return NoTarget("no host can take another replica of this kernel", rejected)
        return NoTarget(f"no host can bind {need.gpus} GPUs now", rejected)
    target = best[1]
    return MigrationPlan(replica.replica_id, replica.host_id, target.host_id, warm.get(target.host_id, 0) > 0)


@dataclass(frozen=True, slots=True)
class RetryAt:
    at: float  # when to try again (same clock as ``now``)
    attempt: int  # the number of the next attempt (1 = the first retry)


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str  # goes into the error execute_reply


@dataclass(frozen=True, slots=True)
class RetrySchedule:
    """Exponential backoff capped at ``max_delay_s``, bounded by attempts and a deadline.

    Time is a parameter: the scheduler passes its monotonic clock, the simulator its virtual one.
    """

    base_s: float = 0.5
    factor: float = 2.0
    max_delay_s: float = 8.0
    max_attempts: int = 6  # tries in all, the first included
    deadline_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based)."""
        return min(self.base_s * self.factor ** max(attempt - 1, 0), self.max_delay_s)

    def after_failure(
        self, attempts: int, started_at: float, now: float, last_reason: str
    ) -> RetryAt | GiveUp:
        """``attempts`` tries (first one included) have failed, the first at ``started_at``."""
        if attempts >= self.max_attempts:
            return GiveUp(f"migration aborted after {attempts} attempts: {last_reason}")
        at = now + self.delay(attempts)
        if at - started_at > self.deadline_s:
            return GiveUp(
                f"migration aborted: deadline of {self.deadline_s:g} s would pass "
                f"after {attempts} attempts: {last_reason}"
            )
        return RetryAt(at, attempts)
