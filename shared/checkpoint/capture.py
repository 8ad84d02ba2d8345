"""One checkpoint in flight: speculative concurrent copy, soft copy-on-write, validation, packing.

Timeline (POS §5.1, for a training job):

1. *begin*, on the training thread at a step boundary: the instant the image must equal. Version
   counters are read, a few tensors known to be written behind the dispatcher's back are cloned
   eagerly, and (``strict``) every piece is fingerprinted. Device memory is copied at the instant
   (``copy_at_instant``: one buffer and one batched copy per device, ordered on the stream before
   later kernels); the small host state beside it too, so a device image needs no write guard.
2. *capture*, on a background thread while training goes on: piece by piece, fingerprint the live
   bytes; a piece whose fingerprint the store already holds (unchanged since the last image, or a
   duplicate) is not copied; others are cloned and packed. Meanwhile ``before_write`` (the
   dispatch mode, training thread) clones any piece an op is about to write before the copier got
   to it: soft copy-on-write. A per-entry lock orders the two.
3. *validate*, after at least one more step boundary: a piece no declared write touched must
   still have the bytes it was captured with, and a tensor's version counter may only have moved if
   a declared write was seen; with ``strict`` every captured piece must also match its fingerprint
   at begin. Any mismatch marks the tensor torn: the image is not committed (the agent retakes).
4. *commit*: flush packs, store the small state and the manifest.

What validation cannot see: without ``strict``, an undeclared write (numpy view, C extension)
that lands before the copier reached the piece and is not repeated before validation. ``strict``
closes that gap at the cost of one XXH3 pass over the image on the training thread at begin.
"""

from __future__ import annotations

import bisect
import operator
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.checkpoint.clock import StallClock
from shared.checkpoint.manifest import Manifest, PieceLocation, TensorRecord
from shared.checkpoint.pieces import byte_extent, byte_view, fingerprint, storage_key
from shared.checkpoint.pusher import StoreLink
from shared.checkpoint.staging import Arena, Staging
from shared.checkpoint.state import Structure, add_specs, encode_meta
from shared.datastore import ObjectRef

_POLL_S = 0.002  # how often a copier waiting for a step boundary looks
DENSE_PIECE_BYTES = 1024 * 1024  # pieces of a tensor that changed everywhere last time (capped at a pack)
_VERSION = operator.attrgetter("_version")
_DEVICE_AND_DTYPE = operator.attrgetter("device", "dtype")
COPIER_SWITCH_S = 0.0002  # the interpreter's switch interval while a copier runs (default 5 ms)
# A device image's host tensors (an optimizer's step counters, a CPU-side buffer) up to this much
# are copied at the instant with the device memory: then nothing needs copy-on-write, and training
# runs without the write guard's per-op dispatch cost during the capture.
EAGER_HOST_BYTES = 4 * 1024 * 1024


@dataclass
class CopyGroup:
    """Tensors of one device and dtype copied at the instant into one flat buffer."""

    flat: torch.Tensor
    indices: list[int]  # the tensors' positions in the structure
    numels: list[int]


class InstantCopies:
    """Copies of some of an image's tensors made at begin: per device and dtype one flat buffer
    (``torch._utils._flatten_dense_tensors``: one C++ call over the group, no Python per tensor
    on the training thread), with the event after each device's copies (the copier waits for it
    before reading)."""

    def __init__(self, groups: list[CopyGroup], events: dict[torch.device, Any], complete: bool) -> None:
        self.groups = groups
        self.events = events
        self.complete = complete  # every tensor is copied: no write can tear the image

    @classmethod
    def none(cls) -> InstantCopies:
        return cls([], {}, complete=False)

    def byte_copies(self) -> dict[int, torch.Tensor]:
        """Each copied tensor's bytes, a flat uint8 view into its group's buffer, by position."""
        views: dict[int, torch.Tensor] = {}
        for group in self.groups:
            data, size, at = group.flat.view(torch.uint8), group.flat.element_size(), 0
            for i, n in zip(group.indices, group.numels, strict=True):
                views[i] = data[at : at + n * size]
                at += n * size
        return views

    def to_host(self) -> None:
        """Bring the device groups to host memory, one transfer each once their copy ran (copier
        thread); later ``byte_copies`` are host views, and the device buffers can be released."""
        for group in self.groups:
            if group.flat.device.type != "cpu":
                event = self.events.get(group.flat.device)
                if event is not None:
                    event.synchronize()
                group.flat = group.flat.cpu()


def _flat_copy(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, one after the other, in a new buffer. ``_flatten_dense_tensors`` of
    a single tensor returns a *view* of it (no copy): that one is cloned."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    return torch._utils._flatten_dense_tensors(tensors)


def copy_at_instant(tensors: tuple[torch.Tensor, ...], host_limit: int = EAGER_HOST_BYTES) -> InstantCopies:
    """Copy every device tensor now (and the host ones too if they total at most ``host_limit``),
    one flat buffer per device and dtype: begin costs a few kernel launches, not a clone per
    tensor. Stream ordered: the copy sees every kernel queued before it, and kernels queued after
    it cannot change it. A device without room for the copy gets it in host memory (a synchronous
    transfer: a longer stall, the same image)."""
    where = list(map(_DEVICE_AND_DTYPE, tensors))
    complete = sum(t.nbytes for t in tensors if t.is_cpu) <= host_limit
    by_group: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, key in enumerate(where):
        if key[0].type != "cpu" or complete:
            by_group.setdefault(key, []).append(i)
    groups: list[CopyGroup] = []
    events: dict[torch.device, Any] = {}
    for (device, _), indices in by_group.items():
        members = [tensors[i] for i in indices]
        try:
            flat = _flat_copy(members)
        except torch.OutOfMemoryError:
            flat = _flat_copy([t.cpu() for t in members])
        groups.append(CopyGroup(flat, indices, list(map(torch.Tensor.numel, members))))
        if flat.device.type == "cuda" and device not in events:
            events[device] = torch.cuda.Event()
    for device, event in events.items():
        event.record(torch.cuda.current_stream(device))
    return InstantCopies(groups, events, complete)


class ShortSwitch:
    """While any copier runs, the interpreter hands the GIL over every ``COPIER_SWITCH_S``.

    The copier is Python between GIL-holding calls (XXH3 does not release it, measured), so a
    training thread coming back from a torch op waited up to the default 5 ms for the GIL, at
    every op: steps ran up to ~1.3x slower during a capture, and a write bookkeeping call of
    0.1 ms CPU took 5-12 ms. The interval is process-wide: set while copiers run (counted), put
    back after the last."""

    _lock = threading.Lock()
    _running = 0
    _saved = 0.005

    def __enter__(self) -> None:
        with ShortSwitch._lock:
            if ShortSwitch._running == 0:
                ShortSwitch._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(COPIER_SWITCH_S, ShortSwitch._saved))
            ShortSwitch._running += 1

    def __exit__(self, *exc: object) -> None:
        with ShortSwitch._lock:
            ShortSwitch._running -= 1
            if ShortSwitch._running == 0:
                sys.setswitchinterval(ShortSwitch._saved)


# Where a piece's bytes are: in a stored pack, or at an offset of a pack this checkpoint is writing.
Known = tuple[ObjectRef | int, int, int]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a tracked tensor's bytes are. Cached across checkpoints by the agent: building it
    costs a few torch calls, and begin builds one per tensor on the training thread."""

    tensor: torch.Tensor
    data_ptr: int
    live: torch.Tensor
    array: Any  # the live bytes as a numpy array (host tensors), None on a device
    storage: int | None
    extent: tuple[int, int]

    @classmethod
    def of(cls, tensor: torch.Tensor, cache: dict[int, Layout] | None = None) -> Layout:
        """The tensor's layout, reused from ``cache`` while it is the same object over the same memory."""
        cached = cache.get(id(tensor)) if cache is not None else None
        if cached is not None and cached.tensor is tensor and cached.data_ptr == tensor.data_ptr():
            return cached
        live = byte_view(tensor)
        array = live.numpy() if live.device.type == "cpu" else None
        layout = cls(tensor, tensor.data_ptr(), live, array, storage_key(tensor), byte_extent(tensor))
        if cache is not None:
            cache[id(tensor)] = layout
        return layout


def _data_ptr(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


class Entry:
    """A tracked tensor: its live bytes, per-piece capture state, and the lock that orders the
    copier against copy-on-write. Per-piece state is flat (bytearrays, a dict of copies): begin
    creates one of these per tensor on the training thread, so it must cost microseconds."""

    __slots__ = (
        "alone",
        "array",
        "begin_fps",
        "captured",
        "dirty",
        "eager",
        "extent",
        "fps",
        "live",
        "lock",
        "name",
        "nbytes",
        "new",
        "piece_bytes",
        "pieces",
        "snaps",
        "storage",
        "tensor",
        "version0",
    )

    def __init__(
        self,
        name: str,
        layout: Layout,
        piece_bytes: int,
        arena: Arena,
        *,
        eager: bool,
        version0: int,
        copy: torch.Tensor | None = None,
    ) -> None:
        tensor = layout.tensor
        self.name = name
        self.tensor = tensor
        self.live = layout.live
        self.array = layout.array
        self.nbytes = self.live.numel()
        self.piece_bytes = piece_bytes
        self.pieces = max(1, -(-self.nbytes // piece_bytes))
        self.storage = layout.storage
        self.extent = layout.extent
        self.lock = threading.Lock()
        self.snaps: dict[int, torch.Tensor] = {}  # pieces copied by copy-on-write or at begin
        self.captured = bytearray(self.pieces)
        self.dirty = bytearray(self.pieces)  # a declared write touched the piece during the checkpoint
        self.fps: list[str | None] = [None] * self.pieces
        self.begin_fps: list[str] | None = None
        self.version0 = version0  # read at begin
        self.new = 0  # pieces the store did not hold
        self.alone = True  # no other tracked tensor shares its storage
        self.eager = eager or tensor.device.type != "cpu" or copy is not None
        if copy is not None:
            self.use_copy(copy)
        elif self.eager:
            # Cloned now, at the instant: known undeclared writers, and device memory (a device
            # clone is ordered on the stream before later kernels; the copier moves it to host).
            self.take(0, self.pieces, arena)

    def span(self, i: int) -> tuple[int, int]:
        """Piece ``i``'s ``[start, end)`` bytes within the tensor."""
        start = i * self.piece_bytes
        return start, min(start + self.piece_bytes, self.nbytes)

    def take(self, first: int, last: int, arena: Arena) -> int:
        """Copy pieces ``first..last-1`` not yet captured, a run of adjacent pieces at a time, into
        pooled memory (a device clone on a device); the bytes copied. Caller holds the lock (or
        owns the entry, at begin)."""
        if 0 not in self.captured[first:last]:
            return 0
        todo = [i for i in range(first, last) if not self.captured[i]]
        copied = 0
        run: list[int] = []
        for i in [*todo, -1]:
            if run and (i != run[-1] + 1 or (len(run) + 1) * self.piece_bytes > arena.limit):
                lo, hi = self.span(run[0])[0], self.span(run[-1])[1]
                if self.array is not None:
                    copy = arena.alloc(hi - lo)
                    copy.numpy()[:] = self.array[lo:hi]
                else:
                    copy = self.live[lo:hi].clone()
                for j in run:
                    a, b = self.span(j)
                    self.snaps[j] = copy[a - lo : b - lo]
                    self.captured[j] = 1
                copied += hi - lo
                run = []
            run.append(i)
        return copied

    def host(self, i: int) -> Any:
        """Piece ``i``'s copied bytes as a host buffer."""
        snap = self.snaps[i]
        return snap.cpu().numpy() if snap.device.type != "cpu" else snap.numpy()

    def use_copy(self, copy: torch.Tensor) -> None:
        """Its pieces are slices of ``copy``, the tensor's bytes at the instant (the copy at
        begin, or that copy brought to host memory)."""
        for i in range(self.pieces):
            a, b = self.span(i)
            self.snaps[i] = copy[a:b]
        self.captured[:] = b"\x01" * self.pieces


@dataclass
class CaptureStats:
    pieces: int = 0
    new_pieces: int = 0
    new_bytes: int = 0
    cow_pieces: int = 0
    cow_bytes: int = 0
    image_bytes: int = 0


@dataclass
class CaptureResult:
    """What one attempt produced: a manifest, or the tensors found torn (then no manifest)."""

    step: int
    manifest: Manifest | None
    manifest_ref: ObjectRef | None
    torn: tuple[str, ...]
    stats: CaptureStats
    known: dict[str, Known] = field(default_factory=dict)  # pieces the next attempt need not store
    written: frozenset[str] = frozenset()  # digests of the packs this attempt stored
    dense: frozenset[str] = frozenset()  # tensors of several pieces that all changed
    stale: bool = False  # the cached structure no longer held at the instant: retake with a fresh one


class Packer:
    """Copies new pieces into packs of ``slab_bytes`` (one pooled slab each) and stores each pack
    once full; the slab returns to the pool when the store has it.

    A tensor at least a pack large starts a pack of its own, so identical large tensors (the same
    pretrained weights in two jobs) produce identical packs, which the store keeps once.
    """

    def __init__(self, link: StoreLink, staging: Staging) -> None:
        self._link = link
        self._staging = staging
        self._slab: Any = None
        self._size = 0
        self.futures: list[Future[ObjectRef]] = []

    def align(self, nbytes: int) -> None:
        if nbytes >= self._staging.slab_bytes and self._size:
            self.flush()

    def reserve(self, nbytes: int) -> None:
        """Store the current pack now unless ``nbytes`` more fit in it."""
        if self._size + nbytes > self._staging.slab_bytes:
            self.flush()

    def add(self, data: Any) -> tuple[int, int]:
        """Copy ``data`` (a host byte array) into the current pack; returns (pack number, offset)."""
        n = data.nbytes
        if self._slab is None or self._size + n > self._staging.slab_bytes:
            self.flush()
            self._slab = self._staging.slab().numpy()
        location = (len(self.futures), self._size)
        self._slab[self._size : self._size + n] = data
        self._size += n
        if self._size >= self._staging.slab_bytes:
            self.flush()
        return location

    def flush(self) -> None:
        if not self._size:
            return
        slab, size = self._slab, self._size
        self._slab, self._size = None, 0
        future = self._link.put_many([slab[:size]])
        future.add_done_callback(lambda _: self._staging.release(torch.from_numpy(slab)))
        self.futures.append(future)


class Capture:
    """The state of one checkpoint attempt, shared by the training thread and the copier."""

    def __init__(
        self,
        *,
        job: str,
        step: int,
        structure: Structure,
        meta: dict[str, Any],
        link: StoreLink,
        known: dict[str, Known],
        eager: set[str],
        piece_bytes: int,
        staging: Staging,
        dense: frozenset[str] = frozenset(),
        dense_piece_bytes: int = DENSE_PIECE_BYTES,
        last: Manifest | None = None,
        group_bytes: int = 1024 * 1024,
        strict: bool,
        parent: str | None,
        pacer: Callable[[], None] | None = None,
        layouts: dict[int, Layout] | None = None,
        walk: Callable[[], Structure] | None = None,
        outside: set[int] | None = None,
    ) -> None:
        """Marks the instant (version counters and addresses of every tensor) and nothing else the
        copier can do: the per-tensor bookkeeping is built on the copier thread (``_prepare``),
        unless something must be copied at the instant (eager tensors, device memory, ``strict``
        fingerprints). ``walk`` re-reads the structure on the copier when ``structure`` is a
        cached one: if it no longer holds, the attempt ends ``stale`` and is retaken."""
        self.job = job
        self.step = step
        self.structure = structure
        self.meta = meta
        self.link = link
        self._known_before = known  # copied on the copier thread: begin must stay cheap
        self.known: dict[str, Known] = {}
        self.piece_bytes = piece_bytes
        self.dense_piece_bytes = min(dense_piece_bytes, staging.slab_bytes)  # a piece fits a pack
        self.group_bytes = group_bytes
        self.strict = strict
        self.parent = parent
        self.pacer = pacer
        self.dense = dense
        self.eager = eager
        self._last = last
        self._walk = walk
        self._cache = layouts
        # The instant: each tensor's version counter and address (a ``p.data = x`` swap is seen).
        # Two C-level passes over the tensors (no bytecode per tensor).
        objects = structure.objects
        self.versions: list[int] = list(map(_VERSION, objects))
        self.ptrs: list[int] = list(map(torch.Tensor.data_ptr, objects))
        self.previous: dict[str, int] = {}  # piece size of each tensor cut in pieces in the last image
        self.stats = CaptureStats()
        self.packer = Packer(link, staging)
        self.arena = Arena(staging)
        self.layouts: dict[int, Layout] = {}
        self.entries: list[Entry] = []
        self.by_storage: dict[int, list[Entry]] = {}
        self.by_ptr: dict[int, Entry] = {}
        self._starts: list[int] = []  # tracked storages' address ranges, sorted, for writes' fast path
        self._ends: list[int] = []
        # Addresses written that lie outside every tracked storage (temporaries): seeded on the
        # copier with the last capture's that are still outside, so the first optimizer step's
        # temporaries, at addresses malloc hands out again each step, cost a set lookup.
        self._outside_hint = outside if outside is not None else set()
        self._outside: set[int] = set()
        # Tensors alone in their storage whose every piece is captured, by ``id``: a write through
        # the tracked tensor object itself marks it written as a whole and settles it, in bulk
        # set operations for a whole foreach op (the dispatcher hands over the same objects).
        self._whole: dict[int, Entry] = {}
        self.clock = StallClock()  # training-thread time in copy-on-write
        self._settled: set[int] = set()  # by address: writes through these need nothing more
        self._settled_ids: set[int] = set()  # the same tracked tensors, by ``id`` of the object
        self._ids: set[int] = set()  # every tracked tensor object, by ``id``
        self._boundaries = 0
        self._quiesced = False
        self._cancelled = False
        self._ready = threading.Event()  # entries built: copy-on-write can run
        self.captured = threading.Event()  # every piece captured (tests inject writes after it)
        self.future: Future[CaptureResult] = Future()
        # Device memory (and then small host state) copied now; the rest is built on the copier.
        self.instant = (
            copy_at_instant(objects) if structure.on_device and not strict else InstantCopies.none()
        )
        if strict or (eager and not self.instant.complete):
            self._prepare()

    def _prepare(self) -> None:
        """Per-tensor bookkeeping: layouts, entries (eager ones cloned), the storage index."""
        if self._ready.is_set():
            return
        tensors = self.structure.tensors
        # The layouts of this checkpoint's tensors only, so replaced tensors are not kept alive.
        self.layouts = {id(t): Layout.of(t, self._cache) for _, t in tensors}
        copies = self.instant.byte_copies()
        self.entries = [
            Entry(
                name,
                self.layouts[id(t)],
                self.dense_piece_bytes if name in self.dense else self.piece_bytes,
                self.arena,
                eager=name in self.eager,
                version0=version,
                copy=copies.get(i),
            )
            for i, ((name, t), version) in enumerate(zip(tensors, self.versions, strict=True))
        ]
        ranges: dict[int, int] = {}
        for entry in self.entries:
            if entry.storage is not None:
                self.by_storage.setdefault(entry.storage, []).append(entry)
                ranges[entry.storage] = entry.tensor.untyped_storage().nbytes()
        for start in sorted(ranges):
            self._starts.append(start)
            self._ends.append(start + ranges[start])
        self._ids = {id(e.tensor) for e in self.entries}
        hint = list(self._outside_hint)
        self._outside = {p for p, inside in zip(hint, self._inside(hint), strict=True) if not inside}
        for shared in self.by_storage.values():
            if len(shared) > 1:
                for entry in shared:
                    entry.alone = False
        # Writes through the tracked tensor itself (the usual case) skip the storage lookup.
        self.by_ptr = {e.tensor.data_ptr(): e for e in self.entries if e.alone and e.storage is not None}
        for entry in self.entries:
            if self.strict and not entry.eager and entry.array is not None:
                array = entry.array
                entry.begin_fps = [fingerprint(array[slice(*entry.span(i))]) for i in range(entry.pieces)]
        self._ready.set()

    def _moved(self) -> bool:
        """The structure or a tensor's memory changed between the cached structure and the instant."""
        tensors = self.structure.tensors
        if any(self.layouts[id(t)].data_ptr != ptr for (_, t), ptr in zip(tensors, self.ptrs, strict=True)):
            return True
        if self._walk is None:
            return False
        try:
            return not (self._walk().same_as(self.structure) and self.structure.template_holds())
        except RuntimeError:  # the optimizer's state grew while it was walked
            return True

    def run(self) -> None:
        """The copier's work, on the agent's copier thread; the outcome lands in ``future``."""
        try:
            with ShortSwitch():
                outcome = self._capture_validate_commit()
            self.future.set_result(outcome)
        except BaseException as exc:
            self.future.set_exception(exc)
        finally:
            self._ready.set()  # a write waiting for the entries goes on; the agent sees the failure

    # ----- training thread --------------------------------------------------------------------

    def before_writes(self, tensors: list[torch.Tensor]) -> None:
        """Soft copy-on-write for the tensors one op is about to write: clone the pieces of tracked
        tensors their bytes overlap that the copier has not captured yet; mark them written. The
        usual writes cost set operations over the whole op, not Python per tensor: to settled
        tensors, and to tracked tensors the copier has wholly captured (marked written, then
        settled); temporaries are known by address after their first write."""
        started = self.clock.start()
        ids = set(map(id, tensors))
        ids -= self._settled_ids
        if ids:
            # Settling marks a whole tensor written (``_written``), before the op writes it:
            # validation reads the marks again after a mismatch.
            hit = self._whole.keys() & ids
            if hit:
                self._settled_ids |= hit
                ids -= hit
            if ids:
                self._other_writes([t for t in tensors if id(t) in ids])
        self.clock.stop(started)

    def _written(self, entry: Entry) -> bool:
        """A declared write covered the whole tensor after the copier captured it (settled)."""
        return id(entry.tensor) in self._settled_ids

    def outside_seen(self) -> set[int]:
        """Addresses written during this capture outside every tracked storage (the next
        capture's hint; it checks them against its own storages)."""
        return self._outside

    def settled(self) -> bool:
        """Every tracked tensor is settled: no write can need anything more from this capture (its
        pieces are all copied and it is marked written), so the write guard may go."""
        return self._ready.is_set() and len(self._settled_ids) == len(self._ids)

    def _other_writes(self, tensors: list[torch.Tensor]) -> None:
        """Writes through other objects than wholly captured tracked tensors: temporaries (most of
        them), views and ``.data`` aliases, tensors the copier has not reached."""
        if not self._ready.is_set():
            self._ready.wait()  # the copier is still building the entries (begin left it to it)
        try:
            ptrs: list[int | None] = list(map(torch.Tensor.data_ptr, tensors))
        except RuntimeError:  # sparse and other storage-less tensors
            ptrs = [_data_ptr(t) for t in tensors]
        outside = self._outside
        if outside.issuperset(ptrs):  # temporaries at addresses seen before (malloc reuses them)
            return
        settled, starts, ends = self._settled, self._starts, self._ends
        if len(outside) > 1 << 16:
            outside.clear()
        for tensor, ptr in zip(tensors, ptrs, strict=True):
            if ptr is None or ptr in settled or ptr in outside:
                continue
            at = bisect.bisect_right(starts, ptr) - 1
            if at >= 0 and ptr < ends[at]:
                self._before_write(tensor, ptr)
            else:
                outside.add(ptr)  # storages never overlap: one starting outside all touches none

    def _inside(self, ptrs: list[int]) -> list[bool]:
        """Whether each address lies in a tracked storage."""
        starts, ends = self._starts, self._ends
        return [(at := bisect.bisect_right(starts, p) - 1) >= 0 and p < ends[at] for p in ptrs]

    def _before_write(self, tensor: torch.Tensor, ptr: int) -> None:
        whole = self.by_ptr.get(ptr)
        if whole is not None and tensor.is_contiguous() and tensor.nbytes == whole.nbytes:
            entries: list[Entry] | None = [whole]  # the tracked tensor itself (or an alias of it)
            start, end = whole.extent
        else:
            key = storage_key(tensor)
            entries = self.by_storage.get(key) if key is not None else None
            start, end = byte_extent(tensor) if entries else (0, 0)
        if entries:
            for entry in entries:
                lo, hi = entry.extent
                if start >= hi or end <= lo:
                    continue
                first = (max(start, lo) - lo) // entry.piece_bytes
                last = min(entry.pieces, -(-(min(end, hi) - lo) // entry.piece_bytes))
                with entry.lock:
                    entry.dirty[first:last] = b"\x01" * (last - first)
                    copied = entry.take(first, last, self.arena)
                    settled = entry.alone and 0 not in entry.dirty and 0 not in entry.captured
                if copied:
                    self.stats.cow_pieces += -(-copied // entry.piece_bytes)
                    self.stats.cow_bytes += copied
                if settled:
                    # Alone in its storage, every piece copied and marked written: later writes
                    # through the tensor itself need nothing (views elsewhere take the slow path).
                    self._settled.add(entry.tensor.data_ptr())
                    self._settled_ids.add(id(entry.tensor))

    def boundary(self) -> None:
        """A step boundary passed (validation waits for one after the capture, so a per-step
        undeclared writer has run at least once in between)."""
        self._boundaries += 1  # polled by the copier: waking it here would hand it the GIL mid-step

    def quiesce(self) -> None:
        """Training is paused (checkpoint-and-stop): validate at once."""
        self._quiesced = True

    def cancel(self) -> None:
        """Stop the copier at its next piece; the attempt ends in ``CancelledError``."""
        self._cancelled = self._quiesced = True

    def done(self) -> bool:
        return self.future.done()

    # ----- copier thread ----------------------------------------------------------------------

    def _store_piece(self, entry: Entry, i: int, fp: str, data: Any) -> None:
        if fp not in self.known:
            pack, offset = self.packer.add(data)
            self.known[fp] = (pack, offset, data.nbytes)
            self.stats.new_pieces += 1
            self.stats.new_bytes += data.nbytes
            entry.new += 1
        entry.fps[i] = fp

    def _capture_order(self) -> list[Entry]:
        """Optimizer state first: an optimizer step writes its moments before the parameters, and
        the forward and backward passes before it write neither, so the copier races ahead of the
        writes it would otherwise force onto the training thread."""
        optim = [e for e in self.entries if e.name.startswith("optim.")]
        return optim + [e for e in self.entries if not e.name.startswith("optim.")]

    def _capture_group(self, entry: Entry, first: int, last: int, array: Any) -> None:
        """Fingerprint pieces ``first..last-1`` as they are now and copy those the store does not
        hold yet straight into the current pack. Under the entry's lock, so a write waits for at
        most one group; the pack has room for the whole group, so nothing waits for the store."""
        self.packer.reserve((last - first) * self.piece_bytes)
        with entry.lock:
            for i in range(first, last):
                if entry.captured[i]:
                    continue
                a, b = entry.span(i)
                data = array[a:b]
                entry.captured[i] = 1
                self._store_piece(entry, i, fingerprint(data), data)

    def _capture_validate_commit(self) -> CaptureResult:
        self._prepare()
        if self._moved():
            known = dict(self._known_before)
            return CaptureResult(self.step, None, None, (), self.stats, known, dense=self.dense, stale=True)
        self.known = dict(self._known_before)
        self.previous = piece_sizes(self._last)
        # Capture: live pieces not yet copied by copy-on-write or at begin.
        group = 1 if self.pacer is not None else max(1, self.group_bytes // self.piece_bytes)
        for entry in self._capture_order():
            self.packer.align(entry.nbytes)
            if entry.eager:
                continue
            array = entry.array
            for first in range(0, entry.pieces, group):
                if self._cancelled:
                    raise CancelledError(f"checkpoint of {self.job} at step {self.step} abandoned")
                if self.pacer is not None:
                    self.pacer()
                self._capture_group(entry, first, min(first + group, entry.pieces), array)
            if entry.alone and entry.storage is not None:
                self._whole[id(entry.tensor)] = entry
        # Pieces copied by copy-on-write or at begin: fingerprint and pack them now (no write
        # can add any: every piece is captured).
        if self.instant.groups:  # one transfer per device and dtype, then host slices
            self.instant.to_host()
            for i, copy in self.instant.byte_copies().items():
                self.entries[i].use_copy(copy)
        for entry in self.entries:
            for i in sorted(entry.snaps):
                if entry.eager and self.pacer is not None:
                    self.pacer()
                data = entry.host(i)
                self._store_piece(entry, i, fingerprint(data), data)
            entry.snaps.clear()
        self.instant.groups.clear()  # packed: the instant's copies are no longer needed
        self.arena.release()
        self.captured.set()
        torn = self._validate()
        if self._cancelled:
            raise CancelledError(f"checkpoint of {self.job} at step {self.step} abandoned")
        self.packer.flush()
        packs = [f.result() for f in self.packer.futures]
        stored = {
            fp: (packs[loc[0]] if isinstance(loc[0], int) else loc[0], loc[1], loc[2])
            for fp, loc in self.known.items()
        }
        written = frozenset(ref.digest for ref in packs)
        # Tensors that changed everywhere (parameters and moments under a dense optimizer) are
        # cut into large pieces next time: fewer fingerprints and manifest rows, same bytes.
        # Judged only where this image was cut like the last one (a tensor just re-cut has all
        # new pieces whatever happened to it); a dense tensor that stops changing goes back.
        dense = frozenset(
            e.name
            for e in self.entries
            if (e.name in self.dense if self.previous.get(e.name) != e.piece_bytes else e.new == e.pieces > 1)
        )
        if torn:
            # Its pieces stay useful to the retake (those not torn are what the store now holds).
            return CaptureResult(
                self.step, None, None, tuple(sorted(torn)), self.stats, stored, written, dense
            )
        manifest = self._manifest(stored)
        ref = self.link.put_many([manifest.to_json()]).result()
        return CaptureResult(self.step, manifest, ref, (), self.stats, known_pieces(manifest), written, dense)

    def _validate(self) -> set[str]:
        # Two boundaries after the capture ended: one whole step ran after it (the first may be
        # the boundary of a step that was already running when the capture ended).
        seen = self._boundaries
        while not (self._quiesced or self._boundaries >= seen + 2):
            time.sleep(_POLL_S)
        torn: set[str] = set()
        for entry in self.entries:
            if entry.eager:
                continue
            if entry.begin_fps is not None and entry.fps != entry.begin_fps:
                torn.add(entry.name)
                continue
            # Lock-free: a declared write is marked before it lands, so a piece read mid-write is
            # seen marked when its marks are read again after the mismatch.
            array = entry.live.numpy()
            for i in range(entry.pieces):
                if self._written(entry):
                    break
                if entry.dirty[i]:
                    continue
                a, b = entry.span(i)
                if fingerprint(array[a:b]) != entry.fps[i] and not (self._written(entry) or entry.dirty[i]):
                    torn.add(entry.name)
                    break
            moved = entry.tensor._version != entry.version0  # read before the marks, as above
            if moved and not (self._written(entry) or any(entry.dirty)):
                torn.add(entry.name)  # a write the dispatch mode did not see
        return torn

    def _manifest(self, stored: dict[str, tuple[ObjectRef, int, int]]) -> Manifest:
        meta_ref = self.link.put_many([encode_meta(add_specs(self.meta, self.structure))]).result()
        pack_index: dict[str, int] = {}
        packs: list[ObjectRef] = []
        records: list[TensorRecord] = []
        for entry in self.entries:
            pieces: list[PieceLocation] = []
            fps: list[str] = []
            for fp in entry.fps:
                assert fp is not None
                ref, offset, length = stored[fp]
                if ref.digest not in pack_index:
                    pack_index[ref.digest] = len(packs)
                    packs.append(ref)
                pieces.append(PieceLocation(pack_index[ref.digest], offset, length))
                fps.append(fp)
            t = entry.tensor
            records.append(
                TensorRecord(
                    entry.name,
                    str(t.dtype).removeprefix("torch."),
                    tuple(t.shape),
                    entry.nbytes,
                    tuple(fps),
                    tuple(pieces),
                )
            )
            self.stats.pieces += len(fps)
            self.stats.image_bytes += entry.nbytes
        stats = {k: int(v) for k, v in vars(self.stats).items()}
        return Manifest(
            self.job, self.step, self.piece_bytes, tuple(packs), meta_ref, tuple(records), self.parent, stats
        )


def known_pieces(manifest: Manifest | None) -> dict[str, Known]:
    """Pieces the store holds for this job (fingerprint -> pack, offset, length): not written again."""
    if manifest is None:
        return {}
    known: dict[str, Known] = {}
    for record in manifest.tensors:
        for fp, piece in zip(record.fingerprints, record.pieces, strict=True):
            known[fp] = (manifest.packs[piece.pack], piece.offset, piece.length)
    return known


def piece_sizes(manifest: Manifest | None) -> dict[str, int]:
    """The piece size each tensor of several pieces was cut into in ``manifest``."""
    if manifest is None:
        return {}
    return {r.name: r.pieces[0].length for r in manifest.tensors if len(r.pieces) > 1}
