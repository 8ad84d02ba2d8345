"""Small-state replication (NotebookOS §3.2.4, minimal version): namespace changes as STATE entries.

After a cell the executor pickles each user name to see which changed against what the log already
holds; if any did (or was deleted) it proposes one STATE entry carrying the WHOLE replicated
namespace as a single pickle, because names share objects (an optimizer holds the model's
parameters) and pickling them one by one would give the standbys separate copies that no longer
move together. Every replica keeps the digests and the latest blob (``ReplicatedNamespace``, also
the Raft snapshot's payload); standbys load the blob into their namespace. Change detection is
behind ``ChangeDetector`` so the AST-guided analysis and large-object pointers of a later issue
replace ``PickleDiffDetector`` without touching the replica's plumbing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import cloudpickle
import msgpack
import xxhash

from kernel_replica.log_entries import State

# Names IPython itself puts in the user namespace; replicating them would be wrong or pointless.
IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})

# A STATE entry travels through every replica's Raft log; beyond this one object belongs in the data
# store (a later issue), not the log.
DEFAULT_MAX_OBJECT_BYTES = 16 * 1024 * 1024


def digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


@dataclass(slots=True)
class StateDiff:
    changed: list[str] = field(default_factory=list)  # names new or different since the last STATE
    deleted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason it was not replicated
    digests: dict[str, bytes] = field(default_factory=dict)  # every replicated name -> its digest
    namespace: bytes = b""  # one pickle of every replicated name; empty when nothing changed

    def __bool__(self) -> bool:
        return bool(self.changed or self.deleted)


def replicable_names(namespace: Mapping[str, Any], hidden: Iterable[str] = ()) -> list[str]:
    """User-defined names: not private (``_``, ``_i3``, ``__builtins__``), not IPython's own."""
    hidden_set = set(hidden)
    return [
        name
        for name in namespace
        if not name.startswith("_") and name not in IPYTHON_NAMES and name not in hidden_set
    ]


class ChangeDetector(Protocol):
    def detect(
        self, namespace: Mapping[str, Any], replicated: Mapping[str, bytes], *, code: str = ""
    ) -> StateDiff:
        """What changed in ``namespace`` relative to ``replicated`` (name -> digest of its pickle)."""
        ...


class PickleDiffDetector:
    """Pickle every user name and compare digests: simple, always right, O(namespace) per cell."""

    def __init__(
        self,
        *,
        hidden: Callable[[], Iterable[str]] = tuple,
        warn: Callable[[str, str], None] | None = None,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
    ) -> None:
        self._hidden = hidden
        self._warn = warn
        self._max_object_bytes = max_object_bytes
        self._warned: set[tuple[str, str]] = set()

    def detect(
        self, namespace: Mapping[str, Any], replicated: Mapping[str, bytes], *, code: str = ""
    ) -> StateDiff:
        diff = StateDiff()
        for name in replicable_names(namespace, self._hidden()):
            value = namespace[name]
            try:
                data = cloudpickle.dumps(value)
            except Exception as exc:  # anything a __reduce__ raises
                self._skip(diff, name, value, f"not picklable: {exc.__class__.__name__}: {exc}")
                continue
            if len(data) > self._max_object_bytes:
                self._skip(diff, name, value, f"{len(data) / 1e6:.1f} MB is too large for the Raft log")
                continue
            diff.digests[name] = digest(data)
            if replicated.get(name) != diff.digests[name]:
                diff.changed.append(name)
        diff.deleted = sorted(name for name in replicated if name not in diff.digests)
        if diff.changed or diff.deleted:
            diff.namespace = cloudpickle.dumps({name: namespace[name] for name in diff.digests})
        return diff

    def _skip(self, diff: StateDiff, name: str, value: Any, reason: str) -> None:
        diff.skipped[name] = reason
        key = (name, type(value).__qualname__)
        if key not in self._warned:
            self._warned.add(key)
            if self._warn is not None:
                self._warn(name, reason)


class ReplicatedNamespace:
    """The replicated namespace as of the last applied STATE: the state machine's data.

    Written by the Raft thread (applying entries, restoring snapshots) and read by the main thread
    (change detection), hence the lock; it is only held for dict operations, never user code.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, bytes] = {}
        self._blob = b""  # the latest full namespace pickle (may hold names deleted since)

    def apply(self, state: State) -> None:
        with self._lock:
            if state.namespace:
                self._digests = dict(state.digests)
                self._blob = state.namespace
            for name in state.deleted:
                self._digests.pop(name, None)

    def digests(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._digests)

    def contents(self) -> tuple[bytes, list[str]]:
        """(blob, names to take from it): what a replica loads to rebuild the namespace."""
        with self._lock:
            return self._blob, sorted(self._digests)

    def to_snapshot(self) -> bytes:
        with self._lock:
            return msgpack.packb({"digests": self._digests, "blob": self._blob}, use_bin_type=True)

    def restore(self, data: bytes) -> None:
        raw = msgpack.unpackb(data, raw=False) if data else {"digests": {}, "blob": b""}
        if not isinstance(raw, dict) or not isinstance(raw.get("digests"), dict):
            raise ValueError("namespace snapshot must be a map with digests")
        with self._lock:
            self._digests = dict(raw["digests"])
            self._blob = bytes(raw.get("blob") or b"")


def load_into(
    namespace: dict[str, Any], blob: bytes, names: Iterable[str], deleted: Iterable[str]
) -> str | None:
    """Load ``names`` from a namespace blob and drop ``deleted``; returns why loading failed, if it did."""
    failure = None
    if blob:
        try:
            values = cloudpickle.loads(blob)
            for name in names:
                if name in values:
                    namespace[name] = values[name]
        except Exception as exc:  # e.g. a module missing on this host
            failure = f"{exc.__class__.__name__}: {exc}"
    for name in deleted:
        namespace.pop(name, None)
    return failure
