"""Which idle kernels hibernate (shared/policies/hibernation.py): past ``after_s`` and not busy,
connected or not; never with the policy off."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.policies.culling import KernelActivity
from shared.policies.hibernation import HibernatePolicy, kernels_to_hibernate


def _kernel(kernel_id: str, idle: float, *, busy: bool = False, connections: int = 0) -> KernelActivity:
    return KernelActivity(kernel_id, 1000.0 - idle, busy, connections)


def test_an_idle_kernel_hibernates_even_with_a_client_connected() -> None:
    decisions = kernels_to_hibernate(HibernatePolicy(60), [_kernel("k", 61, connections=2)], 1000.0)
    assert [d.kernel_id for d in decisions] == ["k"]
    assert "kernel.hibernate_after_s = 60" in decisions[0].reason


def test_a_busy_kernel_never_hibernates() -> None:
    assert kernels_to_hibernate(HibernatePolicy(60), [_kernel("k", 600, busy=True)], 1000.0) == []


def test_a_recently_active_kernel_stays() -> None:
    assert kernels_to_hibernate(HibernatePolicy(60), [_kernel("k", 59)], 1000.0) == []


@given(st.lists(st.floats(min_value=0, max_value=1e6), max_size=5))
def test_zero_turns_hibernation_off(idles: list[float]) -> None:
    kernels = [_kernel(f"k{i}", idle) for i, idle in enumerate(idles)]
    assert kernels_to_hibernate(HibernatePolicy(0), kernels, 1000.0) == []
