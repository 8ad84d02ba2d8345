"""Draining a host before a scale-in releases it: each replica on it moves on its own, to where
``moves.plan_replacement`` (under the subscription watermark) puts it, as the live
``Migrator.replace`` does for each replica of ``tandem host drain`` and of a scale-in. Replicas
that no host can take stay, and the ones that could move have moved (partial, as live): the
release is then abandoned and the idle judgement backs off (``IdleJudge.release_failed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from shared.cluster_core.moves import plan_replacement, why_not_drained
from shared.policies.executor_choice import ReplicaView
from shared.policies.migration import MigrationPlan
from shared.policies.placement import HostView
from shared.resources import Resources


@dataclass(frozen=True, slots=True)
class ReplicaToMove:
    kernel_id: str
    replica_id: str
    resources: Resources
    replicas: tuple[ReplicaView, ...]  # every replica of its kernel, this one included


@dataclass(frozen=True, slots=True)
class DrainPlan:
    moves: tuple[tuple[ReplicaToMove, MigrationPlan], ...]
    stuck: tuple[tuple[ReplicaToMove, str], ...]  # replicas no host can take, and why

    @property
    def complete(self) -> bool:
        return not self.stuck

    def why_not(self) -> str:
        """Why this drain leaves its host unreleasable ("" when every replica moves)."""
        return why_not_drained([(r.kernel_id, r.replica_id, why) for r, why in self.stuck], 0)


def plan_drain(
    host_id: str,
    replicas: Sequence[ReplicaToMove],
    hosts: Iterable[HostView],
    *,
    prewarmed: Mapping[str, int] | None = None,
    watermark: float | None = None,
) -> DrainPlan:
    """Plan each replica's move off ``host_id`` in turn; each placed one subscribes its target
    (and takes its warm runtime) before the next is planned."""
    views = {v.host_id: v for v in hosts}
    if host_id in views:
        views[host_id] = replace(views[host_id], cordoned=True)
    warm = dict(prewarmed or {})
    moves: list[tuple[ReplicaToMove, MigrationPlan]] = []
    stuck: list[tuple[ReplicaToMove, str]] = []
    for r in replicas:
        plan = plan_replacement(
            r.replica_id, r.replicas, r.resources, views.values(), prewarmed=warm, watermark=watermark
        )
        if not isinstance(plan, MigrationPlan):
            stuck.append((r, plan.reason))
            continue
        target = views[plan.target_host]
        views[plan.target_host] = replace(
            target,
            subscribed_gpus=target.subscribed_gpus + r.resources.gpus,
            subscribed=target.subscribed + r.resources,
        )
        if plan.use_prewarmed:
            warm[plan.target_host] -= 1
        moves.append((r, plan))
    return DrainPlan(tuple(moves), tuple(stuck))
