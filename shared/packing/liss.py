"""Lossless input sample stealing (LISS, Gimbal §4.1, after LB-BSP): the workers of a
data-parallel job split each global batch unevenly, faster workers taking samples from slower ones,
while the global batch (which samples, in which step) and the gradient stay those of the unpacked
job.

Three parts:

- ``split_counts`` / ``LissBalancer`` (pure): per-worker sample counts that sum to the global
  batch, rebalanced from each worker's measured forward time (the paper measures forward latency:
  the backward pass hides speed differences behind the all-reduce). Every rank runs the same
  balancer on the same all-gathered times, so all agree on the counts without a leader.
- ``LissBatchSampler``: the job's global batches, a seeded permutation per epoch cut into global
  batches exactly as the unpacked job cuts them; each rank takes its slice of every global batch.
- ``loss_scale``: the factor on a rank's mean loss that makes DDP's averaged gradient the mean over
  the global batch when local batches differ in size.

- ``DataParallelLiss``: the three together for one rank of a DDP job (gloo or NCCL), with the
  per-step exchange of forward times; stealing is on only while the job is packed (the local
  scheduler says so, ``tandem_job.packing``), as rank 0 sees it, so every rank agrees at every step.

Stealing changes only how the global batch's gradient sum is partitioned, so the trained result
equals the unpacked run's up to floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

REBALANCE_THRESHOLD = 1.10  # rebalance when the slowest forward is 10% longer than the fastest


def split_counts(global_batch: int, fractions: Sequence[float], minimum: int = 1) -> list[int]:
    """Integer counts proportional to ``fractions`` that sum to ``global_batch`` (largest remainder),
    each at least ``minimum`` so every worker keeps measuring its speed."""
    n = len(fractions)
    if global_batch < n * minimum:
        raise ValueError(f"global batch {global_batch} < {n} workers x {minimum}")
    total = sum(fractions)
    spare = global_batch - n * minimum
    raw = [spare * f / total for f in fractions]
    counts = [minimum + int(r) for r in raw]
    order = sorted(range(n), key=lambda i: (-(raw[i] - int(raw[i])), i))
    for i in order[: global_batch - sum(counts)]:
        counts[i] += 1
    return counts


class LissBalancer:
    """Per-worker sample counts for the next step, from the forward times of the last one."""

    def __init__(self, global_batch: int, world_size: int, threshold: float = REBALANCE_THRESHOLD) -> None:
        self.global_batch = global_batch
        self.counts = split_counts(global_batch, [1.0] * world_size)
        self._threshold = threshold
        self.moves = 0

    def reset(self) -> list[int]:
        """The equal split of the unpacked job (no one steals)."""
        equal = split_counts(self.global_batch, [1.0] * len(self.counts))
        if equal != self.counts:
            self.counts = equal
            self.moves += 1
        return self.counts

    def observe(self, forward_s: Sequence[float]) -> list[int]:
        """Rebalance (speed = samples / forward time) when the spread passes the threshold."""
        if len(forward_s) != len(self.counts):
            raise ValueError("one forward time per worker")
        if min(forward_s) <= 0 or max(forward_s) / min(forward_s) < self._threshold:
            return self.counts
        speeds = [c / t for c, t in zip(self.counts, forward_s, strict=True)]
        counts = split_counts(self.global_batch, speeds)
        if counts != self.counts:
            self.counts = counts
            self.moves += 1
        return self.counts


def loss_scale(local_count: int, global_batch: int, world_size: int) -> float:
    """Multiply a rank's *mean* loss by this so DDP's average of gradients is the global-batch mean:
    sum_r (W * n_r / B) * g_r / W = sum_r n_r g_r / B."""
    return world_size * local_count / global_batch


class LissBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch; the counts are read when a batch is drawn, so
    a rebalance applies from the next step (use ``num_workers=0`` or no prefetch ahead of the
    all-gather, so every rank draws step i with the same counts)."""

    def __init__(
        self, dataset_len: int, global_batch: int, rank: int, balancer: LissBalancer, seed: int = 0
    ) -> None:
        self._n = dataset_len
        self._batch = global_batch
        self._rank = rank
        self._balancer = balancer
        self._seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_batches(self) -> Iterator[list[int]]:
        """The unpacked job's global batches for this epoch (drop_last)."""
        g = torch.Generator()
        g.manual_seed(self._seed + self.epoch)
        perm = torch.randperm(self._n, generator=g).tolist()
        for start in range(0, self._n - self._batch + 1, self._batch):
            yield perm[start : start + self._batch]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            counts = self._balancer.counts
            offset = sum(counts[: self._rank])
            yield batch[offset : offset + counts[self._rank]]

    def __len__(self) -> int:
        return self._n // self._batch


def _packed_now() -> bool:
    from tandem_job import packing

    return bool(packing())


class DataParallelLiss:
    """LISS for one rank of a data-parallel job (``torch.distributed`` initialised)::

        liss = DataParallelLiss(len(dataset), global_batch, seed=1)
        for epoch in ...:
            liss.sampler.set_epoch(epoch)
            for local in liss.sampler:          # this rank's slice of the global batch
                t0 = time.perf_counter(); out = ddp(x[local]); forward_s = time.perf_counter() - t0
                loss = criterion(out, y[local]) * liss.loss_scale(len(local))
                ...backward, step...
                liss.exchange(forward_s)        # every rank, every step: the next step's split

    ``exchange`` is one all-reduce of every rank's forward time plus rank 0's ``packed()`` (the
    local scheduler's word, read once per step); packed, the balancer moves samples from slow
    ranks to fast ones; alone, the split goes back to equal. Either way every rank applies the
    same counts to the next global batch, which stays the unpacked job's."""

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        packed: Callable[[], bool] = _packed_now,
        threshold: float = REBALANCE_THRESHOLD,
    ) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.global_batch = global_batch
        self.balancer = LissBalancer(global_batch, self.world_size, threshold)
        self.sampler = LissBatchSampler(dataset_len, global_batch, self.rank, self.balancer, seed)
        self._packed = packed
        self.stealing = False  # as of the last exchange
        self.history: list[list[int]] = []  # the split each step ran with

    def loss_scale(self, local_count: int) -> float:
        return loss_scale(local_count, self.global_batch, self.world_size)

    def go(self, more: bool = True) -> bool:
        """Before a step, on every rank: whether it is taken (rank 0's ``more``; the others' is
        ignored). Rank 0 runs the job-side step loop and learns of a stop word there; without
        this the other ranks would wait in their next collective for good::

            if rank == 0:
                for _ in job.steps():
                    liss.go(); step()
                liss.go(False)                  # stopped or done: the others leave too
            else:
                while liss.go(): step()
        """
        import torch.distributed as dist

        flag = torch.tensor([1.0 if more and self.rank == 0 else 0.0], dtype=torch.float64)
        dist.broadcast(flag, src=0)
        return bool(flag[0] > 0)

    def exchange(self, forward_s: float) -> list[int]:
        """After a step: agree on the split of the next one."""
        import torch.distributed as dist

        self.history.append(list(self.balancer.counts))
        shared = torch.zeros(self.world_size + 1, dtype=torch.float64)
        shared[self.rank] = forward_s
        if self.rank == 0:
            shared[self.world_size] = 1.0 if self._packed() else 0.0
        dist.all_reduce(shared)
        self.stealing = bool(shared[self.world_size] > 0)
        if self.stealing:
            return self.balancer.observe(shared[: self.world_size].tolist())
        return self.balancer.reset()
