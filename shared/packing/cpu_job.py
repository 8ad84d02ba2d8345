"""A small CPU training job under the duty-cycle governor: the live half of ``bench_packing``.

``python -m shared.packing.cpu_job --steps N --share-file S --progress-file P --go-file G``
builds an MLP regression on synthetic data (torch, CPU), waits until ``G`` exists (so process and
torch start-up stay out of the measured completion time), then trains ``N`` steps, each inside
``DutyCycleGovernor.step()`` reading its share from ``S``. After every step it atomically writes
``steps monotonic_s process_cpu_s share paused_s`` to ``P``: the runtime monitor's view (throughput from steps over
time, utilization from CPU seconds over wall seconds)."""

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
    args = p.parse_args()

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
