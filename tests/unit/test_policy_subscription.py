"""Cluster-wide dynamic SR limit and watermarks (NotebookOS §3.4.1)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.policies.placement import HostView, cluster_subscription_ratio
from shared.policies.subscription import SubscriptionTotals, dynamic_limit


def test_paper_worked_example_four_kernels_of_four_gpus_on_an_8_gpu_host() -> None:
    totals = SubscriptionTotals.of([HostView("H", 8, subscribed_gpus=4 * 4)])
    assert totals.ratio == pytest.approx(0.667, abs=1e-3)


def test_totals_ignore_dead_hosts_and_match_placement_figure() -> None:
    hosts = [
        HostView("a", 8, subscribed_gpus=12),
        HostView("b", 8, subscribed_gpus=6, alive=False),
        HostView("c", 4),
    ]
    totals = SubscriptionTotals.of(hosts)
    assert (totals.subscribed_gpus, totals.gpus) == (12, 12)
    assert totals.ratio == pytest.approx(cluster_subscription_ratio(hosts))


def test_dynamic_limit_counts_the_new_kernel_and_is_clamped() -> None:
    totals = SubscriptionTotals(subscribed_gpus=48, gpus=16)  # ratio 1.0
    assert dynamic_limit(totals, request_gpus=4) == pytest.approx(60 / 48)
    assert dynamic_limit(SubscriptionTotals(0, 16), request_gpus=1) == 1.0  # floor
    assert dynamic_limit(SubscriptionTotals(200, 16), request_gpus=1, ceiling=3.0) == 3.0
    assert dynamic_limit(SubscriptionTotals(0, 0), request_gpus=1) == 3.0  # no GPUs: inf, clamped


@given(s=st.integers(0, 500), g=st.integers(1, 200), req=st.integers(0, 8))
def test_dynamic_limit_within_bounds_and_monotone(s: int, g: int, req: int) -> None:
    t = SubscriptionTotals(s, g)
    lim = dynamic_limit(t, request_gpus=req)
    assert 1.0 <= lim <= 3.0
    assert dynamic_limit(SubscriptionTotals(s + 1, g), request_gpus=req) >= lim
