"""Cell-reply latency of a cell that changes a large tensor or array, by large-object path (issue #17).

One JSON line. On an embedded cluster (3 replicas, real processes, a real Jupyter client), per
path, a cell changes a ``--mb`` MiB torch tensor in place (``big.add_(1)``) and then a numpy array
(``arr += 1``); the time from ``execute`` to its ``execute_reply`` is measured ``--repeat`` times,
then a trivial cell sent right after it (``next_*``: it runs while a background copy may still
be going). The paths, each on a cluster of its own:

- ``write``: ``datastore.write_behind = false``: the object is written to the store before the reply;
- ``aside``: ``write_behind = true, background_image = false``: copied aside in memory before the
  reply, written after it (the path before this change);
- ``image``: ``background_image = true``: the instant is marked and the copy is a concurrent
  checkpoint after the reply (kernel_replica/state_image.py).

``change_ms_<kind>`` is the same in-place change timed inside the cell (what any path costs).

``--executor-change``: instead, the standbys' side of the image path, per loading mode
(``eager``: ``datastore.lazy_load = false``, each STATE read whole before anything else; ``lazy``:
read in the background, a cell waits only for the names it may touch; kernel_replica/lazy_load.py),
each on a cluster of its own. ``--repeat`` rounds: a cell makes a new ``--mb`` MiB tensor on one
host, and at once the next cell is forced onto another host's replica (the others cordoned): one
round reads only a small name (``first_small_ms``), the next reads the tensor (``first_big_ms``),
from execute to reply. ``main_lag_ms``/``raft_lag_ms``: the longest a standby's main loop (cells,
the scheduler's requests) and Raft loop went without running while a tensor loaded (their
``state_loaded`` log lines; max over standbys and rounds), ``load_ms`` how long the load took.

``--resume``: the same loading modes for a hibernated kernel's first cell (restore-based start:
its three new replicas rebuild the namespace from its image): ``resume_small_ms`` and
``resume_big_ms`` from execute to reply, each after the kernel hibernated again, with the
resumed executor's waits (``*_wait_ms``, its ``timings``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_state_sync import MB, embedded_cluster, run_cell  # noqa: E402
from jupyter_client import KernelManager  # noqa: E402

from services.cluster_file import ask_sync, read_cluster  # noqa: E402
from shared import messages  # noqa: E402
from shared.security import curve  # noqa: E402

WAITS = ("state_wait_ms", "apply_wait_ms", "load_wait_ms")  # what a new executor's first cell waits for
LOADING = {"eager": {"datastore.lazy_load": "false"}, "lazy": {"datastore.lazy_load": "true"}}

PATHS = {
    "write": {"datastore.write_behind": "false", "datastore.background_image": "false"},
    "aside": {"datastore.write_behind": "true", "datastore.background_image": "false"},
    "image": {"datastore.write_behind": "true", "datastore.background_image": "true"},
}
KINDS = {"torch": "big.add_(1)", "numpy": "arr += 1"}


def _timed(kc: Any, code: str) -> float:
    started = time.perf_counter()
    run_cell(kc, code, timeout=300)
    return (time.perf_counter() - started) * 1000


def measure_path(mb: int, repeat: int, settle_s: float) -> dict[str, float]:
    km = KernelManager(kernel_name="tandem")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    out: dict[str, float] = {}
    try:
        kc.wait_for_ready(timeout=90)
        n = mb * MB // 4
        run_cell(
            kc,
            f"import numpy as np, torch, time\nbig = torch.zeros({n})\narr = np.zeros({n}, dtype=np.float32)\nx = 0",
            timeout=300,
        )
        time.sleep(settle_s)
        for change in KINDS.values():  # warm-up: the first image opens its store link
            run_cell(kc, change, timeout=300)
            time.sleep(settle_s)
        for kind, change in KINDS.items():
            replies, nexts, changes = [], [], []
            for _ in range(repeat):
                replies.append(_timed(kc, change))
                nexts.append(_timed(kc, "x += 1"))
                time.sleep(settle_s)  # the copy and the standbys' loads end before the next round
            for _ in range(repeat):  # the change alone, timed inside the cell
                run_cell(
                    kc, f"t0 = time.perf_counter(); {change}; dt = time.perf_counter() - t0", timeout=300
                )
                changes.append(float(kc_eval(kc, "dt")) * 1000)
                time.sleep(settle_s)
            out[f"reply_ms_{kind}"] = round(statistics.median(replies), 1)
            out[f"next_ms_{kind}"] = round(statistics.median(nexts), 1)
            out[f"change_ms_{kind}"] = round(statistics.median(changes), 1)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return out


class _Scheduler:
    """The embedded cluster's global scheduler, asked as its operator (cordons, status)."""

    def __init__(self, state_dir: Path) -> None:
        self.address = read_cluster(state_dir).scheduler
        self.credentials = curve.client_curve(state_dir / "keys", curve.OPERATOR, curve.SCHEDULER)

    def ask(self, msg_type: str, body: dict[str, Any]) -> dict[str, Any]:
        return ask_sync(self.address, msg_type, body, credentials=self.credentials)

    def replica_hosts(self, kernel_id: str) -> list[str]:
        deadline = time.monotonic() + 60
        while True:
            status = self.ask(messages.CLUSTER_STATUS, {})
            kernel = next(k for k in status["kernels"] if k["id"] == kernel_id)
            hosts = sorted({r["host"] for r in kernel["replicas"] if r.get("host")})
            if len(hosts) >= 2 or time.monotonic() > deadline:
                return hosts

    def only_open(self, host: str, hosts: list[str]) -> None:
        for other in hosts:
            self.ask(messages.HOST_UNCORDON if other == host else messages.HOST_CORDON, {"host_id": other})


def _cell_on(kc: Any, code: str) -> tuple[float, str]:
    """(ms from execute to reply, the host that ran it)."""
    started = time.perf_counter()
    msg_id = kc.execute(code)
    while True:
        reply = kc.get_shell_msg(timeout=300)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    elapsed = (time.perf_counter() - started) * 1000
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell failed: {reply['content']}")
    return elapsed, str(reply.get("metadata", {}).get("tandem", {}).get("host_id", "?"))


def measure_executor_change(mb: int, repeat: int, settle_s: float, state_dir: Path) -> dict[str, Any]:
    km = KernelManager(kernel_name="tandem")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    scheduler = _Scheduler(state_dir)
    small: list[float] = []
    big: list[float] = []
    waits: dict[str, list[float]] = {}  # the probe's own steps (its replica's ``timings``)
    off_host = 0
    try:
        kc.wait_for_ready(timeout=90)
        hosts = scheduler.replica_hosts(km.kernel_id)
        run_cell(kc, "import torch\nx = 1", timeout=300)
        time.sleep(settle_s)
        for round_ in range(2 * repeat):
            maker, prober = hosts[round_ % 2], hosts[(round_ + 1) % 2]
            scheduler.only_open(maker, hosts)
            _, ran = _cell_on(kc, f"big = torch.full(({mb * MB // 4},), {round_}.0)")
            off_host += ran != maker
            scheduler.only_open(prober, hosts)  # at once: the prober is still reading ``big``
            probe = "print(x + 1)" if round_ % 2 == 0 else "print(float(big[-1]))"
            elapsed, ran = _cell_on(kc, probe)
            off_host += ran != prober
            (small if round_ % 2 == 0 else big).append(elapsed)
            steps = json.loads(
                kc_eval(kc, "__import__('json').dumps(get_ipython().kernel.timings[-1])")[1:-1]
            )
            for key in WAITS:
                waits.setdefault(f"{key}_{'small' if round_ % 2 == 0 else 'big'}", []).append(
                    steps.get(key, 0.0)
                )
            time.sleep(settle_s)
    finally:
        with contextlib.suppress(Exception):
            for host in scheduler.replica_hosts(km.kernel_id):
                scheduler.ask(messages.HOST_UNCORDON, {"host_id": host})
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    loaded = _events(state_dir, km.kernel_id, "state_loaded")
    imported = _events(state_dir, km.kernel_id, "imports_loaded")
    applied = _events(state_dir, km.kernel_id, "state_applied")
    return {
        **{key: round(statistics.median(values), 1) for key, values in waits.items()},
        # the first STATE replays ``import torch``: eager on the main loop (apply_ms, all of it
        # silent), lazy on a worker thread (imports_loaded)
        "apply_max_ms": max((e["apply_ms"] for e in applied), default=None),
        "import_main_lag_ms": max((e["main_lag_ms"] for e in imported), default=None),
        "import_raft_lag_ms": max((e["raft_lag_ms"] or 0.0 for e in imported), default=None),
        "first_small_ms": round(statistics.median(small), 1),
        "first_big_ms": round(statistics.median(big), 1),
        "main_lag_ms": max((e["main_lag_ms"] for e in loaded), default=None),
        "raft_lag_ms": max((e["raft_lag_ms"] or 0.0 for e in loaded), default=None),
        "load_ms": round(statistics.median(e["took_ms"] for e in loaded), 1) if loaded else None,
        "cells_off_host": off_host,  # an election gave the cell to a cordoned host's replica
    }


RESUME = {"kernel.hibernate_after_s": "3", "kernel.hibernate_interval_s": "0.5"}


def measure_resume(mb: int, repeat: int, state_dir: Path) -> dict[str, Any]:
    km = KernelManager(kernel_name="tandem")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    scheduler = _Scheduler(state_dir)
    times: dict[str, list[float]] = {}
    try:
        kc.wait_for_ready(timeout=90)
        run_cell(kc, f"import torch\nbig = torch.full(({mb * MB // 4},), 1.0)\nx = 1", timeout=300)
        for round_ in range(2 * repeat):
            deadline = time.monotonic() + 120
            while scheduler.ask(messages.KERNEL_STATUS, {"kernel_id": km.kernel_id})["state"] != "hibernated":
                if time.monotonic() > deadline:
                    raise RuntimeError("the kernel did not hibernate")
                time.sleep(0.2)
            kind = "small" if round_ % 2 == 0 else "big"
            elapsed, ran = _cell_on(kc, "print(x + 1)" if kind == "small" else "print(float(big[-1]))")
            times.setdefault(f"resume_{kind}_ms", []).append(elapsed)
            hosts = scheduler.replica_hosts(km.kernel_id)
            scheduler.only_open(ran, hosts)  # its steps are in the probe's replica's ``timings``
            steps = json.loads(
                kc_eval(kc, "__import__('json').dumps(get_ipython().kernel.timings[-1])")[1:-1]
            )
            for host in hosts:
                scheduler.ask(messages.HOST_UNCORDON, {"host_id": host})
            for key in WAITS:
                times.setdefault(f"resume_{kind}_{key}", []).append(steps.get(key, 0.0))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return {key: round(statistics.median(values), 1) for key, values in times.items()}


def _events(state_dir: Path, kernel_id: str, name: str) -> list[dict[str, Any]]:
    """The kernel's replicas' ``name`` log events (``state_loaded``: large objects read)."""
    events = []
    for log in state_dir.glob(f"hosts/*/{kernel_id}/*/replica.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and name in line:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == name:
                        events.append(event)
    return events


def kc_eval(kc: Any, expression: str) -> str:
    reply = kc.execute_interactive("", user_expressions={"v": expression}, timeout=60)
    return str(reply["content"]["user_expressions"]["v"]["data"]["text/plain"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=4.0)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--paths", default="write,aside,image")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides key=value")
    parser.add_argument("--keep", default="", help="run in this directory and keep it (the replicas' logs)")
    parser.add_argument(
        "--executor-change", default="", help="loading modes to compare after an executor change: eager,lazy"
    )
    parser.add_argument(
        "--resume", default="", help="loading modes to compare on a resumed kernel: eager,lazy"
    )
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"mb": args.mb, "repeat": args.repeat, "load1": round(os.getloadavg()[0], 1)}
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-state-image-"))
        for mode in filter(None, args.executor_change.split(",")):
            cluster, state_dir = embedded_cluster(args, Path(tmp) / mode, **PATHS["image"], **LOADING[mode])
            try:
                cluster.start()
                figures = measure_executor_change(args.mb, args.repeat, args.settle_s, state_dir)
            finally:
                cluster.stop()
            result |= {f"{key}_{mode}": value for key, value in figures.items()}
        for mode in filter(None, args.resume.split(",")):
            overrides = {**PATHS["image"], **LOADING[mode], **RESUME}
            cluster, state_dir = embedded_cluster(args, Path(tmp) / f"resume-{mode}", **overrides)
            try:
                cluster.start()
                figures = measure_resume(args.mb, args.repeat, state_dir)
            finally:
                cluster.stop()
            result |= {f"{key}_{mode}": value for key, value in figures.items()}
        for name in args.paths.split(",") if not (args.executor_change or args.resume) else ():
            cluster, _ = embedded_cluster(args, Path(tmp) / name, **PATHS[name])
            try:
                cluster.start()
                figures = measure_path(args.mb, args.repeat, args.settle_s)
            finally:
                cluster.stop()
            result |= {f"{key}_{name}": value for key, value in figures.items()}
    result["load1_end"] = round(os.getloadavg()[0], 1)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
