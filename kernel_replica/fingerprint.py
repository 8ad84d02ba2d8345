"""Cheap change fingerprints: send a name only when its value really changed.

``cell_analysis`` says which names a cell *may* have changed; comparing their fingerprints with the
ones recorded at the last replication says which *did*. Arrays and tensors hash their raw bytes with
XXH3-128 (tens of GB/s, releases the GIL) plus dtype, shape, strides and device; nothing is pickled.
Everything else is pickled with cloudpickle, with every array/tensor inside replaced by a
placeholder and hashed raw alongside, so an ``nn.Module`` or optimizer costs its small skeleton
pickle plus its tensors' bytes: this covers the state_dict and also non-tensor state a state_dict
misses (``training`` flags, hyperparameters such as ``lr``). A fingerprint is only compared within
one process history; a false "changed" costs a resend, never correctness.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import cloudpickle
import xxhash

from kernel_replica.lazy_modules import Deferred, is_ndarray, is_tensor

if TYPE_CHECKING:
    import numpy as np
    import torch
else:  # used only on an array or a tensor, which exists only once the notebook imported its library
    np = Deferred("numpy")
    torch = Deferred("torch")

_UNSENDABLE = (io.IOBase, socket.socket)
_CHUNK_BYTES = 8 * 1024 * 1024  # copy non-contiguous data through a bounded staging buffer
_CPU_CHUNK_BYTES = 1 << 62  # contiguous host memory is hashed in place, in one call
_CUDA_CHUNK_BYTES = 64 * 1024 * 1024  # device -> pinned host copies, one block at a time


def _header(h: xxhash.xxh3_128, *parts: object) -> None:
    h.update(repr(parts).encode())


def _hash_array(h: xxhash.xxh3_128, arr: np.ndarray) -> bool:
    """Add an array's metadata and bytes; False for object arrays (their bytes are pointers).
    A subclass adds its class and instance state (a MaskedArray's mask and fill value: masking
    an element changes no data byte); a structured dtype its fields (``dtype.str`` is ``|V16``
    whatever the field names)."""
    dtype = arr.dtype
    if dtype.hasobject:
        return False
    _header(h, "nd", dtype.str, arr.shape, arr.strides)
    if dtype.fields is not None or dtype.subdtype is not None or dtype.type is np.record:
        _header(h, "dtype", repr(dtype))
    _hash_array_bytes(h, arr)
    cls = type(arr)
    if cls is not np.ndarray:
        _header(h, "cls", cls.__module__, cls.__qualname__)
        state = getattr(arr, "__dict__", None)
        if state and not isinstance(arr, np.memmap):  # a memmap's map is not its value
            file = io.BytesIO()
            _SkeletonPickler(file, h).dump(state)
            h.update(file.getbuffer())
    return True


def _hash_array_bytes(h: xxhash.xxh3_128, arr: np.ndarray) -> None:
    """The array's bytes in its memory order (no copy) or, if it has none, in row blocks."""
    if arr.size == 0:
        return
    if arr.flags.c_contiguous:
        h.update(_bytes_of(arr) if arr.ndim else arr.tobytes())
    elif arr.flags.f_contiguous:
        h.update(_bytes_of(arr.T))
    elif arr.ndim > 1 and (permuted := _memory_order(arr)) is not None:
        h.update(_bytes_of(permuted))
    elif arr.ndim and arr.shape[0]:
        row = max(arr[0].nbytes, 1)
        step = max(1, _CHUNK_BYTES // row)
        for start in range(0, arr.shape[0], step):
            h.update(_bytes_of(np.ascontiguousarray(arr[start : start + step])))


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, without a copy, as uint8: the buffer protocol refuses some
    dtypes (datetime64, timedelta64), a byte view does not."""
    return arr.reshape(-1).view(np.uint8)


def _memory_order(arr: np.ndarray) -> np.ndarray | None:
    """``arr`` transposed to a C-contiguous view, if it is a permutation of one (no copy)."""
    order = sorted(range(arr.ndim), key=lambda d: (-abs(arr.strides[d]), -arr.shape[d]))
    permuted = arr.transpose(order)
    return permuted if permuted.flags.c_contiguous else None


def _hash_tensor(h: xxhash.xxh3_128, t: Any) -> bool:
    """Add a tensor's metadata and bytes; copies only what must move (CUDA -> host, in chunks)."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return False
    _header(
        h, "pt", type(t).__name__, str(t.dtype), tuple(t.shape), t.stride(), str(t.device), t.requires_grad
    )
    data = t.detach()
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    on_host = data.device.type == "cpu"
    if on_host and not data.is_contiguous():
        try:  # numpy's strided copies are ~10x faster than torch's for sliced views
            _hash_array_bytes(h, data.numpy())
            return True
        except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy lacks
            pass
    staging = None
    for block in _blocks(data, _CPU_CHUNK_BYTES if on_host else _CUDA_CHUNK_BYTES):
        if on_host:
            h.update(block.numpy().data)
            continue
        if staging is None:
            staging = torch.empty(block.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host = staging[: block.numel()]
        host.copy_(block)
        h.update(host.numpy().data)
    return True


def _blocks(t: Any, chunk: int) -> Iterator[Any]:
    """Byte views covering ``t`` in row-major order; non-contiguous tensors are made contiguous a
    block of rows at a time, so the staging copy stays near ``chunk`` bytes."""
    if t.numel() == 0:
        return
    if not t.is_contiguous() and t.dim() > 1:  # a transpose/permute: hash it in memory order
        order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
        permuted = t.permute(order)
        if permuted.is_contiguous():
            t = permuted
    if t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), chunk):
            yield flat[start : start + chunk]
        return
    row = max(t[0].numel() * t.element_size(), 1)
    step = max(1, _CHUNK_BYTES // row)
    for start in range(0, t.shape[0], step):
        yield from _blocks(t[start : start + step].contiguous(), chunk)


def _hash_leaf(h: xxhash.xxh3_128, obj: Any) -> bool:
    if is_ndarray(obj):
        return _hash_array(h, obj)
    if is_tensor(obj):
        if not _hash_tensor(h, obj):
            return False
        grad = obj.grad if obj.is_leaf else None
        if grad is not None:  # accumulated gradients are state too
            _header(h, "grad")
            return _hash_tensor(h, grad)
        return True
    return False


class _SkeletonPickler(cloudpickle.Pickler):  # type: ignore[misc]
    """Pickles everything but arrays and tensors, which it hashes directly (by first occurrence,
    so aliasing between them shows in the skeleton)."""

    def __init__(self, file: io.BytesIO, h: xxhash.xxh3_128) -> None:
        super().__init__(file, protocol=5)
        self._h = h
        self._seen: dict[int, int] = {}
        self._keep: list[Any] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _UNSENDABLE) and not isinstance(obj, io.BytesIO | io.StringIO):
            raise TypeError(f"{type(obj).__qualname__} is an open OS resource")  # not a value
        return super().reducer_override(obj)

    def persistent_id(self, obj: Any) -> int | None:
        is_array = is_ndarray(obj) and not obj.dtype.hasobject
        if not (is_array or is_tensor(obj)):
            return None
        index = self._seen.get(id(obj))
        if index is None:
            if not _hash_leaf(self._h, obj):
                return None
            index = self._seen[id(obj)] = len(self._seen)
            self._keep.append(obj)
        return index


def fingerprint(obj: Any) -> bytes | None:
    """16-byte XXH3-128 fingerprint of ``obj``'s value, or None if it cannot be fingerprinted."""
    h = xxhash.xxh3_128()
    try:
        if _hash_leaf(h, obj):
            return h.digest()
        h.reset()
        file = io.BytesIO()
        _SkeletonPickler(file, h).dump(obj)
        h.update(file.getbuffer())
        return h.digest()
    except Exception:  # whatever a __reduce__ raises: the object cannot be fingerprinted
        return None


def fingerprints(namespace: dict[str, Any], names: list[str] | set[str]) -> dict[str, bytes | None]:
    """Fingerprints of ``names`` present in ``namespace``."""
    return {name: fingerprint(namespace[name]) for name in names if name in namespace}
