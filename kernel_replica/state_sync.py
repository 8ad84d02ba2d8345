"""Small-state replication (NotebookOS §3.2.4): AST-guided namespace changes as STATE entries.

After a cell the executor asks ``cell_analysis`` which names the cell may have changed, compares
their ``fingerprint`` with the one recorded at the last replication (``ReplicatedNamespace``: every
replica keeps it, it is the state machine's data), and encodes only the changed names with
``ObjectCodec``: one *group* per set of names sharing objects (a model and its optimizer), inline
in the log when small, a pointer into the data store when large. Imports are not pickled: the
STATE entry carries the import statements and the standbys replay them. ``StatePlan`` is what
``plan_state`` decided for one cell; ``apply_state`` is what a standby does with an entry.

The Raft snapshot is the latest record per name (an import statement or the group that last
carried it), so a restarted or new replica rebuilds the whole namespace from the snapshot and the
log suffix.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from kernel_replica.cell_analysis import CellEffects, names_to_check
from kernel_replica.fingerprint import fingerprint
from kernel_replica.log_entries import State
from kernel_replica.object_codec import EncodedGroup, ObjectCodec, dumps
from shared.config import Config
from shared.datastore import DataStore, open_datastore

# Names IPython itself puts in the user namespace; replicating them would be wrong or pointless.
IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})
IMPORT_MARK = b"import:"  # fingerprint prefix of a name bound by a replayed import statement


def digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def replicable_names(namespace: Mapping[str, Any], hidden: Iterable[str] = ()) -> list[str]:
    """User-defined names: not private (``_``, ``_i3``, ``__builtins__``), not IPython's own."""
    hidden_set = set(hidden)
    return [
        name
        for name in namespace
        if not name.startswith("_") and name not in IPYTHON_NAMES and name not in hidden_set
    ]


def datastore_config(config: Config) -> Config:
    """``config`` with a relative local ``datastore.path`` made absolute under the state dir, so
    every replica of a cluster (each with its own working directory) opens the same store; an
    empty path already means ``<state_dir>/datastore`` (``open_datastore``)."""
    data = config.as_dict()
    section = data["datastore"]
    if section.get("backend") == "local" and section.get("path"):
        path = Path(section["path"]).expanduser()
        if not path.is_absolute():
            section["path"] = str(config.state_dir() / path)
    return Config(data)


async def open_replica_datastore(config: Config) -> DataStore:
    return await open_datastore(datastore_config(config))


def import_fingerprint(statement: str) -> bytes:
    return IMPORT_MARK + digest(statement.encode())


def value_fingerprint(value: Any, namespace: Mapping[str, Any]) -> bytes | None:
    """``fingerprint``, except that a notebook function is hashed as the codec sends it (linked to
    the namespace): cloudpickle would include the globals it uses, so it would look changed, and
    be resent, whenever one of them changes."""
    if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
        try:
            pickled, buffers = dumps({"f": value}, namespace=namespace)
        except Exception:
            return None
        h = xxhash.xxh3_128(pickled)
        for buffer in buffers:
            h.update(buffer.raw())
        return b"fn:" + h.digest()
    return fingerprint(value)


@dataclass(slots=True)
class StatePlan:
    """What one cell's replication decided, and what each step cost (ms)."""

    fingerprints: dict[str, bytes] = field(default_factory=dict)  # names sent (and imported) -> fp
    groups: list[dict[str, Any]] = field(default_factory=list)  # EncodedGroup.to_dict()
    imports: list[tuple[str, str]] = field(default_factory=list)  # (alias, statement)
    deleted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.groups or self.imports or self.deleted)

    def state(self, msg_id: str, replica_id: str) -> State:
        return State(
            msg_id,
            replica_id,
            dict(self.fingerprints),
            b"",
            tuple(self.deleted),
            dict(self.skipped),
            tuple(self.groups),
            tuple(self.imports),
        )

    def nbytes(self) -> int:
        return sum(sum(g["sizes"]) for g in self.groups)


async def plan_state(
    effects: CellEffects,
    namespace: dict[str, Any],
    replicated: Mapping[str, bytes],
    codec: ObjectCodec,
    *,
    hidden: Iterable[str] = (),
    store_seconds: Any = None,
) -> StatePlan:
    """The executor's side of step 7: which names changed, and their encoded groups.

    ``replicated``: name -> fingerprint as the log will hold it. ``store_seconds``: a callable
    returning the seconds spent writing to the data store so far (to split encode time)."""
    plan = StatePlan()
    started = time.perf_counter()
    replicable = replicable_names(namespace, hidden)
    replicable_set = set(replicable)
    check = names_to_check(effects, namespace, replicated=replicated, shared_with=codec.sharing())
    check = {name for name in check if name in replicable_set or name in replicated}
    module_aliases: set[str] = set()
    for record in effects.imported:
        if record.alias == "*" or record.alias not in replicable_set:
            continue
        statement = record.statement()
        plan.imports.append((record.alias, statement))
        if isinstance(namespace[record.alias], types.ModuleType):
            module_aliases.add(record.alias)  # replayed, not pickled
            plan.fingerprints[record.alias] = import_fingerprint(statement)
    plan.deleted = sorted(name for name in replicated if name not in replicable_set)
    plan.timings["analysis_ms"] = (time.perf_counter() - started) * 1000

    started = time.perf_counter()
    changed: list[str] = []
    fps: dict[str, bytes | None] = {}
    for name in sorted(check):
        if name not in replicable_set or name in module_aliases:
            continue
        if isinstance(namespace[name], types.ModuleType) and replicated.get(name, b"").startswith(
            IMPORT_MARK
        ):
            continue  # still the imported module (its attributes are not replicated state)
        fps[name] = value_fingerprint(namespace[name], namespace)
        if fps[name] is None or fps[name] != replicated.get(name):
            changed.append(name)
    plan.timings["fingerprint_ms"] = (time.perf_counter() - started) * 1000

    started = time.perf_counter()
    store_before = store_seconds() if store_seconds is not None else 0.0
    if changed:
        codec.forget(plan.deleted)
        result = await codec.encode(namespace, changed, universe=replicable)
        plan.groups = [group.to_dict() for group in result.groups]
        plan.skipped = {s.name: s.reason for s in result.skipped}
        for name in result.names:
            fp = fps[name] if name in fps else value_fingerprint(namespace[name], namespace)
            if fp is not None:
                plan.fingerprints[name] = fp
    store_ms = ((store_seconds() if store_seconds is not None else 0.0) - store_before) * 1000
    plan.timings["serialize_ms"] = (time.perf_counter() - started) * 1000 - store_ms
    plan.timings["store_ms"] = store_ms
    return plan


def replay_imports(namespace: dict[str, Any], imports: Iterable[tuple[str, str]]) -> list[str]:
    """Run import statements in ``namespace``; returns the failures ("stmt: error")."""
    failures = []
    for _alias, statement in imports:
        try:
            exec(statement, namespace)  # an import statement the executor ran
        except Exception as exc:
            failures.append(f"{statement}: {exc.__class__.__name__}: {exc}")
    return failures


async def apply_state(
    namespace: dict[str, Any],
    codec: ObjectCodec,
    imports: Iterable[tuple[str, str]],
    groups: Iterable[tuple[Mapping[str, Any], Iterable[str] | None]],
    deleted: Iterable[str] = (),
) -> list[str]:
    """A standby's side: replay imports, decode groups in log order (taking ``names`` of each, or
    all when None), then drop ``deleted``. Returns the failures (the rest is still applied)."""
    failures = replay_imports(namespace, imports)
    for raw, names in groups:
        try:
            group = EncodedGroup.from_dict(raw)
            values = await codec.decode(group, namespace)
        except Exception as exc:  # e.g. a module missing on this host, a store unreachable
            failures.append(f"{', '.join(raw.get('names', ()))}: {exc.__class__.__name__}: {exc}")
            continue
        if names is None:
            namespace.update(values)
        else:
            namespace.update({name: values[name] for name in names if name in values})
    for name in deleted:
        namespace.pop(name, None)
    return failures


class ReplicatedNamespace:
    """The replicated namespace as of the last applied STATE: the state machine's data.

    Per name: its fingerprint (for the next executor's change detection) and its latest record,
    an import statement or the group that last carried it. Written by the Raft thread (applying
    entries, restoring snapshots) and read by the main thread, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fps: dict[str, bytes] = {}
        self._records: dict[str, tuple[str, Any]] = {}  # name -> ("i", stmt) | ("g", group id)
        self._groups: dict[int, dict[str, Any]] = {}
        self._next_group = 0

    def apply(self, state: State) -> None:
        with self._lock:
            for alias, statement in state.imports:
                self._records[alias] = ("i", statement)
            for group in state.groups:
                gid = self._next_group
                self._next_group += 1
                self._groups[gid] = dict(group)
                for name in group["names"]:
                    self._records[name] = ("g", gid)
            self._fps.update(state.digests)
            for name in state.deleted:
                self._fps.pop(name, None)
                self._records.pop(name, None)
            self._collect()

    def _collect(self) -> None:
        live = {value for kind, value in self._records.values() if kind == "g"}
        for gid in [gid for gid in self._groups if gid not in live]:
            del self._groups[gid]

    def digests(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._fps)

    def contents(self) -> tuple[list[tuple[str, str]], list[tuple[dict[str, Any], list[str]]]]:
        """(imports, [(group, names to take from it)] in log order): what rebuilds the namespace."""
        with self._lock:
            imports = [(name, value) for name, (kind, value) in self._records.items() if kind == "i"]
            names: dict[int, list[str]] = {}
            for name, (kind, value) in self._records.items():
                if kind == "g":
                    names.setdefault(value, []).append(name)
            groups = [(dict(self._groups[gid]), sorted(names[gid])) for gid in sorted(names)]
            return imports, groups

    def to_snapshot(self) -> bytes:
        with self._lock:
            return msgpack.packb(
                {
                    "fps": self._fps,
                    "records": {name: [kind, value] for name, (kind, value) in self._records.items()},
                    "groups": [[gid, group] for gid, group in sorted(self._groups.items())],
                    "next": self._next_group,
                },
                use_bin_type=True,
            )

    def restore(self, data: bytes) -> None:
        raw = msgpack.unpackb(data, raw=False) if data else {"fps": {}, "records": {}, "groups": []}
        if not isinstance(raw, dict) or not isinstance(raw.get("fps"), dict):
            raise ValueError("namespace snapshot must be a map with fingerprints")
        with self._lock:
            self._fps = dict(raw["fps"])
            self._records = {name: (kind, value) for name, (kind, value) in raw["records"].items()}
            self._groups = {int(gid): dict(group) for gid, group in raw["groups"]}
            self._next_group = int(raw.get("next", max(self._groups, default=-1) + 1))
