"""Durable Raft storage: a CRC-framed write-ahead log plus atomically written snapshot files.

Layout of a storage directory::

    wal-<seq:016x>.log                 segments, replayed in sequence order
    snap-<index:016x>-<term:016x>.snap the newest snapshot (older ones are removed on compaction)
    unsynced-boot                      only with fsync off: the boot id the unsynced writes belong to

A segment is an 8-byte magic followed by records ``[u32 length][u32 crc32(payload)][payload]``; the
payload is a msgpack array, one of

* ``[APPEND, hard_state | nil, [entry, ...]]`` — one per ``Ready``: its entries and hard state land
  (or are lost to a crash) together. An entry at index ``i`` implicitly truncates any stored entry
  ``>= i``: that is how a conflicting suffix is overwritten without a separate marker.
* ``[RESET, index, term]`` — the log restarts after ``(index, term)``, which a snapshot on disk
  covers. Written when a snapshot from the leader is installed and at the head of every compacted
  segment.

Why this shape: one ``write`` and at most one ``fdatasync`` per ``Ready`` (group commit), replay is a
single forward scan, a torn or corrupt tail is found by the CRC and cut off (logged, never applied),
and compaction is "write a fresh self-contained segment, then delete the old ones", which is crash
safe at every step. Log calls are synchronous and meant to run on the event loop: an ``fdatasync``
of a small append measures ~0.14 ms here, and a ``run_in_executor`` hop costs ~0.06 ms on top of it
(plus a wake-up), which measured end to end gives higher commit latency and lower throughput than
syncing inline (see ``PeerConfig.sync_in_thread``). Writing a snapshot file may be slow for a large
state: ``write_snapshot_file`` changes no state here, so it is safe in a worker thread.

Durability policy (``fsync``; the replicas' ``raft.fsync``, default off). Raft is safe as long as
a member never forgets an entry it acknowledged or a vote it cast. Bytes handed to ``write`` live
in the OS page cache: a *process* crash keeps them, only a *machine* crash (power loss, kernel
panic, reboot) can take unsynced writes away. So there are two ways to be safe:

* ``fsync=True``: one ``fdatasync`` per ``Ready`` with entries or a term/vote change (the etcd
  way). The log survives anything the disk survives; it costs ~1 ms per Ready on this VM, twice
  per cell on the execute path (issue #3).
* ``fsync=False``: no ``fdatasync`` of WAL appends (per ``Ready``, or of a segment being rotated
  out), and the directory is *fenced by the boot id*: before the first unsynced write, a small
  file ``unsynced-boot`` holding ``/proc/sys/kernel/random/boot_id`` (a new random id at every
  boot) is written durably (tmp, fsync, rename, fsync dir). Opening a directory whose fence names
  another boot raises ``StaleLogAfterReboot``: the machine went down while the log held writes
  that were never synced, so this member may have forgotten what it acknowledged; it must be
  replaced by a fresh member (a new, empty directory), never restarted in place. Within one boot
  a restarted process finds everything it wrote, so restarts in place stay safe. A clean
  ``close()`` syncs every segment and removes the fence, as does opening the directory with
  ``fsync=True`` in the same boot: from then on the log survives a reboot again. Where there is
  no boot id (not Linux) the fence cannot work, so the storage falls back to ``fsync=True`` and
  logs ``raft.storage.fsync_forced``.

Why a fence and not "sync now and then": a periodic sync still leaves a window in which an
acknowledged entry is lost to a power cut, and nothing after the reboot could tell. The fence
turns that silent loss into a refusal, which the cluster already handles (a dead replica is
replaced by a new member). The cost is that after a machine crash every replica that was on it
is replaced (state sync of the namespace) instead of restarted. Snapshot files, compaction's
fresh segment and recovery's truncation are still synced whatever the setting: they are rare and
off the per-cell path. A deployment that wants the classic guarantee regardless of reboots sets
``raft.fsync = true``.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import structlog

from shared.private_files import open_private, private_dir
from shared.raft.codec import (
    entry_from_wire,
    hard_state_from_wire,
    hard_state_to_wire,
    snapshot_meta_from_wire,
    snapshot_meta_to_wire,
)
from shared.raft.types import Entry, HardState, RestoredState, Snapshot, SnapshotMeta

WAL_MAGIC = b"TNDWAL1\n"
SNAP_MAGIC = b"TNDSNP1\n"
HEADER = struct.Struct("<II")  # payload length, crc32(payload)
MAX_RECORD = 1 << 30  # a length field beyond this is garbage, not a record

REC_APPEND = 1
REC_RESET = 2

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024

_SEGMENT_RE = re.compile(r"^wal-([0-9a-f]{16})\.log$")
_SNAPSHOT_RE = re.compile(r"^snap-([0-9a-f]{16})-([0-9a-f]{16})\.snap$")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
FENCE_FILE = "unsynced-boot"  # present while the WAL may hold writes a machine crash can undo

BootIdReader = Callable[[], str | None]


def read_boot_id() -> str | None:
    """This machine's boot id (Linux draws a new random one at every boot); None where there is none."""
    try:
        return BOOT_ID_PATH.read_text().strip() or None
    except OSError:
        return None


class StorageError(Exception):
    """The directory cannot be turned back into a consistent Raft state; refuse to start."""


class StaleLogAfterReboot(StorageError):
    """The log was written without fsync and the machine rebooted since: it may have lost entries
    this member acknowledged, so the member must be replaced, never restarted in place."""

    def __init__(
        self, directory: str | os.PathLike[str], written_boot: str, current_boot: str | None
    ) -> None:
        super().__init__(
            f"StaleLogAfterReboot: Raft log in {directory} was written without fsync before a reboot "
            f"(boot {written_boot or '?'}, now {current_boot or 'unknown'}); this member may have "
            "forgotten acknowledged entries and must be replaced, not restarted in place"
        )
        self.directory = str(directory)
        self.written_boot = written_boot
        self.current_boot = current_boot


def check_boot_fence(directory: str | os.PathLike[str], boot_id: BootIdReader = read_boot_id) -> None:
    """Raise ``StaleLogAfterReboot`` if ``directory`` holds a log written without fsync under
    another boot. Reads one small file and changes nothing, so a replica can refuse to start
    before it registers (``kernel_replica/__main__.py``); ``Storage`` checks the same on open."""
    written = _read_fence(Path(directory))
    if written is None:
        return
    now = boot_id()
    if written != now:
        raise StaleLogAfterReboot(directory, written, now)


def _read_fence(directory: Path) -> str | None:
    """The boot id of the unsynced writes in ``directory``; None if it holds none."""
    try:
        return (directory / FENCE_FILE).read_text().strip()
    except FileNotFoundError:
        return None


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What ``Storage`` found when it opened the directory (also logged)."""

    segments: int = 0
    records: int = 0
    truncated_bytes: int = 0  # bytes cut from the segment where the problem was found
    discarded_segments: tuple[str, ...] = ()  # later segments set aside as ``*.discarded``
    problem: str | None = None  # what was wrong and where; None for a clean open

    @property
    def clean(self) -> bool:
        return self.problem is None


class Storage:
    """The durable half of a Raft node. Opening the directory replays it (see ``restored()``)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        fsync: bool = True,
        boot_id: BootIdReader = read_boot_id,
        logger: Any = None,
    ) -> None:
        self._dir = Path(directory)
        private_dir(self._dir)  # the log and snapshots hold the application's state (0700/0600)
        self._segment_bytes = segment_bytes
        self._fsync = fsync  # fdatasync WAL appends; off: the directory is fenced by the boot id
        self._boot_id = boot_id
        self._log = logger if logger is not None else structlog.get_logger("raft.storage")
        self._hard_state = HardState()
        self._snapshot_meta = SnapshotMeta()  # newest snapshot on disk
        self._base_index = 0  # the log holds entries base_index+1 .. base_index+len(entries)
        self._base_term = 0
        self._entries: list[Entry] = []
        self._fd = -1
        self._seq = 0
        self._size = 0
        self._dirty = False  # written but not yet fdatasync'd, and the write needs it
        self.recovery = RecoveryReport()
        self._open()

    # ------------------------------------------------------------------ reading

    def restored(self) -> RestoredState:
        """The state to hand to ``RaftNode`` on start."""
        return RestoredState(self._hard_state, self._snapshot_meta, tuple(self._entries))

    def load_snapshot(self) -> Snapshot | None:
        """The newest snapshot including its data (read from disk now), or None if there is none."""
        meta = self._snapshot_meta
        if meta.index == 0:
            return None
        return _read_snapshot_file(self._snapshot_path(meta.index, meta.term))

    @property
    def fsync(self) -> bool:
        """Whether WAL appends are synced (off only where the boot-id fence is in place)."""
        return self._fsync

    @property
    def hard_state(self) -> HardState:
        return self._hard_state

    @property
    def snapshot_meta(self) -> SnapshotMeta:
        return self._snapshot_meta

    @property
    def first_index(self) -> int:
        return self._base_index + 1

    @property
    def last_index(self) -> int:
        return self._base_index + len(self._entries)

    def term(self, index: int) -> int | None:
        """Term of the entry at ``index`` (the snapshot's term at its index), None if not held."""
        if index == self._base_index:
            return self._base_term
        if self._base_index < index <= self.last_index:
            return self._entries[index - self._base_index - 1].term
        return None

    # ------------------------------------------------------------------ writing

    def append(self, entries: Sequence[Entry], hard_state: HardState | None) -> bool:
        """Write one ``Ready``'s entries and hard state as a single record (not yet synced).

        Returns whether the write must be made durable before dependent messages go out: new
        entries, or a term/vote change. A commit-only change is written but needs no fsync (the
        commit index can always be relearned), which spares followers one fsync per heartbeat.
        """
        if not entries and hard_state is None:
            return False
        if entries:
            first = entries[0].index
            if first <= self._base_index:
                raise ValueError(f"entry {first} is at or below the compacted index {self._base_index}")
            if first > self.last_index + 1:
                raise ValueError(f"entry {first} leaves a gap after last index {self.last_index}")
            if entries[-1].index != first + len(entries) - 1:
                raise ValueError("entries to append are not contiguous")
        prev = self._hard_state
        payload = msgpack.packb(
            [
                REC_APPEND,
                None if hard_state is None else [hard_state.term, hard_state.vote, hard_state.commit],
                [[e.term, e.index, int(e.type), e.data, e.proposal_id] for e in entries],
            ],
            use_bin_type=True,
        )
        self._write_record(payload)
        if entries:
            del self._entries[entries[0].index - self._base_index - 1 :]
            self._entries.extend(entries)
        need_sync = bool(entries)
        if hard_state is not None:
            need_sync = need_sync or hard_state.term != prev.term or hard_state.vote != prev.vote
            self._hard_state = hard_state
        self._dirty = self._dirty or need_sync
        self._rotate_if_full()  # after the hard state is taken: the new segment repeats it
        return need_sync

    def sync(self) -> None:
        """Make everything written so far durable (one fdatasync), if anything needs it.

        With ``fsync`` off this only clears the flag: the writes are in the page cache, which a
        process crash keeps, and the boot-id fence refuses the log after a machine crash.
        """
        if self._dirty:
            if self._fsync:
                os.fdatasync(self._fd)
            self._dirty = False

    def save(self, entries: Sequence[Entry], hard_state: HardState | None) -> None:
        """``append`` + ``sync``: what a ``Ready`` needs before its messages are sent."""
        self.append(entries, hard_state)
        self.sync()

    def install_snapshot(self, snapshot: Snapshot) -> None:
        """Persist a snapshot received from the leader. Durable on return.

        If the log already holds the snapshot's last entry (same index and term) the entries after
        it are kept, as Raft's log matching makes them a valid continuation; otherwise the log
        restarts after the snapshot (a ``RESET`` record), as in etcd's ``raftLog.restore``.
        """
        meta = snapshot.meta
        if meta.index <= self._snapshot_meta.index:
            self._log.warning(
                "raft.storage.stale_snapshot_ignored", index=meta.index, have=self._snapshot_meta.index
            )
            return
        self.save_snapshot(snapshot)
        if self.term(meta.index) == meta.term:
            self._entries = self._entries[meta.index - self._base_index :]
        else:
            self._write_record(msgpack.packb([REC_RESET, meta.index, meta.term], use_bin_type=True))
            self._dirty = True
            self.sync()
            self._entries = []
            self._rotate_if_full()
        self._base_index, self._base_term = meta.index, meta.term
        if self._hard_state.commit < meta.index:
            self._hard_state = HardState(self._hard_state.term, self._hard_state.vote, meta.index)

    def save_snapshot(self, snapshot: Snapshot) -> None:
        """Write a snapshot file atomically and remember it as the newest; follow with ``compact()``."""
        self.write_snapshot_file(snapshot)
        if snapshot.meta.index > self._snapshot_meta.index:
            self._snapshot_meta = snapshot.meta

    def write_snapshot_file(self, snapshot: Snapshot) -> None:
        """Only the file part of ``save_snapshot`` (tmp, fsync, rename, fsync dir).

        Changes no state of this object, so a large snapshot can be written from a worker thread
        while the event loop keeps appending to the log; then ``compact(snapshot.meta)`` on the loop.
        """
        meta = snapshot.meta
        payload = msgpack.packb([snapshot_meta_to_wire(meta), snapshot.data], use_bin_type=True)
        path = self._snapshot_path(meta.index, meta.term)
        tmp = path.with_name(path.name + ".tmp")
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
            f.write(SNAP_MAGIC + HEADER.pack(len(payload), zlib.crc32(payload)))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self._dir)

    def compact(self, snapshot_meta: SnapshotMeta | None = None, *, unlink: bool = True) -> list[Path]:
        """Drop the log up to the newest saved snapshot so the disk stays bounded.

        ``snapshot_meta`` names a snapshot written with ``write_snapshot_file`` (it becomes the
        newest if it is newer); without it the newest ``save_snapshot``/``install_snapshot`` counts.

        Writes a fresh segment holding ``RESET(snapshot)``, the hard state and the entries after the
        snapshot (normally only the few not yet applied) and makes it durable; every older segment
        and snapshot is then obsolete. A crash at any point leaves a replayable directory: until
        they are deleted the old files replay first and the new segment's RESET supersedes them.

        Returns the obsolete files. Unlinking a large segment takes milliseconds on ext4, so a
        caller on an event loop passes ``unlink=False`` and removes them with ``remove_files`` in a
        worker thread.
        """
        if snapshot_meta is not None and snapshot_meta.index > self._snapshot_meta.index:
            self._snapshot_meta = snapshot_meta
        meta = self._snapshot_meta
        if meta.index <= self._base_index:
            return []
        if meta.index > self.last_index:
            raise ValueError(f"cannot compact to {meta.index}: log ends at {self.last_index}")
        self.sync()
        keep = self._entries[meta.index - self._base_index :]
        records = [
            msgpack.packb([REC_RESET, meta.index, meta.term], use_bin_type=True),
            msgpack.packb(
                [
                    REC_APPEND,
                    hard_state_to_wire(self._hard_state),
                    [[e.term, e.index, int(e.type), e.data, e.proposal_id] for e in keep],
                ],
                use_bin_type=True,
            ),
        ]
        old = self._segments()
        self._start_segment(self._seq + 1, records)
        obsolete = [self._segment_path(seq) for seq in old if seq < self._seq]
        obsolete += [self._snapshot_path(i, t) for i, t in self._snapshots() if i < meta.index]
        self._entries = list(keep)
        self._base_index, self._base_term = meta.index, meta.term
        self._log.debug("raft.storage.compacted", index=meta.index, kept_entries=len(keep))
        if unlink:
            remove_files(obsolete)
        return obsolete

    def close(self) -> None:
        """Close the active segment. With fsync off, a clean close also syncs the log and drops
        the fence, so a member stopped cleanly may be restarted in place even after a reboot."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self.sync()
                if not self._fsync:
                    self._seal()
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------------ internals: files

    def _segment_path(self, seq: int) -> Path:
        return self._dir / f"wal-{seq:016x}.log"

    def _snapshot_path(self, index: int, term: int) -> Path:
        return self._dir / f"snap-{index:016x}-{term:016x}.snap"

    def _segments(self) -> list[int]:
        return sorted(int(m.group(1), 16) for p in self._dir.iterdir() if (m := _SEGMENT_RE.match(p.name)))

    def _snapshots(self) -> list[tuple[int, int]]:
        found = (_SNAPSHOT_RE.match(p.name) for p in self._dir.iterdir())
        return sorted((int(m.group(1), 16), int(m.group(2), 16)) for m in found if m)

    def _write_record(self, payload: bytes) -> None:
        buf = HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        view = memoryview(buf)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(buf)

    def _rotate_if_full(self) -> None:
        """Continue in a new segment once this one is full. Only once the record just written is
        reflected in this object's state: the new segment opens with the hard state as it is
        now, and replay takes the last hard state it reads. (Rotating inside the write, before
        the caller took the record's hard state, opened the new segment with the previous one,
        and a reopened log went back to the older term and vote: a member could vote twice in a
        term.)"""
        if self._size >= self._segment_bytes:
            self._rotate()

    def _rotate(self) -> None:
        """Continue in a new segment; the old one is synced first so no gap can appear (with fsync
        off it is not: the page cache keeps the order within a boot, and the fence covers a reboot)."""
        if self._fsync:
            os.fdatasync(self._fd)
        hs = msgpack.packb([REC_APPEND, hard_state_to_wire(self._hard_state), []], use_bin_type=True)
        self._start_segment(self._seq + 1, [hs])
        self._dirty = False

    def _start_segment(self, seq: int, payloads: list[bytes]) -> None:
        """Create segment ``seq`` with ``payloads`` durably (tmp + fsync + rename) and make it active."""
        path = self._segment_path(seq)
        tmp = path.with_name(path.name + ".tmp")
        body = WAL_MAGIC + b"".join(HEADER.pack(len(p), zlib.crc32(p)) + p for p in payloads)
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(self._dir)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._seq, self._size = seq, len(body)

    # ------------------------------------------------------------------ internals: recovery

    def _fence(self) -> None:
        """Refuse a log a reboot may have cut; with fsync off, fence the directory before the first
        unsynced write; with fsync on, make an unsynced log from this boot durable and unfence it."""
        written = _read_fence(self._dir)
        now = self._boot_id()
        if written is not None and written != now:
            raise StaleLogAfterReboot(self._dir, written, now)
        if self._fsync:
            if written is not None:
                self._seal()
            return
        if now is None:
            self._log.warning(
                "raft.storage.fsync_forced",
                reason=f"no boot id ({BOOT_ID_PATH}) to fence an unsynced log with: syncing every append",
                directory=str(self._dir),
            )
            self._fsync = True
            return
        if written is None:
            fence = self._dir / FENCE_FILE
            tmp = fence.with_name(FENCE_FILE + ".tmp")
            fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, now.encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, fence)
            _fsync_dir(self._dir)

    def _seal(self) -> None:
        """Sync every segment, then remove the fence: the log now survives a reboot. A crash half
        way leaves the fence in place, which errs on the safe side."""
        for seq in self._segments():
            fd = os.open(self._segment_path(seq), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(self._dir)
        (self._dir / FENCE_FILE).unlink(missing_ok=True)
        _fsync_dir(self._dir)

    def _open(self) -> None:
        self._fence()  # before anything is read or repaired: a stale directory is left as it is
        for p in self._dir.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink()  # an interrupted atomic write; the original (if any) is intact
        self._load_newest_snapshot()
        # Replay models the full log: `_replay_last` is its last index (possibly below the
        # snapshot) and `_anchor_term` the term it holds at the snapshot's index, if any.
        self._replay_last = 0
        self._anchor_term: int | None = 0 if self._base_index == 0 else None
        seqs = self._segments()
        records = 0
        problem: str | None = None
        truncated = 0
        discarded: list[str] = []
        for pos, seq in enumerate(seqs):
            path = self._segment_path(seq)
            data = path.read_bytes()
            good, count, problem = self._replay_segment(data)
            records += count
            if problem is None:
                continue
            problem = f"{path.name} at byte {good}: {problem}"
            truncated = len(data) - good
            ordinary_crash = pos == len(seqs) - 1  # a torn tail of the newest segment
            for later in seqs[pos + 1 :]:
                later_path = self._segment_path(later)
                later_path.rename(later_path.with_name(later_path.name + ".discarded"))
                discarded.append(later_path.name)
            seqs = seqs[: pos + 1]
            with open(path, "r+b") as f:
                if good < len(WAL_MAGIC):  # not even a valid header: make it an empty segment
                    f.truncate(0)
                    f.write(WAL_MAGIC)
                else:
                    f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
            # A torn tail of the newest segment is what a crash leaves; anything else is data loss.
            (self._log.warning if ordinary_crash else self._log.error)(
                "raft.storage.wal_truncated",
                problem=problem,
                truncated_bytes=truncated,
                discarded_segments=discarded,
                last_good_index=self.last_index,
            )
            break
        self._reconcile_with_snapshot()
        self.recovery = RecoveryReport(len(seqs), records, truncated, tuple(discarded), problem)
        if seqs:
            path = self._segment_path(seqs[-1])
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self._seq, self._size = seqs[-1], path.stat().st_size
        else:
            self._start_segment(0, [])
        if records or self._snapshot_meta.index:
            self._log.info(
                "raft.storage.opened",
                segments=len(seqs),
                records=records,
                snapshot_index=self._snapshot_meta.index,
                first_index=self.first_index,
                last_index=self.last_index,
                term=self._hard_state.term,
                commit=self._hard_state.commit,
            )

    def _replay_segment(self, data: bytes) -> tuple[int, int, str | None]:
        """Apply the segment's records; return (offset after the last good record, count, problem)."""
        if data[: len(WAL_MAGIC)] != WAL_MAGIC:
            return 0, 0, "bad segment magic"
        off = len(WAL_MAGIC)
        count = 0
        end = len(data)
        while off < end:
            if end - off < HEADER.size:
                return off, count, f"torn record header ({end - off} of {HEADER.size} bytes)"
            length, crc = HEADER.unpack_from(data, off)
            start = off + HEADER.size
            if length > MAX_RECORD or start + length > end:
                return off, count, f"torn record (header says {length} bytes, {end - start} present)"
            payload = data[start : start + length]
            if zlib.crc32(payload) != crc:
                return off, count, "CRC mismatch"
            try:
                self._apply_record(msgpack.unpackb(payload, raw=False))
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                return off, count, f"undecodable record: {exc}"
            off = start + length
            count += 1
        return off, count, None

    def _apply_record(self, rec: Any) -> None:
        if type(rec) is not list or len(rec) != 3:
            raise ValueError("record is not a 3-element array")
        kind = rec[0]
        base = self._base_index
        if kind == REC_APPEND:
            hs = None if rec[1] is None else hard_state_from_wire(rec[1])
            if type(rec[2]) is not list:
                raise ValueError("entries is not an array")
            entries = [entry_from_wire(e) for e in rec[2]]
            if entries:
                first, last = entries[0].index, entries[-1].index
                if last != first + len(entries) - 1:
                    raise ValueError("entries in the record are not contiguous")
                if first > self._replay_last + 1:
                    raise ValueError(f"entry {first} leaves a gap after {self._replay_last}")
                self._replay_last = last
                if first <= base:  # rewrites the log from below the snapshot: nothing after it survives
                    self._entries = []
                    self._anchor_term = entries[base - first].term if last >= base else None
                    entries = entries[base - first + 1 :]
                else:
                    del self._entries[first - base - 1 :]
                self._entries.extend(entries)
            if hs is not None:
                self._hard_state = hs
        elif kind == REC_RESET:
            index, term = rec[1], rec[2]
            if type(index) is not int or type(term) is not int:
                raise ValueError("reset record index/term are not ints")
            if index > base:
                raise StorageError(
                    f"the log restarts after index {index} but the newest readable snapshot is at "
                    f"{base}: the snapshot file is missing or corrupt"
                )
            self._entries = []
            self._replay_last = index
            self._anchor_term = term if index == base else None
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def _load_newest_snapshot(self) -> None:
        for index, term in reversed(self._snapshots()):
            path = self._snapshot_path(index, term)
            try:
                snap = _read_snapshot_file(path)
            except (OSError, ValueError) as exc:
                self._log.error("raft.storage.snapshot_unreadable", file=path.name, error=str(exc))
                path.rename(path.with_name(path.name + ".corrupt"))
                continue
            self._snapshot_meta = snap.meta
            self._base_index, self._base_term = snap.meta.index, snap.meta.term
            return

    def _reconcile_with_snapshot(self) -> None:
        """Keep only a log that continues the snapshot; the commit index lies within what is held.

        Entries after the snapshot survive only if the log held the snapshot's last entry with the
        same term. That covers a crash between writing an installed snapshot and its RESET record.
        """
        if self._entries and self._anchor_term != self._base_term:
            self._log.warning(
                "raft.storage.log_does_not_continue_snapshot",
                snapshot_index=self._base_index,
                snapshot_term=self._base_term,
                log_term_at_snapshot=self._anchor_term,
                dropped_entries=len(self._entries),
            )
            self._entries = []
        hs = self._hard_state
        commit = max(hs.commit, self._base_index)
        if commit > self.last_index:
            self._log.error("raft.storage.commit_beyond_log", commit=commit, last_index=self.last_index)
            commit = self.last_index
        if commit != hs.commit:
            self._hard_state = HardState(hs.term, hs.vote, commit)


def _fsync_dir(directory: Path) -> None:
    """Make a rename, creation or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_files(paths: Sequence[Path]) -> None:
    """Delete files that compaction made obsolete (thread-safe: touches nothing else)."""
    for p in paths:
        p.unlink(missing_ok=True)


def _read_snapshot_file(path: Path) -> Snapshot:
    data = path.read_bytes()
    head = len(SNAP_MAGIC) + HEADER.size
    if len(data) < head or data[: len(SNAP_MAGIC)] != SNAP_MAGIC:
        raise ValueError(f"{path.name}: bad snapshot header")
    length, crc = HEADER.unpack_from(data, len(SNAP_MAGIC))
    payload = data[head:]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise ValueError(f"{path.name}: snapshot length or CRC mismatch")
    raw = msgpack.unpackb(payload, raw=False)
    if type(raw) is not list or len(raw) != 2 or type(raw[1]) is not bytes:
        raise ValueError(f"{path.name}: malformed snapshot payload")
    return Snapshot(snapshot_meta_from_wire(raw[0]), raw[1])
