"""What the store accepts as bytes, and how it counts them without copying."""

from __future__ import annotations

from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview


def nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat byte view of any buffer (a numpy array's memoryview may have another format/shape)."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
