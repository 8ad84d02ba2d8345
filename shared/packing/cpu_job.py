"""A small CPU training job under the duty-cycle governor: the live half of ``bench_packing``.

``python -m shared.packing.cpu_job --steps N --share-file S --progress-file P --go-file G``
builds an MLP regression on synthetic data (torch, CPU), waits until ``G`` exists (so process and
torch start-up stay out of the measured completion time), then trains ``N`` steps, each inside
``DutyCycleGovernor.step()`` reading its share from ``S``. After every step it atomically writes
``steps monotonic_s process_cpu_s share paused_s`` to ``P``: the runtime monitor's view (throughput from steps over
time, utilization from CPU seconds over wall seconds).

``--load-ms``: before each step the job waits that long for its batch (a synchronous input fetch
from remote storage with no prefetch, modelled as an I/O wait): the device idles meanwhile, the way
the paper's underusing jobs leave a GPU idle (§2). The wait is outside the governor's step: an MPS
cap slows the job's kernels, not its input pipeline. ``--cpu``: pin the job to that core (the
bench's one "GPU", shared by both jobs of a pair)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

from shared.packing.governor import DutyCycleGovernor, FileShare


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--share-file", type=Path, required=True)
    p.add_argument("--progress-file", type=Path, required=True)
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-ms", type=float, default=0.0, help="input wait before each step")
    p.add_argument("--cpu", type=int, default=None, help="pin to this core (the shared device)")
    args = p.parse_args()

    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(64, args.width),
        nn.ReLU(),
        nn.Linear(args.width, args.width),
        nn.ReLU(),
        nn.Linear(args.width, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch * 8, 64)
    y = x[:, :1].sin()
    governor = DutyCycleGovernor(FileShare(args.share_file).read)
    _write(args.progress_file, f"0 {time.monotonic()} {time.process_time()}\n")
    while not args.go_file.exists():
        time.sleep(0.002)
    for step in range(args.steps):
        if args.load_ms > 0:
            time.sleep(args.load_ms / 1000)  # the batch arrives: the device was idle meanwhile
        with governor.step():
            i = (step % 8) * args.batch
            loss = nn.functional.mse_loss(model(x[i : i + args.batch]), y[i : i + args.batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            _write(
                args.progress_file,
                f"{step + 1} {time.monotonic()} {time.process_time()} {governor.share} {governor.paused_s}\n",
            )


if __name__ == "__main__":
    main()
