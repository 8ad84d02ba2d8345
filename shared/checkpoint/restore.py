"""Restore an image into a freshly built job, on demand: the first step runs while the rest loads.

The job runner builds its model and optimizer from code as usual, then restores into them. The
small state (step, RNG, scheduler, scaler, loader position, the optimizer's structure) is loaded
first, synchronously. Tensor contents load on a background thread in the image's order (module
order, then optimizer state), and an ``AccessGuard`` on the training thread holds any op whose
arguments are not loaded yet, moving them to the front of the queue: POS's soft on-demand load.
The first forward pass waits only for the weights it reaches, not for the optimizer's moments.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import numpy as np
import torch

from shared.background_threads import background_thread
from shared.checkpoint.cow import AccessGuard
from shared.checkpoint.manifest import Manifest, PieceLocation, ReadInterrupted, TensorRecord
from shared.checkpoint.pieces import byte_view, storage_key
from shared.checkpoint.pusher import StoreLink
from shared.checkpoint.state import TrainingState, decode_meta
from shared.datastore import ObjectRef


class PackReader:
    """Copies tensors' pieces out of an image's packs, on the calling thread: each pack read once
    through ``get`` (``StoreLink.get``), ``prefetch`` packs ahead of the one being copied (the
    store's latency overlaps), and let go once its last planned piece is out (a large image is
    not held twice). Shared by a job's restore and a kernel replica's large-object loads."""

    def __init__(
        self, manifest: Manifest, get: Callable[[ObjectRef], Future[memoryview]], prefetch: int
    ) -> None:
        self.manifest = manifest
        self._get = get
        self.prefetch = prefetch
        self._packs: dict[int, Future[memoryview]] = {}
        self._uses: dict[int, int] = {}
        self._order: list[int] = []  # packs in the order their pieces are planned to be copied

    def plan(self, pieces: Iterable[PieceLocation]) -> None:
        """Every piece that will be copied, in the expected order (what is read ahead)."""
        for piece in pieces:
            if piece.pack not in self._uses:
                self._order.append(piece.pack)
            self._uses[piece.pack] = self._uses.get(piece.pack, 0) + 1

    def read_ahead(self, upcoming: Iterable[int] | None = None) -> None:
        """Ask for the next packs (``upcoming`` pack indices, or the planned order) until
        ``prefetch`` are in flight beyond the one being copied."""
        for index in self._order if upcoming is None else upcoming:
            if len(self._packs) > self.prefetch:
                return
            if index not in self._packs and self._uses.get(index, 0) > 0:
                self._packs[index] = self._get(self.manifest.packs[index])

    def copy(
        self,
        record: TensorRecord,
        dest: np.ndarray,
        upcoming: Iterable[int] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Fill ``dest`` (``record.nbytes`` uint8) with the record's pieces; ``ReadInterrupted``
        (``dest`` partly filled) as soon as ``stop()`` says so, checked before each piece."""
        at = 0
        for piece in record.pieces:
            if stop is not None and stop():
                raise ReadInterrupted(record.name)
            if piece.pack not in self._packs:
                self._packs[piece.pack] = self._get(self.manifest.packs[piece.pack])
            self.read_ahead(upcoming)
            pack = self._packs[piece.pack].result()
            dest[at : at + piece.length] = np.frombuffer(
                pack, dtype=np.uint8, count=piece.length, offset=piece.offset
            )
            at += piece.length
            self._uses[piece.pack] -= 1
            if not self._uses[piece.pack]:
                del self._packs[piece.pack]  # the store's cache may still hold it; this reader is done

    def close(self) -> None:
        """Give up the reads still in flight (an error, a load no longer wanted)."""
        for future in self._packs.values():
            future.cancel()
        self._packs.clear()


class Restore:
    """One restore of ``manifest`` into ``state``. ``start`` on the training thread; ``wait``
    there too once convenient (it removes the gate), at the latest before the next checkpoint."""

    def __init__(
        self, state: TrainingState, link: StoreLink, manifest: Manifest, *, prefetch_packs: int = 4
    ) -> None:
        self.state = state
        self.link = link
        self.manifest = manifest
        self.prefetch_packs = prefetch_packs
        self._lock = threading.Condition()
        self._queue: OrderedDict[str, TensorRecord] = OrderedDict()
        self._loaded: set[str] = set()
        self._pending_by_storage: dict[int, list[str]] = {}
        self._targets: dict[str, torch.Tensor] = {}
        self._reader = PackReader(manifest, link.get, prefetch_packs)
        self._error: BaseException | None = None
        self._guard: AccessGuard | None = None
        self._thread = background_thread(self._run, name="checkpoint-restore")

    @classmethod
    def from_ref(cls, state: TrainingState, link: StoreLink, ref: ObjectRef) -> Restore:
        """A restore of the manifest stored under ``ref`` (what the service recorded at commit);
        the manifest is checked before anything is loaded."""
        return cls(state, link, Manifest.from_json(link.get(ref).result()))

    def start(self, *, on_demand: bool = True) -> None:
        meta = decode_meta(self.link.get(self.manifest.meta).result())
        self.state.load_meta(meta)
        self._targets = dict(self.state.tensors())
        for record in self.manifest.tensors:
            target = self._targets.get(record.name)
            if target is None:
                raise ValueError(f"the image has {record.name!r}, the job has no such tensor")
            if (
                str(target.dtype).removeprefix("torch.") != record.dtype
                or tuple(target.shape) != record.shape
            ):
                raise ValueError(
                    f"{record.name}: image {record.dtype}{list(record.shape)}, job {target.dtype}{list(target.shape)}"
                )
            self._queue[record.name] = record
            key = storage_key(target)
            if key is not None:
                self._pending_by_storage.setdefault(key, []).append(record.name)
            self._reader.plan(record.pieces)
        missing = set(self._targets) - set(self._queue)
        if missing:
            raise ValueError(f"the job has tensors the image lacks: {sorted(missing)[:5]}")
        if on_demand:
            self._guard = AccessGuard(self._before_access)
            self._guard.__enter__()
        self._thread.start()

    def wait(self) -> None:
        """Block until everything is loaded; remove the gate."""
        self._thread.join()
        if self._guard is not None:
            self._guard.__exit__(None, None, None)
            self._guard = None
        if self._error is not None:
            raise self._error

    # ----- training thread --------------------------------------------------------------------

    def _before_access(self, tensor: torch.Tensor) -> None:
        if not self._pending_by_storage:
            return
        key = storage_key(tensor)
        names = self._pending_by_storage.get(key) if key is not None else None
        if names:
            self.demand(list(names))

    def demand(self, names: list[str]) -> None:
        """Load ``names`` next and block until they are in place."""
        with self._lock:
            for name in reversed(names):
                if name in self._queue:
                    self._queue.move_to_end(name, last=False)
            self._lock.notify_all()
            self._lock.wait_for(lambda: self._error is not None or all(n in self._loaded for n in names))
            if self._error is not None:
                raise self._error

    # ----- loader thread ----------------------------------------------------------------------

    def _upcoming(self) -> list[int]:
        """The packs of what is queued, in queue order (demanded tensors first)."""
        with self._lock:
            upcoming = list(self._queue.values())
        return [piece.pack for record in upcoming for piece in record.pieces]

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._queue:
                        break
                    name, record = next(iter(self._queue.items()))
                self._fill(self._targets[name], record)
                with self._lock:
                    del self._queue[name]
                    self._loaded.add(name)
                    key = storage_key(self._targets[name])
                    if key is not None:
                        names = self._pending_by_storage[key]
                        names.remove(name)
                        if not names:
                            del self._pending_by_storage[key]
                    self._lock.notify_all()
        except BaseException as exc:
            with self._lock:
                self._error = exc
                self._lock.notify_all()

    def _fill(self, target: torch.Tensor, record: TensorRecord) -> None:
        on_host = target.device.type == "cpu"
        dest = byte_view(target).numpy() if on_host else np.empty(record.nbytes, dtype=np.uint8)
        self._reader.copy(record, dest, self._upcoming())
        if not on_host:
            byte_view(target).copy_(torch.from_numpy(dest))
