"""The prewarm policy a local scheduler's warm pool runs, chosen by ``prewarm.policy``."""

from __future__ import annotations

import pytest

from services.local_scheduler.warm_pool import make_prewarm_policy
from shared.config import CHOICES
from shared.policies.prewarm import FixedCapacity, LittlesLaw, MinCapacity, PoolView, PrewarmPolicy


def choose(name: str, rate: float = 0.0, warmup_s: float = 5.0) -> PrewarmPolicy | None:
    return make_prewarm_policy(
        name, per_host=1, max_per_host=4, headroom=1.0, arrival_rate=rate, warmup_s=warmup_s
    )


def test_every_configurable_prewarm_policy_has_a_live_pool_policy() -> None:
    assert choose("none") is None
    assert isinstance(choose("fixed"), FixedCapacity)
    assert isinstance(choose("min"), MinCapacity)
    assert isinstance(choose("littles_law"), LittlesLaw)
    assert set(CHOICES["prewarm.policy"]) == {"none", "fixed", "min", "littles_law"}


def test_littles_law_sizes_the_pool_from_the_observed_rate_and_warm_up_time() -> None:
    pool = [PoolView("host-0", idle_gpus=1, max_warm=4)]

    def target(rate: float) -> int:
        policy = choose("littles_law", rate=rate, warmup_s=5.0)
        assert policy is not None
        return policy.targets(pool)["host-0"]

    assert target(0.0) == 1  # the per-host minimum
    assert target(0.5) == 3  # ceil(0.5/s * 5 s)
    assert target(10.0) == 4  # max_per_host


def test_an_unknown_prewarm_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="always"):
        choose("always")
