"""A small FitGpp synthetic run (``shared.simulator.preemption_sim``): every policy finishes every
job without overcommitting a node (the run raises if it does), FIFO keeps the load it was built
for and never preempts, the preemptive policies serve TE jobs faster than FIFO, and a run is a
function of its seed."""

from __future__ import annotations

import numpy as np
import pytest

from shared.policies.preemption import POLICY_NAMES
from shared.simulator.preemption_sim import TE, Workload, generate, percentiles, run_all

SMALL = Workload().scaled(4096)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_all(SMALL, seed=3)


def test_every_policy_completes_every_job_with_slowdown_at_least_one(results: dict) -> None:
    assert set(results) == set(POLICY_NAMES)
    for r in results.values():
        slowdowns = np.concatenate([r.te_slowdown, r.be_slowdown])
        assert slowdowns.size == SMALL.jobs
        assert np.all(np.isfinite(slowdowns))
        assert slowdowns.min() >= 1.0


def test_fifo_keeps_the_load_it_was_built_for_and_never_preempts(results: dict) -> None:
    fifo = results["fifo"]
    assert fifo.load == pytest.approx(SMALL.load, abs=0.05)
    assert fifo.preemptions == 0


def test_preemption_serves_te_jobs_faster_than_fifo(results: dict) -> None:
    fifo_te_p95 = percentiles(results["fifo"].te_slowdown)[1]
    for name in ("lrtp", "rand", "fitgpp"):
        assert percentiles(results[name].te_slowdown)[1] < fifo_te_p95
        assert results[name].preemptions > 0  # the run exercises the policy, not only free room
        assert results[name].over_budget_preemptions <= results[name].preemptions


def test_the_workload_has_the_papers_stated_shape() -> None:
    jobs = generate(Workload().scaled(20_000), seed=5)
    te = jobs.kind == TE
    assert te.mean() == pytest.approx(0.3, abs=0.02)
    assert jobs.runtime[te].max() <= 30 and jobs.runtime[~te].max() <= 24 * 60
    assert jobs.runtime.min() >= 3
    assert jobs.grace.min() >= 0 and jobs.grace.max() <= 20
    assert jobs.gpus.min() >= 1 and jobs.gpus.max() <= 8
    assert np.all(np.diff(jobs.arrival) >= 0)


def test_a_run_is_a_function_of_its_seed() -> None:
    small = Workload().scaled(1024)
    a, b = run_all(small, seed=9), run_all(small, seed=9)
    for name in POLICY_NAMES:
        assert np.array_equal(a[name].te_slowdown, b[name].te_slowdown)
        assert np.array_equal(a[name].be_slowdown, b[name].be_slowdown)
        assert a[name].preemptions == b[name].preemptions
