"""Pure scheduling policies shared by the live global scheduler and the simulator.

Everything here is events-in, decisions-out: no sockets, no clock, no asyncio, so the simulator
and the service run exactly the same code.
"""

from shared.policies.executor_choice import ExecutorChoice, HostLedgerView, ReplicaView, choose_executor
from shared.policies.placement import (
    HostView,
    PlacementDecision,
    PlacementPolicy,
    PlacementRequest,
    default_placement_policy,
)

__all__ = [
    "ExecutorChoice",
    "HostLedgerView",
    "HostView",
    "PlacementDecision",
    "PlacementPolicy",
    "PlacementRequest",
    "ReplicaView",
    "choose_executor",
    "default_placement_policy",
]
