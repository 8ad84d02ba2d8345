"""The serving controller's core (shared/serving/core.py): pools decided over every host at once
with the prewarm policies, and "a runtime on host H, now" promised at most once per ready one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.serving import HostReport, ServingConfig, ServingCore


def _core(policy: str, per_host: int = 1, **kw: float) -> ServingCore:
    return ServingCore(ServingConfig(policy=policy, per_host=per_host, **kw))  # type: ignore[arg-type]


def test_fixed_capacity_gives_every_host_its_number() -> None:
    core = _core("fixed", per_host=2)
    assert core.report(HostReport("h0", warm=0, starting=0), 0.0) == 2
    assert core.report(HostReport("h1", warm=3, starting=0), 0.0) == 2
    assert core.targets(0.0) == {"h0": 2, "h1": 2}


def test_littles_law_sizes_one_pool_from_the_whole_clusters_demand() -> None:
    core = _core("littles_law", per_host=0, half_life_s=60.0)
    for host in ("h0", "h1", "h2"):
        core.report(HostReport(host, warm=0, starting=0, idle_gpus=int(host[1]), warmup_s=10.0), 0.0)
    # 12 runtimes taken on h0 alone within a second: the demand is the cluster's, not h0's
    core.report(HostReport("h0", warm=0, starting=0, idle_gpus=0, taken=12, warmup_s=10.0), 1.0)
    targets = core.targets(1.0)
    assert sum(targets.values()) >= 2  # λ·W = (12·ln2/60)·10 ≈ 1.4, rounded up
    assert targets["h2"] >= targets["h0"]  # most idle GPUs first: where migrations and resumes go


def test_a_ready_runtime_is_promised_once() -> None:
    core = _core("fixed")
    core.report(HostReport("h0", warm=1, starting=0), 0.0)
    assert core.acquire("h0", 0.1).warm
    second = core.acquire("h0", 0.2)
    assert not second.warm and "no ready runtime" in second.reason
    # the promised one is gone from the view: the next decision starts its replacement
    assert core.views(0.2)[0].warm == 0
    # the host's report counting the take settles the promise
    core.report(HostReport("h0", warm=0, starting=1, taken=1), 0.5)
    assert core.status(0.5)["hosts"][0]["promised"] == 0  # type: ignore[index]


def test_a_silent_host_gets_no_promise_and_no_target() -> None:
    core = _core("fixed", stale_s=5.0)
    core.report(HostReport("h0", warm=2, starting=0), 0.0)
    assert not core.acquire("h0", 10.0).warm
    assert core.targets(10.0) == {}
    assert not core.acquire("nowhere", 0.0).warm


def test_none_decides_nothing() -> None:
    core = _core("none")
    assert core.report(HostReport("h0", warm=0, starting=0), 0.0) == 0
    assert not core.enabled


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown prewarm policy 'lots'"):
        ServingConfig(policy="lots")


@given(
    st.lists(st.tuples(st.sampled_from(["h0", "h1"]), st.booleans()), max_size=40),
    st.integers(min_value=0, max_value=4),
)
def test_promises_never_exceed_the_ready_runtimes(steps: list[tuple[str, bool]], warm: int) -> None:
    core = _core("min")
    for host in ("h0", "h1"):
        core.report(HostReport(host, warm=warm, starting=0), 0.0)
    granted = {"h0": 0, "h1": 0}
    for host, acquire in steps:
        if acquire:
            granted[host] += core.acquire(host, 0.0).warm
    assert all(n <= warm for n in granted.values())
    assert all(v.warm == warm - granted[v.host_id] for v in core.views(0.0))


def test_only_a_host_reports_its_own_pool_and_only_the_scheduler_acquires() -> None:
    from shared import messages
    from shared.security.authorization import serving_refusal

    report = {"host_id": "h1", "warm": 0, "starting": 0}
    assert serving_refusal("host.h1", messages.POOL_REPORT, report) is None
    assert "may not report for host 'h1'" in str(serving_refusal("host.h0", messages.POOL_REPORT, report))
    assert serving_refusal("scheduler", messages.RUNTIME_ACQUIRE, {"host_id": "h1"}) is None
    assert "may not send runtime.acquire" in str(serving_refusal("operator", messages.RUNTIME_ACQUIRE, {}))
    assert "may not send runtime.acquire" in str(serving_refusal("host.h1", messages.RUNTIME_ACQUIRE, {}))
    assert serving_refusal("", messages.SERVING_STATUS, {}) == "unauthenticated peer"


@given(
    st.sampled_from(["fixed", "min", "littles_law"]),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 8)), min_size=1, max_size=6),
)
def test_one_hosts_target_is_its_share_of_the_cluster_wide_decision(
    policy: str, pools: list[tuple[int, int, int]]
) -> None:
    core = _core(policy, per_host=2)
    for n, (warm, starting, idle) in enumerate(pools):
        core.report(HostReport(f"h{n}", warm=warm, starting=starting, idle_gpus=idle, taken=n), float(n))
    now = float(len(pools))
    everyone = core.targets(now)
    assert {f"h{n}": core.target(f"h{n}", now) for n in range(len(pools))} == everyone
