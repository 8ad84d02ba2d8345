"""Byte geometry of tracked tensors: pieces, fingerprints, and storage extents for view-aware CoW.

A tensor is identified for copy-on-write by the *untyped storage* it lives in and the byte range
it spans there, not by the Python object: ``p.data``, ``p.view(-1)[3:]`` and an optimizer's
flattened buffers are other objects over the same memory, and a write through any of them must
be seen as a write to the tracked tensor.
"""

from __future__ import annotations

import torch
import xxhash

from shared.datastore.buffers import Buffer


def piece_ranges(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges tiling ``nbytes``; one empty range for an empty tensor."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    if nbytes == 0:
        return [(0, 0)]
    return [(start, min(start + piece_bytes, nbytes)) for start in range(0, nbytes, piece_bytes)]


def fingerprint(data: Buffer) -> str:
    """XXH3-128 of the bytes: ~30 GB/s, so validation costs little. It holds the GIL while it
    hashes (``capture.ShortSwitch`` keeps a copier from starving the training thread of it).

    Not a content address (a job could craft collisions against itself only); store addresses
    stay BLAKE3, computed by the data store.
    """
    return xxhash.xxh3_128_hexdigest(data)


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of the tensor's untyped storage, or None for tensors without one (sparse, meta)."""
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` bytes of its storage that the tensor can touch (exact for contiguous ones,
    a covering range for strided views; negative strides do not occur in torch)."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return start, start
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    return start, start + span * size


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor over the same memory (contiguous tensors only)."""
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors are tracked")
    return tensor.detach().reshape(-1).view(torch.uint8)
