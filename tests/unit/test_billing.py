"""The paper's billing model (§5.5.1) and its worked numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.workload.billing import (
    Rates,
    Usage,
    UsageKind,
    cumulative_on_grid,
    provider_cost,
    reservation_price_per_hour,
    revenue,
    standby_price_per_hour,
    summarize,
    training_price_per_hour,
)

PAPER = Rates()  # $10/h 8-GPU VM, 1.15x, standby 12.5%
H = 3600.0


def test_paper_worked_numbers() -> None:
    assert standby_price_per_hour(PAPER) == pytest.approx(1.4375)
    assert round(standby_price_per_hour(PAPER), 2) == 1.44
    assert training_price_per_hour(PAPER, 4) == pytest.approx(5.75)
    assert reservation_price_per_hour(PAPER, 8) == pytest.approx(11.5)


def test_reservation_of_one_full_vm_for_a_day() -> None:
    usage = [Usage(0, 24 * H, UsageKind.RESERVED, 8)]
    s = summarize(usage, [(0, 24 * H, 1)], PAPER)
    assert s.cost == pytest.approx(240.0)
    assert s.revenue == pytest.approx(276.0)
    assert s.profit == pytest.approx(36.0)
    assert s.margin == pytest.approx(0.15 / 1.15)


def test_notebookos_kernel_training_then_idle() -> None:
    # One 4-GPU training hour with two standbys, then one idle hour with three standbys.
    usage = [
        Usage(0, H, "training", 4),
        Usage(0, H, "standby", 2),
        Usage(H, 2 * H, "standby", 3),
    ]
    assert revenue(usage, PAPER) == pytest.approx(5.75 + 2 * 1.4375 + 3 * 1.4375)


def test_rates_are_configurable() -> None:
    rates = Rates(vm_rate_per_hour=24.48, gpus_per_vm=8, markup=1.3, standby_fraction=0.1)
    assert training_price_per_hour(rates, 2) == pytest.approx(24.48 / 8 * 2 * 1.3)
    assert standby_price_per_hour(rates) == pytest.approx(24.48 * 1.3 * 0.1)


def test_no_revenue_margin_is_nan_and_bad_input_rejected() -> None:
    assert math.isnan(summarize([], [(0, H, 1)], PAPER).margin)
    with pytest.raises(ValueError, match="gpus_per_vm"):
        Rates(gpus_per_vm=0)
    with pytest.raises(ValueError, match="start <= end"):
        Usage(5, 1, "training", 1)
    with pytest.raises(ValueError):
        Usage(0, 1, "sleeping", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="server interval"):
        provider_cost([(5, 1, 1)], PAPER)


def test_cumulative_timeline_ends_at_the_totals() -> None:
    usage = [Usage(0, 2 * H, "training", 8), Usage(H, 3 * H, "standby", 3)]
    servers = [(0.0, 3 * H, 2.0)]
    grid = np.arange(0, 3 * H + 1, 900.0)
    cost, rev = cumulative_on_grid(grid, usage, servers, PAPER)
    assert cost[-1] == pytest.approx(provider_cost(servers, PAPER))
    assert rev[-1] == pytest.approx(revenue(usage, PAPER))
    assert np.all(np.diff(cost) >= 0) and np.all(np.diff(rev) >= 0)


@given(
    st.lists(
        st.tuples(st.floats(0, 1e5), st.floats(0, 1e5), st.sampled_from(list(UsageKind)), st.integers(0, 8)),
        max_size=20,
    )
)
def test_revenue_is_markup_times_cost_of_the_gpus_used(
    rows: list[tuple[float, float, UsageKind, int]],
) -> None:
    """Training/reserved GPU-hours are billed at exactly 1.15x their share of the VM rate."""
    usage = [Usage(a, a + d, k, n) for a, d, k, n in rows if k is not UsageKind.STANDBY]
    gpu_hours = sum((u.end_s - u.start_s) * u.units for u in usage) / H
    assert revenue(usage, PAPER) == pytest.approx(gpu_hours * PAPER.gpu_rate_per_hour * 1.15, abs=1e-6)
