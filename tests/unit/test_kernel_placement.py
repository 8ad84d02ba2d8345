"""One placement policy, two drivers: the live global scheduler and the simulator's replicated kernels
place kernels through the same ``KernelPlacement`` (dynamic subscription-ratio limit, placement
index), and the scheduler's incrementally kept index always equals a rebuild from its host views."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.global_scheduler.cluster_state import (
    DEAD,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    ClusterState,
    KernelRecord,
    ReplicaRecord,
)
from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.service import GlobalScheduler
from shared import messages
from shared.cluster_core.core import ClusterCore
from shared.cluster_core.replicated import ReplicatedKernels
from shared.cluster_core.sessions import Session, StartRuntime
from shared.envelope import Envelope
from shared.policies.autoscale import AutoscaleConfig, Autoscaler
from shared.policies.kernel_placement import KernelPlacement
from shared.policies.placement import HostView, PlacementRequest, default_placement_policy
from shared.policies.placement_index import PlacementIndex
from shared.resources import Resources
from shared.rpc import RpcError


def _register(gs: GlobalScheduler, host_id: str, gpus: int) -> None:
    gs.state.register_host(host_id, Resources(gpus=gpus), "virtual", "", 0.0)


def _kernel(kernel_id: str, gpus: int, hosts: tuple[str, ...], state: str = RUNNING) -> KernelRecord:
    kernel = KernelRecord(
        kernel_id, "key", "hmac-sha256", Resources(millicpus=100, gpus=gpus), KernelRouter(kernel_id, b"key")
    )
    kernel.state = state
    for n, host_id in enumerate(hosts, start=1):
        kernel.replicas[f"r{n}"] = ReplicaRecord(f"r{n}", host_id, started=True)
    return kernel


def _start_kernel(gs: GlobalScheduler, kernel_id: str, gpus: int) -> Any:
    env = Envelope(messages.KERNEL_START, {"kernel_id": kernel_id, "key": "key", "resources": {"gpus": gpus}})
    return asyncio.get_event_loop().run_until_complete(gs._on_kernel_start(b"gateway", env))


def test_live_scheduler_and_simulator_place_with_their_cores_placement(gs: GlobalScheduler) -> None:
    simulated = ClusterCore(policy="notebookos", hosts={"h1": 8})
    assert gs.placement is gs.core.placement
    assert type(gs.core.placement) is type(simulated.placement) is KernelPlacement
    assert simulated.replicated is not None and simulated.replicated.placement is simulated.placement
    assert gs.placement == KernelPlacement(3.0, 3)  # the configured watermark and replica count
    assert simulated.placement == KernelPlacement(3.0, 3)


def test_both_drivers_place_through_kernel_placement_place(
    gs: GlobalScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, PlacementIndex]] = []
    real = KernelPlacement.place

    def spy(self: KernelPlacement, index: PlacementIndex, request: PlacementRequest, **kw: Any) -> Any:
        seen.append((request.kernel_id, index))
        return real(self, index, request, **kw)

    monkeypatch.setattr(KernelPlacement, "place", spy)
    ReplicatedKernels(KernelPlacement(), hosts={"h1": 1, "h2": 1}).on_session_start(
        Session("sim", Resources(gpus=1))
    )
    _register(gs, "h1", 1)
    _register(gs, "h2", 1)
    with pytest.raises(RpcError, match="cannot place 3 replicas"):
        _start_kernel(gs, "live", 1)  # two hosts for three replicas: fails before starting anything
    assert [k for k, _ in seen] == ["sim", "live"]
    assert seen[1][1] is gs.state.placement_index()  # the scheduler's own, incrementally kept index


@pytest.mark.parametrize("growable", [False, True], ids=["fixed_cluster", "autoscaled_cluster"])
def test_live_and_simulated_placement_choose_the_same_hosts(gs: GlobalScheduler, growable: bool) -> None:
    rng = random.Random(5)
    hosts = {f"h{i}": rng.choice((1, 2, 4, 8)) for i in range(12)}
    scaler = Autoscaler(AutoscaleConfig(min_hosts=1, max_hosts=100)) if growable else None
    simulated = ReplicatedKernels(KernelPlacement(), scaler, hosts=hosts)
    for host_id, gpus in hosts.items():
        _register(gs, host_id, gpus)
    loop = asyncio.get_event_loop()
    refused = 0
    for k in range(120):
        gpus = rng.choice((0, 1, 1, 2, 4))
        actions = simulated.on_session_start(Session(f"k{k}", Resources(gpus=gpus)))
        want = tuple(a.host_id for a in actions if isinstance(a, StartRuntime))
        request = PlacementRequest(f"k{k}", Resources(gpus=gpus))
        if growable:  # the scheduler's autoscaler would add hosts on a refusal: the dynamic limit rules
            got = gs.placement.place(gs.state.placement_index(), request)
        else:  # the scheduler's own path (no provider, so no host can be added)
            got, _ = loop.run_until_complete(
                gs.autoscaling.place(gs.placement, request, gs.state.placement_index)
            )
        assert got.hosts == want, f"kernel {k}"
        if got.ok:
            gs.state.kernels[f"k{k}"] = _kernel(f"k{k}", gpus, got.hosts)
        else:
            refused += 1
    assert refused > 0  # the run reaches the limit that applies


def _three_small_hosts_at_sr_one(gs: GlobalScheduler) -> None:
    for host_id in ("a", "b", "c"):
        _register(gs, host_id, 1)
    _register(gs, "big", 64)  # idle capacity keeps the cluster ratio low, but it is cordoned
    gs.state.hosts["big"].cordoned = True
    for k in range(3):
        gs.state.kernels[f"k{k}"] = _kernel(f"k{k}", 1, ("a", "b", "c"))  # a, b, c at SR 1.0


def test_dynamic_cluster_limit_refuses_what_the_watermark_alone_allows(gs: GlobalScheduler) -> None:
    _three_small_hosts_at_sr_one(gs)
    request = PlacementRequest("k3", Resources(gpus=1))
    index = gs.state.placement_index()
    assert gs.placement.limit(index, request) == 1.0  # ΣS/(ΣG·R) is far below the floor
    refused = gs.placement.place(index, request)
    assert not refused.ok
    for host_id in ("a", "b", "c"):
        assert refused.rejected[host_id] == "subscription ratio would be 1.333 > watermark 1"
    assert refused.rejected["big"] == "host is cordoned"
    assert gs.placement.place(index, request, can_add_hosts=False).hosts == ("a", "b", "c")


def test_fixed_cluster_places_up_to_the_watermark_and_names_every_veto_beyond(
    gs: GlobalScheduler,
) -> None:
    _three_small_hosts_at_sr_one(gs)
    assert not gs.autoscaling.enabled  # no provider: hosts cannot be added
    request = PlacementRequest("k3", Resources(gpus=1))
    loop = asyncio.get_event_loop()
    decision, _ = loop.run_until_complete(
        gs.autoscaling.place(gs.placement, request, gs.state.placement_index)
    )
    assert decision.hosts == ("a", "b", "c")  # over the dynamic limit, within the watermark
    for k in range(3, 9):
        gs.state.kernels[f"k{k}"] = _kernel(f"k{k}", 1, ("a", "b", "c"))  # a, b, c at SR 3.0
    with pytest.raises(RpcError) as refused:
        _start_kernel(gs, "k9", 1)
    message = str(refused.value)
    for host_id in ("a", "b", "c"):
        assert f"{host_id}: subscription ratio would be 3.333 > watermark 3" in message
    assert "big: host is cordoned" in message


def test_relocation_uses_only_the_per_host_watermark() -> None:
    index = PlacementIndex(3.0, [HostView("a", 1, subscribed_gpus=3), HostView("b", 64, cordoned=True)])
    request = PlacementRequest("k", Resources(gpus=1), replicas=1)
    assert not KernelPlacement(3.0).place(index, request).ok
    assert KernelPlacement(3.0).relocate(index, request).hosts == ("a",)


def test_kernel_placement_rejects_meaningless_knobs() -> None:
    with pytest.raises(ValueError, match="replicas_per_kernel"):
        KernelPlacement(3.0, 0)
    with pytest.raises(ValueError, match="watermark"):
        KernelPlacement(0.0)


def test_overlaid_views_are_restored_after_the_block() -> None:
    index = PlacementIndex(3.0, [HostView("a", 4), HostView("b", 4)])
    with index.overlaid([HostView("a", 4, subscribed_gpus=12), HostView("new", 8)]):
        assert index.get("a") == HostView("a", 4, subscribed_gpus=12)
        assert index.live_gpus == 16
    assert index.get("a") == HostView("a", 4)
    assert "new" not in index
    assert index.live_gpus == 8 and index.live_subscribed_gpus == 0


# ---- the live index stays equal to a rebuild, whatever happens to the cluster ----------------

HOSTS = [f"h{i}" for i in range(5)]
KERNELS = [f"k{i}" for i in range(3)]  # few, so that events keep hitting the same kernels
EVENTS = [
    "register",
    "heartbeat",
    "die",
    "cordon",
    "uncordon",
    "scale_in",
    "place",
    "adopt",
    "replica_lost",
    "replica_replaced",
    "replica_rehomed",
    "stop",
    "reserve",
    "commit",
    "release",
    "check",
]


def _sorted(views: list[HostView]) -> list[HostView]:
    return sorted(views, key=lambda v: v.host_id)


def _scanned_views(state: ClusterState) -> list[HostView]:
    """Every host's view from first principles: walk every kernel's every replica."""
    views = []
    for host in state.hosts.values():
        gpus, subscribed = 0, Resources()
        for kernel in state.kernels.values():
            for replica in kernel.replicas.values():
                if kernel.state in (STARTING, RUNNING) and replica.alive and replica.host_id == host.host_id:
                    gpus += kernel.resources.gpus
                    subscribed = subscribed + kernel.resources
        views.append(
            HostView(
                host.host_id,
                host.gpus,
                host.committed_gpus,
                gpus,
                host.capacity,
                subscribed,
                host.cordoned,
                host.alive,
                state.replicas_per_kernel,
            )
        )
    return _sorted(views)


def _assert_index_matches_rebuild(state: ClusterState) -> None:
    index = state.placement_index()
    views = _scanned_views(state)
    assert _sorted(index.views()) == views
    assert _sorted(state.host_views()) == views
    rebuilt = PlacementIndex(3.0, views)
    assert (index.live_subscribed_gpus, index.live_gpus) == (rebuilt.live_subscribed_gpus, rebuilt.live_gpus)
    placement = KernelPlacement(3.0)
    for gpus in (0, 1, 2, 4):
        for replicas in (1, 3):
            request = PlacementRequest("probe", Resources(millicpus=500, gpus=gpus), replicas)
            got = placement.place(index, request)
            assert got == placement.place(rebuilt, request)
            limit = placement.limit(rebuilt, request)
            assert got.hosts == default_placement_policy(limit).place(request, views).hosts


def _apply(state: ClusterState, event: str, a: int, b: int, c: int) -> None:
    host_id = HOSTS[a % len(HOSTS)]
    other = HOSTS[(a + 1 + c) % len(HOSTS)]
    kernel_id = KERNELS[b % len(KERNELS)]
    kernel = state.kernels.get(kernel_id)
    host = state.hosts.get(host_id)
    if event == "register":
        cap = Resources(millicpus=4000 * (1 + c % 3), memory_mb=8192, gpus=(0, 1, 2, 4, 8)[c % 5], vram_gb=16)
        state.register_host(host_id, cap, "virtual", "", float(c))
    elif event == "heartbeat" and kernel is not None:
        state.heartbeat(host_id, {f"{kernel_id}/m{c}": c % 3, f"{kernel_id}/x": [0] * (b % 2)}, float(c))
    elif event == "die" and host is not None:
        host.alive = False
    elif event in ("cordon", "uncordon") and host is not None:
        host.cordoned = event == "cordon"
    elif event == "scale_in":
        state.hosts.pop(host_id, None)
    elif event == "place" and (kernel is None or kernel.state in (STOPPED, DEAD)):
        placed = tuple(HOSTS[(a + i * (1 + c % 5)) % len(HOSTS)] for i in range(3))
        state.kernels[kernel_id] = _kernel(kernel_id, c % 4, placed, state=(STARTING, RUNNING)[c % 2])
    elif event == "adopt" and kernel is None:  # a restarted scheduler learns replicas one host at a time
        adopted = KernelRecord(
            kernel_id, "key", "hmac-sha256", Resources(gpus=1 + c % 2), KernelRouter(kernel_id, b"k")
        )
        adopted.state = RUNNING
        state.kernels[kernel_id] = adopted
        replica = adopted.replicas.setdefault(f"r{c % 3}", ReplicaRecord(f"r{c % 3}", host_id))
        replica.host_id = host_id
        replica.alive = True
    elif kernel is not None and kernel.replicas:
        replica = list(kernel.replicas.values())[c % len(kernel.replicas)]
        if event == "replica_lost":
            replica.alive = False
        elif event == "replica_replaced":  # the migrator's swap: new joins dead, goes live, old leaves
            new = ReplicaRecord(f"m{c}", other, alive=False)
            kernel.replicas[new.replica_id] = new
            new.alive = True
            old = kernel.replicas.pop(replica.replica_id, None)
            if old is not None:
                old.alive = False
        elif event == "replica_rehomed":  # a host reports a replica we had elsewhere
            replica.host_id = other
        elif event == "stop":
            kernel.state = (STOPPING, STOPPED, DEAD)[c % 3]
        elif event == "reserve":
            state.reserve(kernel, f"m{c}", replica.host_id)
        elif event == "commit":
            state.committed_by_election(kernel, f"m{c}", replica.host_id, list(range(c % 3)))
        elif event == "release":
            state.release(kernel, f"m{c}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(EVENTS),
            st.integers(0, len(HOSTS) - 1),
            st.integers(0, len(KERNELS) - 1),
            st.integers(0, 11),
        ),
        min_size=5,
        max_size=80,
    )
)
def test_live_index_equals_a_rebuild_after_any_event_sequence(
    events: list[tuple[str, int, int, int]],
) -> None:
    state = ClusterState()
    for host_id in HOSTS[:4]:
        state.register_host(
            host_id, Resources(millicpus=8000, memory_mb=8192, gpus=4, vram_gb=16), "v", "", 0.0
        )
    for event, a, b, c in events:
        _apply(state, event, a, b, c)
        if event == "check":  # also re-indexes now, so staleness cannot hide behind a later flush
            _assert_index_matches_rebuild(state)
        else:
            assert _sorted(state.placement_index().views()) == _scanned_views(state), event
    _assert_index_matches_rebuild(state)
