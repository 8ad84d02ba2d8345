"""Idle-kernel culling: which kernels to shut down, given what each was doing last. Pure.

The rule is Jupyter Server's (and so Enterprise Gateway's) ``cull_idle_timeout``: a kernel with
no activity for ``idle_s`` seconds is culled, except a busy one unless ``cull_busy`` and one with
connected clients unless ``cull_connected``. Activity is any message from a client or from the
kernel (not heartbeats). The gateway feeds this with what its kernel endpoints saw and carries
out the decisions; keeping the rule here makes it testable without sockets or clocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CullPolicy:
    """``idle_s`` 0 turns culling off."""

    idle_s: float = 0.0
    cull_connected: bool = False
    cull_busy: bool = False

    @property
    def enabled(self) -> bool:
        return self.idle_s > 0


@dataclass(frozen=True, slots=True)
class KernelActivity:
    kernel_id: str
    last_activity: float  # seconds, on the same clock as ``now``
    busy: bool  # a cell runs (last iopub status "busy") or waits to start (its request unanswered)
    connections: int  # clients connected to the kernel's iopub socket


@dataclass(frozen=True, slots=True)
class CullDecision:
    kernel_id: str
    idle_s: float
    reason: str


def kernels_to_cull(policy: CullPolicy, kernels: Iterable[KernelActivity], now: float) -> list[CullDecision]:
    """The kernels idle past ``policy.idle_s`` and not protected by being busy or connected."""
    if not policy.enabled:
        return []
    decisions = []
    for kernel in kernels:
        idle = now - kernel.last_activity
        if idle < policy.idle_s:
            continue
        if kernel.busy and not policy.cull_busy:
            continue
        if kernel.connections > 0 and not policy.cull_connected:
            continue
        reason = (
            f"culled after {idle:.0f}s without activity (kernel.cull_idle_s = {policy.idle_s:g}); "
            f"it was {'busy' if kernel.busy else 'idle'} with {kernel.connections} connected client"
            f"{'' if kernel.connections == 1 else 's'}"
        )
        decisions.append(CullDecision(kernel.kernel_id, idle, reason))
    return decisions
