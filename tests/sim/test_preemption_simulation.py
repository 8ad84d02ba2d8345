"""A small FitGpp synthetic run (``shared.simulator.preemption_sim``): every policy finishes every
job without overcommitting a node (the run raises if it does), FIFO keeps the load it was built
for and never preempts, the preemptive policies serve TE jobs faster than FIFO, and a run is a
function of its seed."""

from __future__ import annotations

import numpy as np
import pytest

from shared.policies.preemption import POLICY_NAMES
from shared.simulator.preemption_calibration import loss_terms
from shared.simulator.preemption_sim import (
    BASELINES,
    PAPER_PREEMPTED_FRACTION,
    PAPER_RESCHEDULING_MIN,
    PAPER_SLOWDOWN,
    TE,
    TruncNormal,
    Workload,
    generate,
    percentiles,
    run_all,
)

PINNED = Workload.pinned()
SMALL = PINNED.scaled(4096)


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
    w = PINNED.scaled(20_000)
    assert (w.nodes, w.node_cpus, w.node_ram_gb, w.node_gpus) == (84, 32, 256, 8)
    assert (w.te_fraction, w.load, w.max_preemptions, w.s) == (0.3, 2.0, 1, 4.0)
    jobs = generate(w, seed=5)
    te = jobs.kind == TE
    assert te.mean() == pytest.approx(0.3, abs=0.02)
    assert jobs.runtime[te].max() <= 30 and jobs.runtime[~te].max() <= 24 * 60
    assert jobs.runtime.min() >= 1
    assert jobs.grace.min() >= 0 and jobs.grace.max() <= 20
    assert jobs.gpus.max() <= 8 and jobs.cpus.max() <= 32 and jobs.ram.max() <= 256
    assert np.all(np.diff(jobs.arrival) >= 0)


def test_a_workload_that_changes_a_stated_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match="paper states"):
        Workload(**{**_fields(PINNED), "te_runtime_min": TruncNormal(6.0, 2.0, 0.0, 30.0)})
    with pytest.raises(ValueError, match="paper states"):
        Workload(**{**_fields(PINNED), "grace_period_min": TruncNormal(3.0, 1.0, 0.0, 10.0)})


def _fields(w: Workload) -> dict:
    return {name: getattr(w, name) for name in w.__dataclass_fields__}


def test_the_pinned_workload_reproduces_the_papers_baseline_rows_on_a_quick_seed() -> None:
    """The open parameters were fitted to the FIFO, LRTP and RAND figures
    (scripts/calibrate_preemption.py); a quick 2^13-job seed stays near them. FitGpp's figures are
    the target and are not asserted here."""
    results = run_all(PINNED.scaled(2**13), seed=1, policies=BASELINES)
    fifo_te = percentiles(results["fifo"].te_slowdown)
    fifo_be = percentiles(results["fifo"].be_slowdown)
    for ours, paper in zip(fifo_te, PAPER_SLOWDOWN["fifo"]["te"], strict=True):
        assert ours == pytest.approx(paper, rel=TOLERANCE["fifo_te"])
    for ours, paper in zip(fifo_be, PAPER_SLOWDOWN["fifo"]["be"], strict=True):
        assert ours == pytest.approx(paper, rel=TOLERANCE["fifo_be"])
    for name in ("lrtp", "rand"):
        r = results[name]
        assert r.preempted_fraction == pytest.approx(
            PAPER_PREEMPTED_FRACTION[name], rel=TOLERANCE["preempted"]
        )
        te = percentiles(r.te_slowdown)
        assert te[0] == 1.0
        assert te[1] - 1 == pytest.approx(PAPER_SLOWDOWN[name]["te"][1] - 1, abs=TOLERANCE["te_p95_excess"])
        be_p50 = percentiles(r.be_slowdown)[0]
        assert be_p50 == pytest.approx(PAPER_SLOWDOWN[name]["be"][0], rel=TOLERANCE["be_p50"])


# What the fit reached (configs/preemption_sim.toml's header; this seed: FIFO TE 8.0/27.5/30.3 vs
# 9.38/33.4/48.5, BE 2.80/4.56/6.27 vs 2.78/4.89/8.21; preempted 8.8%/7.7% vs 9.6%/9.7%; LRTP/RAND
# TE p95 1.36/1.38 vs 1.17, the figure the fit misses most; BE p50 3.41/3.29 vs 3.78/3.87), with
# room for a change of the sim's mechanics to show as a failure rather than noise.
TOLERANCE = {"fifo_te": 0.45, "fifo_be": 0.3, "preempted": 0.3, "te_p95_excess": 0.25, "be_p50": 0.25}


def test_a_run_is_a_function_of_its_seed() -> None:
    small = PINNED.scaled(1024)
    a, b = run_all(small, seed=9), run_all(small, seed=9)
    for name in POLICY_NAMES:
        assert np.array_equal(a[name].te_slowdown, b[name].te_slowdown)
        assert np.array_equal(a[name].be_slowdown, b[name].be_slowdown)
        assert a[name].preemptions == b[name].preemptions


def test_the_calibration_loss_is_zero_at_the_papers_baseline_figures_and_never_reads_fitgpps() -> None:
    paper: dict[str, float] = {}
    for name in BASELINES:
        for kind in ("te", "be"):
            for q, v in zip((50, 95, 99), PAPER_SLOWDOWN[name][kind], strict=True):
                paper[f"{kind}_p{q}_{name}"] = v
        if name != "fifo":
            paper[f"preempted_fraction_{name}"] = PAPER_PREEMPTED_FRACTION[name]
            for q, v in zip((50, 75, 95, 99), PAPER_RESCHEDULING_MIN[name], strict=True):
                paper[f"resched_p{q}_{name}"] = v
    terms = loss_terms(paper)  # a KeyError here would mean the loss reads a figure beyond these
    assert sum(terms.values()) == pytest.approx(0.0, abs=1e-12)
    assert not any("fitgpp" in key for key in terms)
    assert loss_terms(paper | {"preempted_fraction_lrtp": 0.2})["preempted_fraction_lrtp"] > 0
