"""The global scheduler's ``PlacementIndex``, kept current as its cluster state changes.

Placement must not scan every host (issue #5), so ``ClusterState`` keeps a ``PlacementIndex`` of
host views. Views change in many places (registration, heartbeats, cordons, host death, kernels
placed, replicas lost, moved or replaced, kernels stopped, GPU reservations and commits), most of
them plain attribute writes in the service, the migrator and the autoscaler. Rather than trusting
every such line to remember a hook, the records report their own changes (``WatchedDict`` for the
maps, ``__setattr__`` for the fields that enter a view) to a ``LiveIndex``, which only marks the
host dirty: a set insertion, so the per-cell path (reserve, commit, release) stays as cheap as it
was. The next placement re-indexes just the dirty hosts, computing each one's subscription from a
host -> placed-replicas map instead of walking every kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from shared.policies.placement import HostView
from shared.policies.placement_index import PlacementIndex

if TYPE_CHECKING:
    from services.global_scheduler.cluster_state import KernelRecord, ReplicaRecord

K = TypeVar("K")
V = TypeVar("V")

Placed = tuple["KernelRecord", "ReplicaRecord"]


class WatchedDict(dict[K, V]):
    """A dict that calls ``on_change(old, new)`` after each entry it gains, loses or replaces.

    ``old`` is None for a new key and ``new`` None for a removed one (values are never None).
    """

    __slots__ = ("on_change",)

    def __init__(
        self,
        data: Mapping[K, V] | Iterable[tuple[K, V]] = (),
        on_change: Callable[[Any, Any], None] | None = None,
    ) -> None:
        super().__init__(data)
        self.on_change = on_change

    def _changed(self, old: V | None, new: V | None) -> None:
        if self.on_change is not None:
            self.on_change(old, new)

    def __setitem__(self, key: K, value: V) -> None:
        old = super().get(key)
        super().__setitem__(key, value)
        self._changed(old, value)

    def __delitem__(self, key: K) -> None:
        old = super().pop(key)
        self._changed(old, None)

    def pop(self, key: K, *default: Any) -> Any:
        if key in self:
            old = super().pop(key)
            self._changed(old, None)
            return old
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self) -> tuple[K, V]:
        key, old = super().popitem()
        self._changed(old, None)
        return key, old

    def setdefault(self, key: K, default: Any = None) -> Any:
        if key in self:
            return super().__getitem__(key)
        self[key] = default
        return default

    def clear(self) -> None:
        olds = list(self.values())
        super().clear()
        for old in olds:
            self._changed(old, None)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> WatchedDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self


class LiveIndex:
    """Dirty-host tracking plus the host -> placed-replicas map that makes a re-index O(replicas there)."""

    def __init__(self, view_of: Callable[[str, Iterable[Placed]], HostView | None]) -> None:
        self._view_of = view_of  # the host's view given its placed replicas; None once it is gone
        self._index = PlacementIndex()
        self._dirty: set[str] = set()
        self._placed: dict[str, dict[int, Placed]] = {}  # host -> id(replica) -> (kernel, replica)

    def touch(self, host_id: str) -> None:
        self._dirty.add(host_id)

    def link(self, kernel: KernelRecord, replica: ReplicaRecord, host_id: str | None = None) -> None:
        host = replica.host_id if host_id is None else host_id
        self._placed.setdefault(host, {})[id(replica)] = (kernel, replica)
        self._dirty.add(host)

    def unlink(self, replica: ReplicaRecord, host_id: str | None = None) -> None:
        host = replica.host_id if host_id is None else host_id
        placed = self._placed.get(host)
        if placed is not None:
            placed.pop(id(replica), None)
            if not placed:
                del self._placed[host]
        self._dirty.add(host)

    def placed_on(self, host_id: str) -> Iterable[Placed]:
        return self._placed.get(host_id, {}).values()

    def index(self) -> PlacementIndex:
        """The index with every host changed since the last call re-indexed."""
        while self._dirty:
            host_id = self._dirty.pop()
            view = self._view_of(host_id, self.placed_on(host_id))
            if view is None:
                self._index.remove(host_id)
            else:
                self._index.upsert(view)
        return self._index
