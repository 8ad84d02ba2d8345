"""Serialising changed names for replication: inline pickles for small groups, store pointers for large.

Unit of serialisation: a *group* of names whose objects share references (a model and the optimizer
holding its parameters; ``b = a[0]``). Each group is one pickle, so pickle's memo keeps the shared
objects shared after decoding; groups share nothing, so they can be decoded independently. Groups
come from a memo pass: pickling each name records the identities it reaches (mutable containers,
instances, notebook functions, tensor storages, numpy base arrays); names whose identity sets
intersect are joined (union-find). The sets are kept per name (``_reach``) so a changed name pulls
in an unchanged name it shares objects with, and that name is re-encoded with it.

Pickling is cloudpickle (notebook functions and classes by value) at protocol 5 with out-of-band
buffers: numpy arrays natively, torch tensors through a reducer that emits their storage's raw bytes
as a ``PickleBuffer`` and rebuilds views on one shared storage (torch's own reducer copies through
``torch.save`` and loses aliasing between separately pickled views). Numpy arrays get the same
treatment: each memory *region* (the span of the outermost array of a ``.base`` chain) is one
buffer, and every array on it, view of a view or not, is rebuilt as a view of it with its own
class (``recarray``, ``matrix``, ``MaskedArray`` with its mask and fill value), so names that
shared memory still do, and the region is a grouping key. A group under ``large_object_bytes``
travels inline (pickle + buffers copied, small); a larger one is streamed to the data store with
``put_stream([pickle, *buffers])``, which reads the live buffers without another copy, and the
group record carries the ``ObjectRef``. In the payload every buffer starts at a multiple of
``ALIGN`` (64) bytes; decoding has the store fill one fresh, 64-byte aligned writable buffer in
place and unpickles against views of it, so restored arrays are at least as aligned as numpy's
own (glibc gives numpy 16 bytes). Before, a buffer started wherever the pickle ended: an array
not aligned to its item size is reduced through numpy's buffered, chunked loop, and a float64
sum of 1M elements differed in the last digit from the same sum on the executor.
"""

from __future__ import annotations

import array
import bisect
import concurrent.futures
import contextlib
import copyreg
import ctypes
import importlib
import io
import mmap
import os
import pickle
import socket
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import cloudpickle

from kernel_replica.comm_sync import reduce_front_end_object
from kernel_replica.lazy_modules import Deferred, is_ndarray, is_tensor, loaded_class
from kernel_replica.memory_index import MemoryIndex, Span
from shared.datastore.base import DataStore, ObjectRef

if TYPE_CHECKING:
    import numpy as np
    import torch
else:  # imported when an array or tensor is encoded or decoded, never for a notebook without any
    np = Deferred("numpy")
    torch = Deferred("torch")

DEFAULT_LARGE_OBJECT_BYTES = 1024 * 1024
# Without a data store a large group travels inline in the Raft log, up to this: a Raft frame is
# refused beyond 256 MiB (shared/raft/codec.py), and entries this big would stall every peer's
# log and snapshot. A larger group is left unstored (``EncodeResult.unstored``) instead.
MAX_INLINE_BYTES = 64 * 1024 * 1024
_HEAP_MAX_BYTES = 32 * 1024 * 1024
_COPY_SLICE_BYTES = 64 * 1024 * 1024
ALIGN = 64  # payload offset of every out-of-band buffer, and alignment of the decode buffer
FORMAT = "tandem-pickle5/2"  # /1: the same parts, packed without alignment padding
_FORMATS = {"tandem-pickle5/1": False, FORMAT: True}  # format -> parts aligned
_PAD = bytes(ALIGN)
# dtype kinds whose bytes are the value (no pointers): arrays of these are rebuilt over regions
_RAW_KINDS = frozenset("biufcmMUSV")
# Values whose identity never matters (immutable atoms): not recorded by the memo pass.
_UNSENDABLE = (io.IOBase, socket.socket)
# Stands for "the namespace this is decoded into" in pickles (persistent id "namespace").
_NAMESPACE: dict[str, Any] = {}
_ATOMS = (int, float, complex, bool, str, bytes, type(None), range, slice, frozenset, tuple)


@dataclass(frozen=True, slots=True)
class Skipped:
    """A name that was not replicated, and why (type and error)."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class EncodedGroup:
    """One pickle of names that share objects; msgpack-able through ``to_dict``."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]  # pickle stream, then each out-of-band buffer
    inline: bytes | None = None  # the concatenated payload, for small groups
    pointer: dict[str, Any] | None = None  # ObjectRef.to_dict() of the payload in the data store
    aligned: bool = True  # parts at ALIGN-byte offsets (FORMAT); False: a /1 record, packed
    # ObjectRef.to_dict() of a checkpoint manifest (shared/checkpoint) whose tensor "part.<i>" holds
    # part i (the pickle, then each buffer): copied in the background after the reply
    # (kernel_replica/state_image.py), content-addressed, so unchanged pieces are not stored again
    image: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the payload (the parts and the padding between them)."""
        return layout(self.sizes, aligned=self.aligned)[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT if self.aligned else "tandem-pickle5/1",
            "names": list(self.names),
            "sizes": list(self.sizes),
            "inline": self.inline,
            "pointer": self.pointer,
            **({"image": self.image} if self.image is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EncodedGroup:
        aligned = _FORMATS.get(data.get("format"))  # type: ignore[arg-type]
        if aligned is None:
            raise ValueError(f"unknown group format {data.get('format')!r}")
        pointer, image = data.get("pointer"), data.get("image")
        for ref in (pointer, image):
            if ref is not None:
                ObjectRef.from_dict(dict(ref))  # validate early
        inline = data.get("inline")
        return cls(
            tuple(data["names"]),
            tuple(int(n) for n in data["sizes"]),
            bytes(inline) if inline is not None else None,
            dict(pointer) if pointer is not None else None,
            aligned,
            dict(image) if image is not None else None,
        )


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(sizes: Iterable[int], *, aligned: bool = True) -> tuple[list[int], int]:
    """Offsets of the parts (pickle, then each buffer) in a payload, and its length: every
    buffer starts at a multiple of ``ALIGN``, zero padding before it (none after the last)."""
    offsets, end = [], 0
    for index, size in enumerate(sizes):
        start = _round_up(end) if aligned and index else end
        offsets.append(start)
        end = start + size
    return offsets, end


def _padded(views: list[memoryview]) -> list[memoryview]:
    """``views`` with the zero padding ``layout`` puts between them (payload order)."""
    out, end = [], 0
    for index, view in enumerate(views):
        pad = _round_up(end) - end if index else 0
        if pad:
            out.append(memoryview(_PAD)[:pad])
        out.append(view)
        end += pad + view.nbytes
    return out


@dataclass(slots=True)
class EncodeResult:
    groups: list[EncodedGroup] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    # encode(defer_large=True): group index -> a private copy of its payload, still to be written
    # to the store (the group has neither inline bytes nor a pointer until then)
    deferred: dict[int, memoryview] = field(default_factory=dict)
    # name -> why its group could not be stored (store write failed, too large to go inline
    # without a store): not in ``groups``, so not replicated; the executor retries it later
    unstored: dict[str, str] = field(default_factory=dict)
    # encode(images=True): group index -> its parts as live views (the pickle, then each buffer),
    # for ``state_image.StateImager.begin`` to copy in the background; the group has neither
    # inline bytes nor a pointer nor an image until that copy commits
    images: dict[int, list[memoryview]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every name encoded (the requested ones plus those pulled in by sharing)."""
        return [name for group in self.groups for name in group.names]


# ----- rebuild functions (referenced by pickles: keep their names stable) ------------------------


def _rebuild_storage(buffer: Any, nbytes: int, device: str) -> Any:
    if nbytes == 0:
        storage = torch.UntypedStorage(0)
    else:
        storage = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).untyped_storage()
    if device != "cpu":
        target = torch.device(device)
        if target.type == "cuda" and not torch.cuda.is_available():
            return storage  # a standby without a GPU keeps the bytes on the host
        storage = storage.to(device=target)
    return storage


def _rebuild_storage_on_block(block: np.ndarray, offset: int, nbytes: int) -> Any:
    """A CPU storage on its bytes of a rebuilt block (``_BlockBox``), sharing them with the
    numpy arrays and other storages on the block."""
    return torch.frombuffer(
        block[offset : offset + nbytes], dtype=torch.uint8, count=nbytes
    ).untyped_storage()


def _rebuild_region_on_block(
    block: np.ndarray, offset: int, nbytes: int, outer: tuple[Any, ...] | None
) -> np.ndarray:
    """A numpy region on its bytes of a rebuilt block (``_BlockBox``)."""
    return _rebuild_region(block[offset : offset + nbytes], nbytes, outer)


def _rebuild_memoryview(
    owner: Any, offset: int, nbytes: int, fmt: str, shape: tuple[int, ...], readonly: bool
) -> memoryview:
    """A memoryview of ``owner``'s bytes ``offset``..``offset + nbytes``, as ``fmt`` and ``shape``:
    it shares them with ``owner`` (rebuilt in the same pickle), as the original did."""
    view = memoryview(owner).cast("B")[offset : offset + nbytes]
    if fmt != "B" or len(shape) != 1:
        view = view.cast(fmt, shape)
    return view.toreadonly() if readonly else view


def _rebuild_tensor(
    storage: Any,
    dtype: Any,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    grad: Any,
) -> Any:
    tensor = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
    if requires_grad:
        tensor.requires_grad_(True)
    if grad is not None:
        tensor.grad = grad
    return tensor


def _rebuild_parameter(data: Any, requires_grad: bool, grad: Any, state: dict[str, Any]) -> Any:
    param = torch.nn.Parameter(data, requires_grad=requires_grad)
    if grad is not None:
        param.grad = grad
    if state:
        param.__dict__.update(state)
    return param


def _rebuild_np_view(
    base: np.ndarray,
    dtype: np.dtype,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    offset: int,
    writeable: bool,
) -> np.ndarray:
    view = np.ndarray(shape, dtype=dtype, buffer=base, offset=offset, strides=strides)
    if not writeable:
        view.flags.writeable = False
    return view


def _rebuild_region(buffer: Any, nbytes: int, outer: tuple[Any, ...] | None) -> np.ndarray:
    """The outermost array of a memory region, over the region's bytes: every other array on
    the region is rebuilt as a view of it (so ``y.base is x`` for ``y = x[2:]``, as in numpy).
    ``outer``: (class, dtype, shape, strides, offset, writeable), or None for a plain byte array."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    if memoryview(buffer).readonly:  # pickled in band (no buffer_callback): own a writable copy
        buffer = bytearray(buffer)
    raw = np.frombuffer(buffer, dtype=np.uint8, count=nbytes)
    if outer is None:
        return raw
    cls, dtype, shape, strides, offset, writeable = outer
    # A C-contiguous array (the usual owner) is built over the buffer itself, and the views over
    # it; any other is built over ``raw``, and the views over ``raw`` (its base), since numpy
    # exports a buffer only from a C-contiguous array.
    arr = np.ndarray.__new__(cls, shape, dtype=dtype, buffer=raw, offset=offset, strides=strides)
    if arr.flags.c_contiguous:
        arr = np.ndarray.__new__(cls, shape, dtype=dtype, buffer=buffer, offset=offset, strides=strides)
    if not writeable:
        arr.flags.writeable = False
    return arr


def _reopen_memmap(
    filename: str | os.PathLike[str],
    mode: str,
    file_start: int,
    attrs: tuple[int, str],
    nbytes: int,
    outer: tuple[Any, ...],
) -> np.ndarray:
    """A file-backed ``np.memmap``'s region mapped again from its file, not rebuilt from bytes:
    the file is the data, and a copy detached from it took the notebook's writes while the file
    kept the old values (``mm[0] = 5; mm.flush()`` on the next executor changed nothing on disk).
    A file this replica cannot open fails the group's load, which the next cell reports."""
    raw = np.memmap(
        filename, dtype=np.uint8, mode="r" if mode == "r" else "r+", offset=file_start, shape=(nbytes,)
    )
    cls, dtype, shape, strides, offset, writeable = outer
    arr = np.ndarray.__new__(cls, shape, dtype=dtype, buffer=raw, offset=offset, strides=strides)
    arr._mmap, arr.filename, (arr.offset, arr.mode) = raw._mmap, filename, attrs
    if not writeable:
        arr.flags.writeable = False
    return arr


def _file_map(
    outer: np.ndarray, start: int
) -> tuple[str | os.PathLike[str], str, int, tuple[int, str]] | None:
    """(file, mode, file offset of the region's first byte, the memmap's own offset and mode)
    of a memmap whose region is its file's; None for any other array. A copy-on-write map
    (mode ``c``) keeps its changes in this process: its bytes travel."""
    if not isinstance(outer, np.memmap) or getattr(outer, "_mmap", None) is None:
        return None
    filename, mode, offset = outer.filename, outer.mode, outer.offset
    if (
        not isinstance(filename, str | os.PathLike)
        or mode not in ("r", "r+", "w+")
        or not isinstance(offset, int)
    ):
        return None
    return filename, mode, offset + start - _address(outer), (offset, mode)


def _rebuild_ndarray(
    region: np.ndarray,
    cls: type,
    dtype: np.dtype,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    offset: int,
    writeable: bool,
) -> np.ndarray:
    """An array of class ``cls``, a view of ``region`` (the rebuilt outermost array) at byte
    ``offset`` from the region's start: every array on the region aliases it and each other."""
    source = region if region.flags.c_contiguous else region.base  # see _rebuild_region
    arr = np.ndarray.__new__(cls, shape, dtype=dtype, buffer=source, offset=offset, strides=strides)
    if isinstance(arr, np.memmap) and getattr(region, "_mmap", None) is not None:  # as numpy's views
        arr._mmap, arr.filename, arr.offset, arr.mode = (
            region._mmap,
            region.filename,
            region.offset,
            region.mode,
        )
    if not writeable:
        arr.flags.writeable = False
    return arr


def _rebuild_empty(cls: type, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An array without elements, of class ``cls`` (its state follows, as for any array)."""
    return np.ndarray.__new__(cls, shape, dtype=dtype)


def _identity(obj: Any) -> Any:
    return obj


def _set_ndarray_state(arr: np.ndarray, state: dict[str, Any]) -> None:
    """A subclass's instance attributes (a MaskedArray's mask, fill value, hard-mask flag)."""
    arr.__dict__.update(state)


def _by_reference(func: types.FunctionType) -> bool:
    """Whether cloudpickle pickles ``func`` by name (importable) rather than by value."""
    check = getattr(cloudpickle.cloudpickle, "_should_pickle_by_reference", None)
    if check is None:  # private in cloudpickle: fall back to the rule it implements for notebooks
        return func.__module__ != "__main__"
    try:
        return bool(check(func))
    except Exception:
        return False


_HOMES_TRIED: set[str] = set()


def _import_home(cls: type) -> None:
    """Import the module a class names as its home, if its package is imported but the module
    is not: cloudpickle pickles a class by value when its module is missing from
    ``sys.modules``, and the copy is another class (``np.recarray`` lives in the lazily loaded
    ``numpy.rec``: a copy breaks ``super()`` in its methods and ``isinstance``)."""
    name = getattr(cls, "__module__", None)
    if not isinstance(name, str) or name in sys.modules or name in _HOMES_TRIED:
        return
    _HOMES_TRIED.add(name)
    if name.partition(".")[0] in sys.modules:
        with contextlib.suppress(Exception):  # not a real module: by value, as before
            importlib.import_module(name)


class _StorageBox:
    """One pickle-memoised stand-in per torch storage, so every view shares it after decode."""

    __slots__ = ("block", "storage")

    def __init__(self, storage: Any, block: tuple[_BlockBox, int] | None = None) -> None:
        self.storage = storage
        self.block = block  # (its block, its offset there): it shares memory with other objects

    def __reduce__(self) -> tuple[Any, ...]:
        storage = self.storage
        nbytes = storage.nbytes()
        if self.block is not None:
            return (_rebuild_storage_on_block, (*self.block, nbytes))
        device = str(storage.device)
        host = storage if storage.device.type == "cpu" else storage.cpu()
        if nbytes == 0:
            return (_rebuild_storage, (b"", 0, device))
        raw = torch.empty(0, dtype=torch.uint8).set_(host, 0, (nbytes,), (1,)).numpy()
        return (_rebuild_storage, (pickle.PickleBuffer(raw), nbytes, device))


class _Span:
    """Exposes the bytes ``address``..``address + nbytes`` of ``owner`` as a uint8 array."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner: Any, address: int, nbytes: int, readonly: bool | None = None) -> None:
        self.owner = owner  # keeps the memory alive
        if readonly is None:
            readonly = not owner.flags.writeable
        self.__array_interface__ = {
            "data": (address, readonly),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


class _BlockBox:
    """The bytes of overlapping numpy regions and CPU storages (``torch.from_numpy(a)`` and
    ``a``; ``t.numpy()`` and ``t``), which share memory but no Python object: they travel once,
    as one buffer, and each is rebuilt on its part of it, so they share memory again."""

    __slots__ = ("nbytes", "region")

    def __init__(self, owner: Any, start: int, nbytes: int) -> None:
        self.nbytes = nbytes
        # any member keeps the whole allocation alive (a view its base, a from_numpy storage its
        # array, a t.numpy() array its tensor). Exported writable, though only read here: pickle
        # hands a buffer exported read-only back read-only, and the decoded block was then
        # copied for its arrays, away from its storages (and from the 64-byte alignment)
        self.region = np.asarray(_Span(owner, start, nbytes, readonly=False))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_region, (pickle.PickleBuffer(self.region), self.nbytes, None))


def _blocks_of(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The extents of the clusters of two or more overlapping spans, sorted."""
    blocks: list[tuple[int, int]] = []
    start = end = count = 0
    for low, high in sorted(spans):
        if count and low < end:
            end, count = max(end, high), count + 1
            continue
        if count >= 2:
            blocks.append((start, end))
        start, end, count = low, high, 1
    if count >= 2:
        blocks.append((start, end))
    return blocks


class _RegionBox:
    """One pickle-memoised stand-in per numpy memory region, the span of an outermost array (the
    last array of a ``.base`` chain): its bytes travel once, as one out-of-band buffer, and it
    is rebuilt as that outermost array, of which every other array on the region is a view."""

    __slots__ = ("block", "file", "key", "nbytes", "outer", "region", "start", "state")

    def __init__(self, outer: np.ndarray) -> None:
        self.block: tuple[_BlockBox, int] | None = None  # as _StorageBox.block
        self.start, end = _bounds(outer)
        self.nbytes = end - self.start
        self.region = np.asarray(_Span(outer, self.start, self.nbytes))
        self.key = ("np", id(outer))  # grouping key: names whose arrays share the region
        self.outer: tuple[Any, ...] | None = None
        self.state: dict[str, Any] | None = None
        self.file: tuple[str | os.PathLike[str], str, int, tuple[int, str]] | None = None
        if _rebuildable(outer):
            cls = type(outer)
            self.outer = (
                cls,
                outer.dtype,
                outer.shape,
                outer.strides,
                _address(outer) - self.start,
                bool(outer.flags.writeable),
            )
            if cls is not np.ndarray and not issubclass(cls, np.memmap):  # a memmap's map stays
                self.state = getattr(outer, "__dict__", None) or None
            self.file = _file_map(outer, self.start)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.file is not None:
            return (_reopen_memmap, (*self.file, self.nbytes, self.outer))
        if self.block is not None:
            rebuild, args = _rebuild_region_on_block, (*self.block, self.nbytes, self.outer)
        else:
            rebuild, args = _rebuild_region, (pickle.PickleBuffer(self.region), self.nbytes, self.outer)
        if self.state is None:
            return (rebuild, args)
        return (rebuild, args, self.state, None, None, _set_ndarray_state)


def _buffer_address(view: memoryview) -> int:
    """Where a non-empty, C-contiguous buffer starts (numpy only for a read-only one, which
    ctypes will not take)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return _address(np.frombuffer(view, dtype=np.uint8))


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _bounds(arr: np.ndarray) -> tuple[int, int]:
    """First and one-past-last byte address ``arr`` touches (``numpy.lib.array_utils.byte_bounds``)."""
    low = high = _address(arr)
    for n, stride in zip(arr.shape, arr.strides, strict=True):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + arr.itemsize


def _outermost(arr: np.ndarray) -> np.ndarray:
    """The last array of ``arr``'s ``.base`` chain: the one that owns (or wraps) the memory."""
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr


_ARRAY_CLASSES: dict[type, bool] = {}


def _rebuildable(arr: np.ndarray) -> bool:
    """Whether ``arr`` can be rebuilt over raw bytes: a non-empty array of a raw dtype (no
    pointers) and of a class whose state is its ``__dict__`` (``_region_class``)."""
    dtype = arr.dtype
    return (
        arr.size > 0
        and dtype.itemsize > 0
        and not dtype.hasobject
        and dtype.kind in _RAW_KINDS
        and _region_class(type(arr))
    )


def _region_class(cls: type) -> bool:
    """Whether arrays of ``cls`` can be rebuilt as a view of a region plus their ``__dict__``:
    numpy's own pickling for the class (ndarray's or MaskedArray's, which keeps nothing the
    ``__dict__`` lacks), no ``__slots__``. Other subclasses keep their own reducer."""
    known = _ARRAY_CLASSES.get(cls)
    if known is None:
        if cls.__reduce_ex__ is not np.ndarray.__reduce_ex__ or copyreg._slotnames(cls):  # type: ignore[attr-defined]
            known = False
        elif issubclass(cls, np.ma.MaskedArray):
            known = (
                cls.__reduce__ is np.ma.MaskedArray.__reduce__
                and cls.__setstate__ is np.ma.MaskedArray.__setstate__
            )
        else:
            known = cls.__reduce__ is np.ndarray.__reduce__ and cls.__setstate__ is np.ndarray.__setstate__
        _ARRAY_CLASSES[cls] = known
    return known


class _NullWriter:
    """A file that forgets what it is given: the memo pass only needs the traversal."""

    def write(self, data: Any) -> int:
        return len(data) if hasattr(data, "__len__") else 0


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle + torch/numpy sharing-preserving reducers + identity recording."""

    def __init__(
        self,
        file: Any,
        buffers: list[pickle.PickleBuffer] | None,
        namespace: Mapping[str, Any] | None = None,
        blocks: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append if buffers is not None else None)
        self._namespace_id = id(namespace) if namespace is not None else None
        self.reach: set[Any] = set()
        # identity key -> the host memory span of each numpy region and CPU storage pickled
        self.spans: dict[Any, tuple[int, int]] = {}
        self._blocks = blocks  # spans that overlap (``_blocks_of`` of a first pass), rarely any
        if blocks:
            self._block_starts = [start for start, _ in blocks]
            self._block_boxes: dict[int, _BlockBox] = {}
        self._candidates: list[Any] = []  # objects whose identity may matter, filtered by finish()
        self._boxes: dict[tuple[str, int, int], _StorageBox] = {}
        self._regions: dict[int, _RegionBox] = {}  # id(outermost array) -> its region
        self._transient: list[Any] = []  # keeps stand-ins alive so their ids are not reused
        self._transient_ids: set[int] = set()
        self._sends = not isinstance(file, _NullWriter)  # not the memo pass (``memo_pass``)

    def persistent_id(self, obj: Any) -> str | None:
        if obj is _NAMESPACE:
            return "namespace"
        if isinstance(obj, _ATOMS) or id(obj) in self._transient_ids:
            return None
        if isinstance(obj, list | dict | set | bytearray | array.array) or is_ndarray(obj):
            self._candidates.append(obj)
        elif isinstance(obj, types.FunctionType):
            if not _by_reference(obj):  # a notebook function (pickled by value): identity matters
                self._candidates.append(obj)
        elif not isinstance(obj, type | types.ModuleType | types.BuiltinFunctionType) and (
            hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__")
        ):
            self._candidates.append(obj)
        return None

    def finish(self) -> set[Any]:
        """The reach, without temporaries that ``__reduce__``/``__getstate__`` made while pickling
        (a fresh state dict): their ids are reused by later objects and would join unrelated
        names. After the memo is dropped a temporary is referenced only by ``_candidates``; drop
        those, which may free temporaries inside them, until nothing changes."""
        self.clear_memo()
        self._transient.clear()
        alive = self._candidates
        self._candidates = []
        while True:
            # 3 = alive's reference + getrefcount's argument + the loop variable
            kept = [obj for obj in alive if sys.getrefcount(obj) > 3]
            if len(kept) == len(alive):
                break
            alive = kept
            del kept
        self.reach.update(id(obj) for obj in alive)
        return self.reach

    def _dynamic_function_reduce(self, func: types.FunctionType) -> Any:
        """A notebook function's globals are the notebook namespace, wherever it is decoded.

        cloudpickle gives each unpickled function a private globals dict holding copies of the
        globals it uses: ``def bump(): global n; n += 1`` would then update a private ``n`` on a
        standby. Functions of the encoded namespace instead refer to it by a persistent id that
        ``decode`` resolves to the standby's namespace, and carry none of its values.
        """
        make, newargs, state, items, pairs, setstate = super()._dynamic_function_reduce(func)
        if self._namespace_id is not None and id(func.__globals__) == self._namespace_id:
            code, _, name, defaults, closure = newargs
            newargs = (code, _NAMESPACE, name, defaults, closure)
            state = (state[0], {**state[1], "__globals__": {}})
        return (make, newargs, state, items, pairs, setstate)

    def _keep(self, obj: Any) -> Any:
        self._transient.append(obj)
        self._transient_ids.add(id(obj))
        return obj

    def _block_for(self, owner: Any, start: int, nbytes: int) -> tuple[_BlockBox, int] | None:
        """The block a span lies in (and its offset there), if it overlaps another span."""
        blocks = self._blocks or []
        index = bisect.bisect_right(self._block_starts, start) - 1
        if index < 0 or start + nbytes > blocks[index][1]:
            return None
        block_start, block_end = blocks[index]
        box = self._block_boxes.get(block_start)
        if box is None:
            box = self._block_boxes[block_start] = self._keep(
                _BlockBox(owner, block_start, block_end - block_start)
            )
            self._keep(box.region)
        return box, start - block_start

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type):
            _import_home(obj)
        elif (by_comm := reduce_front_end_object(obj)) is not None:
            return by_comm  # a widget or comm: a reference to its replicated model (comm_sync)
        if isinstance(obj, memoryview):
            reduced = self._reduce_memoryview(obj)
            if reduced is not NotImplemented:
                return reduced
        if isinstance(obj, _UNSENDABLE) and not isinstance(obj, io.BytesIO | io.StringIO):
            # cloudpickle would send a read-mode file's *contents* as a StringIO: not the same object
            raise TypeError(f"cannot pickle {type(obj).__qualname__!r} object (an open OS resource)")
        dtype_class = loaded_class("numpy", "dtype")
        if dtype_class is not None and isinstance(obj, dtype_class):
            # a structured dtype's state holds its live fields dict: every array of that dtype
            # would seem to share an object with every other (and join their names' groups)
            reduced = obj.__reduce__()
            if len(reduced) > 2 and isinstance(reduced[2], tuple):
                for part in reduced[2]:
                    if isinstance(part, dict | list):
                        self._keep(part)
            return reduced
        if is_tensor(obj):
            reduced = self._reduce_tensor(obj)
            if reduced is not NotImplemented:
                return reduced
        elif is_ndarray(obj):
            reduced = self._reduce_ndarray(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)

    @staticmethod
    def _reduce_memoryview(view: memoryview) -> Any:
        """A view of bytes, a bytearray, an array or a C-contiguous ndarray as its owner plus where
        it looks: cloudpickle's reducer makes it ``bytes``, a copy of another type, which a write
        to the owner no longer reaches. Any other view keeps cloudpickle's reducer."""
        owner = view.obj
        if not (
            view.c_contiguous
            and (
                isinstance(owner, bytes | bytearray | array.array)
                or (is_ndarray(owner) and owner.flags.c_contiguous)
            )
        ):
            return NotImplemented
        try:
            offset = _buffer_address(view) - _buffer_address(memoryview(owner)) if view.nbytes else 0
            args = (owner, offset, view.nbytes, view.format, view.shape, view.readonly)
            _rebuild_memoryview(*args).release()  # formats cast cannot make (a struct's) fail here
        except (TypeError, ValueError, NotImplementedError):
            return NotImplemented
        return (_rebuild_memoryview, args)

    def _reduce_tensor(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.nn.Parameter:
            state = dict(obj.__dict__) if obj.__dict__ else {}
            data = self._keep(obj.detach())
            return (_rebuild_parameter, (data, obj.requires_grad, obj.grad, state))
        if (
            cls is not torch.Tensor
            or obj.layout != torch.strided
            or obj.is_quantized
            or obj.is_conj()
            or obj.is_neg()
            or obj.device.type not in ("cpu", "cuda")
            or obj.__dict__
        ):
            return NotImplemented  # torch's own reducer (copies, but correct)
        storage = obj.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        # two storages can start at one address (``torch.from_numpy`` of an array and of its first
        # half): keyed by address alone, the second tensor was rebuilt on the first's storage,
        # too short for it
        key = (str(storage.device), address, nbytes)
        box = self._boxes.get(key)
        if box is None:
            block = None
            if storage.device.type == "cpu" and nbytes:
                self.spans[key] = (address, address + nbytes)
                block = self._block_for(storage, address, nbytes) if self._blocks else None
            box = self._boxes[key] = self._keep(_StorageBox(storage, block))
        self.reach.add(key)
        grad = obj.grad if obj.is_leaf else None
        return (
            _rebuild_tensor,
            (box, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.requires_grad, grad),
        )

    def _reduce_ndarray(self, obj: np.ndarray) -> Any:
        """An array as its region's outermost array or a view of it (shared by every array of
        the pickle on the same memory), with its class and instance state. Object dtypes, empty
        arrays and subclasses with their own reducer go through numpy's pickling (a copy)."""
        if not _rebuildable(obj):
            if obj.size == 0 and not obj.dtype.hasobject and _region_class(type(obj)):
                # no memory to share; numpy's MaskedArray pickle would store a default fill value
                return self._with_state(obj, (_rebuild_empty, (type(obj), obj.dtype, obj.shape)))
            return NotImplemented
        outer = _outermost(obj)
        box = self._regions.get(id(outer))
        if box is None:
            box = self._regions[id(outer)] = self._keep(_RegionBox(outer))
            self._keep(box.region)
            if box.file is None:  # a file-backed map is mapped again from its file, never a block
                self.spans[box.key] = (box.start, box.start + box.nbytes)
                if self._blocks:
                    box.block = self._block_for(outer, box.start, box.nbytes)
            if box.file is not None and box.file[1] != "r" and self._sends:
                # written back, so the replica that maps it next reads what the cell left (another
                # host through a shared file system); not for a traversal that sends nothing
                outer.flush()
        if obj is outer and box.outer is not None:
            self.reach.add(box.key)
            return (_identity, (box,))
        low, high = _bounds(obj)
        if low < box.start or high > box.start + box.nbytes:
            return NotImplemented  # memory outside its base's span: not a view we can express
        offset = _address(obj) - box.start
        cls, dtype = type(obj), obj.dtype
        try:  # the constructor's own checks (strides within the buffer), before committing
            np.ndarray(obj.shape, dtype=dtype, buffer=box.region, offset=offset, strides=obj.strides)
        except (ValueError, TypeError):
            return NotImplemented
        self.reach.add(box.key)
        args = (box, cls, dtype, obj.shape, obj.strides, offset, bool(obj.flags.writeable))
        return self._with_state(obj, (_rebuild_ndarray, args))

    @staticmethod
    def _with_state(obj: np.ndarray, reduced: tuple[Any, ...]) -> tuple[Any, ...]:
        """``reduced`` plus a subclass instance's ``__dict__`` (set after the array is memoised,
        so it may refer back to it); a memmap's map does not travel."""
        cls = type(obj)
        state = getattr(obj, "__dict__", None) if cls is not np.ndarray else None
        if not state or issubclass(cls, np.memmap):
            return reduced
        return (*reduced, state, None, None, _set_ndarray_state)


class _Dumped(NamedTuple):
    pickled: bytes
    buffers: list[pickle.PickleBuffer]  # out of band, aliasing live memory
    reach: set[Any]
    spans: list[Span]  # host memory of its numpy regions and CPU storages (``MemoryIndex``)


def _dumps(
    values: Mapping[str, Any],
    namespace: Mapping[str, Any] | None = None,
    blocks: list[tuple[int, int]] | None = None,
) -> _Dumped:
    """One pickle of ``values``. Objects whose memory overlaps without a shared Python object
    are found by a first pass, then pickled again onto shared blocks (a rare second pass)."""
    file = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    pickler = _Pickler(file, buffers, namespace, blocks)
    pickler.dump(dict(values))
    spans = pickler.spans
    if blocks is None and len(spans) > 1 and (overlapping := _blocks_of(spans.values())):
        return _dumps(values, namespace, overlapping)
    listed = [(start, end, key) for key, (start, end) in spans.items()] if spans else []
    return _Dumped(file.getvalue(), buffers, pickler.finish(), listed)


def dumps(
    values: Mapping[str, Any], *, namespace: Mapping[str, Any] | None = None
) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """The pickle of ``values`` as the codec writes it (buffers out of band, functions of
    ``namespace`` linked to it rather than carrying copies of its globals)."""
    dumped = _dumps(values, namespace)
    return dumped.pickled, dumped.buffers


def dumps_inline(value: Any, namespace: Mapping[str, Any] | None = None) -> bytes:
    """``value`` pickled as the codec pickles it (notebook functions of ``namespace`` linked to
    it), every buffer in band: one bytes object, for ``loads`` without buffers."""
    file = io.BytesIO()
    _Pickler(file, None, namespace).dump(value)
    return file.getvalue()


def loads(data: Any, buffers: Iterable[Any] = (), *, namespace: dict[str, Any] | None = None) -> Any:
    """Inverse of ``dumps``; notebook functions get ``namespace`` (or a fresh dict) as globals."""
    unpickler = _Unpickler(io.BytesIO(data), buffers=buffers)
    unpickler.namespace = namespace if namespace is not None else {}
    return unpickler.load()


class _Unpickler(pickle.Unpickler):
    namespace: dict[str, Any]

    def persistent_load(self, pid: Any) -> Any:
        if pid == "namespace":
            return self.namespace
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def memo_pass(value: Any, namespace: Mapping[str, Any] | None = None) -> tuple[set[Any], list[Span]]:
    """The identities ``value`` reaches and its host memory spans, without keeping any bytes
    (buffers are never copied)."""
    pickler = _Pickler(_NullWriter(), [], namespace)
    pickler.dump(value)
    spans = [(start, end, key) for key, (start, end) in pickler.spans.items()]
    return pickler.finish(), spans


class TornImage(Exception):
    """A background image (``state_image``) saw a write it could not order before its copy: the
    image is not the state at the cell's end, so it is not committed."""


def store_failure(exc: BaseException) -> str:
    """The reason recorded for a group whose data store write (or background image) failed."""
    if isinstance(exc, TornImage):
        return str(exc)
    return f"data store write failed: {exc.__class__.__name__}: {exc}"


def _describe(value: Any, exc: BaseException) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__} is not picklable: {exc.__class__.__name__}: {exc}"


def _views(pickled: bytes, buffers: list[pickle.PickleBuffer]) -> list[memoryview]:
    views = [memoryview(pickled)]
    for buf in buffers:
        raw = buf.raw()  # flat, byte-format view of the live memory (contiguous by contract)
        views.append(raw)
    return views


def copy_aside(views: list[memoryview]) -> memoryview:
    """The concatenation of ``views`` in one private buffer. numpy copies with the GIL released, in
    slices, so the Raft thread keeps heartbeating while hundreds of megabytes are copied."""
    total = sum(v.nbytes for v in views)
    whole = memoryview(_writable(total)).cast("B")
    target = np.frombuffer(whole, dtype=np.uint8)
    start = 0
    for view in views:
        source = np.frombuffer(view, dtype=np.uint8)
        for offset in range(0, view.nbytes, _COPY_SLICE_BYTES):
            piece = source[offset : offset + _COPY_SLICE_BYTES]
            np.copyto(target[start + offset : start + offset + piece.nbytes], piece)
        start += view.nbytes
    return whole


def _writable(size: int) -> bytearray | mmap.mmap:
    """A private writable buffer the decoded object will own. Large ones are anonymous maps:
    zero-filled lazily by the kernel as the read touches them, not in a separate memset pass."""
    if size <= _HEAP_MAX_BYTES:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _aligned_writable(size: int) -> memoryview:
    """``size`` private writable bytes starting at an ``ALIGN``-byte aligned address."""
    buffer = _writable(size + ALIGN)
    raw = memoryview(buffer).cast("B")
    shift = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % ALIGN
    return raw[shift : shift + size]


def _realign(whole: memoryview, sizes: Iterable[int], offsets: list[int]) -> None:
    """Move the parts of a packed (/1) payload at the start of ``whole`` to their aligned
    ``offsets``, last first (each moves right, so none overwrites a part not yet moved)."""
    data = np.frombuffer(whole, dtype=np.uint8)
    sizes = list(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for start, size, offset in reversed(list(zip(starts, sizes, offsets, strict=True))):
        if offset != start:
            np.copyto(data[offset : offset + size], data[start : start + size])  # overlap-safe


class ObjectCodec:
    """Encodes names of a namespace into ``EncodedGroup`` records and decodes them back.

    Stateful on the executor: remembers what each encoded name reaches, to group shared objects
    across cells. ``forget`` names that were deleted; a new executor starts empty and indexes
    unknown names on first use (``universe``).
    """

    def __init__(
        self,
        store: DataStore | None,
        *,
        large_object_bytes: int = DEFAULT_LARGE_OBJECT_BYTES,
        max_inline_bytes: int = MAX_INLINE_BYTES,
    ) -> None:
        self.store = store
        self.large_object_bytes = large_object_bytes
        self.max_inline_bytes = max_inline_bytes
        # why there is no store (its open failed), for the reason given when a group is unstored
        self.store_error = ""
        self._reach: dict[str, set[Any]] = {}
        # name -> the plain ndarray its reach was recorded for: bound to the very same array, a
        # name reaches the same memory (a base chain never changes), so ``refresh`` skips it
        self._held: dict[str, weakref.ref[Any]] = {}
        # identity -> the name reaching it, or the set of names when several do (kept with
        # ``_reach``: rebuilding it per cell cost ~0.2 s for a dict of 100 000 lists)
        self._owners: dict[Any, str | set[str]] = {}
        self._shared: set[Any] = set()  # identities two or more names reach
        self._memory = MemoryIndex()  # names' host memory, for sharing without a shared object

    def forget(self, names: Iterable[str]) -> None:
        """Drop what ``names`` reach: deleted, or replaced by a standby's decode (their objects
        are new, so the identities recorded for them would join nothing, or the wrong names)."""
        for name in names:
            reach = self._reach.pop(name, None)
            if reach is not None:
                self._unown(name, reach)
            self._held.pop(name, None)
            self._memory.remove(name)

    def sharing_counts(self) -> dict[str, dict[str, tuple[int, int]]]:
        """name -> {other name: (memory regions, other objects) both reach}: what a name shares,
        told apart, so that a copy still sharing a small object (a MaskedArray copy keeps its
        source's ``_basedict``) is not taken for a view (``sharing`` says only "shares")."""
        counts: dict[str, dict[str, list[int]]] = {name: {} for name in self._reach}
        for key in self._shared:
            names = self._owners[key]
            assert isinstance(names, set)
            kind = 0 if isinstance(key, tuple) else 1  # region / tensor storage, or an object id
            for name in names:
                for other in names:
                    if other != name:
                        counts[name].setdefault(other, [0, 0])[kind] += 1
        return {name: {o: (c[0], c[1]) for o, c in others.items()} for name, others in counts.items()}

    def holder_of(self, obj: Any) -> str | None:
        """A recorded name whose value reaches ``obj`` itself (the first, sorted, of several)."""
        owner = self._owners.get(id(obj))
        if owner is None or isinstance(owner, str):
            return owner
        return min(owner)

    def _own(self, name: str, reach: set[Any]) -> None:
        owners, shared = self._owners, self._shared
        for key in reach:
            current = owners.get(key)
            if current is None:
                owners[key] = name
            elif isinstance(current, str):
                if current != name:
                    owners[key] = {current, name}
                    shared.add(key)
            else:
                current.add(name)

    def _unown(self, name: str, reach: set[Any]) -> None:
        owners, shared = self._owners, self._shared
        for key in reach:
            current = owners.get(key)
            if current == name:
                del owners[key]
            elif isinstance(current, set):
                current.discard(name)
                if len(current) == 1:
                    owners[key] = current.pop()
                    shared.discard(key)

    def index(self, namespace: Mapping[str, Any], names: Iterable[str]) -> None:
        """Record what each of ``names`` reaches, where not known yet (a new executor's names,
        names a standby replaced): sharing with them is then seen."""
        for name in names:
            if name in namespace and name not in self._reach:
                self._record(namespace, name)

    def refresh(self, namespace: Mapping[str, Any], names: Iterable[str]) -> None:
        """Record again what ``names`` reach now: a value can stay equal while what it shares
        changes (``b = a[:]`` after ``b = a.copy()``; ``d["k"] = a`` over an equal copy)."""
        for name in names:
            if name not in namespace:
                continue
            held = self._held.get(name)
            if held is not None and held() is namespace[name]:
                continue
            self._record(namespace, name)

    def _record(self, namespace: Mapping[str, Any], name: str) -> None:
        try:
            reach, spans = memo_pass(namespace[name], namespace)
        except Exception:
            reach, spans = set(), []
        self._remember(name, self._with_memory(name, reach, spans), namespace[name])

    def _with_memory(self, name: str, reach: set[Any], spans: list[Span]) -> set[Any]:
        """``reach`` plus the keys of what shares host memory with ``spans`` (``MemoryIndex``)."""
        if not spans and name not in self._memory:
            return reach
        keys = self._memory.update(name, spans)
        return reach if keys <= reach else reach | keys

    def _remember(self, name: str, reach: set[Any], value: Any) -> None:
        old = self._reach.get(name)
        if old is not None:
            self._unown(name, old)
        self._reach[name] = reach
        self._own(name, reach)
        if type(value) is loaded_class("numpy", "ndarray"):
            self._held[name] = weakref.ref(value)
        else:
            self._held.pop(name, None)

    def sharing(self) -> dict[str, set[str]]:
        """name -> other names sharing objects with it, as of the last record of each name (for
        names_to_check and the fingerprints). Walks only the identities two names reach."""
        result: dict[str, set[str]] = {name: set() for name in self._reach}
        for key in self._shared:
            names = self._owners[key]
            assert isinstance(names, set)
            for name in names:
                result[name].update(names)
        for name, others in result.items():
            others.discard(name)
        return result

    def plan(
        self, namespace: Mapping[str, Any], names: Iterable[str], *, universe: Iterable[str] = ()
    ) -> tuple[list[tuple[str, ...]], list[Skipped]]:
        """Groups to encode for ``names``: sharing components, pulling in other names of the
        index (and of ``universe``, indexed now if unknown) that share objects with them."""
        groups, skipped, _ = self._plan(namespace, names, universe)
        return groups, skipped

    def _plan(
        self, namespace: Mapping[str, Any], names: Iterable[str], universe: Iterable[str]
    ) -> tuple[list[tuple[str, ...]], list[Skipped], dict[str, _Dumped]]:
        self.index(namespace, universe)
        todo = [name for name in dict.fromkeys(names) if name in namespace]
        skipped: list[Skipped] = []
        fresh: dict[str, set[Any]] = {}
        singles: dict[str, _Dumped] = {}
        while todo:
            name = todo.pop()
            if name in fresh:
                continue
            try:  # kept: a name alone in its group (the usual case) is not pickled twice
                singles[name] = _dumps({name: namespace[name]}, namespace)
                fresh[name] = self._with_memory(name, singles[name].reach, singles[name].spans)
            except Exception as exc:
                skipped.append(Skipped(name, _describe(namespace[name], exc)))
                fresh[name] = set()
                self.forget([name])
                continue
            for other, reach in self._reach.items():
                if other not in fresh and other in namespace and not reach.isdisjoint(fresh[name]):
                    todo.append(other)
        skipped_names = {s.name for s in skipped}
        parent = {name: name for name in fresh if name not in skipped_names}

        def find(n: str) -> str:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        owner: dict[Any, str] = {}
        for name in parent:
            for key in fresh[name]:
                first = owner.setdefault(key, name)
                if first != name:
                    parent[find(name)] = find(first)
        groups: dict[str, list[str]] = {}
        for name in sorted(parent):
            groups.setdefault(find(name), []).append(name)
        for name in parent:
            self._remember(name, fresh[name], namespace[name])
        return [tuple(g) for g in groups.values()], skipped, singles

    async def encode(
        self,
        namespace: Mapping[str, Any],
        names: Iterable[str],
        *,
        universe: Iterable[str] = (),
        defer_large: bool = False,
        defer_max_bytes: int | None = None,
        images: bool = False,
    ) -> EncodeResult:
        """Encode ``names`` (and names sharing objects with them) from ``namespace``.

        ``defer_large``: a group for the store is copied aside (``EncodeResult.deferred``) instead
        of written: a memory copy is much faster than a store write, and once it is taken the
        next cell may change the live objects while the copy is written in the background. The
        copy doubles the group's memory, so at most ``defer_max_bytes`` (None: no limit) are
        copied aside per call; larger groups are streamed to the store here. A group whose write
        fails, or that is too large to go inline when there is no store, is left out and its
        names reported in ``unstored``: the other groups of the cell are still replicated.
        ``images``: a group for the store is handed over as live views (``EncodeResult.images``),
        neither copied nor written here: a concurrent checkpoint copies it (``state_image``)."""
        plan, skipped, singles = self._plan(namespace, names, universe)
        result = EncodeResult(skipped=skipped)
        deferred_bytes = 0
        for group in plan:
            try:
                if len(group) == 1:
                    pickled, buffers, _, _ = singles.pop(group[0])
                else:
                    pickled, buffers, _, _ = _dumps({name: namespace[name] for name in group}, namespace)
            except Exception as exc:  # a name pickled alone but not with the others: very unusual
                result.skipped += [Skipped(name, f"group pickle failed: {exc!r}") for name in group]
                continue
            views = _views(pickled, buffers)
            sizes = tuple(v.nbytes for v in views)
            payload = _padded(views)
            total = layout(sizes)[1]
            if sum(sizes) < self.large_object_bytes or (
                self.store is None and total <= self.max_inline_bytes
            ):
                result.groups.append(EncodedGroup(group, sizes, inline=b"".join(payload)))
            elif self.store is None:
                why = f"{total} bytes is too large for the Raft log (at most {self.max_inline_bytes})"
                why += f" and there is no data store ({self.store_error or 'none configured'})"
                result.unstored.update(dict.fromkeys(group, why))
            elif images:
                result.images[len(result.groups)] = views
                result.groups.append(EncodedGroup(group, sizes))
            elif defer_large and (defer_max_bytes is None or deferred_bytes + total <= defer_max_bytes):
                deferred_bytes += total
                result.deferred[len(result.groups)] = copy_aside(payload)
                result.groups.append(EncodedGroup(group, sizes))
            else:
                try:
                    ref = await self.store.put_stream(payload, size_hint=total)
                except Exception as exc:  # the store's error, whatever its backend: this group only
                    result.unstored.update(dict.fromkeys(group, store_failure(exc)))
                    continue
                result.groups.append(EncodedGroup(group, sizes, pointer=ref.to_dict()))
        return result

    async def decode(self, group: EncodedGroup, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
        """The group's names and values; shared objects within it are shared again. Notebook
        functions get ``namespace`` (the standby's user namespace) as their globals."""
        # One private buffer for the pickle and every out-of-band buffer, filled in one pass (the
        # store reads straight into it); decoded arrays and tensors are writable views of it.
        # The buffer is ALIGN-byte aligned and so is every part in it.
        offsets, total = layout(group.sizes)
        whole = _aligned_writable(total)
        received = whole if group.aligned else whole[: sum(group.sizes)]
        if group.inline is not None:
            if len(group.inline) != received.nbytes:
                raise ValueError("inline group is not as long as its record says")
            received[:] = group.inline
        elif group.pointer is not None:
            if self.store is None:
                raise ValueError("a group in the data store needs a store to decode")
            await self.store.get_into(pointer_of(group, received), received)
        elif group.image is not None:
            if self.store is None:
                raise ValueError("a group in the data store needs a store to decode")
            from kernel_replica.state_image import read_image  # imports torch: only for an image

            await read_image(self.store, ObjectRef.from_dict(group.image), whole, offsets, group.sizes)
        else:
            raise ValueError("group has neither inline bytes nor a pointer")
        if not group.aligned:
            _realign(whole, group.sizes, offsets)
        return group_values(group, whole, namespace)


def payload_buffer(group: EncodedGroup) -> memoryview:
    """A private, aligned, writable buffer for the group's payload (``layout``)."""
    return _aligned_writable(layout(group.sizes)[1])


def pointer_of(group: EncodedGroup, received: memoryview) -> ObjectRef:
    """The group's data store pointer, checked against the bytes its record says."""
    ref = ObjectRef.from_dict(group.pointer or {})
    if ref.size != received.nbytes:
        raise ValueError(f"stored group has {ref.size} bytes, its record says {received.nbytes}")
    return ref


def is_large(group: Mapping[str, Any]) -> bool:
    """Whether a group's payload is in the data store (a pointer or an image), not inline."""
    return group.get("pointer") is not None or group.get("image") is not None


def fill_group(
    group: EncodedGroup,
    whole: memoryview,
    get: Callable[[ObjectRef], concurrent.futures.Future[memoryview]],
    get_into: Callable[[ObjectRef, memoryview], concurrent.futures.Future[None]],
    stop: Callable[[], bool] | None = None,
) -> None:
    """Fill ``whole`` (``payload_buffer``) with a large group's payload on the calling thread, from
    the store behind ``get``/``get_into`` (``StoreLink``'s); ``group_values`` then unpickles it.
    ``stop``: an image's read gives up between pieces once it says so (``ReadInterrupted``)."""
    offsets, _ = layout(group.sizes)
    received = whole if group.aligned else whole[: sum(group.sizes)]
    if group.pointer is not None:
        get_into(pointer_of(group, received), received).result()
    elif group.image is not None:
        from kernel_replica.state_image import fill_image  # imports torch: only for an image

        fill_image(get, ObjectRef.from_dict(group.image), whole, offsets, group.sizes, stop)
    else:
        raise ValueError("group has neither a pointer nor an image")
    if not group.aligned:
        _realign(whole, group.sizes, offsets)


def group_values(group: EncodedGroup, whole: memoryview, namespace: dict[str, Any] | None) -> dict[str, Any]:
    """The names and values of a group whose (aligned) payload is in ``whole``: the unpickling,
    on the thread that owns ``namespace`` (the buffers become the values, not copied)."""
    offsets, _ = layout(group.sizes)
    parts = [whole[start : start + size] for start, size in zip(offsets, group.sizes, strict=True)]
    values = loads(parts[0], parts[1:], namespace=namespace)
    if not isinstance(values, dict):
        raise ValueError("group payload is not a namespace mapping")
    return values


async def decode_all(
    codec: ObjectCodec, groups: Iterable[EncodedGroup], namespace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every group's values, merged (groups are disjoint by construction)."""
    values: dict[str, Any] = {}
    for group in groups:
        values.update(await codec.decode(group, namespace))
    return values
