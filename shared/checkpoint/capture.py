"""One checkpoint in flight: speculative concurrent copy, soft copy-on-write, validation, packing.

Timeline (POS §5.1, for a training job):

1. *begin*, on the training thread at a step boundary: the instant the image must equal. Version
   counters are read, a few tensors known to be written behind the dispatcher's back are cloned
   eagerly, and (``strict``) every piece is fingerprinted.
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

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.checkpoint.manifest import Manifest, PieceLocation, TensorRecord
from shared.checkpoint.pieces import byte_extent, byte_view, fingerprint, piece_ranges, storage_key
from shared.checkpoint.pusher import StoreLink
from shared.checkpoint.state import encode_meta
from shared.datastore import ObjectRef

# Where a piece's bytes are: in a stored pack, or at an offset of a pack this checkpoint is writing.
Known = tuple[ObjectRef | int, int, int]


class Entry:
    """A tracked tensor: its live bytes, per-piece capture state, and the lock that orders the
    copier against copy-on-write."""

    __slots__ = (
        "begin_fps",
        "captured",
        "dirty",
        "eager",
        "extent",
        "fps",
        "live",
        "lock",
        "name",
        "ranges",
        "snaps",
        "storage",
        "tensor",
        "version0",
    )

    def __init__(self, name: str, tensor: torch.Tensor, piece_bytes: int, *, eager: bool) -> None:
        self.name = name
        self.tensor = tensor
        self.live = byte_view(tensor)
        self.storage = storage_key(tensor)
        self.extent = byte_extent(tensor)
        self.ranges = piece_ranges(self.live.numel(), piece_bytes)
        self.lock = threading.Lock()
        n = len(self.ranges)
        self.snaps: list[torch.Tensor | None] = [None] * n
        self.captured = [False] * n
        self.dirty = [False] * n  # a declared write touched the piece during the checkpoint
        self.fps: list[str | None] = [None] * n
        self.begin_fps: list[str] | None = None
        self.version0 = tensor._version
        self.eager = eager or tensor.device.type != "cpu"
        if self.eager:
            # Cloned now, at the instant: known undeclared writers, and device memory (a device
            # clone is ordered on the stream before later kernels; the copier moves it to host).
            whole = self.live.clone()
            self.snaps = [whole[a:b] for a, b in self.ranges]
            self.captured = [True] * n

    def host(self, i: int) -> Any:
        """Piece ``i``'s captured bytes as a host buffer."""
        snap = self.snaps[i]
        assert snap is not None
        return snap.cpu().numpy() if snap.device.type != "cpu" else snap.numpy()


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
    known: dict[str, Known] = field(default_factory=dict)  # pieces stored by this attempt


class Packer:
    """Groups new pieces into packs of about ``pack_bytes`` and stores each pack once full.

    A tensor at least a pack large starts a pack of its own, so identical large tensors (the same
    pretrained weights in two jobs) produce identical packs, which the store keeps once.
    """

    def __init__(self, link: StoreLink, pack_bytes: int) -> None:
        self._link = link
        self._pack_bytes = pack_bytes
        self._buffers: list[Any] = []
        self._size = 0
        self.futures: list[Future[ObjectRef]] = []

    def align(self, nbytes: int) -> None:
        if nbytes >= self._pack_bytes and self._size:
            self.flush()

    def add(self, data: Any) -> tuple[int, int]:
        """Append ``data`` (kept alive until stored); returns (pack number, offset)."""
        location = (len(self.futures), self._size)
        self._buffers.append(data)
        self._size += data.nbytes
        if self._size >= self._pack_bytes:
            self.flush()
        return location

    def flush(self) -> None:
        if not self._buffers:
            return
        buffers, self._buffers, self._size = self._buffers, [], 0
        self.futures.append(self._link.put_many(buffers))


class Capture:
    """The state of one checkpoint attempt, shared by the training thread and the copier."""

    def __init__(
        self,
        *,
        job: str,
        step: int,
        tensors: list[tuple[str, torch.Tensor]],
        meta: dict[str, Any],
        link: StoreLink,
        known: dict[str, Known],
        eager: set[str],
        piece_bytes: int,
        pack_bytes: int,
        strict: bool,
        parent: str | None,
        pacer: Callable[[], None] | None = None,
    ) -> None:
        self.job = job
        self.step = step
        self.meta = meta
        self.link = link
        self.known = dict(known)
        self.piece_bytes = piece_bytes
        self.strict = strict
        self.parent = parent
        self.pacer = pacer
        self.stats = CaptureStats()
        self.packer = Packer(link, pack_bytes)
        self.entries = [Entry(name, t, piece_bytes, eager=name in eager) for name, t in tensors]
        self.by_storage: dict[int, list[Entry]] = {}
        for entry in self.entries:
            if entry.storage is not None:
                self.by_storage.setdefault(entry.storage, []).append(entry)
            if strict and not entry.eager:
                array = entry.live.numpy()
                entry.begin_fps = [fingerprint(array[a:b]) for a, b in entry.ranges]
        self.stall_s = 0.0
        self._boundaries = 0
        self._quiesced = False
        self._cancelled = False
        self._progress = threading.Condition()
        self.captured = threading.Event()  # every piece captured (tests inject writes after it)
        self.future: Future[CaptureResult] = Future()
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{job}-{step}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ----- training thread --------------------------------------------------------------------

    def before_write(self, tensor: torch.Tensor) -> None:
        """Soft copy-on-write: clone the pieces of tracked tensors that ``tensor``'s bytes overlap
        and the copier has not captured yet; mark them written."""
        started = time.perf_counter()
        key = storage_key(tensor)
        entries = self.by_storage.get(key) if key is not None else None
        if entries:
            start, end = byte_extent(tensor)
            for entry in entries:
                lo, hi = entry.extent
                if start >= hi or end <= lo:
                    continue
                first, last = max(start, lo) - lo, min(end, hi) - lo
                with entry.lock:
                    for i, (a, b) in enumerate(entry.ranges):
                        if b <= first or a >= last:
                            continue
                        entry.dirty[i] = True
                        if not entry.captured[i]:
                            entry.snaps[i] = entry.live[a:b].clone()
                            entry.captured[i] = True
                            self.stats.cow_pieces += 1
                            self.stats.cow_bytes += b - a
        self.stall_s += time.perf_counter() - started

    def boundary(self) -> None:
        """A step boundary passed (validation waits for one after the capture, so a per-step
        undeclared writer has run at least once in between)."""
        with self._progress:
            self._boundaries += 1
            self._progress.notify_all()

    def quiesce(self) -> None:
        """Training is paused (checkpoint-and-stop): validate at once."""
        with self._progress:
            self._quiesced = True
            self._progress.notify_all()

    def cancel(self) -> None:
        """Stop the copier at its next piece; the attempt ends in ``CancelledError``."""
        with self._progress:
            self._cancelled = self._quiesced = True
            self._progress.notify_all()

    def done(self) -> bool:
        return self.future.done()

    # ----- copier thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.future.set_result(self._capture_validate_commit())
        except BaseException as exc:
            self.future.set_exception(exc)

    def _store_piece(self, entry: Entry, i: int, fp: str, data: Any) -> None:
        if fp not in self.known:
            pack, offset = self.packer.add(data)
            self.known[fp] = (pack, offset, data.nbytes)
            self.stats.new_pieces += 1
            self.stats.new_bytes += data.nbytes
        entry.fps[i] = fp
        entry.snaps[i] = None

    def _capture_validate_commit(self) -> CaptureResult:
        # Capture: live pieces not yet copied by copy-on-write or at begin.
        for entry in self.entries:
            self.packer.align(entry.live.numel())
            array = entry.live.numpy() if not entry.eager else None
            for i, (a, b) in enumerate(entry.ranges):
                if self._cancelled:
                    raise CancelledError(f"checkpoint of {self.job} at step {self.step} abandoned")
                if self.pacer is not None:
                    self.pacer()
                with entry.lock:
                    if entry.captured[i]:
                        continue
                    assert array is not None
                    fp = fingerprint(array[a:b])
                    entry.captured[i] = True
                    entry.fps[i] = fp
                    if fp in self.known:
                        continue
                    snap = entry.live[a:b].clone()
                self._store_piece(entry, i, fp, snap.numpy())
        # Pieces copied by copy-on-write or eagerly: fingerprint and pack them now.
        for entry in self.entries:
            for i in range(len(entry.ranges)):
                if entry.snaps[i] is not None:
                    data = entry.host(i)
                    self._store_piece(entry, i, fingerprint(data), data)
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
        if torn:
            return CaptureResult(self.step, None, None, tuple(sorted(torn)), self.stats, stored)
        manifest = self._manifest(stored)
        ref = self.link.put_many([manifest.to_json()]).result()
        return CaptureResult(self.step, manifest, ref, (), self.stats, stored)

    def _validate(self) -> set[str]:
        # Two boundaries after the capture ended: one whole step ran after it (the first may be
        # the boundary of a step that was already running when the capture ended).
        with self._progress:
            seen = self._boundaries
            self._progress.wait_for(lambda: self._quiesced or self._boundaries >= seen + 2)
        torn: set[str] = set()
        for entry in self.entries:
            if entry.eager:
                continue
            if entry.begin_fps is not None and entry.fps != entry.begin_fps:
                torn.add(entry.name)
                continue
            array = entry.live.numpy()
            for i, (a, b) in enumerate(entry.ranges):
                with entry.lock:
                    if entry.dirty[i]:
                        continue
                    if fingerprint(array[a:b]) != entry.fps[i]:
                        torn.add(entry.name)
                        break
            with entry.lock:
                if entry.tensor._version != entry.version0 and not any(entry.dirty):
                    torn.add(entry.name)  # a write the dispatch mode did not see
        return torn

    def _manifest(self, stored: dict[str, tuple[ObjectRef, int, int]]) -> Manifest:
        meta_ref = self.link.put_many([encode_meta(self.meta)]).result()
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
                    entry.live.numel(),
                    tuple(fps),
                    tuple(pieces),
                )
            )
            self.stats.pieces += len(fps)
            self.stats.image_bytes += entry.live.numel()
        stats = {k: int(v) for k, v in vars(self.stats).items()}
        return Manifest(
            self.job, self.step, self.piece_bytes, tuple(packs), meta_ref, tuple(records), self.parent, stats
        )
