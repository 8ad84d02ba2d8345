"""A data-loader position that survives a restore: which epoch, its shuffle seed, how far into it.

``torch.utils.data.DataLoader`` has no position of its own; a sampler that knows its epoch and
offset gives one, so a restored job reads exactly the batches the uninterrupted job would have
read next (for map-style datasets; workers' prefetched batches are dropped, not replayed).
Give the DataLoader a ``generator=`` of its own: each new iterator draws a base seed, from the
global torch RNG otherwise, and a restored process starts one more iterator than the original.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Shuffled indices, one permutation per epoch (seed + epoch), resumable mid-epoch."""

    def __init__(self, length: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # indices handed out in this epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.position < self.length:
            index = order[self.position]
            self.position += 1
            yield index
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.length - self.position

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["length"] != self.length or state["seed"] != self.seed:
            raise ValueError(f"sampler state for length {state['length']}, seed {state['seed']}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
