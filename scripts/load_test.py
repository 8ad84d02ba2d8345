#!/usr/bin/env python
"""Replay a time-compressed IDLT trace against a live embedded cluster, then simulate the same trace.

The trace: the first ``--sessions`` training sessions of the synthetic 17.5-hour excerpt
(``shared.workload.idlt.excerpt_17_5h``), cut to its first ``--trace-hours`` and compressed to
``--minutes`` (every time and duration divided by the same factor; GPUs capped at the hosts' size).

The live run: ``tandem up`` (real processes, virtual GPUs) in a private state directory; one real
Jupyter client per session (``jupyter_client.KernelManager(kernel_name="tandem")``, started at the
session's arrival with its GPU request in the kernelspec's provisioner config); each task is one cell that busy-waits
(or sleeps, ``--cell sleep``) for the task's scaled duration, sent at its scaled submit time or as
soon as the session's previous cell replied. ``cluster.status`` is polled every second for the
provisioned GPUs (integrated into GPU-hours) and read at the end for the scheduler's count of cells
whose GPUs were committed immediately.

Then the simulator runs the same compressed trace on the same cluster shape, with the container
start times the live cluster just measured, and both are printed side by side.

Prints ONE JSON line: ``{"live": {"notebookos": {...}}, "sim": {"notebookos": {...}}, "compare":
{...}}``, the inner objects in the shape of ``tandem sim --json``.

Usage: ``python scripts/load_test.py [--sessions 10] [--minutes 3] [--hosts 4] [--gpus-per-host 4]``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cluster_file import ask_sync  # noqa: E402
from shared import messages  # noqa: E402
from shared.config import load_config  # noqa: E402
from shared.security import curve  # noqa: E402
from shared.simulator.engine import Simulator  # noqa: E402
from shared.simulator.params import SimParams  # noqa: E402
from shared.simulator.results import summarize_run  # noqa: E402
from shared.workload.idlt import excerpt_17_5h  # noqa: E402
from shared.workload.metrics import percentiles, step_integral_hours  # noqa: E402
from shared.workload.model import Session, Task, Trace  # noqa: E402

BUSY_CELL = "import time as _t\n_end = _t.perf_counter() + {d!r}\nwhile _t.perf_counter() < _end:\n    pass\n"
SLEEP_CELL = "import time as _t\n_t.sleep({d!r})\n"


def replay_trace(
    seed: int, sessions: int, hours: float, seconds: float, max_gpus: int
) -> tuple[Trace, float]:
    """The first ``sessions`` training sessions of the excerpt, cut at ``hours``, compressed to ``seconds``."""
    source = excerpt_17_5h(seed)
    cut = hours * 3600.0
    speed = cut / seconds
    by_session: dict[int, list[int]] = {}
    for k in range(source.n_tasks):
        if source.task_end_s[k] <= cut:
            by_session.setdefault(int(source.task_session[k]), []).append(k)
    chosen = sorted(by_session, key=lambda i: source.sessions[i].start_s)[:sessions]
    if len(chosen) < sessions:
        raise SystemExit(
            f"only {len(chosen)} training sessions in the first {hours} h of seed {seed}'s excerpt"
        )
    out_sessions: list[Session] = []
    tasks: list[Task] = []
    for i in chosen:
        s = source.sessions[i]
        g = min(s.gpus, max_gpus)
        last_end = max(float(source.task_end_s[k]) for k in by_session[i])
        end = max(min(s.end_s, cut), last_end)
        out_sessions.append(Session(s.session_id, s.start_s / speed, end / speed, g))
        tasks.extend(
            Task(
                s.session_id,
                float(source.task_submit_s[k]) / speed,
                float(source.task_duration_s[k]) / speed,
                g,
            )
            for k in by_session[i]
        )
    return Trace.from_tasks(out_sessions, tasks), speed


# ---- the live cluster -------------------------------------------------------------------------


def start_cluster(
    state_dir: Path, hosts: int, max_hosts: int, gpus: int
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    args = ["--hosts", str(hosts), "--gpus-per-host", str(gpus), "--log-format", "json"]
    if max_hosts > hosts:
        args += ["--max-hosts", str(max_hosts)]
    out = open(state_dir / "tandem-up.out", "wb")  # noqa: SIM115 - lives as long as the cluster
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--state-dir", str(state_dir), *args],
        stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if (state_dir / "cluster.json").exists():
            return proc, json.loads((state_dir / "cluster.json").read_text())
        time.sleep(0.2)
    stop_cluster(proc)
    tail = (state_dir / "tandem-up.out").read_text(errors="replace")[-3000:]
    raise SystemExit(f"tandem up did not become ready:\n{tail}")


def stop_cluster(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@dataclass
class CellOutcome:
    task: int
    sent_s: float  # replay clock
    replied_s: float
    status: str
    gateway_delay_s: float | None  # arrival at the gateway -> user code started (execute_reply metadata)
    replica: str | None = None
    host: str | None = None


@dataclass
class Replay:
    trace: Trace
    cell: str
    t0: float = 0.0
    outcomes: list[CellOutcome] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def wait_until(self, t: float) -> None:
        delay = t - self.clock()
        if delay > 0:
            time.sleep(delay)

    def run_session(self, index: int, tasks: list[int]) -> None:
        from jupyter_client import KernelManager

        s = self.trace.sessions[index]
        self.wait_until(s.start_s)
        km = KernelManager(kernel_name="tandem")
        try:
            # The session's GPU request, as the kernelspec's provisioner config (per manager, so
            # sessions can start concurrently; TANDEM_GPUS would be one value for the process).
            km.kernel_spec.metadata["kernel_provisioner"]["config"]["gpus"] = s.gpus
            km.start_kernel()
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=180)
        except Exception as exc:  # the session could not start: its cells count as failed
            with self.lock:
                self.errors.append(f"{s.session_id}: kernel start failed: {exc}")
                self.done += len(tasks)
            return
        try:
            for k in tasks:
                self.wait_until(float(self.trace.task_submit_s[k]))
                code = self.cell.format(d=round(float(self.trace.task_duration_s[k]), 3))
                sent = self.clock()
                msg_id = kc.execute(code, store_history=False)
                while True:
                    reply = kc.get_shell_msg(timeout=600)
                    if reply["parent_header"].get("msg_id") == msg_id:
                        break
                meta = reply.get("metadata", {}).get("tandem", {})
                delay_ms = meta.get("interactivity_delay_ms")
                outcome = CellOutcome(
                    k, sent, self.clock(), reply["content"].get("status", "?"),
                    delay_ms / 1000 if isinstance(delay_ms, int | float) else None,
                    meta.get("replica_id"), meta.get("host_id"),
                )  # fmt: skip
                while kc.iopub_channel.msg_ready():  # keep the iopub queue from growing
                    kc.get_iopub_msg(timeout=1)
                with self.lock:
                    self.outcomes.append(outcome)
                    self.done += 1
            self.wait_until(s.end_s)
        except Exception as exc:
            with self.lock:
                self.errors.append(f"{s.session_id}: {exc.__class__.__name__}: {exc}")
        finally:
            kc.stop_channels()
            try:
                km.shutdown_kernel(now=False)
            except Exception as exc:
                with self.lock:
                    self.errors.append(f"{s.session_id}: shutdown: {exc}")


def poll_status(
    scheduler: str, keys_dir: str, stop: threading.Event, replay: Replay, samples: list[dict[str, Any]]
) -> None:
    credentials = curve.client_curve(Path(keys_dir), curve.OPERATOR, curve.SCHEDULER)
    while not stop.is_set():
        try:
            status = ask_sync(scheduler, messages.CLUSTER_STATUS, {}, credentials=credentials, timeout=5.0)
            cluster = status.get("cluster") or {}
            hosts = status.get("hosts", [])
            samples.append({
                "t": replay.clock(),
                "provisioned_gpus": cluster.get("provisioned_gpus", sum(h.get("gpus", 0) for h in hosts if h.get("alive", True))),
                "committed_gpus": cluster.get("committed_gpus"),
                "subscription_ratio": cluster.get("subscription_ratio"),
                "migrations": cluster.get("migrations"),
            })  # fmt: skip
        except Exception as exc:  # a busy scheduler: skip one sample
            samples.append({"t": replay.clock(), "error": str(exc)})
        stop.wait(1.0)


def live_numbers(
    trace: Trace,
    replay: Replay,
    samples: list[dict[str, Any]],
    final: dict[str, Any],
    window_s: float,
    wall_s: float,
) -> dict[str, Any]:
    ok = [o for o in replay.outcomes if o.status == "ok"]
    submit = trace.task_submit_s
    delays = [
        (o.sent_s - submit[o.task]) + (o.gateway_delay_s if o.gateway_delay_s is not None else 0.0)
        for o in ok
    ]
    tct = [o.replied_s - submit[o.task] for o in ok]
    good = [s for s in samples if "provisioned_gpus" in s and s["t"] <= window_s]
    grid = np.array([s["t"] for s in good] + [window_s])
    level = np.array([s["provisioned_gpus"] for s in good] + [good[-1]["provisioned_gpus"] if good else 0])
    gpu_hours = step_integral_hours(grid, level) if len(good) else None
    metrics = final.get("metrics", {})
    total, immediate = metrics.get("cells_total"), metrics.get("cells_committed_immediately")
    d = percentiles(delays, (50, 99)) if delays else {50.0: None, 99.0: None}
    t = percentiles(tct, (50, 99)) if tct else {50.0: None, 99.0: None}
    return {
        "gpu_hours": round(gpu_hours, 5) if gpu_hours is not None else None,
        "gpu_hours_saved_vs_reservation": None,  # reservation is not a live mode
        "interactivity_delay_p50_s": d[50.0],
        "interactivity_delay_p99_s": d[99.0],
        "immediate_commit_fraction": round(immediate / total, 4) if total else None,
        "tct_p50_s": t[50.0],
        "provider_cost": None,
        "revenue": None,
        "profit_margin": None,
        "wall_s": round(wall_s, 2),
        "cells_run": len(ok),
        "cells_failed": trace.n_tasks - len(ok),
        "scheduler_cells_total": total,
        "migrations": (final.get("cluster") or {}).get("migrations"),
        "replica_start_ms": metrics.get("replica_start_ms"),
        "status_samples": len(good),
        "subscription_ratio_max": max((s["subscription_ratio"] or 0.0 for s in good), default=None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--trace-hours", type=float, default=2.0, help="how much of the excerpt to replay")
    ap.add_argument("--minutes", type=float, default=3.0, help="wall-clock length of the replay")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--max-hosts", type=int, default=0, help="> --hosts: let the cluster autoscale")
    ap.add_argument("--gpus-per-host", type=int, default=4)
    ap.add_argument("--cell", choices=["busy", "sleep"], default="busy", help="how a cell holds its time")
    args = ap.parse_args()
    from rich.console import Console
    from rich.progress import Progress

    from services.kernelspec import install

    err = Console(file=sys.stderr)
    trace, speed = replay_trace(
        args.seed, args.sessions, args.trace_hours, args.minutes * 60, args.gpus_per_host
    )
    window_s = max(s.end_s for s in trace.sessions)
    err.print(
        f"load test: {len(trace.sessions)} sessions, {trace.n_tasks} cells, {speed:.0f}x compressed, {window_s:.0f} s"
    )
    max_hosts = max(args.max_hosts, args.hosts)
    with tempfile.TemporaryDirectory(prefix="tandem-load-") as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        prefix = Path(tmp) / "prefix"
        install(prefix=str(prefix))
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            filter(None, [str(prefix / "share" / "jupyter"), os.environ.get("JUPYTER_PATH")])
        )
        os.environ["TANDEM_STATE_DIR"] = str(state)
        os.environ.pop("TANDEM_GPUS", None)  # would override every session's own request
        proc, info = start_cluster(state, args.hosts, max_hosts, args.gpus_per_host)
        try:
            replay = Replay(trace, BUSY_CELL if args.cell == "busy" else SLEEP_CELL)
            per_session: dict[int, list[int]] = {}
            for k in range(trace.n_tasks):
                per_session.setdefault(int(trace.task_session[k]), []).append(k)
            samples: list[dict[str, Any]] = []
            stop = threading.Event()
            replay.t0 = time.monotonic()
            wall0 = time.perf_counter()
            poller = threading.Thread(
                target=poll_status,
                args=(info["scheduler"], info["keys_dir"], stop, replay, samples),
                daemon=True,
            )
            poller.start()
            threads = [
                threading.Thread(target=replay.run_session, args=(i, per_session.get(i, [])), daemon=True)
                for i in range(len(trace.sessions))
            ]
            for th in threads:
                th.start()
            with Progress(console=err) as bar:
                task = bar.add_task("cells", total=trace.n_tasks)
                while any(th.is_alive() for th in threads):
                    bar.update(task, completed=replay.done)
                    time.sleep(0.5)
                bar.update(task, completed=replay.done)
            wall = time.perf_counter() - wall0
            stop.set()
            poller.join(timeout=10)
            final = ask_sync(
                info["scheduler"],
                messages.CLUSTER_STATUS,
                {},
                credentials=curve.client_curve(Path(info["keys_dir"]), curve.OPERATOR, curve.SCHEDULER),
                timeout=10.0,
            )
        finally:
            stop_cluster(proc)
    live = live_numbers(trace, replay, samples, final, window_s, wall)

    cold = ((live.get("replica_start_ms") or {}).get("cold") or {}).get("p50")
    warm = ((live.get("replica_start_ms") or {}).get("warm") or {}).get("p50")
    cfg = load_config()
    params = SimParams.from_config(cfg)
    from dataclasses import replace

    params = replace(
        params,
        gpus_per_host=args.gpus_per_host,
        initial_hosts=args.hosts,
        min_hosts=args.hosts,  # the live autoscaler never releases the hosts `tandem up` started
        max_hosts=max_hosts,
        cold_start_s=(cold / 1000) if cold else 3.0,
        warm_start_s=(warm / 1000) if warm else 0.5,
        large_object_mb=0.0,  # the replayed cells create no large objects
        host_provision_s=5.0,
        autoscale_interval_s=float(cfg.get("autoscale.interval_s")),
        buffer_hosts=int(cfg.get("autoscale.buffer_hosts")),
        scaling_factor=float(cfg.get("autoscale.scaling_factor")),
        prewarm_per_host=int(cfg.get("prewarm.per_host")) if cfg.get("prewarm.policy") != "none" else 0,
        timeline_step_s=1.0,
    )
    result = Simulator(trace, "notebookos", params, seed=args.seed).run()
    sim = summarize_run(result, None, window_s).numbers
    compare: dict[str, Any] = {}
    for key in ("immediate_commit_fraction", "gpu_hours"):
        a, b = live.get(key), sim.get(key)
        compare[key] = {
            "live": a, "sim": b,
            "rel_diff": round(abs(a - b) / max(abs(a), 1e-12), 4) if a is not None and b is not None else None,
        }  # fmt: skip
    compare["within_15pct"] = all(
        v["rel_diff"] is not None and v["rel_diff"] <= 0.15 for v in compare.values()
    )
    compare["errors"] = replay.errors[:10]
    compare["speedup"] = round(speed, 1)
    print(
        json.dumps(
            {"live": {"notebookos": live}, "sim": {"notebookos": sim}, "compare": compare}, default=str
        )
    )


if __name__ == "__main__":
    main()
