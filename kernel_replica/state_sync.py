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

import ast
import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib.util
import sys
import threading
import time
import types
from collections.abc import Collection, Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack
import xxhash

from kernel_replica.cell_analysis import CellEffects, ImportRecord, names_to_check
from kernel_replica.comm_sync import CommRecord, record_digest
from kernel_replica.durability import Marker, apply_markers, apply_repair
from kernel_replica.fingerprint import fingerprint
from kernel_replica.log_entries import GpuResident, State, decode_gpu_resident, encode_gpu_resident
from kernel_replica.object_codec import EncodedGroup, ObjectCodec, dumps, is_large, store_failure
from kernel_replica.output_history import CellOutput, ReplicatedOutputs
from kernel_replica.process_context import ProcessContext
from shared.config import Config
from shared.datastore import DataStore, open_datastore

# Names IPython itself puts in the user namespace; replicating them would be wrong or pointless.
IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})
IMPORT_MARK = b"import:"  # fingerprint prefix of a name bound by a replayed import statement
# A name's replicated fingerprint is its value's, then, if it shares objects with other names
# (views of one array, a model and its optimizer), SHARE_MARK and a digest of their sorted names:
# an equal value that shares differently (``b = a[:]`` after ``b = a.copy()``) is sent again.
SHARE_MARK = b"&shares:"
# The fingerprint of a name sent whose value cannot be fingerprinted: never equal to a computed
# one (the name is sent again whenever checked), but the name is known replicated (a deletion
# of it reaches the standbys).
UNFINGERPRINTED = b"unfingerprinted:"
_SHARE_SUFFIX = len(SHARE_MARK) + 16


def digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def replicable_names(namespace: Mapping[str, Any], hidden: Container[str] = ()) -> list[str]:
    """User-defined names: not private (``_``, ``_i3``, ``__builtins__``), not IPython's own.
    IPython adds hidden, private names for every cell run (``_i3``, ``_3``), so this scan grows
    with a session: ``hidden`` is tested as given (IPython's ``user_ns_hidden`` is a dict, not
    copied into a set every cell) and the private test indexes the first character rather than
    calling ``startswith`` (together 0.57 -> 0.2 ms per cell after 10 000 cells). An empty name
    (no code can use it) is not replicable either."""
    return [
        name
        for name in namespace
        if name and name[0] != "_" and name not in IPYTHON_NAMES and name not in hidden
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
    """The statement itself (short): a later cell tells from it whether the name still holds
    what the import bound (``still_imported``), even before the entry that carried it commits."""
    return IMPORT_MARK + statement.encode()


@functools.lru_cache(maxsize=1024)
def _from_import(statement: str) -> tuple[str, str] | None:
    """(module, attribute) of an absolute single-name ``from m import a [as b]`` (attribute "*"
    for a star import); None for any other statement."""
    try:
        body = ast.parse(statement).body
    except SyntaxError:
        return None
    node = body[0] if len(body) == 1 else None
    if isinstance(node, ast.ImportFrom) and node.module and not node.level and len(node.names) == 1:
        return node.module, node.names[0].name
    return None


def still_imported(statement: str, name: str, value: Any) -> bool:
    """Whether ``name`` still holds what ``statement`` bound, so that the standbys replay the
    statement instead of receiving a pickle: a module (its attributes are not replicated state),
    or the very object a from-import took from its module. The latter keeps identity with the
    module's own object (``from matplotlib import rcParams``, ``from os import environ``: a
    pickled copy on the next executor took the notebook's changes and the library ignored them;
    those changes travel as the module's state, ``library_settings`` and ``process_context``),
    as ``m.a`` would; what a notebook changes in another module's object through the name is that
    module's state, not the namespace's, on the next executor too."""
    if isinstance(value, types.ModuleType):
        return True
    target = _from_import(statement)
    if target is None:
        return False
    module_name, attribute = target
    module = sys.modules.get(module_name)
    missing = object()
    return module is not None and getattr(module, name if attribute == "*" else attribute, missing) is value


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


def with_sharers(value_fp: bytes, sharers: Mapping[str, tuple[int, int]]) -> bytes:
    """The replicated fingerprint of a value whose name shares objects with ``sharers`` (name ->
    memory regions and other objects shared, ``ObjectCodec.sharing_counts``)."""
    if not sharers:
        return value_fp
    text = "\0".join(f"{name}:{mem}:{obj}" for name, (mem, obj) in sorted(sharers.items()))
    return value_fp + SHARE_MARK + digest(text.encode())


def value_part(fp: bytes) -> bytes:
    """``fp`` without its sharers' digest (``with_sharers``)."""
    if len(fp) >= _SHARE_SUFFIX and fp[-_SHARE_SUFFIX:-16] == SHARE_MARK:
        return fp[:-_SHARE_SUFFIX]
    return fp


@dataclass(slots=True)
class StatePlan:
    """What one cell's replication decided, and what each step cost (ms)."""

    fingerprints: dict[str, bytes] = field(default_factory=dict)  # names sent (and imported) -> fp
    groups: list[dict[str, Any]] = field(default_factory=list)  # EncodedGroup.to_dict()
    imports: list[tuple[str, str]] = field(default_factory=list)  # (alias, statement)
    deleted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    deferred: dict[int, memoryview] = field(default_factory=dict)  # group index -> payload to write
    # group index -> its parts as live views, for a background image (``state_image``)
    images: dict[int, list[memoryview]] = field(default_factory=dict)
    unstored: dict[str, str] = field(default_factory=dict)  # changed, but the store write failed
    retried: tuple[str, ...] = ()  # unstored names of earlier cells encoded again by this one

    def __bool__(self) -> bool:
        return bool(self.groups or self.imports or self.deleted or self.unstored)

    def state(self, msg_id: str, replica_id: str, gpu_resident: tuple[GpuResident, ...] = ()) -> State:
        """The STATE entry; ``gpu_resident``: what the executor keeps in host memory for the GPU."""
        return State(
            msg_id,
            replica_id,
            dict(self.fingerprints),
            b"",
            tuple(self.deleted),
            dict(self.skipped),
            tuple(self.groups),
            tuple(self.imports),
            gpu_resident,
            dict(self.unstored),
        )

    def nbytes(self) -> int:
        return sum(sum(g["sizes"]) for g in self.groups)


async def plan_state(
    effects: CellEffects,
    namespace: dict[str, Any],
    replicated: Mapping[str, bytes],
    codec: ObjectCodec,
    *,
    hidden: Container[str] = (),
    store_seconds: Any = None,
    defer_large: bool = False,
    defer_max_bytes: int | None = None,
    retry: Collection[str] = (),
    unprotected: Collection[str] = (),
    images: bool = False,
    loading: Collection[str] = (),
) -> StatePlan:
    """The executor's side of step 7: which names changed, and their encoded groups.

    ``replicated``: name -> fingerprint as the log will hold it. ``store_seconds``: a callable
    returning the seconds spent writing to the data store so far (to split encode time).
    ``defer_large``: groups for the data store are copied aside (``StatePlan.deferred``) for
    ``complete_state`` to write after the reply, instead of being written here (at most
    ``defer_max_bytes`` of them per cell: the copy doubles their memory). ``retry``: names an
    earlier cell could not store, encoded again whatever their fingerprint says (the next
    attempt). ``unprotected``: names the log holds no current value of (unstored, unpicklable);
    one that is gone from the namespace is listed as deleted, so no later executor reports it
    missing. ``images``: groups for the data store are left as live views (``StatePlan.images``)
    for a background image (``state_image.StateImager``) instead of being copied or written.
    ``loading``: names whose logged value this replica is still loading (``lazy_load``): absent
    from the namespace, yet neither deleted nor changed (the cell could not touch them: the names
    it may touch were loaded before it ran)."""
    plan = StatePlan()
    started = time.perf_counter()
    replicable = replicable_names(namespace, hidden)
    replicable_set = set(replicable)
    check = names_to_check(effects, namespace, replicated=replicated, shared_with=codec.sharing())
    check = {name for name in check if (name in replicable_set or name in replicated) and name not in loading}
    retrying = {name for name in retry if name in replicable_set}
    check |= retrying
    module_aliases: set[str] = set()
    for record in effects.imported:
        try:
            statement = import_statement(record, namespace)
        except (ImportError, ValueError):  # a relative import without a package: cannot replay
            continue
        if record.alias == "*":
            for name in star_imported(record, namespace, replicable_set):
                plan.imports.append((name, statement))
                module_aliases.add(name)  # replayed, not pickled (until a cell changes it)
                plan.fingerprints[name] = import_fingerprint(statement)
            continue
        if record.alias not in replicable_set:
            continue
        plan.imports.append((record.alias, statement))
        if still_imported(statement, record.alias, namespace[record.alias]):
            module_aliases.add(record.alias)  # replayed, not pickled
            plan.fingerprints[record.alias] = import_fingerprint(statement)
    plan.deleted = sorted(
        name for name in {*replicated, *unprotected} if name not in replicable_set and name not in loading
    )
    codec.forget(plan.deleted)
    plan.timings["analysis_ms"] = (time.perf_counter() - started) * 1000

    started = time.perf_counter()
    changed: list[str] = []
    fps: dict[str, bytes | None] = {}
    for name in sorted(check):
        if name not in replicable_set or name in module_aliases:
            continue
        old = replicated.get(name, b"")
        if old.startswith(IMPORT_MARK) and still_imported(
            old[len(IMPORT_MARK) :].decode(errors="replace"), name, namespace[name]
        ):
            continue  # still what its import bound: the standbys have it by replaying it
        fps[name] = value_fingerprint(namespace[name], namespace)
        if fps[name] is None or fps[name] != value_part(replicated.get(name, b"")) or name in retrying:
            changed.append(name)
    same = [name for name in fps if name not in changed]
    if same:  # an equal value may share differently than the standbys' copy does
        codec.index(namespace, replicable)
        codec.refresh(namespace, same)
        sharing = codec.sharing_counts()
        for name in same:
            if with_sharers(fps[name], sharing.get(name, {})) != replicated.get(name):  # type: ignore[arg-type]
                changed.append(name)
    plan.timings["fingerprint_ms"] = (time.perf_counter() - started) * 1000

    started = time.perf_counter()
    store_before = store_seconds() if store_seconds is not None else 0.0
    if changed:
        result = await codec.encode(
            namespace,
            changed,
            universe=replicable,
            defer_large=defer_large,
            defer_max_bytes=defer_max_bytes,
            images=images,
        )
        plan.groups = [group.to_dict() for group in result.groups]
        plan.deferred = result.deferred
        plan.images = result.images
        plan.skipped = {s.name: s.reason for s in result.skipped}
        plan.unstored = dict(result.unstored)
        plan.retried = tuple(sorted(retrying & set(changed)))
        sharing = codec.sharing_counts()
        for name in result.names:
            fp = fps[name] if name in fps else value_fingerprint(namespace[name], namespace)
            plan.fingerprints[name] = with_sharers(fp, sharing.get(name, {})) if fp else UNFINGERPRINTED
        # a name left unsent whose sharers changed (``v`` rebound away from a view of ``x``): the
        # standbys' copy no longer shares with them either, so only its fingerprint is updated
        for name, old in replicated.items():
            if name in plan.fingerprints or name not in namespace or name not in sharing:
                continue
            if old.startswith(IMPORT_MARK) or old == UNFINGERPRINTED or name in plan.skipped:
                continue
            fp = with_sharers(value_part(old), sharing[name])
            if fp != old:
                plan.fingerprints[name] = fp
    store_ms = ((store_seconds() if store_seconds is not None else 0.0) - store_before) * 1000
    plan.timings["serialize_ms"] = (time.perf_counter() - started) * 1000 - store_ms
    plan.timings["store_ms"] = store_ms
    return plan


async def complete_state(
    state: State,
    deferred: Mapping[int, memoryview],
    store: DataStore | None,
    log: Any,
    images: Mapping[int, concurrent.futures.Future[Any]] | None = None,
) -> State:
    """Write-behind (``datastore.write_behind``), on the Raft thread after the reply: write each
    copied-aside group to the data store and put its pointer into the STATE entry, which is only
    proposed then (a standby must never see a pointer to an object not yet written); ``images``:
    groups copied by a background image (``state_image``), whose manifest refs go in once each
    image has committed. A group whose write (or image) fails is left out with its names,
    fingerprints included, and they are listed in ``unstored`` with the reason: the executor
    retries them, and any other replica that executes next tells its user they are missing. The
    standbys keep their previous values meanwhile. Never raises."""
    groups = list(state.groups)
    failed: dict[int, str] = {}
    for index, image in sorted((images or {}).items()):
        try:
            result = await asyncio.wrap_future(image)
        except Exception as exc:
            failed[index] = store_failure(exc)
            log.warning("state_write_failed", names=groups[index]["names"], reason=failed[index])
            continue
        groups[index] = {**groups[index], "image": result.ref.to_dict()}
        log.debug(
            "state_imaged",
            names=groups[index]["names"],
            bytes=result.image_bytes,
            new_bytes=result.new_bytes,
            cow_bytes=result.cow_bytes,
        )
    for index, payload in sorted(deferred.items()):
        assert store is not None
        started = time.perf_counter()
        try:
            ref = await store.put_stream([payload], size_hint=payload.nbytes)
        except Exception as exc:
            failed[index] = store_failure(exc)
            log.warning("state_write_failed", names=groups[index]["names"], reason=failed[index])
            continue
        groups[index] = {**groups[index], "pointer": ref.to_dict()}
        log.debug(
            "state_written",
            names=groups[index]["names"],
            bytes=payload.nbytes,
            write_ms=round((time.perf_counter() - started) * 1000, 3),
        )
    if not failed:
        return dataclasses.replace(state, groups=tuple(groups))
    lost = {name: failed[index] for index in failed for name in groups[index]["names"]}
    return dataclasses.replace(
        state,
        groups=tuple(group for index, group in enumerate(groups) if index not in failed),
        digests={name: fp for name, fp in state.digests.items() if name not in lost},
        unstored={**state.unstored, **lost},
    )


def import_statement(record: ImportRecord, namespace: Mapping[str, Any]) -> str:
    """The statement that re-creates ``record``'s binding on a standby, made absolute: a relative
    import resolves against the executor's ``__package__`` (private names are not replicated, so
    a standby's namespace lacks it). ``ImportError``/``ValueError`` when it cannot resolve."""
    if record.level == 0:
        return record.statement()
    package = namespace.get("__package__") or ""
    absolute = importlib.util.resolve_name("." * record.level + record.module, package)
    return dataclasses.replace(record, module=absolute, level=0).statement()


def star_imported(record: ImportRecord, namespace: Mapping[str, Any], replicable: set[str]) -> list[str]:
    """Names a ``from m import *`` bound that still hold m's attributes (``__all__``, else its
    public names): a standby gets them by replaying the statement instead of pickles."""
    try:
        module_name = import_statement(record, namespace).split()[1]
    except (ImportError, ValueError):
        return []
    module = sys.modules.get(module_name)
    if module is None:
        return []
    exported = getattr(module, "__all__", None)
    if not isinstance(exported, list | tuple):
        exported = [name for name in vars(module) if not name.startswith("_")]
    missing = object()
    return sorted(
        name
        for name in exported
        if isinstance(name, str)
        and name in replicable
        and namespace.get(name, missing) is getattr(module, name, missing)
    )


def modules_of(statements: Iterable[str]) -> list[str]:
    """The (absolute) modules import statements import, in order, each once."""
    found: dict[str, None] = {}
    for statement in statements:
        try:
            tree = ast.parse(statement)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(dict.fromkeys(alias.name for alias in node.names))
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found[node.module] = None
    return list(found)


def not_imported(statements: Iterable[str]) -> list[str]:
    """The modules of ``statements`` this process has not imported yet."""
    return [module for module in modules_of(statements) if module not in sys.modules]


def preimport(modules: Iterable[str]) -> None:
    """Import ``modules`` on the calling thread, a worker's: the replay of their statements on
    the namespace's thread is then a lookup, not seconds of a cold ``import torch`` during which
    that thread answers nothing. A failure is left to the replay (it reports it; a module that
    must be imported on the main thread is imported there)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # the replay on the main thread reports it
            continue


def replay_imports(
    namespace: dict[str, Any], imports: Iterable[tuple[str, str]], not_loaded: dict[str, str] | None = None
) -> list[str]:
    """Run import statements in ``namespace``, each distinct one once (a star import stands for
    every name it binds); returns the failures ("stmt: error"), and records each failed alias
    in ``not_loaded`` (a successful one is removed from it)."""
    failures = []
    aliases: dict[str, list[str]] = {}
    for alias, statement in imports:
        aliases.setdefault(statement, []).append(alias)
    for statement, names in aliases.items():
        try:
            exec(statement, namespace)  # an import statement the executor ran
        except Exception as exc:
            failures.append(f"{statement}: {exc.__class__.__name__}: {exc}")
            if not_loaded is not None:
                not_loaded.update(
                    dict.fromkeys(names, f"{statement!r} failed: {exc.__class__.__name__}: {exc}")
                )
            continue
        if not_loaded is not None:
            for name in names:
                not_loaded.pop(name, None)
    return failures


class Deferrer(Protocol):
    """Where a standby's large groups go instead of being read at once (``lazy_load.LazyLoader``)."""

    def add(self, group: Mapping[str, Any], names: Iterable[str], msg_id: str = "") -> None: ...

    def supersede(self, names: Iterable[str]) -> None: ...


async def apply_state(
    namespace: dict[str, Any],
    codec: ObjectCodec,
    imports: Iterable[tuple[str, str]],
    groups: Iterable[tuple[Mapping[str, Any], Iterable[str] | None]],
    deleted: Iterable[str] = (),
    not_loaded: dict[str, str] | None = None,
    lazy: Deferrer | None = None,
    msg_id: str = "",
) -> list[str]:
    """A standby's side: replay imports, decode groups in log order (taking ``names`` of each, or
    all when None), then drop ``deleted``. Returns the failures (the rest is still applied).
    ``not_loaded``: name -> why this replica lacks the log's value of it, kept up to date (a
    name loaded or deleted later leaves it), so that it can be loaded again or told. ``lazy``:
    large groups (in the data store) are handed to it instead of read here, their names' older
    values removed meanwhile (never a stale value); every name this entry binds or deletes
    supersedes an older load of it still pending there."""
    imports = list(imports)  # replayed, then forgotten by the codec
    failures = replay_imports(namespace, imports, not_loaded)
    if lazy is not None:
        lazy.supersede(alias for alias, _statement in imports)
    for raw, names in groups:
        wanted = list(raw.get("names", ()) if names is None else names)
        if lazy is not None and is_large(raw):
            lazy.add(raw, wanted, msg_id)
            for name in wanted:
                namespace.pop(name, None)
                if not_loaded is not None:
                    not_loaded.pop(name, None)
            codec.forget(wanted)
            continue
        if lazy is not None:
            lazy.supersede(wanted)
        try:
            group = EncodedGroup.from_dict(raw)
            values = await codec.decode(group, namespace)
        except Exception as exc:  # e.g. a module missing on this host, a store unreachable
            failures.append(f"{', '.join(raw.get('names', ()))}: {exc.__class__.__name__}: {exc}")
            if not_loaded is not None:
                not_loaded.update(dict.fromkeys(wanted, not_loaded_reason(exc)))
            continue
        taken = values if names is None else {name: values[name] for name in names if name in values}
        namespace.update(taken)
        codec.forget(taken)  # new objects: what the old ones reached no longer holds
        if not_loaded is not None:
            for name in taken:
                not_loaded.pop(name, None)
    deleted = list(deleted)
    if lazy is not None:
        lazy.supersede(deleted)
    for name in deleted:
        namespace.pop(name, None)
        if not_loaded is not None:
            not_loaded.pop(name, None)
    codec.forget([*deleted, *(alias for alias, _statement in imports)])
    return failures


def not_loaded_reason(exc: BaseException) -> str:
    """Why a replica lacks a logged value (``not_loaded``): told to the user when it executes."""
    return f"could not be loaded here: {exc.__class__.__name__}: {exc}"


def _markers(raw: Any) -> dict[str, Marker]:
    if not isinstance(raw, dict) or not all(
        isinstance(name, str) and isinstance(m, list) and len(m) == 3 and all(isinstance(f, str) for f in m)
        for name, m in raw.items()
    ):
        raise ValueError("namespace snapshot 'up' must map names to [reason, msg_id, replica_id]")
    return {name: Marker(*fields) for name, fields in raw.items()}


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
        # what the last executor keeps in host memory for the GPU (its latest STATE's list), so
        # that a replica restored from a snapshot brings the same objects to its GPU
        self._gpu_resident: tuple[GpuResident, ...] = ()
        # names whose latest value is not in the log (durability.Marker): who holds it and why
        self._unprotected: dict[str, Marker] = {}
        # the notebook's open comms (comm_sync): id -> record, its digest, and the replica that
        # owns them (the last executor: only its comm-only repair STATEs are taken)
        self._comms: dict[str, CommRecord] = {}
        self._comm_fps: dict[str, bytes] = {}
        self._comm_owner: str | None = None
        # the last executor's working directory, environment changes, sys.path
        # and configuration magics (process_context), as of the last STATE that carried them
        self._process: ProcessContext | None = None
        # the cells' outputs (Out[n]), for a replica rebuilt from a snapshot or an image
        self._outputs = ReplicatedOutputs()

    def apply(self, state: State) -> State:
        """Apply a committed STATE; returns it as every replica must apply it to its namespace
        (a repair narrowed to the names it still protects: ``durability.apply_repair``)."""
        with self._lock:
            if state.repair:
                self._unprotected, state = apply_repair(self._unprotected, state)
                if self._comm_owner not in (None, state.replica_id) and (state.comms or state.comms_closed):
                    # a comm message handled by a replica that has since stopped executing: stale
                    state = dataclasses.replace(state, comms={}, comms_closed=())
            else:
                self._unprotected = apply_markers(self._unprotected, state)
                self._gpu_resident = state.gpu_resident
                self._comm_owner = state.replica_id
                self._outputs.rebound(
                    [
                        *(n for g in state.groups for n in g["names"]),
                        *state.deleted,
                        *(a for a, _ in state.imports),
                    ]
                )
                if state.output is not None:
                    self._outputs.add(state.output, state.replica_id)
            for comm_id, record in state.comms.items():
                self._comms[comm_id] = record
                self._comm_fps[comm_id] = record_digest(record)
            for comm_id in state.comms_closed:
                self._comms.pop(comm_id, None)
                self._comm_fps.pop(comm_id, None)
            if state.process is not None and not state.repair:
                self._process = state.process.merged_onto(self._process)
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
        return state

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

    def imported_modules(self) -> list[str]:
        """The top-level packages the namespace's import statements name (``import numpy as np``:
        numpy): what a resumed kernel imports first, recorded with its image for the runtime
        template (services/local_scheduler/runtime_template.py) to import ahead."""
        with self._lock:
            statements = [value for kind, value in self._records.values() if kind == "i"]
        return sorted({module.partition(".")[0] for module in modules_of(statements)})

    def gpu_resident(self) -> tuple[GpuResident, ...]:
        with self._lock:
            return self._gpu_resident

    def comm_digests(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._comm_fps)

    def comms(self) -> dict[str, CommRecord]:
        """Every open comm's record: what a replica restored from a snapshot re-creates."""
        with self._lock:
            return dict(self._comms)

    def process_context(self) -> ProcessContext | None:
        """The last executor's process context as committed (``process_context``), or None."""
        with self._lock:
            return self._process

    def outputs(self) -> list[tuple[CellOutput, str]]:
        """The cells' outputs as the log holds them, oldest first, with the replica that showed each."""
        with self._lock:
            return self._outputs.entries()

    def unprotected(self) -> dict[str, Marker]:
        """Names whose latest value never reached the log, as committed (``durability``)."""
        with self._lock:
            return dict(self._unprotected)

    def contents_of(
        self, names: Collection[str]
    ) -> tuple[list[tuple[str, str]], list[tuple[dict[str, Any], list[str]]]]:
        """``contents`` restricted to ``names``: what puts the log's values of them back."""
        imports, groups = self.contents()
        wanted = set(names)
        return (
            [(alias, stmt) for alias, stmt in imports if alias in wanted],
            [(group, kept) for group, names_of in groups if (kept := [n for n in names_of if n in wanted])],
        )

    def to_snapshot(self) -> bytes:
        with self._lock:
            return msgpack.packb(
                {
                    "fps": self._fps,
                    "records": {name: [kind, value] for name, (kind, value) in self._records.items()},
                    "groups": [[gid, group] for gid, group in sorted(self._groups.items())],
                    "next": self._next_group,
                    "gr": encode_gpu_resident(self._gpu_resident),
                    "up": {name: list(marker) for name, marker in self._unprotected.items()},
                    "cm": self._comms,
                    "co": self._comm_owner,
                    "px": self._process.to_wire() if self._process is not None else None,
                    "oh": self._outputs.to_wire(),
                },
                use_bin_type=True,
            )

    def restore(self, data: bytes) -> None:
        """Replace the contents with a ``to_snapshot``'s; ValueError (nothing replaced) if malformed."""
        parsed = self.parse_snapshot(data)
        with self._lock:
            (
                self._fps,
                self._records,
                self._groups,
                self._next_group,
                self._gpu_resident,
                self._unprotected,
                self._comms,
                self._comm_owner,
                self._process,
                self._outputs,
            ) = parsed
            self._comm_fps = {comm_id: record_digest(record) for comm_id, record in self._comms.items()}

    @staticmethod
    def parse_snapshot(
        data: bytes,
    ) -> tuple[
        dict[str, bytes],
        dict[str, tuple[str, Any]],
        dict[int, dict[str, Any]],
        int,
        tuple[GpuResident, ...],
        dict[str, Marker],
        dict[str, CommRecord],
        str | None,
        ProcessContext | None,
        ReplicatedOutputs,
    ]:
        """A snapshot's contents, checked (no import is run, nothing is unpickled here: that is
        the kernel's, when it loads the namespace); ValueError naming what is malformed."""
        try:
            raw = msgpack.unpackb(data, raw=False) if data else {"fps": {}, "records": {}, "groups": []}
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            raise ValueError(f"namespace snapshot is not msgpack: {type(exc).__name__}") from None
        if not isinstance(raw, dict):
            raise ValueError("namespace snapshot must be a map")
        fps, records, groups = raw.get("fps"), raw.get("records"), raw.get("groups")
        if type(fps) is not dict or not all(type(k) is str and type(v) is bytes for k, v in fps.items()):
            raise ValueError("namespace snapshot 'fps' must map names to digests")
        if type(groups) is not list or not all(
            type(g) is list and len(g) == 2 and type(g[0]) is int and type(g[1]) is dict for g in groups
        ):
            raise ValueError("namespace snapshot 'groups' must be a list of [id, group]")
        parsed_groups = {gid: dict(group) for gid, group in groups}
        if not all(
            type(g.get("names")) is list and all(type(n) is str for n in g["names"])
            for g in parsed_groups.values()
        ):
            raise ValueError("every group of a namespace snapshot must list its names")
        if type(records) is not dict:
            raise ValueError("namespace snapshot 'records' must be a map")
        parsed_records: dict[str, tuple[str, Any]] = {}
        for name, record in records.items():
            if not (
                type(name) is str
                and type(record) is list
                and len(record) == 2
                and (
                    (record[0] == "i" and type(record[1]) is str)
                    or (record[0] == "g" and type(record[1]) is int and record[1] in parsed_groups)
                )
            ):
                raise ValueError(f"namespace snapshot record {str(name)[:80]!r} is malformed")
            parsed_records[name] = (record[0], record[1])
        next_group = raw.get("next", max(parsed_groups, default=-1) + 1)
        if type(next_group) is not int or next_group <= max(parsed_groups, default=-1):
            raise ValueError("namespace snapshot 'next' must be an int above every group id")
        gpu_resident = decode_gpu_resident(raw.get("gr", []), "namespace snapshot 'gr'")  # a ValueError
        unprotected = _markers(raw.get("up", {}))  # a ValueError
        comms, owner = raw.get("cm", {}), raw.get("co")
        if type(comms) is not dict or not all(
            type(k) is str and type(v) is dict and type(v.get("target")) is str for k, v in comms.items()
        ):
            raise ValueError("namespace snapshot 'cm' must map comm ids to records with a target")
        if owner is not None and type(owner) is not str:
            raise ValueError("namespace snapshot 'co' must be a replica id")
        process = raw.get("px")
        if process is not None:
            process = ProcessContext.from_wire(process)  # a ValueError naming the field
        outputs = ReplicatedOutputs.from_wire(raw.get("oh", []))  # a ValueError
        return (
            dict(fps), parsed_records, parsed_groups, next_group, gpu_resident, unprotected, comms, owner, process,
            outputs,
        )  # fmt: skip
