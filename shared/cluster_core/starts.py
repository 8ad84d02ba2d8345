"""A kernel start whose replicas find no room, and what counts as a kernel with work in flight:
the live autoscaling shell (``ClusterAutoscaler.place``, its ``host_facts``) and the simulator
(``ReplicatedKernels._place``, ``Simulator._facts``) both ask these, so each rule exists once.

* placement may plan on hosts still to come only while the cluster can add one (below
  ``max_hosts`` counting the hosts asked for and not yet registered) and autoscaling is on;
* a failed placement asks ``Autoscaler.on_placement_failed`` for the missing replicas' hosts;
* the start waits for hosts only while some are reserved for it; when none is coming it fails
  (live: at once, with why; the simulator: ``StartFailed``); once its reserved hosts all came
  and it still does not fit, it asks again.

Pure: the autoscaler's bookkeeping is the only state touched.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.cluster_core.idle import KernelFacts
from shared.cluster_core.lifecycle import OVER, RUNNING
from shared.policies.autoscale import Autoscaler, ScaleDecision, feasible_hosts
from shared.policies.placement import PlacementDecision, PlacementRequest


def can_add_hosts(autoscaler: Autoscaler | None, live_hosts: int, *, enabled: bool = True) -> bool:
    """Whether a refused placement could still be helped by a scale-out."""
    if autoscaler is None or not enabled:
        return False
    return live_hosts + autoscaler.pending_hosts < autoscaler.config.max_hosts


def start_unplaced(
    autoscaler: Autoscaler, request: PlacementRequest, decision: PlacementDecision, live_hosts: int
) -> ScaleDecision:
    """The start's placement failed: reserve its missing replicas on hosts to come (ScaleOut: ask
    the provider for them)."""
    return autoscaler.on_placement_failed(request, feasible_hosts(decision), live_hosts)


def start_waits(autoscaler: Autoscaler | None, kernel_id: str) -> bool:
    """Whether hosts reserved for the kernel's start are still to register: the start waits for
    them; else nothing is coming for it (it fails, or, placed again after they came, asks again)."""
    return autoscaler is not None and autoscaler.reserved_for(kernel_id) > 0


def kernel_facts(
    hosts: Sequence[str],
    *,
    kernel_state: str = RUNNING,
    cell_in_flight: bool = False,
    held: bool = False,
    replica_starting: bool = False,
) -> KernelFacts:
    """A kernel's replicas' hosts and whether it is busy (its hosts are not idle): it is starting
    or stopping (not running), has a cell or request in flight or held, or a replica being
    started (a move under way)."""
    if kernel_state in OVER:  # stopped or dead: its replicas are gone, or going with it
        return KernelFacts((), False)
    busy = kernel_state != RUNNING or cell_in_flight or held or replica_starting
    return KernelFacts(tuple(hosts), busy)
