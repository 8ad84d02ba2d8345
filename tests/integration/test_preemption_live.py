"""A cell preempts best-effort jobs live (issue #17): every GPU of the cluster is leased to a
running job, a cell arrives, it runs promptly on a revoked GPU, the victim pauses at its step
boundary meanwhile and resumes on the same GPU afterwards with no step lost or repeated, and no
GPU is ever bound to a cell and a job at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, running_cluster
from _kernels import tandem_kernel
from _preempt_live import (
    CONFIG,
    HOSTS,
    STEP_S,
    global_choices,
    invariant_violations,
    revocations,
    steps_by_job,
    submit_jobs,
    timed_cell,
    wait_all_stepping,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CELLS = 4
GAP_S = 1.2  # think time: a heartbeat shows the resumed leases to the scheduler again
PROMPT_S = 2.0  # request sent -> user code running, with every GPU leased (target 0.5 s at p99)


def test_a_cell_revokes_a_leased_gpu_and_the_job_resumes_without_loss(
    tandem_kernelspec: Path, tmp_path: Path
) -> None:
    with (
        running_cluster(tmp_path / "state", *CONFIG, *WITHOUT_HTTP_API) as cluster,
        tandem_kernel() as (_, client),
    ):
        timed_cell(client)  # warm: imports, first election
        # `tandem up` started the checkpoint service; the operator's key reads it
        assert cluster.status()["checkpoints"]["jobs"] == {}
        job_ids, record = submit_jobs(cluster, tmp_path, HOSTS)
        wait_all_stepping(cluster, record, job_ids, timeout=90.0)
        cells = []
        for _ in range(CELLS):
            cells.append(timed_cell(client))
            time.sleep(GAP_S)
        after = max(c.ended for c in cells)
        time.sleep(1.0)  # the jobs step on after the last cell
        assert revocations(cluster) >= CELLS, revocations(cluster)
        assert invariant_violations(cluster) == 0
        assert global_choices(cluster) >= 1  # the scheduler saw the leases and chose the victim

    steps = steps_by_job(record)
    for cell in cells:
        assert cell.gpus, cell  # the cell held a GPU of its own
        assert cell.delay_s < PROMPT_S, [round(c.delay_s, 3) for c in cells]
        # the victim: the job on the cell's GPU; at most the step in flight ends after the cell
        # started (it pauses at that boundary), none while the cell runs
        on_gpu = [
            t
            for job in steps.values()
            for t, host, devices, _ in job
            if host == cell.host_id
            and set(devices) & set(cell.gpus)
            and cell.started + 2 * STEP_S + 0.1 < t < cell.ended
        ]
        assert not on_gpu, (cell, on_gpu)
    for job_id, job in steps.items():
        numbers = [n for *_, n in job]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), (job_id, numbers[:50])
        assert {(host, tuple(devices)) for _, host, devices, _ in job} == {(job[0][1], tuple(job[0][2]))}
        assert any(t > after for t, *_ in job), f"{job_id} did not resume after the cells"
