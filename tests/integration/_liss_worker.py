"""A data-parallel training process for the LISS test: a float64 MLP on a fixed synthetic set,
2 ranks on gloo under DDP, LISS on or off; rank 0 returns the global batches it saw (gathered from
every rank), the per-step counts and the trained parameters."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shared.packing.liss import LissBalancer, LissBatchSampler, loss_scale

DATASET = 96
FEATURES = 8
GLOBAL_BATCH = 16
EPOCHS = 2


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(DATASET, FEATURES, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)).tanh()
    return x, y


def setup() -> tuple[nn.Module, DistributedDataParallel, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """The seeded model under DDP, its optimizer and the data set (gloo initialised)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _data()
    return model, ddp, opt, x, y


def train(rank: int, world: int, port: int, steal: bool, slow_rank_s_per_sample: float, out: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, ddp, opt, x, y = setup()
        balancer = LissBalancer(GLOBAL_BATCH, world)
        sampler = LissBatchSampler(DATASET, GLOBAL_BATCH, rank, balancer, seed=1)
        seen: list[list[int]] = []
        counts: list[list[int]] = []
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for local in sampler:
                counts.append(list(balancer.counts))
                t0 = time.perf_counter()
                pred = ddp(x[local])
                if rank == 1 and slow_rank_s_per_sample:
                    time.sleep(slow_rank_s_per_sample * len(local))  # a co-located job slows rank 1
                forward_s = time.perf_counter() - t0
                loss = nn.functional.mse_loss(pred, y[local]) * loss_scale(len(local), GLOBAL_BATCH, world)
                opt.zero_grad()
                loss.backward()
                opt.step()
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, local)
                seen.append([i for part in gathered for i in part])
                times = torch.zeros(world, dtype=torch.float64)
                times[rank] = forward_s
                dist.all_reduce(times)
                if steal:
                    balancer.observe(times.tolist())
        if rank == 0:
            params = [p.detach().flatten().tolist() for p in model.parameters()]
            out.put({"seen": seen, "counts": counts, "params": params, "moves": balancer.moves})
        dist.barrier()  # no rank tears gloo down while its peer still has a collective in flight
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: a CI run aborted both ranks there ("terminate
    # called without an active exception", SIGABRT) after the results were in. Flush first.
    out.close()
    out.join_thread()
    os._exit(0)
