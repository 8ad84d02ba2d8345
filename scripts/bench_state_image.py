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
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"mb": args.mb, "repeat": args.repeat}
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-state-image-"))
        for name in args.paths.split(","):
            cluster, _ = embedded_cluster(args, Path(tmp) / name, **PATHS[name])
            try:
                cluster.start()
                figures = measure_path(args.mb, args.repeat, args.settle_s)
            finally:
                cluster.stop()
            result |= {f"{key}_{name}": value for key, value in figures.items()}
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
