"""Idle-kernel hibernation: which kernels to write to storage and stop, given what each was doing
last. Pure, so the gateway (which sees client activity) and the simulator apply one rule.

NotebookOS §5.5.2 reclaims an idle session's replicas and restores it on its next cell. Unlike
culling (``culling.py``) the kernel is not lost: its namespace goes to the data store and the next
request resumes it, so a kernel with connected clients hibernates too (a notebook left open is
the case that matters). A busy kernel never does: its cell would be cut short.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.policies.culling import KernelActivity


@dataclass(frozen=True, slots=True)
class HibernatePolicy:
    """``after_s`` 0 turns hibernation off (the default: a resume costs the first cell seconds)."""

    after_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.after_s > 0


@dataclass(frozen=True, slots=True)
class HibernateDecision:
    kernel_id: str
    idle_s: float
    reason: str


def kernels_to_hibernate(
    policy: HibernatePolicy, kernels: Iterable[KernelActivity], now: float
) -> list[HibernateDecision]:
    """The kernels idle for at least ``policy.after_s`` and not running or holding a cell."""
    if not policy.enabled:
        return []
    decisions = []
    for kernel in kernels:
        idle = now - kernel.last_activity
        if idle < policy.after_s or kernel.busy:
            continue
        reason = f"idle for {idle:.0f}s (kernel.hibernate_after_s = {policy.after_s:g})"
        decisions.append(HibernateDecision(kernel.kernel_id, idle, reason))
    return decisions
