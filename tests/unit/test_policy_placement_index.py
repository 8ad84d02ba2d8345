"""The placement index makes exactly the default filter-and-score policy's decisions, incrementally."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policies.placement import HostView, PlacementRequest, default_placement_policy
from shared.policies.placement_index import PlacementIndex
from shared.resources import Resources


@st.composite
def host_views(draw: st.DrawFn, host_id: str) -> HostView:
    gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
    cap = Resources(
        millicpus=draw(st.sampled_from([0, 8_000, 64_000])),
        memory_mb=draw(st.sampled_from([0, 16_384, 262_144])),
        gpus=gpus,
        vram_gb=draw(st.sampled_from([0.0, 16.0, 80.0])),
    )
    sub = Resources(millicpus=draw(st.integers(0, 70_000)), memory_mb=draw(st.integers(0, 300_000)), gpus=0)
    return HostView(
        host_id,
        gpus,
        committed_gpus=draw(st.integers(0, gpus + 1)),
        subscribed_gpus=draw(st.integers(0, 3 * gpus * 3 + 2)),
        capacity=cap,
        subscribed=sub,
        cordoned=draw(st.integers(0, 9)) == 0,
        alive=draw(st.integers(0, 9)) != 0,
        replicas_per_kernel=draw(st.sampled_from([3, 3, 3, 2])),
        warm_runtimes=draw(st.sampled_from([0, 0, 1, 2])),
    )


@st.composite
def clusters(draw: st.DrawFn) -> list[HostView]:
    n = draw(st.integers(0, 25))
    return [draw(host_views(f"h{i:02d}")) for i in range(n)]


@st.composite
def requests(draw: st.DrawFn, n_hosts: int) -> PlacementRequest:
    res = Resources(
        millicpus=draw(st.sampled_from([0, 1000, 4000])),
        memory_mb=draw(st.sampled_from([0, 2048, 32_768])),
        gpus=draw(st.sampled_from([0, 1, 2, 4, 8])),
        vram_gb=draw(st.sampled_from([0.0, 8.0, 40.0])),
    )
    exclude = draw(st.frozensets(st.sampled_from([f"h{i:02d}" for i in range(max(n_hosts, 1))]), max_size=3))
    return PlacementRequest("k", res, replicas=draw(st.sampled_from([1, 2, 3, 3, 3])), exclude_hosts=exclude)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), hosts=clusters(), watermark=st.sampled_from([0.5, 1.0, 1.5, 3.0]))
def test_index_decision_equals_filter_and_score(
    data: st.DataObject, hosts: list[HostView], watermark: float
) -> None:
    index = PlacementIndex(watermark, hosts)
    for _ in range(3):
        request = data.draw(requests(len(hosts)))
        expected = default_placement_policy(watermark).place(request, hosts)
        got = index.place(request)
        assert got.hosts == expected.hosts
        if not expected.ok:
            assert got.rejected == expected.rejected


@settings(max_examples=50, deadline=None)
@given(hosts=clusters(), seed=st.integers(0, 2**16))
def test_index_stays_equal_under_random_updates(hosts: list[HostView], seed: int) -> None:
    rng = random.Random(seed)
    index = PlacementIndex(3.0, hosts)
    current = {h.host_id: h for h in hosts}
    for step in range(30):
        if current and rng.random() < 0.7:
            h = current[rng.choice(sorted(current))]
            h = HostView(
                h.host_id,
                h.gpus,
                committed_gpus=rng.randint(0, h.gpus),
                subscribed_gpus=max(0, h.subscribed_gpus + rng.randint(-2, 3)),
                capacity=h.capacity,
                subscribed=h.subscribed,
                cordoned=rng.random() < 0.1,
                alive=rng.random() > 0.05,
            )
            current[h.host_id] = h
            index.upsert(h)
        elif current and rng.random() < 0.5:
            victim = rng.choice(sorted(current))
            del current[victim]
            assert index.remove(victim) is not None
        else:
            h = HostView(f"n{step}", rng.choice([1, 4, 8]), capacity=Resources(gpus=8))
            current[h.host_id] = h
            index.upsert(h)
        request = PlacementRequest("k", Resources(gpus=rng.choice([0, 1, 2, 4])))
        view = list(current.values())
        assert index.place(request).hosts == default_placement_policy(3.0).place(request, view).hosts
        assert index.live_gpus == sum(v.gpus for v in view if v.alive)
        assert index.live_subscribed_gpus == sum(v.subscribed_gpus for v in view if v.alive)
        assert sorted(v.host_id for v in index.views()) == sorted(current)


def test_watermark_override_and_bind_query() -> None:
    hosts = [HostView(f"h{i}", 8, committed_gpus=i, subscribed_gpus=4 * i) for i in range(6)]
    index = PlacementIndex(3.0, hosts)
    request = PlacementRequest("k", Resources(gpus=4))
    assert index.place(request).hosts == ("h0", "h1", "h2")
    # a tight dynamic limit (S+4)/24 <= 0.5 admits only S <= 8: h0, h1, h2
    assert index.place(request, watermark=0.5).hosts == ("h0", "h1", "h2")
    assert not index.place(request, watermark=0.3).ok
    assert [h.host_id for h in index.hosts_that_can_bind(5)] == ["h0", "h1", "h2", "h3"]


def test_among_equal_hosts_those_with_a_warm_runtime_win_in_policy_and_index() -> None:
    """The third score (WarmRuntimeScore) only breaks ties: idle GPUs and subscription first."""
    hosts = [
        HostView("a", 8),
        HostView("b", 8, warm_runtimes=1),
        HostView("c", 8),
        HostView("d", 8, warm_runtimes=2),
        HostView("e", 8, subscribed_gpus=2, warm_runtimes=1),  # more subscribed: after the cold ones
        HostView("f", 8, committed_gpus=1, warm_runtimes=1),  # less idle: last
    ]
    request = PlacementRequest("k", Resources(gpus=1), replicas=3)
    policy = default_placement_policy(3.0)
    assert policy.place(request, hosts).hosts == ("b", "d", "a")
    index = PlacementIndex(3.0, hosts)
    assert index.place(request).hosts == ("b", "d", "a")
    assert [v.host_id for v in index.ranked(request)] == ["b", "d", "a", "c", "e", "f"]
    index.upsert(HostView("c", 8, warm_runtimes=1))  # its pool refilled
    index.upsert(HostView("d", 8))  # its runtime taken
    assert index.place(request).hosts == ("b", "c", "a")
