"""Which names share host memory without sharing a Python object.

``torch.from_numpy(a)`` makes a tensor whose storage is ``a``'s memory, and ``t.numpy()`` an array
on ``t``'s storage: the two objects share nothing pickle can see (a numpy region is keyed by its
outermost array, a storage by its address), so the codec would put their names in two groups
and the next executor would get two copies: ``a[0] = 5`` would no longer show in ``t``. The codec
records, per name, the byte spans of the numpy regions and CPU storages it reaches; this index
merges overlapping spans into clusters (one allocation each, since live allocations never
overlap) and tells the codec the identity keys of everything in a name's clusters. Those keys go
into the name's reach, so the codec's union-find joins the names, its sharing report sees them,
and one pickle of the group rebuilds them on one buffer (``object_codec``'s blocks).

Clusters are kept disjoint and sorted, so adding a span is a bisection, not a scan of every span:
a namespace of thousands of arrays is indexed in one pass on a new executor.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

Span = tuple[int, int, Hashable]  # first byte, one past the last, the identity key


@dataclass(slots=True, eq=False)
class _Cluster:
    start: int
    end: int
    members: dict[str, list[Span]] = field(default_factory=dict)  # name -> its spans here

    def keys(self) -> set[Hashable]:
        return {key for spans in self.members.values() for _, _, key in spans}


class MemoryIndex:
    """Names' host memory spans, merged where they overlap."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # cluster starts, sorted (clusters are disjoint)
        self._clusters: list[_Cluster] = []
        self._spans: dict[str, list[Span]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._spans

    def update(self, name: str, spans: Iterable[Span]) -> set[Hashable]:
        """Replace ``name``'s spans; return the keys of every span overlapping them, through any
        chain of overlaps (its own keys included), for the name's reach."""
        self.remove(name)
        mine = [span for span in spans if span[1] > span[0]]
        if not mine:
            return set()
        self._spans[name] = mine
        keys: set[Hashable] = set()
        for span in mine:
            cluster = self._insert(name, span)
            if len(cluster.members) == 1 and len(cluster.members[name]) == 1:
                keys.add(span[2])  # alone (the usual case): no set to build
            else:
                keys |= cluster.keys()
        return keys

    def remove(self, name: str) -> None:
        """Forget ``name``'s spans; a cluster they held together splits into what still overlaps."""
        spans = self._spans.pop(name, None)
        if not spans:
            return
        touched: dict[int, _Cluster] = {}
        for start, _, _ in spans:
            index = bisect.bisect_right(self._starts, start) - 1
            cluster = self._clusters[index]
            touched[id(cluster)] = cluster
        for cluster in touched.values():
            index = bisect.bisect_left(self._starts, cluster.start)  # starts are unique
            del self._clusters[index], self._starts[index]
            cluster.members.pop(name, None)
            for other, others in cluster.members.items():
                for span in others:
                    self._insert(other, span)

    def _insert(self, name: str, span: Span) -> _Cluster:
        start, end, _ = span
        low = bisect.bisect_right(self._starts, start) - 1
        if low < 0 or self._clusters[low].end <= start:
            low += 1  # the cluster before does not reach this span
        high = low
        while high < len(self._clusters) and self._clusters[high].start < end:
            high += 1
        if high == low:  # overlaps nothing (the usual case)
            alone = _Cluster(start, end, {name: [span]})
            self._clusters.insert(low, alone)
            self._starts.insert(low, start)
            return alone
        merged = _Cluster(start, end)
        for cluster in self._clusters[low:high]:
            merged.start, merged.end = min(merged.start, cluster.start), max(merged.end, cluster.end)
            for other, others in cluster.members.items():
                merged.members.setdefault(other, []).extend(others)
        merged.members.setdefault(name, []).append(span)
        self._clusters[low:high] = [merged]
        self._starts[low:high] = [merged.start]
        return merged
