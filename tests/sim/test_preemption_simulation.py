"""A small FitGpp synthetic run (``shared.simulator.preemption_sim``): every policy finishes every
job without overcommitting a node (the run raises if it does), FIFO keeps the load it was built
for and never preempts, the preemptive policies serve TE jobs faster than FIFO, and a run is a
function of its seed."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import numpy as np
import pytest

from shared.policies.preemption import POLICY_NAMES, make_policy
from shared.simulator.preemption_calibration import loss_terms
from shared.simulator.preemption_sim import (
    BASELINES,
    BE,
    PAPER_PREEMPTED_FRACTION,
    PAPER_RESCHEDULING_MIN,
    PAPER_SLOWDOWN,
    PINNED_CONFIG,
    TE,
    TE_STARTS,
    Jobs,
    TruncNormal,
    Workload,
    generate,
    percentiles,
    run_all,
    run_policy,
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


def _two_full_nodes_then_a_te_job() -> Jobs:
    """Two 8-GPU nodes, each filled by one BE job (A: 100 min, GP 10; B: ends at minute 3, GP 15);
    a TE job of 8 GPUs and 5 min arrives at minute 1, finds no room and preempts A (shorter GP)."""

    def col(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return Jobs(
        kind=col(BE, BE, TE),
        arrival=col(0, 0, 1),
        runtime=col(100, 3, 5),
        grace=col(10, 15, 0),
        gpus=col(8, 8, 8),
        cpus=col(1, 1, 1),
        ram=col(1, 1, 1),
    )


@pytest.mark.parametrize("policy", ["fitgpp", "lrtp"])
def test_a_te_job_that_preempted_starts_at_the_first_room_unless_bound_to_its_victims_node(
    policy: str,
) -> None:
    """The reading of where a preempting TE job starts (docs/preemption.md): "first_room" takes B's
    node when B ends at minute 3, before A's 10-minute GP ends; "victims_node" waits for A."""
    jobs = _two_full_nodes_then_a_te_job()
    slowdown = {}
    for te_start in TE_STARTS:
        w = replace(PINNED, nodes=2, jobs=3, te_start=te_start)
        r = run_policy(w, jobs, make_policy(policy))
        assert r.preemptions == 1
        slowdown[te_start] = (float(r.te_slowdown[0]), r.te_started_before_victims)
    assert slowdown["first_room"] == (pytest.approx((3 + 5 - 1) / 5), 1)  # started at minute 3
    assert slowdown["victims_node"] == (pytest.approx((11 + 5 - 1) / 5), 0)  # at A's GP end, minute 11


def test_the_te_start_reading_is_read_from_the_config_and_checked() -> None:
    with PINNED_CONFIG.open("rb") as f:
        raw = tomllib.load(f)
    assert Workload.from_open(raw).te_start == raw.get("te_start", TE_STARTS[0])
    assert Workload.from_open(raw | {"te_start": "victims_node"}).te_start == "victims_node"
    with pytest.raises(ValueError, match="te_start"):
        replace(PINNED, te_start="anywhere")


def test_under_the_default_reading_te_jobs_wait_longer_with_longer_gps_unless_s_is_large() -> None:
    """§4.3 (Figs. 4 and 7): TE slowdowns grow with the GP length ("8.0": every GP x 8) and a large
    s counters it. The "first_room" reading loses both (p95 within ~0.1 of each other: the reason
    it is not the default); "victims_node" keeps them."""
    w = PINNED.scaled(2**13)
    assert w.te_start == "victims_node"
    jobs = generate(w, seed=1)
    p95 = {}
    for gp_scale in (1, 8):
        scaled = replace(jobs, grace=jobs.grace * gp_scale)
        for s in (0.0, 4.0):
            p95[gp_scale, s] = percentiles(run_policy(w, scaled, make_policy("fitgpp", s=s)).te_slowdown)[1]
    assert p95[8, 4.0] > p95[1, 4.0] + 0.3
    assert p95[8, 0.0] > p95[8, 4.0] + 1.0
    assert p95[1, 0.0] > p95[1, 4.0]
