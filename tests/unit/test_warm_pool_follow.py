"""A host's warm pool follows the serving controller's target (services/local_scheduler/
warm_pool.py ``follow``) while its answers come, and decides alone again once they stop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.local_scheduler.warm_pool import WarmPool
from shared.config import load_config
from shared.policies.prewarm import FixedCapacity, MinCapacity


@pytest.fixture
def pool(tmp_path: Path) -> WarmPool:
    cfg = load_config(overrides={"prewarm.policy": "min", "prewarm.per_host": 1, "prewarm.interval_s": 0.5})
    return WarmPool(cfg, host_id="h0", directory=tmp_path)


def test_the_controllers_target_replaces_the_local_policy(pool: WarmPool) -> None:
    assert pool.policy() == MinCapacity(1)
    pool.follow(3)
    assert pool.policy() == FixedCapacity(3)
    assert pool.report()["target"] == 3  # what the heartbeat shows is what the pool pursues


def test_a_silent_controller_hands_the_decision_back(pool: WarmPool, monkeypatch: pytest.MonkeyPatch) -> None:
    pool.follow(0)
    later = time.monotonic() + 60.0
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert pool.policy() == MinCapacity(1)


def test_the_pool_report_carries_what_the_controller_decides_from(pool: WarmPool) -> None:
    pool.taken, pool.misses = 4, 1
    pool.warmup_s.extend([2.0, 4.0, 9.0])
    assert pool.pool_report() == {
        "host_id": "h0", "warm": 0, "starting": 0, "idle_gpus": 0, "taken": 4, "misses": 1, "warmup_s": 4.0,
    }  # fmt: skip


def test_without_a_policy_there_is_nothing_to_follow(tmp_path: Path) -> None:
    asyncio.set_event_loop(asyncio.new_event_loop())
    pool = WarmPool(load_config(), host_id="h0", directory=tmp_path)  # prewarm.policy = none
    pool.follow(2)
    assert pool.policy() is None
