#!/usr/bin/env python
"""Memory of one Tandem kernel (its three replica processes) on the embedded cluster, for a
notebook that never imports torch and for one that does, beside a stock ipykernel in the same run.

One ``tandem up`` (cold starts: ``prewarm.policy = none``, the default; a pre-warmed runtime has
imported torch on purpose). Each kernel runs its notebook's cells, then the script waits until the
memory of its three replicas has settled (the standbys apply the last cell's state after the reply)
and reads ``/proc/PID/smaps_rollup`` of each replica.

* RSS counts every resident page, shared libraries included, once per process;
* PSS divides each shared page among the processes that map it: the sum over a kernel's replicas
  is what the kernel adds to the machine (on one machine; on three hosts each replica pays its
  libraries alone, so per-host cost is nearer RSS).

Prints ONE JSON line: ``{notebook}_rss_mb`` and ``{notebook}_pss_mb`` per kernel (sum of the three
replicas), per-replica lists, ``{notebook}_torch_loaded`` (replicas that have imported torch: its
native library is mapped in ``/proc/PID/maps``), and the stock
ipykernel's figures. Before-vs-after is running it on two checkouts.

A second cluster in the same run has ``prewarm.template = true`` (no imports ahead): every replica
is forked from its host's runtime template (kernel_replica/template.py), so the interpreter,
IPython and the replica's modules are pages it shares with the template until written. Its
figures are prefixed ``template_``; ``template_host_rss_mb``/``pss_mb`` are the templates
themselves (one per host; four on this one machine), which a host pays once, not per kernel.

Usage: ``python scripts/bench_kernel_memory.py``
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernel_start import cluster  # noqa: E402
from jupyter_client import KernelManager  # noqa: E402

from services.cluster_file import ask_sync  # noqa: E402
from services.kernelspec import install_private  # noqa: E402
from shared import messages  # noqa: E402
from shared.security import curve  # noqa: E402

NOTEBOOKS: dict[str, list[str]] = {
    # a data-wrangling notebook with no ML framework: the stdlib, a few names in the namespace
    "no_torch": [
        "import json, collections, math\nrows = [{'i': i, 'sq': i * i} for i in range(1000)]",
        "counts = collections.Counter(r['sq'] % 7 for r in rows)\ntotal = sum(counts.values())",
        "print(json.dumps(dict(counts))[:40], total)",
    ],
    # the same, then a small model: torch imported by the notebook, tensors in the namespace
    "torch": [
        "import json, collections, math\nrows = [{'i': i, 'sq': i * i} for i in range(1000)]",
        "import torch\nw = torch.randn(256, 256)\nb = torch.zeros(256)",
        "y = (w @ torch.ones(256) + b).sum().item()\nprint(y)",
    ],
}
SETTLE_S = 2.0  # the replicas' memory must stay within 1 MB this long after the last cell


def smaps_rollup(pid: int) -> dict[str, float]:
    """RSS and PSS of ``pid`` in MB (``/proc/PID/smaps_rollup``)."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("Rss:", "Pss:"):
            fields[parts[0].rstrip(":").lower()] = int(parts[1]) / 1024
    return fields


def torch_mapped(pid: int) -> bool:
    """Whether torch's native library is mapped in ``pid`` (true once ``import torch`` ran)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def run_cells(km: KernelManager, cells: list[str]) -> None:
    kc = km.client()
    kc.start_channels()
    try:
        for code in cells:
            reply = kc.execute_interactive(code, timeout=180, output_hook=lambda _msg: None)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"cell failed: {reply['content']}")
    finally:
        kc.stop_channels()


def settled(pids: list[int]) -> list[dict[str, float]]:
    """Each pid's smaps figures once none of them moved by more than 1 MB for ``SETTLE_S``."""
    last = [smaps_rollup(p) for p in pids]
    stable_since = time.monotonic()
    deadline = stable_since + 60
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = [smaps_rollup(p) for p in pids]
        if any(abs(a["rss"] - b["rss"]) > 1 for a, b in zip(now, last, strict=True)):
            stable_since = time.monotonic()
        last = now
        if time.monotonic() - stable_since >= SETTLE_S:
            break
    return last


def kernel_pids(scheduler: str, state_dir: Path, kernel_id: str) -> list[int]:
    credentials = curve.client_curve(state_dir / "keys", curve.OPERATOR, curve.SCHEDULER)
    status = ask_sync(scheduler, messages.KERNEL_STATUS, {"kernel_id": kernel_id}, credentials=credentials)
    return [int(r["pid"]) for r in status["replicas"] if r["alive"]]


def measure(kernel_name: str, cells: list[str], pids_of: Any) -> dict[str, Any]:
    km = KernelManager(kernel_name=kernel_name)
    km.start_kernel(stderr=subprocess.DEVNULL)
    try:
        run_cells(km, cells)
        pids = pids_of(km)
        figures = settled(pids)
        return {
            "rss_mb": round(sum(f["rss"] for f in figures), 1),
            "pss_mb": round(sum(f["pss"] for f in figures), 1),
            "replica_rss_mb": [round(f["rss"], 1) for f in figures],
            "replica_pss_mb": [round(f["pss"], 1) for f in figures],
            "torch_loaded": sum(torch_mapped(p) for p in pids),
        }
    finally:
        km.shutdown_kernel(now=True)


def templates() -> list[int]:
    """The runtime templates running (a forked runtime shows the same command line, but its
    parent is a template)."""

    def cmdline(pid: str) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and b"kernel_replica.template" in cmdline(entry.name):
            status = (entry / "status").read_text()
            ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
            if b"kernel_replica.template" not in cmdline(ppid):
                found.append(int(entry.name))
    return found


def bench() -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "kernel_memory"}
    with tempfile.TemporaryDirectory(prefix="bench-kernel-memory-") as tmp:
        install_private(Path(tmp) / "prefix")
        for prefix, settings in (("", ()), ("template_", ("prewarm.template=true", "prewarm.imports=[]"))):
            state = Path(tmp) / f"state{prefix}"
            with cluster(state, "prewarm.policy=none", *settings) as info:

                def tandem_pids(
                    km: KernelManager, state: Path = state, info: dict[str, Any] = info
                ) -> list[int]:
                    return kernel_pids(info["scheduler"], state, km.kernel_id)

                for name, cells in NOTEBOOKS.items():
                    figures = measure("tandem", cells, tandem_pids)
                    for key, value in figures.items():
                        result[f"{prefix}{name}_{key}"] = value
                if prefix:
                    hosts = [smaps_rollup(pid) for pid in templates()]
                    result["template_hosts"] = len(hosts)
                    result["template_host_rss_mb"] = [round(f["rss"], 1) for f in hosts]
                    result["template_host_pss_mb"] = [round(f["pss"], 1) for f in hosts]
                else:
                    stock = measure("python3", NOTEBOOKS["no_torch"], lambda km: [km.provisioner.process.pid])
                    result["ipykernel_no_torch_rss_mb"] = stock["rss_mb"]
                    result["ipykernel_no_torch_pss_mb"] = stock["pss_mb"]
    return result


def main() -> int:
    print(json.dumps(bench()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
