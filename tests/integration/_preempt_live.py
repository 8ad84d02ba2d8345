"""A live preemption scenario shared by tests/integration/test_preemption_live.py and
scripts/bench_preemption.py --live: an embedded cluster of 3 hosts x 1 virtual GPU (so every
replica host of a kernel has exactly one GPU), a kernel asking for 1 GPU, and 3 best-effort jobs
on the job-side API that lease every GPU, with leases long enough that none rotates meanwhile.

A cell that arrives then finds no idle GPU on any replica host: the global scheduler picks host
and victim with FitGpp, the host suspends that job's lease, binds its GPU to the cell and the job
pauses at its next step boundary; when the cell ends the job resumes on the same GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _cluster import ROOT, ClusterHandle
from _kernels import run
from jupyter_client import BlockingKernelClient

HOSTS = 3
CONFIG = (
    "--hosts", str(HOSTS), "--gpus-per-host", "1",
    "--set", "arbiter.round_s=0.5",
    "--set", "arbiter.lease_s=600",
    "--set", "arbiter.report_interval_s=0.5",
    "--set", "arbiter.stop_grace_s=3",
    "--set", "arbiter.preempt_pause_grace_s=1",
    "--set", "arbiter.cell_reserve_gpus=0",
)  # fmt: skip
STEP_S = 0.05
# each step appends "time job host devices step" to the record file: what the checks read;
# START_S: how long the job takes to start (its imports, its data) before its first step
JOB = """
import os, sys, time, tandem_job
record = sys.argv[2]
where = f"{os.environ['TANDEM_JOB_ID']} {os.environ['TANDEM_HOST_ID']} {os.environ['CUDA_VISIBLE_DEVICES']}"
with tandem_job.session(total=int(sys.argv[1])) as job, open(record, "a") as out:
    time.sleep(float(sys.argv[3]))
    for step in job.steps():
        time.sleep(STEP_S)
        out.write(f"{time.time():.4f} {where} {step}\\n")
        out.flush()
""".replace("STEP_S", repr(STEP_S))
CELL = (
    "import json, time\n"
    "from kernel_replica.helper import gpu_ids\n"
    "t0 = time.time(); time.sleep(0.2)\n"
    "print(json.dumps([t0, time.time(), gpu_ids()]))"
)


@dataclass(frozen=True)
class TimedCell:
    sent: float  # client's wall clock just before execute_request
    started: float  # user code's first statement (same machine, same clock)
    ended: float
    host_id: str
    gpus: list[int]
    seconds: float  # round trip at the client

    @property
    def delay_s(self) -> float:
        """Request sent at the client -> user code running (gateway, scheduler, election, bind)."""
        return self.started - self.sent


def timed_cell(client: BlockingKernelClient) -> TimedCell:
    sent = time.time()
    cell = run(client, CELL)
    assert cell.status == "ok", cell.errors
    t0, t1, gpus = json.loads(cell.stdout)
    return TimedCell(sent, t0, t1, str(cell.tandem.get("host_id", "")), list(gpus), cell.seconds)


def tandem(cluster: ClusterHandle, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    command, rest = args[:2], args[2:]
    argv = [sys.executable, "-m", "services.cli", *command, "--state-dir", str(cluster.state_dir), *rest]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def submit_jobs(
    cluster: ClusterHandle,
    workdir: Path,
    count: int,
    steps: int = 100_000,
    app: str = "be",
    start_s: float = 0.0,
) -> tuple[list[str], Path]:
    """``count`` one-GPU jobs of ``app`` that take ``start_s`` to reach their first step; their ids
    and the record file."""
    script, record = workdir / "be_job.py", workdir / "steps.txt"
    script.write_text(JOB)
    submits = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "job",
                "submit",
                "--state-dir",
                str(cluster.state_dir),
                "--app",
                app,
                "--iterations",
                str(steps),
                "--",
                sys.executable,
                str(script),
                str(steps),
                str(record),
                str(start_s),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(count)
    ]
    ids = []
    for process in submits:
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        ids.append(out.strip())
    return ids, record


def jobs(cluster: ClusterHandle) -> list[dict[str, Any]]:
    listed = tandem(cluster, "job", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return list(json.loads(listed.stdout))


def wait_all_stepping(cluster: ClusterHandle, record: Path, job_ids: list[str], timeout: float) -> None:
    """Every job holds a lease and has recorded a step (so every GPU is leased and in use)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stepped = {line.split()[1] for line in record.read_text().splitlines()} if record.exists() else set()
        if set(job_ids) <= stepped and all(j["state"] == "running" for j in jobs(cluster)):
            time.sleep(1.0)  # a heartbeat or two: the global scheduler's mirror shows the leases
            return
        time.sleep(0.2)
    raise AssertionError(f"jobs not all stepping within {timeout} s: {jobs(cluster)}")


def steps_by_job(record: Path) -> dict[str, list[tuple[float, str, list[int], int]]]:
    """job id -> [(time, host, devices, step)] in record order."""
    out: dict[str, list[tuple[float, str, list[int], int]]] = {}
    for line in record.read_text().splitlines():
        t, job, host, devices, step = line.split()
        out.setdefault(job, []).append((float(t), host, [int(d) for d in devices.split(",")], int(step)))
    return out


def revocations(cluster: ClusterHandle) -> int:
    """``lease_revoked`` events in the local schedulers' logs."""
    return sum(
        path.read_text(errors="replace").count("lease_revoked")
        for path in cluster.log_dir.glob("*.log")
        if "local" in path.name or "host" in path.name
    )


def global_choices(cluster: ClusterHandle) -> int:
    """Revocations whose victims the global scheduler chose with the executor (one decision)."""
    return sum(
        path.read_text(errors="replace").count("the global scheduler's FitGpp choice")
        for path in cluster.log_dir.glob("host-*.log")
    )


def invariant_violations(cluster: ClusterHandle) -> int:
    return sum(
        path.read_text(errors="replace").count("LedgerInvariantError")
        for path in cluster.log_dir.glob("*.log")
    )
