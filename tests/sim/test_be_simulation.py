"""The BE simulator: Themis and the baselines on small Workload-1-like traces (each run < 10 s)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from shared.arbiter.reports import APP_SUCCESSIVE_HALVING
from shared.simulator.be import (
    POLICIES,
    THEMIS_64,
    BeSimParams,
    StepTimeline,
    cluster,
    main,
    run_be,
)
from shared.workload.be_model import MODELS, BeApp, BeJob, BeWorkload
from shared.workload.be_trace_csv import read_be_trace_csv
from shared.workload.themis_workload import ThemisWorkloadParams, generate_themis_workload


def _small(seed: int = 0, halving: float = 0.0) -> BeWorkload:
    return generate_themis_workload(
        ThemisWorkloadParams(
            n_apps=8,
            jobs_min=4,
            jobs_max=12,
            work_scale=0.02,
            arrival_span_s=3 * 3600.0,
            halving_fraction=halving,
            seed=seed,
        )
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_finishes_every_app_without_double_booking(policy: str) -> None:
    result = run_be(_small(), policy, THEMIS_64[:8])
    assert result.finished
    assert all(a.rho > 0 for a in result.apps)
    total_work = sum(a.budget_gpu_s for a in _small().apps)
    # Placement slowdowns only add GPU time; nothing runs for free.
    assert result.gpu_seconds_allocated >= total_work * 0.999
    assert 0 < result.utilization <= 1.0 + 1e-9


def test_same_inputs_give_the_same_run() -> None:
    a = run_be(_small(seed=3), "themis", THEMIS_64[:8])
    b = run_be(_small(seed=3), "themis", THEMIS_64[:8])
    assert [x.rho for x in a.apps] == [x.rho for x in b.apps]


def test_a_lone_single_gpu_job_has_rho_one() -> None:
    model = MODELS["resnet50"]
    app = BeApp("solo", 0.0, (BeJob("solo-j", model, 6000, 1),))
    result = run_be(BeWorkload((app,), "t"), "themis", (4,), BeSimParams(round_s=10.0))
    (solo,) = result.apps
    assert solo.rho == pytest.approx(1.0, abs=0.01)  # 3600 s of work on 1 GPU, alone
    assert solo.queueing_s == 0.0


def test_a_placement_sensitive_job_runs_slower_across_hosts() -> None:
    vgg = MODELS["vgg16"]
    app = BeApp("v", 0.0, (BeJob("v-j", vgg, 36000, 4),))
    packed = run_be(BeWorkload((app,), "t"), "gandiva", (4, 2, 2), BeSimParams(round_s=10.0))
    spread = run_be(BeWorkload((app,), "t"), "gandiva", (2, 2, 2, 2), BeSimParams(round_s=10.0))
    ratio = spread.makespan_s / packed.makespan_s
    assert ratio == pytest.approx(vgg.placement_sensitivity, rel=0.02)


def test_successive_halving_runs_the_worked_example_sweep_and_kills_the_worse_half() -> None:
    """§4.3.3's sweep alone on 16 GPUs: 8/16/36 iterations per phase; the losses keep the 100 s
    and 120 s jobs after phase 1 and the 100 s one after phase 2, so the app uses
    8 * (80 + 100 + 100 + 120) + 16 * (100 + 120) + 36 * 100 = 10,320 GPU-seconds."""
    times_losses = [(80.0, 0.9), (100.0, 0.1), (100.0, 0.8), (120.0, 0.2)]
    jobs = tuple(
        BeJob(f"j{i}", replace(MODELS["inception-v3"], seconds_per_iteration=t), 10**6, 8, loss)
        for i, (t, loss) in enumerate(times_losses)
    )
    app = BeApp("sh", 0.0, jobs, APP_SUCCESSIVE_HALVING, (8, 16, 36))
    result = run_be(BeWorkload((app,), "t"), "themis", (4, 4, 4, 4), BeSimParams(round_s=1.0))
    assert result.finished
    assert result.gpu_seconds_allocated == pytest.approx(10_320, rel=0.01)


def test_generated_halving_sweeps_finish() -> None:
    workload = _small(halving=1.0)
    assert any(a.app_type == APP_SUCCESSIVE_HALVING for a in workload.apps)
    assert run_be(workload, "themis", THEMIS_64[:8]).finished


def test_gpus_a_cell_takes_leave_the_be_pool() -> None:
    """A mixed-run timeline: half the GPUs go to cells for an hour; BE leases on them end."""
    everything = cluster((4, 4))
    half = frozenset(s for s in everything if s.host_id == "h000")
    timeline = StepTimeline(((0.0, everything), (1800.0, half), (5400.0, everything)))
    model = MODELS["inception-v3"]
    jobs = tuple(BeJob(f"j{i}", model, 20000, 1) for i in range(8))
    workload = BeWorkload((BeApp("a", 0.0, jobs),), "t")
    steady = run_be(workload, "themis", (4, 4))
    mixed = run_be(workload, "themis", params=BeSimParams(), timeline=timeline)
    assert mixed.makespan_s > steady.makespan_s
    assert mixed.usable_gpu_seconds < 8 * mixed.makespan_s


def test_themis_is_fairer_than_fifo_on_a_contended_trace() -> None:
    workload = _small(seed=1)
    themis = run_be(workload, "themis", THEMIS_64[:4])
    fifo = run_be(workload, "fifo", THEMIS_64[:4])
    assert themis.max_rho < fifo.max_rho


def test_csv_trace_replays() -> None:
    text = "app_id,job_id,submit_time,gpus,duration_s,model\nA,a1,0,1,600,vgg16\nA,a2,5,2,300,\n,b1,60,1,900,gnmt\n"
    workload = read_be_trace_csv(io.StringIO(text))
    result = run_be(workload, "tiresias", (2, 2))
    assert result.finished and len(result.apps) == 2


def test_cli_prints_one_json_line_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--apps",
            "3",
            "--work-scale",
            "0.01",
            "--arrival-span-h",
            "1",
            "--hosts",
            "4,4",
            "--policies",
            "themis,fifo",
            "--json",
        ]
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 2 and '"policy": "themis"' in lines[0]
