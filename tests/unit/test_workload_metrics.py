"""Metric helpers: percentiles, CDFs, GPU-hours, step curves on a grid, commit fractions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.workload.metrics import (
    cdf_points,
    gpu_hours,
    immediate_commit_fraction,
    immediate_fraction_from_delays,
    level_on_grid,
    percentiles,
    provisioned_vs_oracle,
    step_integral_hours,
)

H = 3600.0
intervals = st.lists(
    st.tuples(st.integers(0, 100), st.integers(0, 50), st.integers(0, 8)).map(
        lambda t: (float(t[0]), float(t[0] + t[1]), float(t[2]))
    ),
    max_size=30,
)


def test_percentiles_and_cdf() -> None:
    assert percentiles(range(1, 101), (50, 99)) == {50.0: 50.5, 99.0: pytest.approx(99.01)}
    x, y = cdf_points([3, 1, 2, 2])
    assert x.tolist() == [1, 2, 2, 3] and y.tolist() == [0.25, 0.5, 0.75, 1.0]
    x, y = cdf_points(np.arange(1000), max_points=11)
    assert len(x) == 11 and y[-1] == 1.0 and x[0] == 0
    with pytest.raises(ValueError, match="empty"):
        percentiles([])


def test_gpu_hours() -> None:
    assert gpu_hours([(0, H, 4), (H, 1.5 * H, 2)]) == pytest.approx(5.0)
    assert gpu_hours([]) == 0.0
    with pytest.raises(ValueError, match="interval #1"):
        gpu_hours([(0, 1, 1), (2, 1, 1)])


@settings(max_examples=60, deadline=None)
@given(intervals, st.lists(st.integers(-5, 160), min_size=1, max_size=20))
def test_level_on_grid_matches_brute_force(ivs: list[tuple[float, float, float]], ts: list[int]) -> None:
    grid = np.array(ts, dtype=float)
    brute = [sum(w for a, b, w in ivs if a <= t < b) for t in grid]
    assert np.allclose(level_on_grid(ivs, grid), brute)


@settings(max_examples=60, deadline=None)
@given(intervals)
def test_step_integral_of_level_equals_gpu_hours(ivs: list[tuple[float, float, float]]) -> None:
    grid = np.arange(0.0, 200.0, 1.0)  # integer endpoints all land on the grid: exact
    assert step_integral_hours(grid, level_on_grid(ivs, grid)) == pytest.approx(gpu_hours(ivs))


def test_provisioned_vs_oracle_regions() -> None:
    grid = np.arange(0, 4 * H + 1, 60.0)
    training = [(0, H, 4), (2 * H, 3 * H, 8)]
    provisioned = [(0, 4 * H, 8)]
    reservation = [(0, 4 * H, 16)]
    r = provisioned_vs_oracle(grid, provisioned, training, reservation)
    assert r.oracle_gpu_hours == pytest.approx(12.0)
    assert r.provisioned_gpu_hours == pytest.approx(32.0)
    assert r.over_provisioned_gpu_hours == pytest.approx(20.0)
    assert r.saved_vs_reservation_gpu_hours == pytest.approx(32.0)
    assert provisioned_vs_oracle(grid, provisioned, training).saved_vs_reservation_gpu_hours is None


def test_immediate_commit_fraction() -> None:
    assert immediate_commit_fraction([True] * 896 + [False] * 104) == pytest.approx(0.896)
    assert immediate_fraction_from_delays([0, 0, 0.5, 3], tolerance_s=0.5) == 0.75
    with pytest.raises(ValueError, match="no requests"):
        immediate_commit_fraction([])


def test_step_integral_rejects_bad_grid() -> None:
    with pytest.raises(ValueError, match="increasing"):
        step_integral_hours([0, 0, 1], [1, 1, 1])
