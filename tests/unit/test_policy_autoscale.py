"""Autoscaling (§3.4.2): scale out on failed placement with reservations, f·ΣC, buffer, scale in."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from shared.cluster_core.core import ClusterCore
from shared.policies.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    HostLoad,
    NoScale,
    ScaleDecision,
    ScaleIn,
    ScaleOut,
    feasible_hosts,
)
from shared.policies.placement import HostView, PlacementRequest, default_placement_policy
from shared.resources import Resources
from shared.simulator.engine import Simulator
from shared.simulator.params import SimParams
from shared.workload.model import Session as TraceSession
from shared.workload.model import Task, Trace


def loads(committed: list[int], subscribed: list[int] | None = None) -> list[HostLoad]:
    subs = subscribed or [0] * len(committed)
    return [HostLoad(f"h{i}", 8, c, s) for i, (c, s) in enumerate(zip(committed, subs, strict=True))]


def test_failed_placement_requests_hosts_for_missing_replicas_and_reserves_them() -> None:
    hosts = [HostView("a", 8), HostView("b", 8, subscribed_gpus=72)]
    request = PlacementRequest("k1", Resources(gpus=2))
    decision = default_placement_policy().place(request, hosts)
    assert not decision.ok and feasible_hosts(decision) == 1
    scaler = Autoscaler()
    out = scaler.on_placement_failed(request, feasible_hosts(decision), live_hosts=2)
    assert out == ScaleOut(2, "placement of k1 failed: 2 replica host(s) missing")
    assert scaler.pending_hosts == 2 and scaler.reserved_for("k1") == 2
    # a second kernel reuses the hosts already on their way (distinct kernels may share a new host)
    out2 = scaler.on_placement_failed(PlacementRequest("k2", Resources(gpus=2)), 1, live_hosts=2)
    assert isinstance(out2, NoScale) and scaler.pending_hosts == 2
    # arrivals hand over the reservations
    first = scaler.on_host_registered("n1")
    assert [k for k, _ in first] == ["k1", "k2"]
    assert scaler.reserved_for("k1") == 1
    assert scaler.on_scale_out_failed(1) == ("k1", "k2")
    assert scaler.pending_hosts == 0


def test_failed_placement_respects_max_hosts() -> None:
    scaler = Autoscaler(AutoscaleConfig(max_hosts=4))
    out = scaler.on_placement_failed(PlacementRequest("k", Resources(gpus=1)), 0, live_hosts=3)
    assert isinstance(out, NoScale) and "max_hosts=4" in out.reason
    assert scaler.pending_hosts == 0


def test_scale_out_when_provisioned_below_f_times_committed_plus_buffer() -> None:
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=1, min_hosts=3))
    # ΣC = 40 -> f·ΣC = 42 GPUs -> 6 hosts of 8, + 1 buffer = 7 wanted; 5 provisioned
    out = scaler.evaluate(loads([8, 8, 8, 8, 8]))
    assert isinstance(out, ScaleOut) and out.count == 2
    assert "f·ΣC = 42.0" in out.reason


def test_scale_in_releases_at_most_two_idle_hosts_fewest_replicas_first() -> None:
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=1, min_hosts=3))
    out = scaler.evaluate(loads([8, 0, 0, 0, 0, 0], subscribed=[8, 6, 0, 3, 0, 9]))
    assert isinstance(out, ScaleIn) and out.host_ids == ("h2", "h4")


def test_scale_in_never_pushes_cluster_ratio_over_the_limit() -> None:
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=1, max_ratio_after_scale_in=1.0))
    # ΣS = 48 over 4 hosts (ΣG·R = 96): removing one host gives 48/72 = 0.67, two gives 48/48 = 1.0
    # three would give 2.0 > 1.0
    out = scaler.evaluate(loads([0, 0, 0, 0], subscribed=[12, 12, 12, 12]))
    assert isinstance(out, ScaleIn) and len(out.host_ids) == 2
    tight = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=1, max_ratio_after_scale_in=0.6))
    assert isinstance(tight.evaluate(loads([0, 0, 0, 0], subscribed=[12, 12, 12, 12])), NoScale)


def test_no_scaling_while_a_scale_out_is_pending() -> None:
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=1))
    scaler.on_placement_failed(PlacementRequest("k", Resources(gpus=1)), 2, live_hosts=6)
    assert scaler.evaluate(loads([0] * 6)) == NoScale("scale-out pending")


@given(committed=st.lists(st.integers(0, 8), min_size=0, max_size=40), buffer=st.integers(0, 3))
def test_evaluate_respects_bounds(committed: list[int], buffer: int) -> None:
    cfg = AutoscaleConfig(buffer_hosts=buffer, min_hosts=3, max_hosts=30)
    out = Autoscaler(cfg).evaluate(loads(committed))
    if isinstance(out, ScaleOut):
        assert out.count > 0 and len(committed) + out.count <= cfg.max_hosts
        assert len(committed) + out.count >= cfg.min_hosts
    elif isinstance(out, ScaleIn):
        assert 1 <= len(out.host_ids) <= cfg.max_release
        assert len(committed) - len(out.host_ids) >= cfg.min_hosts
        assert all(committed[int(h[1:])] == 0 for h in out.host_ids)
        # capacity after release still covers f·ΣC
        assert (len(committed) - len(out.host_ids)) * 8 >= cfg.scaling_factor * sum(committed)


def test_hosts_marked_not_releasable_are_never_scaled_in() -> None:
    scaler = Autoscaler(AutoscaleConfig(min_hosts=1, buffer_hosts=0))
    hosts = [
        HostLoad("fixed", 8, releasable=False),
        HostLoad("added", 8),
        HostLoad("also-fixed", 8, releasable=False),
    ]
    out = scaler.evaluate(hosts)
    assert isinstance(out, ScaleIn) and out.host_ids == ("added",)


def test_expected_hosts_stop_the_periodic_check_asking_again() -> None:
    scaler = Autoscaler(AutoscaleConfig(min_hosts=1, buffer_hosts=0, gpus_per_host=8))
    busy = loads([8, 8])
    first = scaler.evaluate(busy)
    assert isinstance(first, ScaleOut) and first.count == 1
    scaler.expect_hosts(first.count)
    assert isinstance(scaler.evaluate(busy), NoScale)
    assert scaler.on_host_registered("h2") == ()  # an unreserved pending host carries no replicas
    assert scaler.pending_hosts == 0


def test_cancel_frees_a_kernels_reservations_but_keeps_the_hosts_pending() -> None:
    scaler = Autoscaler(AutoscaleConfig(max_hosts=10))
    out = scaler.on_placement_failed(PlacementRequest("k1", Resources(gpus=1)), feasible=0, live_hosts=3)
    assert isinstance(out, ScaleOut) and out.count == 3 and scaler.reserved_for("k1") == 3
    scaler.cancel("k1")
    assert scaler.reserved_for("k1") == 0 and scaler.pending_hosts == 3
    again = scaler.on_placement_failed(PlacementRequest("k2", Resources(gpus=1)), feasible=0, live_hosts=3)
    assert isinstance(again, NoScale) and scaler.reserved_for("k2") == 3  # reuses the hosts on their way


def test_scale_in_prefers_hosts_with_fewer_replicas_to_migrate_at_equal_subscription() -> None:
    """CPU-only replicas subscribe no GPUs: the replicas a release would migrate break the tie."""
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=3, max_release=1))
    hosts = [
        HostLoad("a", 8, replicas=2),
        HostLoad("b", 8, replicas=1),
        HostLoad("c", 8, replicas=3),
        HostLoad("d", 8, replicas=1, committed_gpus=1),  # running a cell: never a candidate
    ]
    out = scaler.evaluate(hosts)
    assert isinstance(out, ScaleIn) and out.host_ids == ("b",)
    assert "1 replica(s) to migrate first" in out.reason


def test_idle_hosts_holding_replicas_are_released_when_the_rest_can_take_their_subscriptions() -> None:
    """A released host's replicas move, so its subscribed GPUs count against the hosts that stay."""
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=2, max_ratio_after_scale_in=1.0))
    # ΣS = 24 on 4 hosts of 8 (R = 3): without one host 24/72, without two 24/48 -- both under 1.0
    hosts = [HostLoad(f"h{i}", 8, subscribed_gpus=6, replicas=3) for i in range(4)]
    out = scaler.evaluate(hosts)
    assert isinstance(out, ScaleIn) and out.host_ids == ("h0", "h1")
    assert "6 replica(s) to migrate first" in out.reason
    tight = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=2, max_ratio_after_scale_in=0.4))
    fewer = tight.evaluate(hosts)  # 24/72 = 0.33 fits, 24/48 = 0.5 does not: one host only
    assert isinstance(fewer, ScaleIn) and fewer.host_ids == ("h0",)


def test_a_host_the_caller_marks_busy_keeps_its_replicas_even_when_nothing_is_committed() -> None:
    """The shells mark a host holding a replica of a kernel with a cell in flight not releasable."""
    scaler = Autoscaler(AutoscaleConfig(buffer_hosts=0, min_hosts=1))
    hosts = [HostLoad("in-flight", 8, subscribed_gpus=1, replicas=1, releasable=False), HostLoad("x", 8)]
    out = scaler.evaluate(hosts)
    assert isinstance(out, ScaleIn) and out.host_ids == ("x",)


class _RecordingAutoscaler(Autoscaler):
    """The real policy, keeping each periodic check's input (what the simulator shell passes it)."""

    def __init__(self, config: AutoscaleConfig) -> None:
        super().__init__(config)
        self.seen: list[list[HostLoad]] = []

    def evaluate(self, hosts: Sequence[HostLoad]) -> ScaleDecision:
        self.seen.append(list(hosts))
        return super().evaluate(hosts)


def test_simulator_keeps_hosts_of_a_session_with_a_cell_in_flight_and_counts_replicas_to_move() -> None:
    """As live: a host holding a replica of a session whose cell is in flight is not idle, even
    when its own GPUs are free; the replicas on each host are the cost the policy sees."""
    params = SimParams(initial_hosts=4, min_hosts=3, buffer_hosts=0, autoscale_interval_s=100.0)
    scaler = _RecordingAutoscaler(params.autoscale_config())
    core = ClusterCore(params.core_config(), autoscaler=scaler, prewarmed={})
    trace = Trace.from_tasks(
        [TraceSession("s1", 0.0, 1000.0, 1)], [Task("s1", 50.0, 500.0, 1)]
    )  # one cell in flight from t=50 to t=550: the checks at t=100..500 see it
    Simulator(trace, "notebookos", params, core=core).run()
    during = next(loads for loads in scaler.seen if any(h.committed_gpus for h in loads))
    assert sum(h.replicas for h in during) == 3
    assert all(not h.releasable for h in during if h.replicas)
    assert not any(h.releasable for h in during)  # and the initial hosts are not the provider's to release
    assert sum(h.committed_gpus for h in during) == 1  # two of its hosts hold idle standby replicas
