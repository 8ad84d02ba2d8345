"""The job-side API (tandem_job): progress reports and run/pause/stop at step boundaries."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import tandem_job
from tandem_job import CONTROL_FILE, PROGRESS_FILE, write_atomically


@pytest.fixture
def job_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_JOB_START", "0")
    return tmp_path


def progress(job_dir: Path) -> dict:
    return json.loads((job_dir / PROGRESS_FILE).read_text())


def test_the_total_is_reported_before_the_first_step(job_dir: Path) -> None:
    with tandem_job.session(total=5):
        assert progress(job_dir) == {**progress(job_dir), "state": "starting", "iterations_total": 5}


def test_a_loop_that_runs_to_its_total_reports_finished_with_its_step_time(job_dir: Path) -> None:
    with tandem_job.session(total=4) as job:
        steps = [step for step in job.steps() if time.sleep(0.01) is None]
    assert steps == [0, 1, 2, 3] and not job.stopped
    report = progress(job_dir)
    assert report["state"] == "finished" and report["iterations_done"] == 4
    assert 0.005 < report["seconds_per_iteration"] < 1.0


def test_stop_ends_the_loop_at_the_next_step_boundary(job_dir: Path) -> None:
    with tandem_job.session(total=100) as job:
        for step in job.steps():
            if step == 2:
                write_atomically(job_dir / CONTROL_FILE, "stop")
    assert job.stopped and job.done == 3
    assert progress(job_dir)["state"] == "stopped" and progress(job_dir)["iterations_done"] == 3


def test_pause_blocks_at_a_step_boundary_until_run(job_dir: Path) -> None:
    seen: list[str] = []

    def operator() -> None:
        while not (job_dir / PROGRESS_FILE).exists() or progress(job_dir)["state"] != "paused":
            time.sleep(0.01)
        seen.append("paused")
        time.sleep(0.2)
        write_atomically(job_dir / CONTROL_FILE, "run")

    write_atomically(job_dir / CONTROL_FILE, "pause")
    helper = threading.Thread(target=operator)
    helper.start()
    started = time.monotonic()
    with tandem_job.session(total=2) as job:
        first = next(iter(job.steps()))
    helper.join()
    assert first == 0 and seen == ["paused"] and time.monotonic() - started >= 0.2


def test_a_resumed_job_starts_where_it_reported(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_JOB_START", "7")
    with tandem_job.session(total=9) as job:
        assert list(job.steps()) == [7, 8]
    assert progress(job_dir)["iterations_done"] == 9


def test_outside_tandem_the_loop_simply_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_JOB_DIR", raising=False)
    monkeypatch.delenv("TANDEM_JOB_START", raising=False)
    with tandem_job.session(total=3) as job:
        assert list(job.steps()) == [0, 1, 2]


def test_gpu_ids_are_the_leased_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GPU_IDS", "2,5")
    assert tandem_job.gpu_ids() == [2, 5]
