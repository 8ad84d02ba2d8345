"""Container Prewarmer policies: fixed, minimum, Little's law; reconcile to start/stop actions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.policies.prewarm import (
    ArrivalRate,
    FixedCapacity,
    LittlesLaw,
    MinCapacity,
    PoolView,
    PrewarmAction,
    reconcile,
)

POOLS = [
    PoolView("a", warm=0, starting=0, idle_gpus=8),
    PoolView("b", warm=3, starting=1, idle_gpus=2),
    PoolView("c", warm=2, starting=0, idle_gpus=4, max_warm=1),
]


def test_fixed_capacity_starts_missing_and_stops_extra() -> None:
    assert reconcile(FixedCapacity(2), POOLS) == [
        PrewarmAction("a", start=2),
        PrewarmAction("b", stop=2),
        PrewarmAction("c", stop=1),
    ]


def test_min_capacity_only_starts() -> None:
    assert reconcile(MinCapacity(2), POOLS) == [PrewarmAction("a", start=2)]


def test_littles_law_sizes_pool_as_rate_times_lifetime() -> None:
    policy = LittlesLaw(arrival_rate_per_s=0.05, lifetime_s=60)  # L = 3
    assert policy.total == 3
    targets = policy.targets(POOLS)
    assert targets == {"a": 1, "b": 1, "c": 1}  # spread round robin, most idle first
    assert reconcile(policy, POOLS) == [
        PrewarmAction("a", start=1),
        PrewarmAction("b", stop=3),
        PrewarmAction("c", stop=1),
    ]
    assert LittlesLaw(0.1, 60).targets(POOLS) == {"a": 3, "b": 2, "c": 1}  # L = 6, c capped at 1


def test_littles_law_respects_min_and_host_limits() -> None:
    pools = [PoolView("a", max_warm=1), PoolView("b", max_warm=2)]
    assert LittlesLaw(10.0, 10.0, min_per_host=1).targets(pools) == {"a": 1, "b": 2}


@given(
    rate=st.floats(0, 5),
    life=st.floats(0, 120),
    counts=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 8)), min_size=1, max_size=8
    ),
)
def test_reconcile_reaches_target(rate: float, life: float, counts: list[tuple[int, int, int]]) -> None:
    pools = [PoolView(f"h{i}", w, s, g) for i, (w, s, g) in enumerate(counts)]
    for policy in (FixedCapacity(2), MinCapacity(2), LittlesLaw(rate, life, min_per_host=1)):
        targets = policy.targets(pools)
        after = {p.host_id: p.total for p in pools}
        for a in reconcile(policy, pools):
            assert a.start >= 0 and a.stop >= 0 and not (a.start and a.stop)
            after[a.host_id] += a.start - a.stop
        for p in pools:
            if policy.may_stop and p.warm >= p.total - targets[p.host_id]:
                assert after[p.host_id] == targets[p.host_id]
            else:
                assert after[p.host_id] >= targets[p.host_id] or after[p.host_id] == p.total - p.warm


def test_arrival_rate_converges_to_the_event_rate() -> None:
    est = ArrivalRate(half_life_s=60)
    for i in range(2000):
        est.observe(i * 2.0)  # one event every 2 s
    assert est.rate(4000.0) == pytest.approx(0.5, rel=0.05)
    assert est.rate(4000.0 + 600) < 0.001  # decays when events stop
