"""A data-parallel best-effort job for the job runner (LISS through the runner path): the job's
process starts one gloo rank per GPU of its lease, each training the float64 MLP of
``_liss_worker`` on its slice of every global batch (``DataParallelLiss``: it steals samples only
while the local scheduler says the job is packed). A rank whose GPU another job shares is slowed
(sleeps per sample in its forward pass), as the co-located job would slow it on a GPU.

    python _liss_job.py OUT GO [EPOCHS]

Rank 0 runs the job-side API's step loop (progress, share, control word); the ranks wait for the
file GO before the first step; rank 0 writes OUT (JSON): the global batches seen, the split each
step ran with, whether it stole, the trained parameters.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _liss_worker import DATASET, EPOCHS, GLOBAL_BATCH, setup
from torch import nn

import tandem_job
from shared.packing.liss import DataParallelLiss

SLOW_S_PER_SAMPLE = 0.004


def rank_main(rank: int, world: int, port: int, out: str, go: str, epochs: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    my_gpu = tandem_job.gpu_ids()[rank]
    try:
        model, ddp, opt, x, y = setup()
        liss = DataParallelLiss(DATASET, GLOBAL_BATCH, seed=1)
        while not Path(go).exists():
            time.sleep(0.01)

        def batches():
            for epoch in range(epochs):
                liss.sampler.set_epoch(epoch)
                yield from liss.sampler

        seen, stealing = [], []
        total = epochs * len(liss.sampler)
        local_batches = batches()

        def step() -> None:
            local = next(local_batches)
            t0 = time.perf_counter()
            pred = ddp(x[local])
            if my_gpu in tandem_job.packing().get("shared_device_ids", []):
                time.sleep(SLOW_S_PER_SAMPLE * len(local))  # the job packed on this GPU slows it
            forward_s = time.perf_counter() - t0
            loss = nn.functional.mse_loss(pred, y[local]) * liss.loss_scale(len(local))
            opt.zero_grad()
            loss.backward()
            opt.step()
            gathered: list = [None] * world
            dist.all_gather_object(gathered, local)
            seen.append([i for part in gathered for i in part])
            liss.exchange(forward_s)
            stealing.append(liss.stealing)

        if rank == 0:
            with tandem_job.session(total=total) as job:
                for _ in job.steps():
                    liss.go()
                    step()
                liss.go(False)  # done, or stopped by the runner: the other ranks leave too
            params = [p.detach().flatten().tolist() for p in model.parameters()]
            result = {"seen": seen, "counts": liss.history, "stealing": stealing, "params": params,
                      "moves": liss.balancer.moves, "stopped": job.stopped}  # fmt: skip
            tandem_job.write_atomically(Path(out), json.dumps(result))
        else:
            while liss.go():
                step()
        dist.barrier()  # no rank tears gloo down while its peer still has a collective in flight
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as _liss_worker: no interpreter teardown under gloo


def main() -> None:
    out, go = sys.argv[1], sys.argv[2]
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else EPOCHS
    world = len(tandem_job.gpu_ids())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the ranks inherit the imported torch (spawn would import it once per rank again)
    mp.start_processes(rank_main, args=(world, port, out, go, epochs), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main()
