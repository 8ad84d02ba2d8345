"""A host that registered with replica slots reserved for a waiting kernel looks subscribed by
that kernel to every other placement, in the live shell and in the simulator alike (one
``ArrivedReservations`` per core)."""

from __future__ import annotations

from services.global_scheduler.autoscaling import ClusterAutoscaler
from services.global_scheduler.cluster_state import ClusterState
from services.host_provider import NoHostProvider
from shared.cluster_core.core import ClusterCore, CoreConfig
from shared.cluster_core.reservations import ArrivedReservations
from shared.config import load_config
from shared.policies.kernel_placement import KernelPlacement
from shared.policies.placement import HostView, PlacementRequest
from shared.policies.placement_index import PlacementIndex
from shared.resources import Resources

ONE_GPU = Resources(gpus=1)


def one_host_index() -> PlacementIndex:
    index = PlacementIndex(1.0)
    index.upsert(HostView("n1", 1, replicas_per_kernel=1))
    return index


def test_only_the_kernel_a_host_came_for_can_take_its_room() -> None:
    placement = KernelPlacement(1.0, replicas_per_kernel=1)
    arrived = ArrivedReservations()
    arrived.arrived("n1", [("waiting", ONE_GPU)])
    index = one_host_index()
    other = arrived.place(placement, index, PlacementRequest("other", ONE_GPU, 1), can_add_hosts=False)
    mine = arrived.place(placement, index, PlacementRequest("waiting", ONE_GPU, 1), can_add_hosts=False)
    assert not other.ok and mine.ok and mine.hosts == ("n1",)
    assert index.get("n1") == HostView("n1", 1, replicas_per_kernel=1)  # the overlay is undone
    arrived.done("waiting")
    assert "n1" not in arrived
    assert arrived.place(placement, index, PlacementRequest("other", ONE_GPU, 1), can_add_hosts=False).ok


def test_the_live_shell_and_the_simulated_plugin_share_the_cores_reservations() -> None:
    cfg = load_config()
    core = ClusterCore(CoreConfig.from_config(cfg))
    assert core.replicated is not None and core.replicated.arrived is core.arrived
    assert core.held.arrived is core.arrived
    scaler = ClusterAutoscaler(cfg, ClusterState(), NoHostProvider(), core=core)
    core.arrived.arrived("n1", [("waiting", ONE_GPU)])
    (seen,) = scaler.views_for("other", [HostView("n1", 1)])
    assert seen.subscribed_gpus == 1  # the live shell sees the core's reservations
