"""The idle-culling rule (shared/policies/culling.py): Jupyter Server's cull_idle_timeout with
its cull_busy and cull_connected exceptions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.policies.culling import CullPolicy, KernelActivity, kernels_to_cull

NOW = 1_000.0


def kernel(idle_s: float, *, busy: bool = False, connections: int = 0, kid: str = "k") -> KernelActivity:
    return KernelActivity(kid, NOW - idle_s, busy, connections)


def test_culling_off_by_default_culls_nothing() -> None:
    assert kernels_to_cull(CullPolicy(), [kernel(1e9)], NOW) == []


def test_a_kernel_idle_past_the_limit_is_culled_with_the_reason() -> None:
    [decision] = kernels_to_cull(CullPolicy(idle_s=60), [kernel(90, kid="a"), kernel(30, kid="b")], NOW)
    assert decision.kernel_id == "a" and decision.idle_s == 90
    assert "90s without activity" in decision.reason and "kernel.cull_idle_s = 60" in decision.reason


def test_busy_and_connected_kernels_are_spared_unless_the_options_say_otherwise() -> None:
    busy, connected = kernel(90, busy=True, kid="busy"), kernel(90, connections=2, kid="connected")
    assert kernels_to_cull(CullPolicy(idle_s=60), [busy, connected], NOW) == []
    assert [d.kernel_id for d in kernels_to_cull(CullPolicy(60, cull_busy=True), [busy, connected], NOW)] == [
        "busy"
    ]
    assert [
        d.kernel_id for d in kernels_to_cull(CullPolicy(60, cull_connected=True), [busy, connected], NOW)
    ] == ["connected"]


@given(
    idle_s=st.floats(0, 1e6),
    limit=st.floats(0.001, 1e6),
    busy=st.booleans(),
    connections=st.integers(0, 5),
    cull_busy=st.booleans(),
    cull_connected=st.booleans(),
)
def test_culled_exactly_when_idle_long_enough_and_not_protected(
    idle_s: float, limit: float, busy: bool, connections: int, cull_busy: bool, cull_connected: bool
) -> None:
    policy = CullPolicy(limit, cull_connected=cull_connected, cull_busy=cull_busy)
    culled = bool(kernels_to_cull(policy, [kernel(idle_s, busy=busy, connections=connections)], NOW))
    protected = (busy and not cull_busy) or (connections > 0 and not cull_connected)
    assert culled == (NOW - (NOW - idle_s) >= limit and not protected)
