"""Per-cell latency of trivial cells: Tandem vs a stock local ipykernel, same client code.

Each sample is one ``x = 1`` through jupyter_client's BlockingKernelClient: send execute_request,
wait for the execute_reply and for iopub ``status: idle`` of that request (what a notebook front
end waits for). The two kernels are measured in alternating blocks so machine noise hits both
alike; the figure that matters is the ratio. Prints one JSON line.

Targets (issue): ratio_p50 <= 1.3, tandem_p99_ms <= 20.

``tandem_steps_p50_ms`` says where a Tandem cell's time goes (medians over the last cells kept,
from ``tandem status --json``): ``replica`` holds the executor's own step times
(``metrics.replica_steps_ms``: ``replied_ms`` is its request handling up to the reply, ``run_ms``
the cell itself, ``replicate_ms`` the DONE/STATE commit that idle waits for), ``scheduler`` the
global scheduler's view (``metrics.steps_ms``: ``elect_ms`` from routing the request to hearing
who executes it, ``run_ms`` from then to the cell's end). The rest of ``tandem_p50_ms`` is the
hops between client, gateway, schedulers and replica.

``*_cpu_ms_per_cell`` is the CPU time (user + system, all threads) each side burns per cell: the
client (this process) plus the stock kernel's process, or plus every process of the embedded
cluster. On a machine with few cores the cell path is CPU-bound, and this figure moves far less
with the neighbours' load than latency does, so it is what an A/B of a change reads first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from jupyter_client import BlockingKernelClient, KernelManager  # noqa: E402

from services.embedded import EmbeddedCluster  # noqa: E402
from services.kernelspec import install_private  # noqa: E402
from shared.config import load_config, parse_overrides  # noqa: E402
from shared.logs import configure_logging  # noqa: E402


def one_cell(kc: BlockingKernelClient, code: str = "x = 1", timeout: float = 30.0) -> float:
    """Milliseconds from send to (reply and idle) for one cell."""
    started = time.perf_counter()
    msg_id = kc.execute(code)
    got_reply = got_idle = False
    deadline = time.monotonic() + timeout
    while not got_reply:
        reply = kc.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
        got_reply = reply["parent_header"].get("msg_id") == msg_id
    while not got_idle:
        msg = kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        got_idle = (
            msg["parent_header"].get("msg_id") == msg_id
            and msg["msg_type"] == "status"
            and msg["content"]["execution_state"] == "idle"
        )
    return (time.perf_counter() - started) * 1000.0


def step_medians(state_dir: Path) -> dict[str, dict[str, float]]:
    """Median step times of recent cells, from the running cluster's status (see the docstring)."""
    status = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--json", "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    if status.returncode != 0:
        return {}
    metrics = json.loads(status.stdout).get("metrics") or {}
    return {
        where: {name: p["p50"] for name, p in (metrics.get(key) or {}).items() if p and "p50" in p}
        for where, key in (("replica", "replica_steps_ms"), ("scheduler", "steps_ms"))
    }


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[index]


def start(kernel_name: str, cwd: Path | None = None) -> tuple[KernelManager, BlockingKernelClient]:
    """``cwd``: the kernel's working directory (a Tandem kernel's replicas start there)."""
    km = KernelManager(kernel_name=kernel_name)
    km.start_kernel(cwd=str(cwd) if cwd is not None else None)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU of these processes (all their threads) so far."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone: it used nothing more since the last look
            continue
        total += times.user + times.system
    return total


_ROLES = (
    ("services.gateway", "gateway"),
    ("services.global_scheduler", "global_scheduler"),
    ("services.local_scheduler", "local_scheduler"),
    ("kernel_replica", "replica"),
)
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def role_of(process: psutil.Process) -> str:
    """What a cluster process is, from its command line (``other``: ``tandem up`` and the rest)."""
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return "other"
    return next((role for module, role in _ROLES if module in command), "other")


def cpu_by_role(processes: dict[int, str]) -> dict[str, float]:
    """CPU seconds so far per role (pid -> role), each split into ``<role>/zmq_io`` (ZMQ's I/O
    threads, where CURVE encrypts and decrypts) and ``<role>`` (every other thread), read from
    /proc per thread (clock-tick resolution: meaningful summed over many cells)."""
    totals: dict[str, float] = {}
    for pid, role in processes.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index(b"(") + 1 : stat.rindex(b")")]
            fields = stat[stat.rindex(b")") + 2 :].split()
            seconds = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime + stime
            where = f"{role}/zmq_io" if name.startswith(b"ZMQbg/IO") else role
            totals[where] = totals.get(where, 0.0) + seconds
    return totals


def side_processes(stock_kernel_pid: int | None) -> dict[str, list[psutil.Process]]:
    """Whose CPU each side's cells cost: the client (this process) and the stock kernel, or the
    client and every other process under it (the embedded cluster's services and replicas)."""
    me = psutil.Process()
    others = [p for p in me.children(recursive=True) if p.pid != stock_kernel_pid]
    stock = [psutil.Process(stock_kernel_pid)] if stock_kernel_pid is not None else []
    return {"tandem": [me, *others], "ipykernel": [me, *stock]}


def measure(cells: int, block: int, warmup: int) -> dict[str, Any]:
    kernels = {name: start(spec) for name, spec in (("tandem", "tandem"), ("ipykernel", "python3"))}
    samples: dict[str, list[float]] = {name: [] for name in kernels}
    cpu_s: dict[str, float] = {name: 0.0 for name in kernels}
    try:
        for _, kc in kernels.values():
            for _ in range(warmup):
                one_cell(kc)
        stock = kernels["ipykernel"][0].provisioner
        stock_pid = getattr(getattr(stock, "process", None), "pid", None)
        processes = side_processes(stock_pid)  # after warm-up: every replica is up
        while min(len(s) for s in samples.values()) < cells:
            for name, (_, kc) in kernels.items():
                before = cpu_seconds(processes[name])
                for _ in range(min(block, cells - len(samples[name]))):
                    samples[name].append(one_cell(kc))
                cpu_s[name] += cpu_seconds(processes[name]) - before
    finally:
        for km, kc in kernels.values():
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    result: dict[str, Any] = {"cells": cells}
    for name, values in samples.items():
        result[f"{name}_p50_ms"] = round(statistics.median(values), 3)
        result[f"{name}_p99_ms"] = round(percentile(values, 99), 3)
        result[f"{name}_mean_ms"] = round(statistics.fmean(values), 3)
        result[f"{name}_cpu_ms_per_cell"] = round(cpu_s[name] * 1000.0 / len(values), 3)
    result["ratio_p50"] = round(result["tandem_p50_ms"] / result["ipykernel_p50_ms"], 3)
    result["meets_targets"] = result["ratio_p50"] <= 1.3 and result["tandem_p99_ms"] <= 20.0
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cells", type=int, default=500)
    parser.add_argument("--block", type=int, default=50, help="cells per kernel before switching")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    overrides = {"cluster.hosts": str(args.hosts), **parse_overrides(args.set)}
    cfg = load_config(None, overrides)
    configure_logging("console", "warning", service="bench")
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        state_dir = Path(tmp) / "state"
        install_private(Path(tmp) / "prefix")
        os.environ["TANDEM_STATE_DIR"] = str(state_dir)
        cluster = EmbeddedCluster(cfg, state_dir=state_dir)
        try:
            cluster.start()
            result = measure(args.cells, args.block, args.warmup)
            result["tandem_steps_p50_ms"] = step_medians(state_dir)
        finally:
            cluster.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
