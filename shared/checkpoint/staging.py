"""Reused host memory for the bytes a checkpoint copies.

Fresh memory costs a page fault per 4 KiB on first touch: on this project's machines a 150 MB
clone into new memory spent ~190 ms faulting, eight times the copy itself, and the allocator hands
large freed blocks back to the kernel, so every checkpoint would pay it again. Slabs taken from
this pool are faulted once and reused: packs are built in them (a pack is one slab), and copy-on-
write copies land in them.
"""

from __future__ import annotations

import threading

import torch

DEFAULT_SLAB_BYTES = 4 * 1024 * 1024


class Staging:
    """A thread-safe pool of uint8 host slabs; keeps up to ``retain_bytes`` of free ones."""

    def __init__(self, slab_bytes: int = DEFAULT_SLAB_BYTES, retain_bytes: int = 256 * 1024 * 1024) -> None:
        self.slab_bytes = slab_bytes
        self._retain = max(1, retain_bytes // slab_bytes)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def slab(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self.slab_bytes, dtype=torch.uint8)

    def release(self, slab: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._retain:
                self._free.append(slab)


class Arena:
    """Bump allocation from slabs of a ``Staging`` pool, for one checkpoint's copy-on-write and
    eager copies; everything goes back to the pool at once when the checkpoint has packed them."""

    def __init__(self, staging: Staging) -> None:
        self._staging = staging
        self._slabs: list[torch.Tensor] = []
        self._used = staging.slab_bytes  # no current slab

    @property
    def limit(self) -> int:
        """The largest allocation served from a slab."""
        return self._staging.slab_bytes

    def alloc(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pooled memory (a private tensor when larger than a slab)."""
        if nbytes > self._staging.slab_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self._used + nbytes > self._staging.slab_bytes:
            self._slabs.append(self._staging.slab())
            self._used = 0
        start, self._used = self._used, self._used + nbytes
        return self._slabs[-1][start : self._used]

    def release(self) -> None:
        for slab in self._slabs:
            self._staging.release(slab)
        self._slabs = []
        self._used = self._staging.slab_bytes
