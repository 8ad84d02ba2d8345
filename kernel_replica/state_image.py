"""The kernel replica's checkpoint agent: a cell's large objects copied after its reply (issue #17).

Without it, the executor's large-object path copies each large group aside (or writes it to the
data store) before the cell's reply, so a cell that changes a 200 MB tensor answers a few hundred
milliseconds (or seconds) late. With it, the executor marks the instant the cell ended, answers,
and copies the group's buffers in the background with the job agent's machinery
(``shared.checkpoint``, POS): each out-of-band buffer of the group's pickle (a tensor's storage, a
numpy memory region) and the pickle itself are the tensors ``part.<i>`` of one concurrent,
validated, content-addressed image; its manifest's ref goes into the STATE entry's group
(``EncodedGroup.image``), proposed only once the image is in the store.

The state replicated is bitwise the state at the cell's end although the next cell may already
run and change it:

- torch writes: the job agent's ``WriteGuard`` (a ``TorchDispatchMode`` on the main thread, where
  cells run) copies each piece an op is about to write before the copier reached it;
- numpy arrays (writes no dispatcher sees): before any user code runs again (a cell, a comm
  message), the pieces of numpy parts the copier has not reached yet are cloned at once, of the
  groups that code may change (``before_user_code``): the fallback, paid only when the next cell
  comes before the copy ended;
- anything else (a torch tensor written through a numpy view of it): ``strict`` validation (every
  piece's XXH3 at the instant, compared with what was copied) finds the image torn. There is no
  later instant to retake at, so the group's names are reported unstored with the reason
  (``durability``: the user is told, and the value is stored again by the next attempt).

Pieces already in the store (unchanged since the last image of the group, or duplicates) are not
written again. The replica writes to the data store it already writes its large objects to, opened
the same way (``datastore`` configuration): no new peer, key or trust relation.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kernel_replica.object_codec import TornImage
from shared.background_threads import background_pool
from shared.checkpoint.capture import Capture, CaptureResult, Known, known_pieces
from shared.checkpoint.cow import UNDECLARED_WRITES, WriteGuard
from shared.checkpoint.manifest import Manifest
from shared.checkpoint.pusher import StoreLink
from shared.checkpoint.restore import PackReader
from shared.checkpoint.staging import Staging
from shared.checkpoint.state import Structure
from shared.datastore import DataStore, ObjectRef

# 200 pieces for 200 MB: begin fingerprints each piece at the instant on the main thread, and
# behind a running copy each call waits for the GIL (800 pieces of 256 KiB: 4 s at load 14 on 2
# cores, 8 ms alone)
DEFAULT_PIECE_BYTES = 1024 * 1024
DEFAULT_PACK_BYTES = 4 * 1024 * 1024
RETAIN_BYTES = 32 * 1024 * 1024
PREFETCH_PACKS = 4  # packs read ahead of the one being copied out (a store's latency overlaps)
KNOWN_GROUPS = 64  # groups whose last image's pieces are remembered (not stored again)
# Cells whose images may be in flight at once: an image copies on write what later cells change
# before it is done, so cells faster than the copier would hold a copy per cell; the next cell's
# first begin waits for the oldest cell's images instead.
MAX_IN_FLIGHT = 2


def part_name(index: int) -> str:
    return f"part.{index}"


@dataclass
class ImageResult:
    """A committed image of one group: its manifest's ref and what the copy cost."""

    ref: ObjectRef
    new_bytes: int
    cow_bytes: int
    image_bytes: int


@dataclass
class _InFlight:
    capture: Capture
    step: int  # the cell's
    names: frozenset[str]  # the group's names
    untracked: list[torch.Tensor]  # parts whose writers no dispatcher sees (numpy memory)


def _part_tensor(view: memoryview) -> tuple[torch.Tensor, bool]:
    """A flat uint8 tensor over the part's memory, and whether torch writes it (the buffer of a
    tensor's storage is a numpy array whose base is a uint8 tensor on that storage: writes to the
    user's tensor are seen by the guard through the storage)."""
    owner = view.obj
    if isinstance(owner, np.ndarray) and isinstance(owner.base, torch.Tensor):
        base = owner.base
        if base.dtype == torch.uint8 and base.dim() == 1 and base.numel() == view.nbytes:
            return base, True
    with warnings.catch_warnings():  # a read-only array: the copier only reads it
        warnings.simplefilter("ignore", UserWarning)
        flat = np.frombuffer(view, dtype=np.uint8)
        return torch.from_numpy(flat), False


class StateImager:
    """Begins, tracks and settles background images of a kernel's large groups.

    ``begin`` and ``before_user_code`` are called on the main thread (the thread cells run on:
    the write guard is that thread's dispatch mode); the copies run on one copier thread.
    """

    def __init__(
        self,
        open_store: Callable[[], Awaitable[DataStore]],
        *,
        kernel: str,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        pacer: Callable[[], None] | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        """``pacer``: called by the copier before each piece (tests hold it mid-copy)."""
        self.max_in_flight = max_in_flight
        self._open_store = open_store
        self._pacer = pacer
        self.kernel = kernel
        self.piece_bytes = piece_bytes
        # a kernel idles between cells: keep few free slabs (a job keeps 256 MiB for its next step)
        self._staging = Staging(pack_bytes, retain_bytes=RETAIN_BYTES)
        self._link: StoreLink | None = None
        self._copier = background_pool(1, thread_name_prefix="state-image")
        self._inflight: list[_InFlight] = []  # main thread only
        self._guard: WriteGuard | None = None
        self._main = threading.get_ident()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple[str, ...], dict[str, Known]] = OrderedDict()

    @property
    def link(self) -> StoreLink:
        if self._link is None:
            self._link = StoreLink.start(self._open_store)
        return self._link

    def in_flight(self) -> int:
        return len(self._inflight)

    def begin(self, names: Sequence[str], views: Sequence[memoryview], step: int) -> Future[ImageResult]:
        """Mark this instant as the image of a group (its pickle and buffers, ``views``) and copy
        it in the background. Main thread, before any user code runs again. The future ends
        with the image's ref, or ``TornImage``, or the store's error."""
        if threading.get_ident() != self._main:
            raise RuntimeError("a state image begins on the thread cells run on")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self.settle()
        while len({f.step for f in self._inflight if f.step != step}) >= self.max_in_flight:
            self._inflight[0].capture.future.exception()  # back-pressure: the oldest cell's images
            self.settle()
        parts: list[tuple[str, torch.Tensor]] = []
        untracked: list[torch.Tensor] = []
        for index, view in enumerate(views):
            if index == 0:  # the pickle: bytes of its own, never written
                tensor, seen = torch.frombuffer(bytearray(view), dtype=torch.uint8), True
            else:
                tensor, seen = _part_tensor(view)
            parts.append((part_name(index), tensor))
            if not seen:
                untracked.append(tensor)
        with self._lock:
            known: dict[str, Known] = {}
            for pieces in self._known.values():
                known.update(pieces)
        capture = Capture(
            job=f"kernel-{self.kernel}",
            step=step,
            structure=Structure(tuple(parts), ()),
            meta={"step": step, "names": list(names)},
            link=self.link,
            known=known,
            eager=set(),
            piece_bytes=self.piece_bytes,
            staging=self._staging,
            strict=True,  # every piece's fingerprint at the instant: a torn image is always found
            parent=None,
            pacer=self._pacer,
        )
        capture.quiesce()  # no step boundaries here: validate as soon as everything is copied
        self._inflight.append(_InFlight(capture, step, frozenset(names), untracked))
        if self._guard is None:
            self._guard = WriteGuard(self._before_writes, UNDECLARED_WRITES)
            self._guard.__enter__()
        result: Future[ImageResult] = Future()
        key = tuple(names)
        capture.future.add_done_callback(lambda done: self._finished(done, key, result))
        self._copier.submit(capture.run)
        return result

    def _before_writes(self, tensors: list[torch.Tensor]) -> None:
        for flight in self._inflight:
            if not flight.capture.done():
                flight.capture.before_writes(tensors)

    def untracked_in_flight(self) -> bool:
        """Whether an image in flight has parts no write guard sees (``before_user_code`` work)."""
        return any(f.untracked and not f.capture.done() for f in self._inflight)

    def before_user_code(self, names: Collection[str] | None = None) -> int:
        """User code is about to run (a cell, a comm message): clone the numpy parts' pieces the
        copier has not reached (no dispatcher sees numpy writes), of the groups with a name in
        ``names`` (those the code may change, ``cell_analysis.names_to_check``; None: every
        group). Returns the images in flight."""
        self.settle()
        for flight in self._inflight:
            wanted = names is None or not flight.names.isdisjoint(names)
            if wanted and flight.untracked and not flight.capture.done():
                flight.capture.before_writes(flight.untracked)
        return len(self._inflight)

    def settle(self) -> None:
        """Forget finished images; pop the write guard once none is in flight (main thread), if
        it is the innermost dispatch mode: a cell awaiting inside its own ``with`` mode (top-level
        await lets this run mid-cell) keeps it until a later settle (dispatch modes pop in order)."""
        if threading.get_ident() != self._main:
            return
        self._inflight = [f for f in self._inflight if not f.capture.done()]
        if not self._inflight and self._guard is not None and _get_current_dispatch_mode() is self._guard:
            guard, self._guard = self._guard, None
            guard.__exit__(None, None, None)

    def _finished(
        self, done: Future[CaptureResult], key: tuple[str, ...], result: Future[ImageResult]
    ) -> None:
        """On the copier thread: the capture's outcome becomes the image's."""
        try:
            outcome = done.result()
            if outcome.manifest is None or outcome.manifest_ref is None:
                raise TornImage(
                    "changed during its background copy by a write Tandem could not see first "
                    "(through a numpy view of a tensor, or from another thread)"
                )
            with self._lock:
                self._known[key] = known_pieces(outcome.manifest)
                self._known.move_to_end(key)
                while len(self._known) > KNOWN_GROUPS:
                    self._known.popitem(last=False)
            stats = outcome.stats
            result.set_result(
                ImageResult(outcome.manifest_ref, stats.new_bytes, stats.cow_bytes, stats.image_bytes)
            )
        except BaseException as exc:
            result.set_exception(exc)
        finally:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.settle)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every image in flight has ended (tests, shutdown). Main thread."""
        futures.wait([flight.capture.future for flight in self._inflight], timeout)
        self.settle()

    def abandon(self) -> None:
        """Stop the copies in flight at their next piece (the process is ending); not waited for."""
        for flight in self._inflight:
            flight.capture.cancel()
        self._copier.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Abandon what is in flight, wait for the copier, close the store link (tests)."""
        self.abandon()
        self._copier.shutdown(wait=True)
        self.settle()
        if self._link is not None:
            self._link.close()


async def read_image(
    store: DataStore, ref: ObjectRef, whole: memoryview, offsets: Sequence[int], sizes: Sequence[int]
) -> None:
    """``fill_image`` from ``store`` (a store of the running loop), the copying on a worker thread:
    the loop answers meanwhile."""
    loop = asyncio.get_running_loop()

    def get(ref: ObjectRef) -> Future[memoryview]:
        return asyncio.run_coroutine_threadsafe(store.get(ref), loop)

    await asyncio.to_thread(fill_image, get, ref, whole, offsets, sizes)


def fill_image(
    get: Callable[[ObjectRef], Future[memoryview]],
    ref: ObjectRef,
    whole: memoryview,
    offsets: Sequence[int],
    sizes: Sequence[int],
    stop: Callable[[], bool] | None = None,
) -> None:
    """Fill ``whole`` (a group's payload buffer) with the image's parts at ``offsets``, on the
    calling thread (never the one that answers Raft or the scheduler); ``get`` reads an object
    from the store (``StoreLink.get``); ``stop``: ``PackReader.copy``'s. Each pack is read once, ``PREFETCH_PACKS`` ahead, and let
    go once its last piece is in place (a 200 MB group is not held twice). Every object read is
    checked against its BLAKE3 address by the store, the manifest's against the ref in the
    (authenticated) STATE entry, the packs' against the refs in the manifest."""
    manifest = Manifest.from_json(get(ref).result())  # checked: pieces inside their packs
    if len(manifest.tensors) != len(sizes):
        raise ValueError(f"image has {len(manifest.tensors)} parts, the group {len(sizes)}")
    records = [manifest.record(part_name(index)) for index in range(len(sizes))]
    for record, size in zip(records, sizes, strict=True):
        if record.nbytes != size:
            raise ValueError(f"image part {record.name} has {record.nbytes} bytes, the group {size}")
    reader = PackReader(manifest, get, PREFETCH_PACKS)
    reader.plan([piece for record in records for piece in record.pieces])
    target = np.frombuffer(whole, dtype=np.uint8)
    try:
        for record, offset in zip(records, offsets, strict=True):
            reader.copy(record, target[offset : offset + record.nbytes], stop=stop)
    finally:
        reader.close()
