"""The Workload-1 generator's statistics and the BE trace CSV importer's errors."""

from __future__ import annotations

import io
import statistics

import pytest

from shared.workload.be_trace_csv import read_be_trace_csv
from shared.workload.themis_workload import ThemisWorkloadParams, generate_themis_workload, workload_stats
from shared.workload.trace_csv import TraceCsvError


def test_generator_matches_workload_1_statistics_over_seeds() -> None:
    stats = [workload_stats(generate_themis_workload(ThemisWorkloadParams(seed=s))) for s in range(5)]
    assert all(s["apps"] == 85 for s in stats)
    assert 65 <= statistics.median(s["median_jobs_per_app"] for s in stats) <= 85
    assert 2.5 <= statistics.median(s["median_task_gpu_hours"] for s in stats) <= 5.5
    nlp = statistics.mean(s["fraction_nlp"] for s in stats)
    speech = statistics.mean(s["fraction_speech"] for s in stats)
    cv = statistics.mean(s["fraction_cv"] for s in stats)
    assert nlp == pytest.approx(0.6, abs=0.08)
    assert speech == pytest.approx(0.3, abs=0.08)
    assert cv == pytest.approx(0.1, abs=0.06)


def test_workload_1_jobs_are_one_or_two_gpus_and_the_median_app_is_near_11_5_gpu_days() -> None:
    """Themis §6.2: "all jobs are either 1 or 2 GPU jobs"; §2.2: the median app 11.5 GPU-days."""
    workloads = [generate_themis_workload(ThemisWorkloadParams(seed=s)) for s in range(5)]
    sizes = {j.max_gpus for w in workloads for a in w.apps for j in a.jobs}
    assert sizes == {1, 2}
    app_days = statistics.median(workload_stats(w)["median_app_gpu_days"] for w in workloads)
    assert 10.0 <= app_days <= 14.0


def test_generator_is_seeded() -> None:
    a = generate_themis_workload(ThemisWorkloadParams(n_apps=5, seed=7))
    b = generate_themis_workload(ThemisWorkloadParams(n_apps=5, seed=7))
    c = generate_themis_workload(ThemisWorkloadParams(n_apps=5, seed=8))
    assert a == b and a != c


def test_csv_groups_jobs_into_apps_and_rebases_time() -> None:
    text = (
        "app_id,job_id,submit_time,gpus,duration_s,model,placement_sensitivity\n"
        "sweep,s1,100,2,600,VGG16,\n"
        "sweep,s2,130,1,60,,1.5\n"
        ",solo,160,1,30,unknown-net,\n"
    )
    w = read_be_trace_csv(io.StringIO(text))
    assert [a.app_id for a in w.apps] == ["sweep", "solo"]
    sweep = w.apps[0]
    assert sweep.submitted_at == 0.0 and w.apps[1].submitted_at == 60.0
    assert sweep.jobs[0].model.name == "vgg16" and sweep.jobs[0].work_gpu_s == pytest.approx(1200, rel=0.01)
    assert sweep.jobs[1].model.placement_sensitivity == 1.5


@pytest.mark.parametrize(
    ("row", "line", "column"),
    [
        ("a,j2,soon,1,60", 3, "submit_time"),
        ("a,j2,0,0,60", 3, "gpus"),
        ("a,j2,0,1,-5", 3, "duration_s"),
        ("a,j1,0,1,60", 3, "job_id"),
        ("a,,0,1,60", 3, "job_id"),
    ],
)
def test_csv_errors_name_the_line_and_column(row: str, line: int, column: str) -> None:
    text = f"app_id,job_id,submit_time,gpus,duration_s\na,j1,0,1,60\n{row}\n"
    with pytest.raises(TraceCsvError) as err:
        read_be_trace_csv(io.StringIO(text))
    assert err.value.line == line and err.value.column == column
    assert f"line {line}" in str(err.value) and column in str(err.value)


def test_csv_rejects_a_missing_column_and_a_sensitivity_below_one() -> None:
    with pytest.raises(TraceCsvError, match="lacks required"):
        read_be_trace_csv(io.StringIO("app_id,job_id,gpus\n"))
    with pytest.raises(TraceCsvError, match="placement_sensitivity"):
        read_be_trace_csv(
            io.StringIO("app_id,job_id,submit_time,gpus,duration_s,placement_sensitivity\na,j,0,1,5,0.5\n")
        )
