"""The application entries a kernel's Raft log carries, and their msgpack encoding.

Every replica decides who executes a cell, whether it already ran, and what state it left, only
from these entries in commit order, so decoding is strict: anything malformed raises
``LogEntryError`` naming the problem and the caller logs and skips it. One corrupt or foreign
entry must never stop a replica from applying the rest of its log.

Wire shape: a msgpack map ``{"t": 1, "k": kind, ...fields}``; maps rather than arrays because
these entries are few (a handful per cell) and readable dumps matter more than bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from kernel_replica.output_history import CellOutput
from kernel_replica.process_context import ProcessContext

T = TypeVar("T")

ENTRY_VERSION = 1

LEAD = "LEAD"
YIELD = "YIELD"
VOTE = "VOTE"
VOTES = "VOTES"
DONE = "DONE"
STATE = "STATE"
PROGRESS = "PROGRESS"
KINDS = (LEAD, YIELD, VOTE, VOTES, DONE, STATE, PROGRESS)
GPU_RESIDENT_KINDS = ("tensor", "module", "optimizer")  # device_residency.Location.kind
GpuResident = tuple[str, tuple[str | int, ...], str]  # (name, path, kind): device_residency.Location


class LogEntryError(ValueError):
    """An entry that cannot be decoded or fails validation; ``str(exc)`` says why."""


@dataclass(frozen=True, slots=True)
class Lead:
    """``replica_id`` asks to execute ``msg_id`` (it received ``execute_request``)."""

    msg_id: str
    replica_id: str


@dataclass(frozen=True, slots=True)
class Yield:
    """``replica_id`` declines to execute ``msg_id``.

    ``proposer`` is who appended it: normally ``replica_id`` itself, or a peer that waited too long
    for a silent voter and yields on its behalf so the election can end (the log order still decides:
    a LEAD committed before that proxy YIELD wins).
    """

    msg_id: str
    replica_id: str
    proposer: str


@dataclass(frozen=True, slots=True)
class Vote:
    """``replica_id`` saw ``winner``'s LEAD commit first (informational; the log order decides)."""

    msg_id: str
    replica_id: str
    winner: str


@dataclass(frozen=True, slots=True)
class Votes:
    """Several of ``replica_id``'s VOTEs in one entry, ``(msg_id, winner)`` in the order cast: a
    replica not sent the cells votes as their LEADs commit and sends its votes together (one
    entry per flush, not one per cell, for every replica to store and apply)."""

    replica_id: str
    votes: tuple[tuple[str, str], ...]

    @property
    def msg_id(self) -> str:  # the first cell's, for logs
        return self.votes[0][0]

    def each(self) -> list[Vote]:
        return [Vote(msg_id, self.replica_id, winner) for msg_id, winner in self.votes]


@dataclass(frozen=True, slots=True)
class Done:
    """The executor finished ``msg_id``: the reply every replica sends, and the counter after it."""

    msg_id: str
    replica_id: str
    content: dict[str, Any]
    execution_count: int  # the shell's counter after the cell (what the next cell will be numbered)
    state_follows: bool = True  # a STATE entry for this msg_id will follow (the cell ran)
    # The cell's code when it belongs in the input history: the standbys are not sent the cell
    # (only its designated executor is), so this is how their history and function registry
    # learn it. None for silent cells, ``store_history=False``, and DONEs not from the executor.
    code: str | None = None
    # The executor's LEAD rode in this DONE: no replica proposes such a DONE any more (user code
    # runs only after a committed LEAD), but Raft logs written before that change may hold one,
    # and they must replay as they were decided: the book applies the LEAD first, and ignores
    # the DONE when the election was already won by another replica.
    claims_lead: bool = False


@dataclass(frozen=True, slots=True)
class State:
    """What ``msg_id`` changed in the namespace (``kernel_replica.state_sync``).

    ``groups`` are ``EncodedGroup.to_dict()`` records of the changed names (names sharing objects
    travel in one group, so shared objects stay shared on the standbys), inline or pointing into
    the data store; ``imports`` are ``(alias, statement)`` pairs the standbys replay;
    ``digests`` (name -> fingerprint of the value sent) let whichever replica executes next
    detect changes against it. ``namespace`` is a legacy whole-namespace pickle (empty now).
    """

    msg_id: str
    replica_id: str
    digests: dict[str, bytes] = field(default_factory=dict)
    namespace: bytes = b""
    deleted: tuple[str, ...] = ()
    # name -> why it could not be replicated (unpicklable); the next executor names it as missing.
    skipped: dict[str, str] = field(default_factory=dict)
    groups: tuple[dict[str, Any], ...] = ()
    imports: tuple[tuple[str, str], ...] = ()
    # (name, path, kind) of what the executor keeps in host memory for the GPU between cells
    # (kernel_replica/device_residency.py): the next executor moves the same objects to its GPU
    gpu_resident: tuple[GpuResident, ...] = ()
    # name -> why its new value could not be stored (the data store failed, or it is too large
    # for the Raft log): the value lives only in the executor's memory, which retries. Committed
    # so that any other replica that executes next can tell its user exactly what it lacks.
    unstored: dict[str, str] = field(default_factory=dict)
    # Not a cell's STATE: the executor stored, after the cell, values it had left unstored
    # (``msg_id`` is its own id for the attempt). Replicas take from it only the names still
    # marked as held by ``replica_id`` (``state_sync.ReplicatedNamespace.apply``).
    repair: bool = False
    # comm id -> record of the comms opened or changed (``comm_sync``: widget models, their
    # state), and the ids closed, since the previous STATE: the comms follow the executor
    comms: dict[str, dict[str, Any]] = field(default_factory=dict)
    comms_closed: tuple[str, ...] = ()
    # the executor's working directory, changed environment variables, sys.path and configuration
    # magics (``process_context``), when they differ from the log's last ones
    process: ProcessContext | None = None
    # the cell's Out[n], for the other replicas' output history (``output_history``)
    output: CellOutput | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    """The executor of ``msg_id`` is alive and still running it (appended every few seconds), so
    standbys can tell a long cell from a dead executor."""

    msg_id: str
    replica_id: str


LogEntry = Lead | Yield | Vote | Votes | Done | State | Progress


def encode(entry: LogEntry) -> bytes:
    body: dict[str, Any]
    match entry:
        case Lead():
            body = {"k": LEAD, "m": entry.msg_id, "r": entry.replica_id}
        case Yield():
            body = {"k": YIELD, "m": entry.msg_id, "r": entry.replica_id, "p": entry.proposer}
        case Vote():
            body = {"k": VOTE, "m": entry.msg_id, "r": entry.replica_id, "w": entry.winner}
        case Votes():
            body = {"k": VOTES, "m": entry.msg_id, "r": entry.replica_id, "v": [list(v) for v in entry.votes]}
        case Done():
            body = {
                "k": DONE,
                "m": entry.msg_id,
                "r": entry.replica_id,
                "c": entry.content,
                "n": entry.execution_count,
                "s": entry.state_follows,
            }
            if entry.code is not None:
                body["h"] = entry.code
            if entry.claims_lead:
                body["l"] = True
        case Progress():
            body = {"k": PROGRESS, "m": entry.msg_id, "r": entry.replica_id}
        case State():
            body = {
                "k": STATE,
                "m": entry.msg_id,
                "r": entry.replica_id,
                "dg": entry.digests,
                "ns": entry.namespace,
                "d": list(entry.deleted),
                "sk": entry.skipped,
                "g": list(entry.groups),
                "im": [list(pair) for pair in entry.imports],
            }
            if entry.gpu_resident:
                body["gr"] = encode_gpu_resident(entry.gpu_resident)
            if entry.unstored:
                body["us"] = entry.unstored
            if entry.repair:
                body["rp"] = True
            if entry.comms:
                body["cm"] = entry.comms
            if entry.comms_closed:
                body["cc"] = list(entry.comms_closed)
            if entry.process is not None:
                body["px"] = entry.process.to_wire()
            if entry.output is not None:
                body["ou"] = entry.output.to_wire()
        case _:
            raise TypeError(f"not a log entry: {type(entry).__name__}")
    body["t"] = ENTRY_VERSION
    return msgpack.packb(body, use_bin_type=True)


def _str(raw: dict[str, Any], key: str, kind: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise LogEntryError(f"{kind}: field {key!r} must be a non-empty string, got {value!r}")
    return value


def decode(data: bytes) -> LogEntry:
    """Parse and validate one entry; raises ``LogEntryError`` with the reason."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise LogEntryError(f"not msgpack: {exc.__class__.__name__}: {exc}") from exc
    if not isinstance(raw, dict):
        raise LogEntryError(f"entry must be a map, got {type(raw).__name__}")
    if raw.get("t") != ENTRY_VERSION:
        raise LogEntryError(f"unsupported entry version {raw.get('t')!r} (expected {ENTRY_VERSION})")
    kind = raw.get("k")
    if kind not in KINDS:
        raise LogEntryError(f"unknown entry kind {kind!r}")
    msg_id = _str(raw, "m", kind)
    replica_id = _str(raw, "r", kind)
    if kind == LEAD:
        return Lead(msg_id, replica_id)
    if kind == YIELD:
        return Yield(msg_id, replica_id, _str(raw, "p", kind))
    if kind == VOTE:
        return Vote(msg_id, replica_id, _str(raw, "w", kind))
    if kind == VOTES:
        votes = raw.get("v")
        if (
            not isinstance(votes, list)
            or not votes
            or not all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) and x for x in v)
                for v in votes
            )
        ):
            raise LogEntryError("VOTES: 'v' must be a non-empty list of [msg_id, winner] pairs")
        return Votes(replica_id, tuple((m, w) for m, w in votes))
    if kind == PROGRESS:
        return Progress(msg_id, replica_id)
    if kind == DONE:
        content, count, follows, code = raw.get("c"), raw.get("n"), raw.get("s", True), raw.get("h")
        claims_lead = raw.get("l", False)
        if not isinstance(content, dict) or not isinstance(content.get("status"), str):
            raise LogEntryError("DONE: content must be a map with a string 'status'")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise LogEntryError(f"DONE: execution count must be a non-negative int, got {count!r}")
        if not isinstance(follows, bool):
            raise LogEntryError("DONE: 's' must be a bool")
        if code is not None and not isinstance(code, str):
            raise LogEntryError(f"DONE: 'h' (the cell's code) must be a string, got {type(code).__name__}")
        if not isinstance(claims_lead, bool):
            raise LogEntryError("DONE: 'l' (claims the LEAD) must be a bool")
        return Done(msg_id, replica_id, content, count, follows, code, claims_lead)
    digests, blob = raw.get("dg", {}), raw.get("ns", b"")
    deleted, skipped, unstored = raw.get("d", []), raw.get("sk", {}), raw.get("us", {})
    if not isinstance(digests, dict) or not all(
        isinstance(k, str) and isinstance(v, bytes) for k, v in digests.items()
    ):
        raise LogEntryError("STATE: 'dg' must map names to bytes")
    if not isinstance(blob, bytes):
        raise LogEntryError("STATE: 'ns' must be bytes")
    if not isinstance(deleted, list) or not all(isinstance(n, str) for n in deleted):
        raise LogEntryError("STATE: 'd' must be a list of names")
    if not isinstance(skipped, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in skipped.items()
    ):
        raise LogEntryError("STATE: 'sk' must map names to reasons")
    if not isinstance(unstored, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in unstored.items()
    ):
        raise LogEntryError("STATE: 'us' must map names to reasons")
    repair = raw.get("rp", False)
    if not isinstance(repair, bool):
        raise LogEntryError("STATE: 'rp' (a repair) must be a bool")
    groups, imports = raw.get("g", []), raw.get("im", [])
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("names"), list) and isinstance(g.get("sizes"), list)
        for g in groups
    ):
        raise LogEntryError("STATE: 'g' must be a list of group records")
    if not isinstance(imports, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in imports
    ):
        raise LogEntryError("STATE: 'im' must be a list of [alias, statement] pairs")
    resident = decode_gpu_resident(raw.get("gr", []), "STATE: 'gr'")
    comms, comms_closed = raw.get("cm", {}), raw.get("cc", [])
    if not isinstance(comms, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("target"), str)
        for k, v in comms.items()
    ):
        raise LogEntryError("STATE: 'cm' must map comm ids to records with a target")
    if not isinstance(comms_closed, list) or not all(isinstance(c, str) for c in comms_closed):
        raise LogEntryError("STATE: 'cc' must be a list of comm ids")
    process = _optional(raw, "px", ProcessContext.from_wire)
    output = _optional(raw, "ou", CellOutput.from_wire)
    return State(
        msg_id,
        replica_id,
        digests,
        blob,
        tuple(deleted),
        skipped,
        tuple(groups),
        tuple((alias, stmt) for alias, stmt in imports),
        resident,
        unstored,
        repair,
        comms,
        tuple(comms_closed),
        process,
        output,
    )


def _optional(raw: dict[str, Any], key: str, parse: Callable[[Any], T]) -> T | None:
    """A STATE's optional field ``key`` parsed, or None; LogEntryError naming it if malformed."""
    value = raw.get(key)
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError as exc:
        raise LogEntryError(f"STATE: {key!r}: {exc}") from None


def encode_gpu_resident(resident: Iterable[GpuResident]) -> list[list[Any]]:
    return [[name, list(path), kind] for name, path, kind in resident]


def decode_gpu_resident(raw: Any, what: str) -> tuple[GpuResident, ...]:
    """``[[name, [key, ...], kind], ...]`` as in a STATE's ``gr`` (also a namespace snapshot's);
    LogEntryError naming ``what`` if it is anything else."""
    if not isinstance(raw, list) or not all(
        isinstance(r, list)
        and len(r) == 3
        and isinstance(r[0], str)
        and isinstance(r[1], list)
        and all(isinstance(key, str | int) for key in r[1])
        and r[2] in GPU_RESIDENT_KINDS
        for r in raw
    ):
        raise LogEntryError(f"{what} must be a list of [name, [key, ...], kind] locations")
    return tuple((name, tuple(path), kind) for name, path, kind in raw)
