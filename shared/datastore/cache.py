"""Node-level read cache: least recently used objects, bounded by their total size in bytes.

Replicas on a node restore the same large objects (a model, a dataset) again and again after
failover and migration; keeping the last few in memory spares the backend. Entries are read-only
views, so a caller cannot alter what the next reader gets.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ByteLRU:
    """LRU keyed by content digest; an object larger than the whole budget is never admitted."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, memoryview] = OrderedDict()
        self._bytes = 0
        self.stats = CacheStats()

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> memoryview | None:
        view = self._entries.get(digest)
        if view is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.stats.hits += 1
        return view

    def put(self, digest: str, view: memoryview) -> bool:
        """Admit ``view`` (made read-only), evicting the least recently used; False if it cannot fit."""
        size = view.nbytes
        if size > self.capacity_bytes:
            return False
        self.discard(digest)
        while self._bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.stats.evictions += 1
        self._entries[digest] = view if view.readonly else view.toreadonly()
        self._bytes += size
        return True

    def discard(self, digest: str) -> None:
        old = self._entries.pop(digest, None)
        if old is not None:
            self._bytes -= old.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
