"""A kernel's held cells on the global scheduler's disk, so a restarted scheduler still runs them.

A cell held for a migration, and the kernel's later shell requests queued behind it, were never
sent to any replica (a cell held after a failed election was, but no replica ran it): they live
only in the scheduler, and were lost with it, leaving their client waiting. The migrator hands
the kernel's held queue here on every change, and releases it just before sending the cells on,
so a crash in between loses them rather than sending them twice, which could run a cell twice.
A restarted scheduler reads the queue back when it adopts the kernel.

Why a log and a writer thread: the journal used to rewrite the whole queue, fsync'd, on the event
loop at every change; a queue growing to 60 cells of 1 MB wrote 1.8 GB and stalled the loop for
seconds, long enough for every host to call the scheduler unreachable. Now each kernel has an
append-only log (``<kernel>.held.log``): a change becomes the records it adds (the head cell, a
request queued at the back or put back at the front), encoded and written by one background
thread in the order they were made, with one fsync per file per batch. The loop only compares
the new queue with the last one it handed over (frames are shared, so that is pointer
comparisons). A queue written late, or lost in a crash before its fsync, is lost, never doubled.

Releasing is the one durable step the loop waits for, because the cells go out right after it:
it drops the kernel's writes still queued, waits for a write of that file in progress, and
deletes the log (a released queue compacts to nothing), then fsyncs the directory. Any change
that removes a request is such a release followed by the rest written afresh. A log that grew
past twice its live content (head records piling up) is rewritten from its live content.

Each record is ``length (4 bytes) | crc32 (4 bytes) | msgpack map``; replay stops at the first
incomplete or damaged record, so a torn tail from a crash mid-write is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import threading
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import structlog

log = structlog.get_logger("global_scheduler.held_journal")

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_RECORD_HEADER = struct.Struct(">II")  # payload length, crc32 of the payload
LOG_SUFFIX = ".held.log"
# A log is rewritten from its live content once it is this large and twice that content.
COMPACT_MIN_BYTES = 4 << 20
# At most this much is written to one file between two looks at whether it was released, so a
# release waits for a bounded write, not a whole backlog.
CHUNK_BYTES = 8 << 20

HEAD, HELD, HELD_FRONT = "head", "held", "held_front"


@dataclass(frozen=True, slots=True)
class HeldQueue:
    """What a restarted scheduler needs to hold a kernel's cells again."""

    msg_id: str  # the cell at the head
    round_: int  # its election round (a cell held after a failed election is sent as the next)
    busy_sent: bool  # the client already saw busy for it
    requests: tuple[tuple[bytes, ...], ...]  # the client's frames, head first


# ---- the log format (pure) -----------------------------------------------------------------


def encode_record(record: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb(record, use_bin_type=True)
    return _RECORD_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(data: bytes) -> tuple[list[dict[str, Any]], int, str]:
    """The whole records at the start of ``data``, the bytes they take, and why reading stopped
    early ("" when it reached the end): a torn or damaged tail is left out, never raised."""
    records: list[dict[str, Any]] = []
    offset = 0
    size = _RECORD_HEADER.size
    while offset < len(data):
        if len(data) - offset < size:
            return records, offset, "torn record header"
        length, crc = _RECORD_HEADER.unpack_from(data, offset)
        payload = data[offset + size : offset + size + length]
        if len(payload) < length:
            return records, offset, "torn record"
        if zlib.crc32(payload) != crc:
            return records, offset, "record checksum mismatch"
        try:
            record = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            return records, offset, f"undecodable record: {exc}"
        if not isinstance(record, dict):
            return records, offset, "record is not a map"
        records.append(record)
        offset += size + length
    return records, offset, ""


@dataclass(slots=True)
class _Replay:
    """A queue as rebuilt from records; also the writer's view of what a log holds."""

    kernel_id: str = ""
    msg_id: str = ""
    round_: int = 0
    busy_sent: bool = False
    requests: deque[tuple[bytes, ...]] = field(default_factory=deque)
    payload_bytes: int = 0

    def apply(self, record: dict[str, Any]) -> None:
        op = record["op"]
        if op == HEAD:
            self.kernel_id = str(record["kernel_id"])
            self.msg_id = str(record["msg_id"])
            self.round_ = int(record["round"])
            self.busy_sent = bool(record["busy_sent"])
        elif op in (HELD, HELD_FRONT):
            frames = tuple(bytes(f) for f in record["frames"])
            if not frames:
                raise ValueError("a held request without frames")
            if op == HELD:
                self.requests.append(frames)
            else:
                self.requests.appendleft(frames)
            self.payload_bytes += sum(len(f) for f in frames)
        else:
            raise ValueError(f"unknown record {op!r}")

    def queue(self) -> HeldQueue | None:
        if not self.msg_id or not self.requests:
            return None
        return HeldQueue(self.msg_id, self.round_, self.busy_sent, tuple(self.requests))

    def snapshot(self) -> list[dict[str, Any]]:
        """The records that rebuild this queue alone (a compacted log)."""
        head = {
            "op": HEAD,
            "kernel_id": self.kernel_id,
            "msg_id": self.msg_id,
            "round": self.round_,
            "busy_sent": self.busy_sent,
        }
        return [head, *({"op": HELD, "frames": list(frames)} for frames in self.requests)]


def head_record(kernel_id: str, queue: HeldQueue) -> dict[str, Any]:
    return {
        "op": HEAD,
        "kernel_id": kernel_id,
        "msg_id": queue.msg_id,
        "round": queue.round_,
        "busy_sent": queue.busy_sent,
    }


def changes(kernel_id: str, before: HeldQueue | None, after: HeldQueue) -> list[dict[str, Any]] | None:
    """The records that turn the log of ``before`` into one of ``after``; None when requests were
    removed (the caller then releases and writes ``after`` afresh). Frames are compared by
    identity first, so a queue that only grew costs pointer comparisons."""
    if before is None:
        return [head_record(kernel_id, after), *({"op": HELD, "frames": list(f)} for f in after.requests)]
    old, new = before.requests, after.requests
    records: list[dict[str, Any]] = []
    if (before.msg_id, before.round_, before.busy_sent) != (after.msg_id, after.round_, after.busy_sent):
        records.append(head_record(kernel_id, after))
    if new[: len(old)] == old:
        records.extend({"op": HELD, "frames": list(f)} for f in new[len(old) :])
    elif len(new) > len(old) and new[len(new) - len(old) :] == old:
        added = new[: len(new) - len(old)]
        records.extend({"op": HELD_FRONT, "frames": list(f)} for f in reversed(added))
    else:
        return None
    return records


def replay(kernel_id: str, data: bytes) -> tuple[HeldQueue | None, str]:
    """The queue a log holds and, when part of it was ignored, why."""
    records, _, problem = read_records(data)
    state = _Replay()
    for record in records:
        try:
            state.apply(record)
        except (KeyError, TypeError, ValueError) as exc:
            return None, f"malformed record: {exc}"
    if state.kernel_id and state.kernel_id != kernel_id:
        return None, f"the log is for kernel {state.kernel_id!r}"
    return state.queue(), problem


# ---- the shell: files and the writer thread --------------------------------------------------


@dataclass(slots=True)
class _Append:
    kernel_id: str
    generation: int
    records: list[dict[str, Any]]


@dataclass(slots=True)
class _LogFile:
    """What the writer knows of one kernel's log (guarded by that kernel's file lock)."""

    generation: int
    state: _Replay = field(default_factory=_Replay)
    size: int = 0
    broken: bool = False  # a write failed: the next one rewrites the log from ``state``


class HeldJournal:
    """Per global scheduler: the kernels' held-queue logs and the thread that writes them."""

    def __init__(self, directory: Path, *, compact_min_bytes: int = COMPACT_MIN_BYTES) -> None:
        self._dir = directory
        self._compact_min_bytes = compact_min_bytes
        self._handed: dict[str, HeldQueue] = {}  # loop side: the last queue given to the writer
        self._lock = threading.Lock()  # guards _pending, _generation, _queued, _written, _stopping
        self._changed = threading.Condition(self._lock)
        self._pending: deque[_Append] = deque()
        self._generation: dict[str, int] = {}
        self._queued = 0
        self._written = 0
        self._stopping = False
        self._file_locks: dict[str, threading.Lock] = {}
        self._files: dict[str, _LogFile] = {}  # writer side, each under its file lock
        self._thread: threading.Thread | None = None

    def path(self, kernel_id: str) -> Path:
        name = kernel_id if _SAFE_NAME.match(kernel_id) else hashlib.sha256(kernel_id.encode()).hexdigest()
        return self._dir / f"{name}{LOG_SUFFIX}"

    def _legacy_path(self, kernel_id: str) -> Path:  # the one-file-per-queue format before the log
        path = self.path(kernel_id)
        return path.with_name(path.name.removesuffix(LOG_SUFFIX) + ".msgpack")

    # ---- called on the event loop -------------------------------------------------------------

    def save(self, kernel_id: str, queue: HeldQueue | None) -> None:
        """Record the kernel's held queue as it is now (None: nothing held any more). A removal
        is durable when this returns; anything else is written in the background. A failure is
        logged, not raised: the scheduler keeps serving, only a restart would lose the cells."""
        before = self._handed.get(kernel_id)
        if queue is None or not queue.requests:
            if before is not None or self.path(kernel_id).exists() or self._legacy_path(kernel_id).exists():
                self._release(kernel_id)
            return
        records = changes(kernel_id, before, queue)
        if records is None:  # requests left the queue: they must not come back after a crash
            self._release(kernel_id)
            records = changes(kernel_id, None, queue)
            assert records is not None
        self._handed[kernel_id] = queue
        if records:
            self._enqueue(kernel_id, records)

    def load(self, kernel_id: str) -> HeldQueue | None:
        """The kernel's held queue as last saved; None if there is none or it cannot be read
        (then logged with the reason). A torn tail is left out, with a warning."""
        if kernel_id in self._handed:  # written by this process: what it handed over is the truth
            return self._handed[kernel_id]
        path = self.path(kernel_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self._load_legacy(kernel_id)
        except OSError as exc:
            log.warning("held_queue_unreadable", kernel=kernel_id, path=str(path), error=str(exc))
            return None
        queue, problem = replay(kernel_id, data)
        if problem:
            log.warning("held_queue_tail_ignored", kernel=kernel_id, path=str(path), reason=problem)
        if queue is None:
            if problem.startswith(("malformed", "the log is for")):
                log.warning("held_queue_unreadable", kernel=kernel_id, path=str(path), error=problem)
            return None
        # The log is kept as it is: later changes append to it (a torn tail is cut first).
        with self._file_lock(kernel_id):
            file = self._files[kernel_id] = _LogFile(self._current_generation(kernel_id))
            file.state = _state_of(kernel_id, queue)
            file.size = len(data)
            file.broken = bool(problem)  # rewritten whole at the next change
        self._handed[kernel_id] = queue
        return queue

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far is on disk (or given up); False on timeout."""
        with self._changed:
            target = self._queued
            return self._changed.wait_for(lambda: self._written >= target, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending, then stop the writer thread."""
        self.flush(timeout)
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _enqueue(self, kernel_id: str, records: list[dict[str, Any]]) -> None:
        with self._changed:
            self._pending.append(_Append(kernel_id, self._generation.get(kernel_id, 0), records))
            self._queued += 1
            self._stopping = False
            self._changed.notify_all()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="held-journal", daemon=True)
            self._thread.start()

    def _release(self, kernel_id: str) -> None:
        """Durably forget the kernel's queue before its cells are sent on (see the docstring)."""
        self._handed.pop(kernel_id, None)
        with self._changed:
            generation = self._generation[kernel_id] = self._generation.get(kernel_id, 0) + 1
            dropped = [op for op in self._pending if op.kernel_id == kernel_id]
            if dropped:
                self._pending = deque(op for op in self._pending if op.kernel_id != kernel_id)
                self._written += len(dropped)
                self._changed.notify_all()
        path = self.path(kernel_id)
        with self._file_lock(kernel_id):
            self._files[kernel_id] = _LogFile(generation)
            try:
                path.unlink(missing_ok=True)
                self._legacy_path(kernel_id).unlink(missing_ok=True)
                _fsync_directory(self._dir)
            except OSError as exc:
                log.warning("held_queue_not_released", kernel=kernel_id, path=str(path), error=str(exc))

    def _current_generation(self, kernel_id: str) -> int:
        with self._lock:
            return self._generation.get(kernel_id, 0)

    def _file_lock(self, kernel_id: str) -> threading.Lock:
        with self._lock:
            return self._file_locks.setdefault(kernel_id, threading.Lock())

    def _load_legacy(self, kernel_id: str) -> HeldQueue | None:
        path = self._legacy_path(kernel_id)
        try:
            raw = msgpack.unpackb(path.read_bytes(), raw=False)
            if raw["kernel_id"] != kernel_id:
                raise ValueError(f"the file is for kernel {raw['kernel_id']!r}")
            requests = tuple(tuple(bytes(f) for f in frames) for frames in raw["requests"])
            if not requests:
                raise ValueError("no requests")
            queue = HeldQueue(str(raw["msg_id"]), int(raw["round"]), bool(raw["busy_sent"]), requests)
        except FileNotFoundError:
            return None
        except (OSError, KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            log.warning("held_queue_unreadable", kernel=kernel_id, path=str(path), error=str(exc))
            return None
        self.save(kernel_id, queue)  # into a log; the old file goes at the next release
        return queue

    # ---- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._stopping)
                if not self._pending:
                    return
                batch = list(self._pending)
                self._pending.clear()
            by_kernel: dict[str, list[_Append]] = {}
            for op in batch:
                by_kernel.setdefault(op.kernel_id, []).append(op)
            for kernel_id, ops in by_kernel.items():
                for chunk in _chunks(ops):
                    self._write(kernel_id, chunk)
                    with self._changed:
                        self._written += len(chunk)
                        self._changed.notify_all()

    def _write(self, kernel_id: str, ops: list[_Append]) -> None:
        path = self.path(kernel_id)
        with self._file_lock(kernel_id):
            generation = self._current_generation(kernel_id)
            ops = [op for op in ops if op.generation == generation]  # the rest was released
            if not ops:
                return
            file = self._files.get(kernel_id)
            if file is None or file.generation != generation:
                file = self._files[kernel_id] = _LogFile(generation)
            try:
                data = bytearray()
                for op in ops:
                    for record in op.records:
                        file.state.apply(record)
                        data += encode_record(record)
                if file.broken or file.size > max(self._compact_min_bytes, 2 * file.state.payload_bytes):
                    self._rewrite(path, file)
                    return
                self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                created = not path.exists()
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if created:
                    _fsync_directory(self._dir)
                file.size += len(data)
                if file.size > max(self._compact_min_bytes, 2 * file.state.payload_bytes):
                    self._rewrite(path, file)
            except (OSError, KeyError, TypeError, ValueError) as exc:
                file.broken = True
                log.warning("held_queue_not_saved", kernel=kernel_id, path=str(path), error=str(exc))

    def _rewrite(self, path: Path, file: _LogFile) -> None:
        """Compaction: the log replaced by the records of its live content alone."""
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        data = b"".join(encode_record(r) for r in file.state.snapshot())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_directory(self._dir)
        file.size = len(data)
        file.broken = False
        log.info("held_queue_compacted", path=str(path), bytes=len(data))


def _state_of(kernel_id: str, queue: HeldQueue) -> _Replay:
    state = _Replay()
    for record in changes(kernel_id, None, queue) or []:
        state.apply(record)
    return state


def _chunks(ops: Iterable[_Append]) -> Iterator[list[_Append]]:
    chunk: list[_Append] = []
    size = 0
    for op in ops:
        chunk.append(op)
        size += sum(len(f) for r in op.records for f in r.get("frames", ()))
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_directory(directory: Path) -> None:
    """Make a create, rename or unlink in ``directory`` durable (where the platform allows)."""
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:  # some filesystems refuse fsync on a directory; the entry is then best effort
            pass
        finally:
            os.close(fd)
