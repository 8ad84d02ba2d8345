"""The concurrent checkpoint agent against stop-the-world ``torch.save``, on CPU training with Adam.

For each model size (default ~50 MB and ~200 MB of parameters; a stack of transformer-style MLP
blocks, d=1024, ff=2048, LayerNorm), in the same process and on the same model:

- ``stall_ms``: training-thread time the checkpoint costs (begin, copy-on-write, commit at a
  step boundary), median over ``--checkpoints`` checkpoints each overlapping training;
  ``stop_world_stall_ms``: ``torch.save`` of the same state (model, optimizer, RNG, step) to a
  file, median of as many.
- ``every3_step_slowdown``: mean step time with a checkpoint begun every 3 steps / without;
  ``stop_world_every3_step_slowdown``: the same with ``torch.save`` every 3 steps. The three
  variants run interleaved in rounds, so each sees the same machine load.

Then, on the first size:

- ``incremental_bytes_ratio_frozen_backbone``: bytes stored by a second checkpoint (packs, small
  state, manifest) / the full image, for a frozen backbone whose head alone trains (Adam on it).
- ``incremental_bytes_ratio_sparse_embedding``: the same for an embedding table of the model's
  size trained by SparseAdam on 16 hot rows; ``..._vs_model`` divides by the table instead.
- ``restore_first_step_ratio``: time to the first forward output after an on-demand restore /
  after a full restore, reading through a store throttled to ``--restore-mb-s``.

``stall_cpu_ms`` / ``stop_world_stall_cpu_ms`` give the training thread's CPU time for the same
events: on a shared machine wall time also counts waiting for a core. ``cow_mb_median`` is what
copy-on-write copied on the training thread (the copier had not reached it before the optimizer
step wrote it).

``--device cuda``: the same on a GPU (model, optimizer state and batches in device memory; the
agent clones device tensors at the instant, stream-ordered, and its copier moves them to host).
Timers wait for the device (``torch.cuda.synchronize``) before they start and where a figure
must include queued device work (step times; ``begin_synced_ms``: begin until the instant's clones
ran), so a figure does not count another's kernels.

Prints one JSON line. ``--quick``: ~16 and ~32 MB, fewer steps (a smoke run, not a measurement).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.checkpoint import CheckpointAgent, CommitResult, Restore, StoreLink, TrainingState
from shared.checkpoint.state import rng_state
from shared.datastore import ObjectRef
from shared.datastore.keys import ChecksumVerifier
from shared.datastore.local_backend import LocalStore

MB = 1024 * 1024


class ThrottledStore(LocalStore):
    """A local store whose reads share one link of ``mb_s``: a remote store's bandwidth. Reads in
    flight together queue for it, as they would on a network link."""

    def __init__(self, root: Path, mb_s: float) -> None:
        super().__init__(root, fsync=False, cache_bytes=0)
        self.bytes_per_s = mb_s * MB
        self._link_free_at = 0.0

    async def _read_into(self, ref: ObjectRef, view: memoryview, verifier: ChecksumVerifier) -> int:
        done_at = self._link_free_at = (
            max(time.perf_counter(), self._link_free_at) + ref.size / self.bytes_per_s
        )
        filled = await super()._read_into(ref, view, verifier)
        await asyncio.sleep(max(0.0, done_at - time.perf_counter()))
        return filled


class Block(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, ff)
        self.down = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def mlp(megabytes: float, d: int = 1024, ff: int = 2048) -> nn.Sequential:
    per_block = (2 * d * ff + d + ff + 2 * d) * 4
    blocks = max(1, round(megabytes * MB / per_block))
    return nn.Sequential(*[Block(d, ff) for _ in range(blocks)], nn.Linear(d, 16))


def model_bytes(model: nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    def __init__(self, model: nn.Module, batch: int, device: torch.device) -> None:
        self.device = device
        self.model = model.to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, foreach=True)
        self.state = TrainingState(self.model, self.opt)
        self.x = torch.randn(batch, 1024, device=device)
        self.y = torch.randint(0, 16, (batch,), device=device)

    def step(self) -> None:
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.state.step += 1

    def save_stop_world(self, path: Path) -> tuple[float, float]:
        """torch.save of the same state on the training thread: (wall, CPU) seconds."""
        sync(self.device)
        started, cpu = time.perf_counter(), time.thread_time()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": rng_state(),
            "step": self.state.step,
        }
        torch.save(state, path)
        return time.perf_counter() - started, time.thread_time() - cpu


def open_link(root: Path, store: Callable[[Path], LocalStore] | None = None) -> StoreLink:
    async def opener() -> LocalStore:
        return store(root) if store is not None else LocalStore(root, fsync=False)

    return StoreLink.start(opener)


def run_until_commit(trainer: Trainer, agent: CheckpointAgent, limit: int = 50) -> CommitResult:
    sync(trainer.device)
    agent.begin()
    for _ in range(limit):
        trainer.step()
        result = agent.step_boundary(trainer.state.step)
        if result is not None:
            return result
    return agent.wait()


def stalls(megabytes: float, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = mlp(megabytes)
    trainer = Trainer(model, args.batch, device)
    link = open_link(tmp / f"store-{megabytes}")
    agent = CheckpointAgent(trainer.state, link, job=f"bench-{megabytes}")
    for _ in range(2):
        trainer.step()
    run_until_commit(trainer, agent)  # the first image: everything is new
    agent_stalls: list[CommitResult] = []
    world_stalls: list[tuple[float, float]] = []
    for _ in range(args.checkpoints):
        agent_stalls.append(run_until_commit(trainer, agent))
        world_stalls.append(trainer.save_stop_world(tmp / "stop-world.pt"))
        trainer.step()
    begin_synced: list[float] = []
    if device.type == "cuda":  # begin until the instant's device clones ran, then let it commit
        for _ in range(args.checkpoints):
            sync(device)
            started = time.perf_counter()
            agent.begin()
            sync(device)
            begin_synced.append(time.perf_counter() - started)
            agent.wait()
            trainer.step()
    # Every 3 steps: none / agent / torch.save, interleaved round by round.
    times: dict[str, list[float]] = {"none": [], "agent": [], "save": []}
    thread_cpu: dict[str, list[float]] = {"none": [], "agent": [], "save": []}
    process_cpu: dict[str, list[float]] = {"none": [], "agent": [], "save": []}
    for _ in range(args.rounds):
        for mode in ("none", "agent", "save"):
            started, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
            for i in range(args.steps):
                trainer.step()
                if mode == "agent":
                    agent.step_boundary(trainer.state.step)
                    if i % 3 == 2 and not agent.in_flight:
                        agent.begin()
                elif mode == "save" and i % 3 == 2:
                    trainer.save_stop_world(tmp / "stop-world.pt")
            if mode == "agent" and agent.in_flight:
                agent.wait()
            sync(device)
            times[mode].append((time.perf_counter() - started) / args.steps)
            thread_cpu[mode].append((time.thread_time() - cpu) / args.steps)
            process_cpu[mode].append((time.process_time() - proc) / args.steps)
    link.close()
    base = statistics.median(times["none"])
    wall = [r.stall_s for r in agent_stalls]
    synced = {"begin_synced_ms": round(statistics.median(begin_synced) * 1000, 2)} if begin_synced else {}
    return {
        **synced,
        "model_mb": round(model_bytes(model) / MB, 1),
        "step_ms": round(base * 1000, 1),
        "stall_ms": round(statistics.median(wall) * 1000, 2),
        "stall_ms_max": round(max(wall) * 1000, 2),
        "stall_cpu_ms": round(statistics.median(r.stall_cpu_s for r in agent_stalls) * 1000, 2),
        "cow_mb_median": round(statistics.median(r.stats.cow_bytes for r in agent_stalls) / MB, 1),
        "stop_world_stall_ms": round(statistics.median(w for w, _ in world_stalls) * 1000, 1),
        "stop_world_stall_cpu_ms": round(statistics.median(c for _, c in world_stalls) * 1000, 1),
        "every3_step_slowdown": round(statistics.median(times["agent"]) / base, 3),
        "stop_world_every3_step_slowdown": round(statistics.median(times["save"]) / base, 3),
        # Where the time goes: the training thread's CPU per step, and the whole process's
        # (copier and store threads included), each against the run without checkpoints.
        "every3_train_cpu_ratio": round(
            statistics.median(thread_cpu["agent"]) / statistics.median(thread_cpu["none"]), 3
        ),
        "stop_world_every3_train_cpu_ratio": round(
            statistics.median(thread_cpu["save"]) / statistics.median(thread_cpu["none"]), 3
        ),
        "every3_process_cpu_ratio": round(
            statistics.median(process_cpu["agent"]) / statistics.median(process_cpu["none"]), 3
        ),
        "stop_world_every3_process_cpu_ratio": round(
            statistics.median(process_cpu["save"]) / statistics.median(process_cpu["none"]), 3
        ),
    }


def increment(state: TrainingState, step: Callable[[], None], root: Path) -> tuple[int, int]:
    """Bytes a checkpoint stores (new packs + small state + manifest) three steps after a first
    one, and the image's size."""
    link = open_link(root)
    agent = CheckpointAgent(state, link, job=root.name)
    step()
    agent.checkpoint()
    for _ in range(3):
        step()
    result = agent.checkpoint()
    link.close()
    written = result.stats.new_bytes + result.manifest.meta.size + len(result.manifest.to_json())
    return written, result.manifest.image_bytes()


def frozen_backbone(megabytes: float, tmp: Path, device: torch.device) -> float:
    torch.manual_seed(1)
    backbone = mlp(megabytes)
    backbone.requires_grad_(False)
    head = nn.Linear(16, 10)
    model = nn.Sequential(backbone, head).to(device)
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    state = TrainingState(model, opt)
    x, y = torch.randn(8, 1024, device=device), torch.randint(0, 10, (8,), device=device)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    written, image = increment(state, step, tmp / "frozen")
    return written / image


def sparse_embedding(megabytes: float, tmp: Path, device: torch.device) -> tuple[float, float]:
    torch.manual_seed(2)
    dim = 128
    rows = int(megabytes * MB / (dim * 4))
    table = nn.Embedding(rows, dim, sparse=True).to(device)
    opt = torch.optim.SparseAdam(list(table.parameters()), lr=1e-2)
    state = TrainingState(table, opt)
    hot = torch.randperm(rows, device=device)[:16]
    readout = torch.randn(dim, device=device)

    def step() -> None:
        batch = hot[torch.randint(0, len(hot), (32,), device=device)]
        loss = (table(batch) @ readout).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    written, image = increment(state, step, tmp / "sparse")
    return written / image, written / table.weight.nbytes


def restore_first_step(
    megabytes: float, mb_s: float, tmp: Path, repeat: int, device: torch.device
) -> dict[str, float]:
    torch.manual_seed(3)
    trainer = Trainer(mlp(megabytes), 8, device)
    root = tmp / "restore"
    link = open_link(root)
    agent = CheckpointAgent(trainer.state, link, job="restore")
    trainer.step()
    image = agent.checkpoint().manifest
    link.close()
    firsts: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        for on_demand in (True, False):
            torch.manual_seed(3)
            fresh = Trainer(mlp(megabytes), 8, device)
            sync(device)
            throttled = open_link(root, lambda path: ThrottledStore(path, mb_s))
            started = time.perf_counter()
            restore = Restore(fresh.state, throttled, image)
            restore.start(on_demand=on_demand)
            if not on_demand:
                restore.wait()
            fresh.model(fresh.x)
            sync(device)
            firsts[on_demand].append(time.perf_counter() - started)
            restore.wait()
            throttled.close()
    on_demand_s, eager_s = statistics.median(firsts[True]), statistics.median(firsts[False])
    return {
        "restore_first_step_ratio": round(on_demand_s / eager_s, 3),
        "restore_first_step_on_demand_ms": round(on_demand_s * 1000, 1),
        "restore_first_step_full_ms": round(eager_s * 1000, 1),
        "restore_store_mb_s": mb_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, few steps (smoke run)")
    parser.add_argument("--sizes", type=float, nargs="+", help="model sizes in MB (default 50 200)")
    parser.add_argument("--checkpoints", type=int, help="checkpoints timed per size (default 5)")
    parser.add_argument("--rounds", type=int, help="interleaved every-3-steps rounds (default 3)")
    parser.add_argument("--steps", type=int, default=9, help="steps per round (a multiple of 3)")
    parser.add_argument(
        "--batch", type=int, default=64, help="rows per step (the copier races forward+backward)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for training")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to train on the GPU")
    parser.add_argument("--restore-mb-s", type=float, default=200.0, help="throttled store read bandwidth")
    args = parser.parse_args()
    sizes = args.sizes or ([16.0, 32.0] if args.quick else [50.0, 200.0])
    args.checkpoints = args.checkpoints or (2 if args.quick else 5)
    args.rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": args.threads,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "batch": args.batch,
    }
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp_name:
        tmp = Path(tmp_name)
        for megabytes in sizes:
            for key, value in stalls(megabytes, args, tmp).items():
                out[f"{key}_{megabytes:g}mb"] = value
        out["incremental_bytes_ratio_frozen_backbone"] = round(frozen_backbone(sizes[0], tmp, device), 5)
        sparse, sparse_vs_model = sparse_embedding(sizes[0], tmp, device)
        out["incremental_bytes_ratio_sparse_embedding"] = round(sparse, 5)
        out["incremental_bytes_ratio_sparse_embedding_vs_model"] = round(sparse_vs_model, 5)
        out.update(restore_first_step(sizes[0], args.restore_mb_s, tmp, 1 if args.quick else 3, device))
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
