"""The fluid processor-sharing reference for finish-time fairness (shared.simulator.be_reference)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.simulator.be_reference import fluid_ps_rho, water_fill
from shared.workload.be_model import MODELS, BeApp, BeJob, BeWorkload

_MODEL = MODELS["resnet50"]  # 0.6 s per iteration


def _app(app_id: str, at: float, *jobs: tuple[int, int]) -> BeApp:
    """Jobs as (iterations, max_gpus)."""
    return BeApp(app_id, at, tuple(BeJob(f"{app_id}-j{i}", _MODEL, it, g) for i, (it, g) in enumerate(jobs)))


def test_identical_apps_sharing_the_cluster_from_the_start_have_rho_one() -> None:
    apps = tuple(_app(f"a{i}", 0.0, (6000, 4)) for i in range(2))
    rho = fluid_ps_rho(BeWorkload(apps, "t"), 4)
    assert rho == pytest.approx({"a0": 1.0, "a1": 1.0})


def test_a_later_arrival_under_sharing_stays_at_or_below_rho_one() -> None:
    """Jensen: with R / N(t) GPUs each, an app whose parallelism never binds finishes by T_id."""
    apps = (_app("early", 0.0, (12000, 8)), _app("late", 600.0, (3000, 8)), _app("last", 900.0, (6000, 8)))
    rho = fluid_ps_rho(BeWorkload(apps, "t"), 8)
    assert set(rho) == {"early", "late", "last"}
    assert max(rho.values()) <= 1.0 + 1e-9


def test_an_apps_own_straggler_pushes_its_rho_above_one_even_alone() -> None:
    """T_id assumes the app's work parallelises over min(R, demand) GPUs; one long job cannot."""
    (rho,) = fluid_ps_rho(BeWorkload((_app("a", 0.0, (3000, 1), (1000, 1)),), "t"), 2).values()
    assert rho == pytest.approx(3000 / 2000)


@given(
    st.floats(min_value=0.0, max_value=100.0),
    st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=1, max_size=8),
)
def test_water_fill_never_exceeds_a_cap_and_hands_out_all_it_can(total: float, caps: list[float]) -> None:
    out = water_fill(total, caps)
    assert all(0.0 <= o <= c + 1e-9 for o, c in zip(out, caps, strict=True))
    assert sum(out) == pytest.approx(min(total, sum(caps)), abs=1e-6)
