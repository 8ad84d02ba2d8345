"""A cell preempts best-effort jobs live (issue #17): every GPU of the cluster is leased to a
running job, a cell arrives, it runs promptly on a revoked GPU, the victim pauses at its step
boundary meanwhile and resumes on the same GPU afterwards with no step lost or repeated, and no
GPU is ever bound to a cell and a job at once.

The same cluster (packing on; it changes nothing while no job waits) then shows the arbiter's
packing pass live (issue #18): a job submitted while every GPU is leased is packed beside a running
job, and the GPU's time is charged once, split between the two."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, eventually, running_cluster
from _kernels import tandem_kernel
from _preempt_live import (
    CONFIG,
    HOSTS,
    STEP_S,
    global_choices,
    invariant_violations,
    jobs,
    revocations,
    steps_by_job,
    submit_jobs,
    tandem,
    timed_cell,
    wait_all_stepping,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PACKING = ("--set", "packing.enabled=true", "--set", "packing.trial_s=1", "--set", "packing.settle_s=0.2")


@dataclass
class Leased:
    """The module's cluster; ``every_gpu_leased`` submits one job per GPU the first time."""

    cluster: ClusterHandle
    workdir: Path
    job_ids: list[str] = field(default_factory=list)
    record: Path | None = None

    def every_gpu_leased(self) -> tuple[list[str], Path]:
        if self.record is None:
            self.job_ids, self.record = submit_jobs(self.cluster, self.workdir, HOSTS)
        wait_all_stepping(self.cluster, self.record, self.job_ids, timeout=90.0)
        return self.job_ids, self.record


@pytest.fixture(scope="module")
def leased(tandem_kernelspec: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Leased]:
    workdir = tmp_path_factory.mktemp("preempt-live")
    with running_cluster(workdir / "state", *CONFIG, *PACKING, *WITHOUT_HTTP_API) as cluster:
        yield Leased(cluster, workdir)


CELLS = 4
GAP_S = 1.2  # think time: a heartbeat shows the resumed leases to the scheduler again
PROMPT_S = 2.0  # request sent -> user code running, with every GPU leased (target 0.5 s at p99)


def test_a_cell_revokes_a_leased_gpu_and_the_job_resumes_without_loss(leased: Leased) -> None:
    cluster = leased.cluster
    with tandem_kernel() as (_, client):
        timed_cell(client)  # warm: imports, first election
        # `tandem up` started the checkpoint service; the operator's key reads it
        assert cluster.status()["checkpoints"]["jobs"] == {}
        _, record = leased.every_gpu_leased()
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


def test_a_job_left_waiting_is_packed_beside_a_running_job_and_the_gpu_charged_once(leased: Leased) -> None:
    cluster = leased.cluster
    job_ids, record = leased.every_gpu_leased()
    (guest,), _ = submit_jobs(cluster, leased.workdir, 1, app="pk")
    by_id: dict[str, dict] = {}

    def packed() -> bool:
        by_id.update({j["job_id"]: j for j in jobs(cluster)})
        entry = by_id[guest]
        return entry["state"] == "running" and bool(entry["packing"]) and entry["packing"]["with"] in job_ids

    # no GPU is idle and no lease ends (600 s): only the packing pass after the auction places it
    assert eventually(packed, timeout=20.0), by_id.get(guest)
    entry = by_id[guest]
    jmax = by_id[entry["packing"]["with"]]
    assert (entry["host"], entry["device_ids"]) == (jmax["host"], jmax["device_ids"])
    assert jmax["packing"] is not None and jmax["packing"]["with"] == guest
    assert eventually(lambda: guest in {line.split()[1] for line in record.read_text().splitlines()}, 20.0)

    def charged_once() -> bool:
        batch = cluster.status()["batch"]
        apps = batch["apps"]
        # 3 GPUs leased (not 4), the shared one split: "pk" holds a part of it, "be" the rest
        return (
            batch["usage"]["gpus_now"]["be"] == HOSTS
            and 0 < apps["pk"]["gpus_now"] < 1
            and abs(apps["be"]["gpus_now"] + apps["pk"]["gpus_now"] - HOSTS) < 1e-6
            and apps["pk"]["gpu_seconds"] > 0
        )

    assert eventually(charged_once, timeout=10.0), cluster.status()["batch"]
    assert "job_packed" in cluster.log_text(entry["host"])
    cancelled = tandem(cluster, "job", "cancel", guest)
    assert cancelled.returncode == 0, cancelled.stderr
    assert eventually(
        lambda: {j["job_id"]: j for j in jobs(cluster)}[jmax["job_id"]]["packing"] is None, 10.0
    )
