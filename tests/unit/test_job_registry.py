"""The arbiter's job registry (pure): submissions, leases and GPU time, hosts' reports, what the
auction is told, persistence."""

from __future__ import annotations

import json

import pytest

from services.arbiter.registry import (
    CANCELLED,
    FAILED,
    FINISHED,
    QUEUED,
    RUNNING,
    Registry,
    RegistryError,
    command_name,
)

BODY = {"argv": ["python", "train.py"], "cwd": "/work", "env": {"A": "1"}}


def running(
    registry: Registry, job_id: str, *, host: str = "host-0", devices: tuple[int, ...] = (0,)
) -> None:
    registry.lease_started(job_id, host=host, device_ids=list(devices), pid=42, now=100.0, expires_at=110.0)


def test_submit_names_the_problem_with_bad_sizes_and_apps() -> None:
    registry = Registry()
    with pytest.raises(RegistryError, match="--gpus must be at least 1"):
        registry.submit({**BODY, "gpus": 0}, 0.0)
    with pytest.raises(RegistryError, match=r"--max-gpus \(1\) must be at least --gpus \(2\)"):
        registry.submit({**BODY, "gpus": 2, "max_gpus": 1}, 0.0)
    with pytest.raises(RegistryError, match="nothing to run"):
        registry.submit({**BODY, "argv": []}, 0.0)
    with pytest.raises(RegistryError, match="'app'"):
        registry.submit({**BODY, "app": "../etc"}, 0.0)
    with pytest.raises(RegistryError, match=r"no job 'x\.9'"):
        registry.get("x.9")


def test_a_job_larger_than_every_host_is_refused_rather_than_queued_forever() -> None:
    registry = Registry()
    with pytest.raises(
        RegistryError, match=r"--gpus 9 can never be granted.*largest host of this cluster has 8"
    ):
        registry.submit({**BODY, "gpus": 9}, 0.0, largest_host_gpus=8)
    assert registry.jobs == {}
    assert registry.submit({**BODY, "gpus": 8, "max_gpus": 16}, 0.0, largest_host_gpus=8).gpus == 8
    assert registry.submit({**BODY, "gpus": 9}, 0.0).gpus == 9  # no host has reported yet


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["python", "train.py", "--lr", "0.1"], "train.py"),
        (["/usr/bin/python3", "-u", "/home/u/sweep/train.py"], "train.py"),
        (["python", "-m", "pkg.train", "--epochs", "3"], "pkg.train"),
        (["./run", "--x"], "run"),
        (["bash", "go.sh"], "go.sh"),
    ],
)
def test_a_jobs_default_name_is_its_script_module_or_program(argv: list[str], name: str) -> None:
    assert command_name(argv) == name


def test_jobs_get_ids_of_their_app_and_a_name_from_the_command() -> None:
    registry = Registry()
    first = registry.submit({**BODY, "app": "sweep"}, 0.0)
    second = registry.submit(BODY, 0.0)
    assert (first.job_id, second.job_id) == ("sweep.1", "default.2")
    assert first.name == "train.py" and first.state == QUEUED
    assert "env" not in first.describe() and first.describe()["command"] == "python train.py"


def test_gpu_time_is_the_leased_gpus_times_the_lease_held() -> None:
    registry = Registry()
    job = registry.submit({**BODY, "gpus": 2}, 0.0)
    running(registry, job.job_id, devices=(0, 1))
    registry.account(103.0)
    registry.lease_renewed(job.job_id, now=105.0, expires_at=120.0)
    registry.lease_ended(job.job_id, 106.0)
    registry.account(200.0)  # no lease, no time
    assert job.gpu_seconds == pytest.approx(12.0) and job.run_seconds == pytest.approx(6.0)
    assert job.state == QUEUED and job.host is None and job.last_host == "host-0"
    assert registry.apps()["default"]["gpu_seconds"] == pytest.approx(12.0)


def test_runs_that_end_finish_fail_or_wait_for_the_next_lease() -> None:
    registry = Registry()
    jobs = [registry.submit(BODY, 0.0) for _ in range(4)]
    for job in jobs:
        running(registry, job.job_id)
    outcomes = ["finished", "failed", "stopped", "paused"]
    report = {
        "host_id": "host-0",
        "jobs": [
            {"job_id": j.job_id, "running": False, "outcome": o} for j, o in zip(jobs, outcomes, strict=True)
        ],
        "at": 101.0,
    }
    assert registry.on_report(report, 101.0) == [j.job_id for j in jobs]
    assert [j.state for j in jobs] == [FINISHED, FAILED, QUEUED, QUEUED]
    assert all(j.host is None for j in jobs)


def test_progress_reports_replace_the_crude_estimate() -> None:
    registry = Registry()
    job = registry.submit({**BODY, "iterations": 500}, 0.0)
    declared = registry.app_reports(1.0, releasing=set())[0].jobs[0]
    assert (declared.iterations_done, declared.iterations_total, declared.seconds_per_iteration) == (
        0,
        500,
        None,
    )
    running(registry, job.job_id)
    progress = {
        "state": "running",
        "iterations_done": 40,
        "iterations_total": 400,
        "seconds_per_iteration": 0.5,
    }
    report = {"host_id": "host-0", "jobs": [{"job_id": job.job_id, "running": True, "progress": progress}]}
    registry.on_report(report, 101.0)
    (reported,) = registry.app_reports(101.0, releasing=set())[0].jobs
    assert (reported.iterations_done, reported.iterations_total, reported.seconds_per_iteration) == (
        40,
        400,
        0.5,
    )
    assert reported.gpus == 1
    assert registry.app_reports(101.0, releasing={job.job_id})[0].jobs[0].gpus == 0
    assert registry.start_iteration(job) == 40


def test_a_job_without_the_api_is_reported_by_the_time_it_ran() -> None:
    registry = Registry()
    job = registry.submit(BODY, 0.0)
    running(registry, job.job_id)
    registry.account(130.0)
    (reported,) = registry.app_reports(130.0, releasing=set())[0].jobs
    assert (reported.iterations_done, reported.iterations_total, reported.seconds_per_iteration) == (
        30,
        None,
        None,
    )


def test_a_job_missing_from_its_hosts_report_lost_its_run() -> None:
    registry = Registry()
    job = registry.submit(BODY, 0.0)
    running(registry, job.job_id)
    registry.on_report({"host_id": "host-1", "jobs": [], "at": 110.0}, 110.0)
    assert job.state == RUNNING  # another host says nothing about it
    registry.on_report({"host_id": "host-0", "jobs": [], "at": 110.0}, 110.0)
    assert job.state == QUEUED and job.host is None


def test_cancelled_and_ended_jobs_ask_for_no_gpu() -> None:
    registry = Registry()
    job = registry.submit(BODY, 0.0)
    running(registry, job.job_id)
    assert registry.cancel(job.job_id, 105.0).state == CANCELLED
    assert job.host is None and job.gpu_seconds == pytest.approx(5.0)
    with pytest.raises(RegistryError, match="already ended"):
        registry.cancel(job.job_id, 106.0)
    assert registry.app_reports(106.0, releasing=set()) == []


def test_a_restarted_arbiter_has_every_job_and_lease() -> None:
    registry = Registry()
    job = registry.submit({**BODY, "app": "a"}, 0.0)
    running(registry, job.job_id)
    restored = Registry.from_dict(json.loads(json.dumps(registry.to_dict())))
    assert restored.jobs[job.job_id] == job
    assert restored.submit({**BODY, "app": "a"}, 1.0).job_id == "a.2"


def test_a_job_without_the_api_counts_its_time_in_its_siblings_iterations() -> None:
    registry = Registry()
    timed = registry.submit({**BODY, "app": "sweep"}, 0.0)
    silent = registry.submit({**BODY, "app": "sweep"}, 0.0)
    running(registry, timed.job_id)
    running(registry, silent.job_id, devices=(1,))
    progress = {
        "state": "running",
        "iterations_done": 10,
        "iterations_total": 400,
        "seconds_per_iteration": 0.5,
    }
    registry.on_report(
        {"host_id": "host-0", "jobs": [{"job_id": timed.job_id, "running": True, "progress": progress}]},
        101.0,
    )
    registry.account(130.0)
    reports = {j.job_id: j for j in registry.app_reports(130.0, releasing=set())[0].jobs}
    assert reports[silent.job_id].iterations_done == 60  # 30 s at the sibling's 0.5 s per iteration
    assert reports[silent.job_id].min_gpus == 1 and reports[silent.job_id].host == "host-0"


def test_a_lease_a_cell_revoked_is_not_charged_and_its_clock_stops() -> None:
    registry = Registry()
    job = registry.submit(BODY, 0.0)
    running(registry, job.job_id)  # at 100, expires at 110
    entry = {"job_id": job.job_id, "running": True, "progress": {}}
    registry.on_report({"host_id": "host-0", "jobs": [{**entry, "suspended": True}], "at": 102.0}, 102.0)
    registry.account(105.0)
    registry.on_report({"host_id": "host-0", "jobs": [{**entry, "suspended": False}], "at": 106.0}, 106.0)
    registry.account(107.0)
    assert job.gpu_seconds == pytest.approx(3.0)  # 100-102 and 106-107
    assert job.lease_expires_at == pytest.approx(114.0)  # 4 s suspended


def test_a_packed_gpu_is_charged_once_split_between_its_two_jobs_by_their_shares() -> None:
    registry = Registry()
    jmax = registry.submit({**BODY, "app": "big", "gpus": 2}, 0.0)
    guest = registry.submit({**BODY, "app": "small"}, 0.0)
    running(registry, jmax.job_id, devices=(0, 1))  # at 100
    running(registry, guest.job_id, devices=(1,))  # packed on GPU 1, J_max's

    def report(at: float, jmax_share: int, guest_share: int) -> None:
        entries = [
            {"job_id": jmax.job_id, "running": True, "packing": {"with": guest.job_id, "share": jmax_share}},
            {"job_id": guest.job_id, "running": True, "packing": {"with": jmax.job_id, "share": guest_share}},
        ]
        registry.on_report({"host_id": "host-0", "jobs": entries, "at": at}, at)

    report(100.0, 100, 100)  # free competition: GPU 1 half each
    registry.account(104.0)
    assert (jmax.gpu_seconds, guest.gpu_seconds) == pytest.approx((6.0, 2.0))
    report(104.0, 100, 60)  # the guest squeezed to 60%: GPU 1 is 100:60 from now on
    registry.account(112.0)
    assert jmax.gpu_seconds == pytest.approx(6.0 + 8 * (1 + 100 / 160))
    assert guest.gpu_seconds == pytest.approx(2.0 + 8 * 60 / 160)
    # the two GPUs' time is charged once in all, and each app is charged its job's part now
    assert jmax.gpu_seconds + guest.gpu_seconds == pytest.approx(2 * 12.0)
    apps = registry.apps()
    assert (apps["big"]["gpus_now"], apps["small"]["gpus_now"]) == (1.625, 0.375)
    registry.lease_ended(guest.job_id, 112.0)  # alone again: J_max is charged both GPUs
    registry.account(114.0)
    assert jmax.gpu_seconds == pytest.approx(6.0 + 8 * (1 + 100 / 160) + 4.0)


def test_a_job_that_lost_a_start_keeps_its_next_lease_until_its_run_steps_or_the_allowance_runs_out() -> None:
    registry = Registry()
    job = registry.submit(BODY, 0.0)

    def report(pid: int, state: str) -> None:
        progress = {"state": state, "iterations_done": 0, "iterations_total": 100}
        entry = {"job_id": job.job_id, "running": True, "pid": pid, "progress": progress}
        registry.on_report({"host_id": "host-0", "jobs": [entry], "at": 111.0}, 111.0)

    running(registry, job.job_id)  # granted at 100 s, pid 42
    assert not registry.still_starting(job, 111.0, allowance_s=60.0)  # a first lease ends as any
    registry.lease_ended(job.job_id, 111.0)  # before its run stepped: a start lost
    running(registry, job.job_id)
    assert registry.still_starting(job, 111.0, allowance_s=60.0)  # no report yet: importing
    report(42, "starting")
    assert registry.still_starting(job, 111.0, allowance_s=60.0)
    report(41, "running")  # an earlier process of the job: not this run's step
    assert registry.still_starting(job, 111.0, allowance_s=60.0)
    assert not registry.still_starting(job, 160.0, allowance_s=60.0)  # started too long ago
    assert not registry.still_starting(job, 111.0, allowance_s=0.0)  # the rule turned off
    report(42, "running")
    assert not registry.still_starting(job, 111.0, allowance_s=60.0)
    registry.lease_ended(job.job_id, 112.0)  # it stepped: nothing lost
    running(registry, job.job_id)
    assert job.starts_lost == 0 and not registry.still_starting(job, 112.0, allowance_s=60.0)
    registry.lease_ended(job.job_id, 113.0)
    assert not registry.still_starting(job, 113.0, allowance_s=60.0)  # no lease to keep
