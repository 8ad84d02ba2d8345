"""Placement: filters veto with reasons, scores rank least-loaded first, 3 distinct hosts."""

from __future__ import annotations

import pytest

from shared.policies.placement import (
    HostView,
    PlacementRequest,
    cluster_subscription_ratio,
    default_placement_policy,
    subscription_ratio,
)
from shared.resources import Resources

CAP = Resources(millicpus=64_000, memory_mb=262_144, gpus=8, vram_gb=320)


def host(host_id: str, *, gpus: int = 8, committed: int = 0, subscribed: int = 0, **kw: object) -> HostView:
    cap = Resources(CAP.millicpus, CAP.memory_mb, gpus, CAP.vram_gb)
    return HostView(host_id, gpus, committed, subscribed, capacity=cap, **kw)  # type: ignore[arg-type]


def request(gpus: int = 1, **kw: object) -> PlacementRequest:
    return PlacementRequest("k", Resources(millicpus=1000, memory_mb=2048, gpus=gpus, vram_gb=8), **kw)  # type: ignore[arg-type]


def test_paper_worked_example_four_kernels_of_four_gpus_on_one_8_gpu_host() -> None:
    assert subscription_ratio(4 * 4, 8, 3) == pytest.approx(0.667, abs=1e-3)
    assert host("h", subscribed=16).subscription_ratio == pytest.approx(16 / 24)


def test_places_three_distinct_hosts_preferring_most_idle_gpus() -> None:
    hosts = [host("a", committed=6), host("b", committed=0), host("c", committed=2), host("d", committed=1)]
    decision = default_placement_policy().place(request(), hosts)
    assert decision.ok
    assert decision.hosts == ("b", "d", "c")


def test_equal_idle_gpus_break_ties_by_lower_subscription_then_host_id() -> None:
    hosts = [
        host("a", subscribed=9),
        host("b", subscribed=3),
        host("c", subscribed=3),
        host("d", subscribed=0),
    ]
    assert default_placement_policy().place(request(), hosts).hosts == ("d", "b", "c")


def test_cordoned_dead_and_excluded_hosts_are_rejected_with_reasons() -> None:
    hosts = [
        host("a", cordoned=True),
        host("b", alive=False),
        host("c"),
        host("d"),
        host("e"),
        host("f"),
    ]
    decision = default_placement_policy().place(request(exclude_hosts=frozenset({"f"})), hosts)
    assert decision.hosts == ("c", "d", "e")
    assert decision.rejected["a"] == "host is cordoned"
    assert decision.rejected["b"] == "host is not alive"
    assert "already hosts" in decision.rejected["f"]


def test_fewer_than_three_feasible_hosts_fails_and_explains() -> None:
    decision = default_placement_policy().place(request(), [host("a"), host("b"), host("c", cordoned=True)])
    assert not decision.ok
    assert decision.hosts == ()
    assert "cordoned" in decision.explain()
    assert "only 2 feasible hosts" in decision.rejected["a"]


def test_watermark_rejects_host_that_would_exceed_subscription_ratio() -> None:
    # 8 GPUs, R=3: watermark 1.0 allows S <= 24. 22 subscribed + 4 requested = 26 -> 1.083.
    hosts = [host("a", subscribed=22), host("b"), host("c"), host("d")]
    decision = default_placement_policy(watermark=1.0).place(request(gpus=4), hosts)
    assert decision.hosts == ("b", "c", "d")
    assert "watermark" in decision.rejected["a"]


def test_cpu_only_kernel_ignores_gpu_watermark() -> None:
    hosts = [host("a", subscribed=100), host("b", subscribed=100), host("c", subscribed=100)]
    assert default_placement_policy(watermark=1.0).place(request(gpus=0), hosts).ok


def test_request_for_more_gpus_than_a_host_has_is_rejected() -> None:
    hosts = [host("a", gpus=2), host("b"), host("c"), host("d")]
    decision = default_placement_policy().place(request(gpus=4), hosts)
    assert decision.hosts == ("b", "c", "d")
    assert "needs 4 GPUs" in decision.rejected["a"]


def test_cpu_memory_subscription_is_bounded_by_capacity() -> None:
    cap = Resources(64_000, 262_144, 8, 320)
    full = HostView("a", 8, capacity=cap, subscribed=Resources(millicpus=64_000))
    hosts = [full, host("b"), host("c"), host("d")]
    decision = default_placement_policy().place(request(), hosts)
    assert "a" not in decision.hosts
    assert "millicpus" in decision.rejected["a"]


def test_duplicate_host_views_never_yield_the_same_host_twice() -> None:
    decision = default_placement_policy().place(request(), [host("a"), host("a"), host("b")])
    assert not decision.ok


def test_cluster_subscription_ratio_counts_live_hosts_only() -> None:
    hosts = [host("a", subscribed=12), host("b", subscribed=12), host("c", subscribed=48, alive=False)]
    assert cluster_subscription_ratio(hosts) == pytest.approx(24 / (16 * 3))


def test_idle_gpus_never_negative() -> None:
    assert host("a", gpus=2, committed=5).idle_gpus == 0
    assert subscription_ratio(0, 0) == 0.0
    assert subscription_ratio(1, 0) == float("inf")
