"""A job whose start (imports, data, a checkpoint read) outlasts its lease still reaches its steps.

One virtual GPU, 1 s leases auctioned every 0.3 s, two apps of one job each that take 3 s from
their process's start to their first step. Ended at expiry, each lease would go to the other app
(it starves) and each job would start again from nothing at its next lease, for ever: the arbiter
renews the lease of a job that already lost a start while its run has not reached its first step
boundary (for at most ``arbiter.startup_allowance_s``), so the two take turns and both step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, eventually, running_cluster
from _preempt_live import jobs, steps_by_job, submit_jobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CONFIG = (
    "--hosts", "1", "--gpus-per-host", "1",
    "--set", "arbiter.round_s=0.3",
    "--set", "arbiter.lease_s=1",
    "--set", "arbiter.report_interval_s=0.3",
    "--set", "arbiter.stop_grace_s=2",
    *WITHOUT_HTTP_API,
)  # fmt: skip
START_S = 3.0


def test_jobs_whose_start_outlasts_a_lease_take_turns_and_both_step(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "state", *CONFIG) as cluster:
        (first,), record = submit_jobs(cluster, tmp_path, 1, app="a", start_s=START_S)
        (second,), _ = submit_jobs(cluster, tmp_path, 1, app="b", start_s=START_S)

        def both_stepped() -> bool:
            return record.exists() and {first, second} <= steps_by_job(record).keys()

        stepped = eventually(both_stepped, timeout=90.0)
        runs = {j["job_id"]: (j["runs"], j["iterations_done"]) for j in jobs(cluster)}
        assert stepped, f"(runs, iterations) by job: {runs}"
        # each stepped on its second run (its first lease ends as any other): turns, not
        # restarts (the first job may have begun its third turn meanwhile)
        assert max(r for r, _ in runs.values()) <= 3, runs
