"""The IDLT generator reproduces the published AdobeTrace statistics, deterministically."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from shared.workload.idlt import (
    DAY,
    PUBLISHED_DURATION_QUANTILES,
    PUBLISHED_IAT_QUANTILES,
    PUBLISHED_MIN_IAT_S,
    IdltParams,
    QuantileFunction,
    excerpt_17_5h,
    generate,
    generate_with_stats,
)
from shared.workload.metrics import level_on_grid
from shared.workload.model import Session, Task, Trace


@pytest.fixture(scope="module")
def summer() -> Trace:
    """The full 92-day summer (June-August) at the default parameters."""
    return generate(92, seed=7)


def _active(trace: Trace, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sessions = level_on_grid([(s.start_s, s.end_s, 1.0) for s in trace.sessions], grid)
    ones = np.ones(trace.n_tasks)
    trainings = level_on_grid(np.c_[trace.task_submit_s, trace.task_end_s, ones], grid)
    return sessions, trainings


def test_task_duration_quantiles_match_published(summer: Trace) -> None:
    for p, published in PUBLISHED_DURATION_QUANTILES.items():
        got = np.quantile(summer.task_duration_s, p)
        assert got == pytest.approx(published, rel=0.03), f"p{p * 100:g}"


def test_iat_quantiles_match_published_and_min_is_respected(summer: Trace) -> None:
    iats = summer.iats_s()
    assert len(iats) > 100_000
    for p, published in PUBLISHED_IAT_QUANTILES.items():
        assert np.quantile(iats, p) == pytest.approx(published, rel=0.04), f"p{p * 100:g}"
    assert iats.min() >= PUBLISHED_MIN_IAT_S


def test_durations_follow_the_fitted_distribution(summer: Trace) -> None:
    """KS test of the generated durations against the quantile function they were drawn from."""
    q = IdltParams().duration
    sample = np.random.default_rng(0).choice(summer.task_duration_s, 5000, replace=False)
    assert stats.kstest(sample, q.cdf).pvalue > 1e-3


def test_tasks_of_a_session_never_overlap(summer: Trace) -> None:
    # Trace validates this on construction; check the margin the generator promises too.
    order = np.lexsort((summer.task_submit_s, summer.task_session))
    same = summer.task_session[order][1:] == summer.task_session[order][:-1]
    gap = summer.task_submit_s[order][1:] - summer.task_end_s[order][:-1]
    assert gap[same].min() >= IdltParams().min_think_s - 1e-6


def test_summer_concurrency_roughly_as_published(summer: Trace) -> None:
    """Appendix E.1 / Figure 20: sessions 206/312/397 at month ends, mean trainings 67.63 (max 141)."""
    grid = np.arange(0, 92 * DAY, 900.0)
    sessions, trainings = _active(summer, grid)
    at = lambda d: sessions[int(d * DAY / 900.0) - 1]  # noqa: E731
    assert at(30) == pytest.approx(206, rel=0.2)
    assert at(61) == pytest.approx(312, rel=0.2)
    assert at(92) == pytest.approx(397, rel=0.2)
    assert 330 <= sessions.max() <= 520  # published 433
    assert trainings.mean() == pytest.approx(67.63, rel=0.15)
    assert 100 <= trainings.max() <= 190  # published 141
    june, aug = trainings[grid < 30 * DAY].mean(), trainings[grid >= 61 * DAY].mean()
    assert june == pytest.approx(31, rel=0.25) and aug == pytest.approx(105, rel=0.25)


def test_excerpt_rises_to_about_90_sessions_and_20_trainings() -> None:
    """§5.3: 0 -> 87 sessions (max 90); trainings mean 19.5, max 34. Averaged over seeds."""
    grid = np.arange(0, 17.5 * 3600, 60.0)
    rows = []
    for seed in range(12):
        sessions, trainings = _active(excerpt_17_5h(seed), grid)
        assert sessions[0] <= 15
        rows.append((sessions[-1], sessions.max(), trainings.mean(), trainings.max()))
    end, peak, mean_tr, max_tr = np.mean(rows, axis=0)
    assert 75 <= end <= 100 and 75 <= peak <= 105
    assert mean_tr == pytest.approx(19.5, rel=0.25)
    assert max_tr == pytest.approx(34, rel=0.3)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a, b, c = generate(5, seed=3), generate(5, seed=3), generate(5, seed=4)
    assert a.sessions == b.sessions
    for col in ("task_session", "task_submit_s", "task_duration_s", "task_gpus"):
        assert np.array_equal(getattr(a, col), getattr(b, col))
    assert a.sessions != c.sessions


def test_gpu_requests_are_1_to_8_and_skewed_to_one(summer: Trace) -> None:
    gpus = np.array([s.gpus for s in summer.sessions])
    assert gpus.min() >= 1 and gpus.max() <= 8
    assert np.mean(gpus == 1) > 0.4
    assert np.array_equal(summer.task_gpus, gpus[summer.task_session])
    assert all(s.resources.gpus == s.gpus for s in summer.sessions)


def test_ninety_days_generate_with_few_clamped_gaps() -> None:
    # how long generation takes is the simulator benchmark's business (a timing is no assertion)
    trace, st_ = generate_with_stats(90, seed=11)
    assert trace.n_tasks > 300_000
    assert st_.gaps_clamped / st_.gaps_total < 0.05


def test_params_are_overridable() -> None:
    quiet = replace(IdltParams(), session_rate=((0.0, 1.0),), idle_fraction=0.0, gpu_weights=((8, 1.0),))
    trace = generate(2, seed=1, params=quiet)
    assert {s.gpus for s in trace.sessions} == {8}
    assert 20 <= len(trace.sessions) <= 80


@pytest.mark.parametrize(
    "change",
    [
        {"rho": 1.0},
        {"idle_fraction": 1.0},
        {"session_rate": ((1.0, 2.0),)},
        {"gpu_weights": ((9, 1.0),)},
        {"lifetime_mix": ((1.0, 0.0),)},
    ],
)
def test_bad_params_are_named(change: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(change))):
        replace(IdltParams(), **change)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50))
def test_quantile_function_is_exact_at_knots_and_inverts(us: list[float]) -> None:
    q = IdltParams().duration
    for p, v in q.knots:
        assert float(q(p)) == pytest.approx(v, rel=1e-12)
    u = np.array(us)
    assert np.allclose(q.cdf(q(u)), u, atol=1e-9)
    assert np.all(np.diff(q(np.sort(u))) >= 0)


def test_quantile_function_mean_matches_sampling() -> None:
    q = IdltParams().iat
    sample = q(np.random.default_rng(1).random(400_000))
    assert sample.mean() == pytest.approx(q.mean(), rel=0.03)


@pytest.mark.parametrize(
    "knots", [((0.1, 1.0), (1.0, 2.0)), ((0.0, 2.0), (1.0, 1.0)), ((0.0, 0.0), (1.0, 1.0))]
)
def test_bad_quantile_knots_rejected(knots: tuple) -> None:
    with pytest.raises(ValueError, match=r"knots|> 0"):
        QuantileFunction(knots)


# -- the data model's validation names the problem --------------------------------------------


def test_session_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match=r"'a'.*gpus must be an integer 1\.\.8"):
        Session("a", 0.0, 10.0, 9)
    with pytest.raises(ValueError, match=r"'a'.*ends at 1.0 before"):
        Session("a", 5.0, 1.0, 1)
    with pytest.raises(ValueError, match="duration must be > 0"):
        Task("a", 0.0, 0.0, 1)


@pytest.mark.parametrize(
    ("tasks", "why"),
    [
        ([Task("a", -1.0, 5.0, 1)], "before its session starts"),
        ([Task("a", 95.0, 10.0, 1)], "past its session's end"),
        ([Task("a", 0.0, 10.0, 3)], "more GPUs than its session"),
        ([Task("a", 0.0, 10.0, 1), Task("a", 5.0, 10.0, 1)], "previous task ends"),
    ],
)
def test_trace_validation_names_the_task(tasks: list[Task], why: str) -> None:
    sessions = [Session("a", 0.0, 100.0, 2)]
    with pytest.raises(ValueError, match=why):
        Trace.from_tasks(sessions, tasks)


def test_trace_rejects_duplicate_sessions_and_unknown_ids() -> None:
    with pytest.raises(ValueError, match="duplicate session id 'a'"):
        Trace.from_tasks([Session("a", 0, 1, 1), Session("a", 0, 1, 1)], [])
    with pytest.raises(ValueError, match="unknown session 'b'"):
        Trace.from_tasks([Session("a", 0, 1, 1)], [Task("b", 0.0, 1.0, 1)])


def test_trace_sorts_tasks_and_yields_objects() -> None:
    sessions = [Session("a", 0.0, 100.0, 1), Session("b", 0.0, 100.0, 2)]
    trace = Trace.from_tasks(sessions, [Task("b", 50.0, 5.0, 2), Task("a", 10.0, 5.0, 1)])
    assert [t.session_id for t in trace.tasks()] == ["a", "b"]
    assert trace.task(1) == Task("b", 50.0, 5.0, 2)
    assert not trace.task_submit_s.flags.writeable


def test_interval_views_feed_the_metrics() -> None:
    from shared.workload.metrics import gpu_hours

    sessions = [Session("a", 0.0, 7200.0, 2), Session("b", 0.0, 3600.0, 4)]
    trace = Trace.from_tasks(sessions, [Task("a", 0.0, 1800.0, 2), Task("b", 100.0, 3600.0 - 100.0, 4)])
    assert gpu_hours(trace.session_intervals()) == pytest.approx(2 * 2 + 4 * 1)
    assert gpu_hours(trace.task_intervals()) == pytest.approx(2 * 0.5 + 4 * 3500 / 3600)
    assert Trace.from_tasks([], []).session_intervals().shape == (0, 3)
