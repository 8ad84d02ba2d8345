"""Mixed runs (notebooks plus BE apps, ``tandem sim --policies notebookos,notebookos+be``): the
coupling invariants on a short synthetic trace."""

from __future__ import annotations

import bisect

import pytest

from shared.arbiter import GpuSlot
from shared.simulator.be import POLICIES, BeSimParams, StepTimeline, run_be
from shared.simulator.cli import BE_POLICIES, MIXED_POLICY, load_trace, run_sim
from shared.simulator.engine import Simulator
from shared.simulator.mixed import CommittedRecorder, MixedResult, run_be_on_cells
from shared.simulator.params import SimParams
from shared.simulator.results import summarize_run
from shared.workload.be_model import MODELS, BeApp, BeJob, BeWorkload

DAYS = 0.3
SEED = 1


@pytest.fixture(scope="module")
def mixed_run() -> tuple[CommittedRecorder, MixedResult, list[tuple[float, frozenset[GpuSlot]]], float]:
    trace, window = load_trace("synthetic-idlt", DAYS, SEED)
    recorder = CommittedRecorder()
    Simulator(trace, "notebookos", SimParams(), seed=SEED, gpu_recorder=recorder).run()
    leased: list[tuple[float, frozenset[GpuSlot]]] = []
    result = run_be_on_cells(
        recorder, window, load=1.5, seed=SEED, observer=lambda t, s: leased.append((t, s))
    )
    return recorder, result, leased, window


def test_be_holds_only_gpus_no_cell_holds_at_every_instant(mixed_run) -> None:  # type: ignore[no-untyped-def]
    recorder, result, leased, window = mixed_run
    assert result.be.gpu_seconds_allocated > 0 and result.be.cuts > 0  # cells did take leased GPUs
    timeline = recorder.timeline()
    times = [t for t, _ in leased]
    checked = 0
    for t in sorted({*times, *timeline.times}):
        if t > window:
            break
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            continue
        held = leased[i][1]
        usable = timeline.at(t)  # uncommitted GPUs of live hosts
        assert held <= usable, f"at {t}: BE holds {sorted(held - usable)} that a cell holds or no host has"
        checked += 1
    assert checked > 100


def test_utilization_accounting_adds_up(mixed_run) -> None:  # type: ignore[no-untyped-def]
    _, result, leased, window = mixed_run
    leased_s = sum(
        len(s) * (min(t2, window) - min(t, window))
        for (t, s), (t2, _) in zip(leased, [*leased[1:], (window, 0)], strict=True)
    )
    assert result.be.gpu_seconds_allocated <= leased_s + 1e-6 <= result.usable_gpu_s + 1e-6
    provisioned_h = (result.cell_gpu_s + result.usable_gpu_s) / 3600.0 + 1.0  # + a host still starting
    n = result.numbers(provisioned_h)
    parts = n["cell_gpu_hours"] + n["be_gpu_hours"] + n["idle_gpu_hours"]
    assert parts == pytest.approx(provisioned_h, abs=1e-3)
    assert n["idle_gpu_hours"] >= 0
    assert n["provisioned_gpu_utilization"] == pytest.approx(
        (n["cell_gpu_hours"] + n["be_gpu_hours"]) / provisioned_h, abs=1e-3
    )


def test_recorded_cell_gpu_time_matches_the_notebook_runs_allocated_hours() -> None:
    trace, window = load_trace("synthetic-idlt", DAYS, SEED)
    recorder = CommittedRecorder()
    run = Simulator(trace, "notebookos", SimParams(), seed=SEED, gpu_recorder=recorder).run()
    allocated_h = summarize_run(run, None, window).numbers["allocated_gpu_hours"]
    committed_s, _ = recorder.timeline().integrals(window)
    assert committed_s / 3600.0 == pytest.approx(allocated_h, rel=0.01)


def test_be_changes_no_notebook_figure_and_the_json_has_the_mixed_keys() -> None:
    trace, window = load_trace("synthetic-idlt", 0.1, SEED)
    _, summaries = run_sim(
        trace, ["notebookos", MIXED_POLICY], seed=SEED, window_end_s=window, progress=False, be_load=1.0
    )
    alone, mixed = summaries["notebookos"].numbers, summaries[MIXED_POLICY].numbers
    assert mixed["interactivity_delay_p99_s"] == alone["interactivity_delay_p99_s"]
    assert mixed["gpu_hours"] == alone["gpu_hours"]
    assert mixed["provisioned_gpu_utilization"] > alone["provisioned_gpu_utilization"]
    assert mixed["be_gpu_hours"] > 0 and mixed["be_rho_by_app"]
    assert mixed["be_max_rho"] == max(mixed["be_rho_by_app"].values())


def test_a_cell_ends_a_lease_at_once_within_the_round_and_the_job_loses_its_partial_step() -> None:
    model = MODELS["resnet50"]
    app = BeApp("solo", 0.0, (BeJob("solo-j", model, round(7200 / model.seconds_per_iteration), 1),))
    gpu = GpuSlot("h000", 0)
    # the GPU is BE-usable until a cell takes it mid-round (rounds every 60 s) and mid-step, back at 200 s
    cut = 90.0 + model.seconds_per_iteration / 2
    timeline = StepTimeline(((0.0, frozenset({gpu})), (cut, frozenset()), (200.0, frozenset({gpu}))))
    seen: list[tuple[float, frozenset[GpuSlot]]] = []
    result = run_be(
        BeWorkload((app,), "t"),
        "themis",
        params=BeSimParams(round_s=60.0),
        timeline=timeline,
        observer=lambda t, s: seen.append((t, s)),
    )
    assert (cut, frozenset()) in seen  # at the cell's instant, not at the next round (120 s)
    assert result.cuts == 1
    assert 0 < result.lost_gpu_seconds <= model.seconds_per_iteration
    # the lost half step is redone: BE GPU-time is the work plus what was lost
    (solo,) = result.apps
    assert solo.gpu_seconds == pytest.approx(result.gpu_seconds_allocated)
    assert result.gpu_seconds_allocated == pytest.approx(7200 + result.lost_gpu_seconds, rel=1e-3)


def test_the_cli_lists_the_be_simulators_policies() -> None:
    assert BE_POLICIES == POLICIES
