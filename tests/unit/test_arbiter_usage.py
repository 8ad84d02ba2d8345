"""GPU use from hosts' reports (pure): cells / BE / idle now and over time, what BE jobs could use."""

from __future__ import annotations

from services.arbiter.usage import UsageMeter


def report(
    host: str, *, gpus: int, committed: int, leased: list[int], idle: list[int], reserved: int
) -> dict:
    jobs = [{"job_id": f"j{d}", "running": True, "device_ids": [d]} for d in leased]
    return {
        "host_id": host,
        "gpus": gpus,
        "committed": committed,
        "idle": idle,
        "reserved": reserved,
        "jobs": jobs,
    }


def test_gpus_are_split_into_cells_be_and_idle_and_integrated_over_time() -> None:
    meter = UsageMeter(stale_s=5.0)
    meter.observe(report("h0", gpus=4, committed=1, leased=[1, 2], idle=[], reserved=1), 0.0)
    assert meter.split(0.0) == {"cells": 1, "be": 2, "idle": 1, "provisioned": 4}
    out = meter.report(2.0)
    assert out["gpu_seconds"] == {"cells": 2.0, "be": 4.0, "idle": 2.0}
    assert out["utilization"]["be"] == 0.5


def test_a_silent_host_is_left_out() -> None:
    meter = UsageMeter(stale_s=5.0)
    meter.observe(report("h0", gpus=2, committed=0, leased=[], idle=[1], reserved=1), 0.0)
    assert meter.split(10.0)["provisioned"] == 0 and meter.live(10.0) == {}


def test_be_jobs_could_use_the_leased_and_the_idle_gpus_beyond_the_cells_reserve() -> None:
    meter = UsageMeter(stale_s=1000.0)
    meter.observe(report("h0", gpus=4, committed=1, leased=[1], idle=[3], reserved=1), 0.0)
    meter.observe(report("h1", gpus=2, committed=0, leased=[], idle=[1], reserved=1), 0.0)
    assert meter.usable(0.0) == 3.0


def test_each_live_host_reports_its_gpus_by_use() -> None:
    meter = UsageMeter(stale_s=5.0)
    meter.observe(report("h1", gpus=4, committed=1, leased=[1], idle=[3], reserved=1), 0.0)
    meter.observe(report("h0", gpus=2, committed=0, leased=[], idle=[1], reserved=1), 4.0)
    assert meter.report(8.0)["hosts"] == {"h0": {"gpus": 2, "cells": 0, "be": 0, "free": 1, "reserved": 1}}
    assert list(meter.by_host(4.0)) == ["h0", "h1"]


def test_a_gpu_two_packed_jobs_share_is_one_leased_gpu() -> None:
    meter = UsageMeter(stale_s=5.0)
    body = report("h0", gpus=2, committed=0, leased=[], idle=[1], reserved=0)
    body["jobs"] = [{"job_id": j, "running": True, "device_ids": [0]} for j in ("a.1", "a.2")]
    meter.observe(body, 0.0)
    assert meter.split(0.0) == {"cells": 0, "be": 1, "idle": 1, "provisioned": 2}
