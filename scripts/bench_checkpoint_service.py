"""The checkpoint service and checkpoint-and-stop, measured (issue #17). Prints one JSON line.

1. ``service_round_trip_ms_p50/p99``: a host's ``checkpoint.commit`` of an image a real agent just
   committed to the store (~``--mb`` MB of model, read back and checked by the service: manifest
   parsed, every pack present, book written to disk) followed by ``checkpoint.latest`` naming it:
   announce -> stored -> latest, over CURVE on loopback. ``service_commit_ms_p50``: the service's
   own share. ``stop_image_s_p50``: ``agent.checkpoint()`` of that model (every tensor changed
   since the last image): what checkpoint-and-stop waits for at its boundary. A job's
   announcement also waits for the host's next look at its file (at most ``RELAY_POLL_S``,
   50 ms), not counted here.
2. ``--cycles`` checkpoint-and-stop cycles of ``examples/checkpointed_job.py`` (a real job process,
   MLP + Adam, ~0.4 MB image) moved between two hosts (``BatchJobs`` with links of their own):
   ``stop_release_s_p50`` (lease end asked -> job exited, image at the service, GPUs free),
   ``checkpoint_stop_s_p50`` (the job's own: stop word seen -> image committed),
   ``stop_teardown_s_p50`` (image announced -> GPUs free: the job's interpreter exit at its idle
   CPU priority, and the relay), ``restore_s_p50`` (the job's own: image restore begun -> done) and
   ``steps_lost_max`` (steps reported at the stop - the image's step).

Everything runs on this machine's CPU; on a loaded machine the job (nice 19, SCHED_IDLE) is slow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tests" / "integration"))

from _checkpoint_hosts import Host, cluster, grant  # noqa: E402

from services.checkpoint_service.service import CheckpointService  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def round_trips(host: Host, service: CheckpointService, images: int, mb: int) -> dict[str, float]:
    import torch
    from torch import nn

    from shared.checkpoint import CheckpointAgent, StoreLink, TrainingState
    from shared.datastore import open_datastore

    torch.manual_seed(0)
    width = int((mb * 1024 * 1024 / 4 / 4) ** 0.5)  # four width x width layers
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = TrainingState(model, optimizer)
    store_link = StoreLink.start(lambda: open_datastore(service.cfg))
    agent = CheckpointAgent(state, store_link, job="bench-job")
    link = host.link
    trips: list[float] = []
    images_s: list[float] = []  # agent.checkpoint(): what a checkpoint-and-stop of this model waits for
    try:
        for step in range(1, images + 1):
            x = torch.randn(8, width)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agent.step_boundary(step)
            began = time.perf_counter()
            result = await asyncio.get_running_loop().run_in_executor(None, agent.checkpoint)
            images_s.append(time.perf_counter() - began)
            started = time.perf_counter()
            await link.commit(
                "bench-job", {"manifest": result.manifest_ref.to_dict(), "written": list(result.written)}
            )
            latest = await link.latest("bench-job")
            trips.append((time.perf_counter() - started) * 1000)
            assert latest is not None and latest["manifest"]["digest"] == result.manifest_ref.digest
    finally:
        agent.close()
        store_link.close()
    commit_ms = list(service.commit_ms)
    return {
        "service_image_mb": round(sum(p.numel() * 4 for p in model.parameters()) / 2**20, 1),
        "service_round_trip_ms_p50": round(statistics.median(trips), 3),
        "service_round_trip_ms_p99": round(percentile(trips, 0.99), 3),
        "service_commit_ms_p50": round(statistics.median(commit_ms), 3),
        "service_images": len(trips),
        "stop_image_s_p50": round(statistics.median(images_s), 4),
    }


async def stop_cycles(hosts: tuple[Host, Host], cycles: int, workdir: Path) -> dict[str, float]:
    release, ckpt_stop, teardown, restore, lost = [], [], [], [], []
    body = grant("cycled", workdir / "digest", workdir, total=100_000, every=5)
    for cycle in range(cycles + 1):
        jobs = hosts[cycle % 2].jobs
        await jobs.grant(body)
        run = jobs.runs["cycled"]
        first = run.restored_step or 0
        deadline = time.monotonic() + 300
        while int((run.process.progress() or {}).get("iterations_done") or 0) < first + 8:
            assert time.monotonic() < deadline and not run.process.exited.is_set(), "the job does not step"
            await asyncio.sleep(0.02)
        if cycle > 0:
            restore.append(float((run.process.progress() or {})["restore_s"]))
        if cycle == cycles:
            await jobs.end("cycled", reason="cancelled")
            break
        asked = time.monotonic()
        ended = await jobs.end("cycled", reason="moved")
        release.append(time.monotonic() - asked)
        released_at = time.time()
        progress = ended["progress"]
        ckpt_stop.append(float(progress["checkpoint_stop_s"]))
        lost.append(int(progress["iterations_done"]) - int(ended["checkpoint_step"]))
        announced = json.loads((run.process.directory / "checkpoint.json").read_text())["at"]
        teardown.append(released_at - float(announced))
    return {
        "stop_cycles": len(release),
        "stop_release_s_p50": round(statistics.median(release), 4),
        "stop_release_s_max": round(max(release), 4),
        "checkpoint_stop_s_p50": round(statistics.median(ckpt_stop), 4),
        "stop_teardown_s_p50": round(statistics.median(teardown), 4),
        "restore_s_p50": round(statistics.median(restore), 4),
        "steps_lost_max": max(lost),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-service-") as tmp:
        async with cluster(Path(tmp), gpus=1) as (service, a, b):
            figures = await round_trips(a, service, args.images, args.mb)
            if args.cycles > 0:
                figures |= await stop_cycles((a, b), args.cycles, Path(tmp))
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=20, help="images committed for the round trip")
    parser.add_argument("--mb", type=int, default=50, help="model size of those images (MB)")
    parser.add_argument("--cycles", type=int, default=3, help="checkpoint-and-stop cycles of a real job")
    args = parser.parse_args()
    figures = asyncio.run(main_async(args))
    print(json.dumps({"load_average_1m": round(os.getloadavg()[0], 2), **figures}))


if __name__ == "__main__":
    main()
