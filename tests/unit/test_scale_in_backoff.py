"""A host whose release failed waits twice as long (idle) before each next try, until it is used."""

from __future__ import annotations

import asyncio

from services.global_scheduler.autoscaling import ClusterAutoscaler
from services.global_scheduler.cluster_state import ClusterState
from shared.config import load_config
from shared.policies.autoscale import SCALE_IN_BACKOFF_MAX
from shared.resources import Resources

IDLE_S = 30.0


class RefusingProvider:
    """Owns every host and fails every release (a host that cannot be stopped, say)."""

    can_provision = True

    def __init__(self) -> None:
        self.release_calls: list[str] = []

    def owns(self, host_id: str) -> bool:
        return True

    async def provision(self, count: int) -> list[str]:
        return []

    async def release(self, host_id: str) -> None:
        self.release_calls.append(host_id)
        raise RuntimeError("the host would not stop")

    async def close(self) -> None:
        return None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def releasable(scaler: ClusterAutoscaler, host_id: str) -> bool:
    return next(load for load in scaler.host_loads() if load.host_id == host_id).releasable


def test_each_failed_release_doubles_the_idle_time_before_the_next_try() -> None:
    cfg = load_config(
        None, {"cluster.hosts": "1", "cluster.max_hosts": "4", "autoscale.scale_in_idle_s": str(IDLE_S)}
    )
    state, clock, provider = ClusterState(), Clock(), RefusingProvider()
    state.register_host("h1", Resources(gpus=8), "virtual", "tcp://127.0.0.1:1", clock.now)
    scaler = ClusterAutoscaler(cfg, state, provider, clock=clock)  # type: ignore[arg-type]
    assert scaler.enabled
    for failures in range(6):
        wanted = IDLE_S * min(2**failures, SCALE_IN_BACKOFF_MAX)
        start = clock.now
        assert not releasable(scaler, "h1")  # idle from now on
        clock.now = start + wanted - 1
        assert not releasable(scaler, "h1"), failures
        clock.now = start + wanted
        assert releasable(scaler, "h1"), failures
        asyncio.run(scaler._release("h1", "test"))
        assert provider.release_calls == ["h1"] * (failures + 1)
        assert scaler.events[-1]["kind"] == "scale_in_failed"
        assert not state.hosts["h1"].cordoned  # put back as it was
    # used again: the next release is judged afresh, after one idle period
    state.hosts["h1"].ledger.mirror({"k/m": 1})
    assert not releasable(scaler, "h1")
    state.hosts["h1"].ledger.mirror({})
    start = clock.now
    assert not releasable(scaler, "h1")
    clock.now = start + IDLE_S
    assert releasable(scaler, "h1")
