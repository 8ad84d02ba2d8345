"""Rechunking: exact chunk sizes, no lost or duplicated bytes, large inputs sliced without copies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.datastore.chunking import HashingStream, Rechunker, arechunk, rechunk
from shared.datastore.keys import content_id


@given(
    pieces=st.lists(st.binary(max_size=50), max_size=30),
    size=st.integers(1, 40),
)
def test_rechunk_preserves_bytes_and_sizes(pieces: list[bytes], size: int) -> None:
    chunks = list(rechunk(pieces, size))
    assert b"".join(bytes(c) for c in chunks) == b"".join(pieces)
    assert all(c.nbytes == size for c in chunks[:-1])
    assert all(0 < c.nbytes <= size for c in chunks)


def test_large_input_is_sliced_not_copied() -> None:
    data = bytes(range(256)) * 40
    chunks = list(rechunk([data], 1000))
    assert all(c.obj is data for c in chunks[:-1])  # views into the caller's buffer
    assert chunks[-1].nbytes == 240  # only the short tail is coalesced


def test_yielded_chunks_are_not_reused() -> None:
    chunks = list(rechunk([b"ab", b"cd", b"ef", b"gh"], 3))
    assert [bytes(c) for c in chunks] == [b"abc", b"def", b"gh"]


def test_non_byte_buffers_are_flattened() -> None:
    import numpy as np

    array = np.arange(10, dtype=np.float64).reshape(2, 5)
    chunks = list(rechunk([memoryview(array.data)], 16))
    assert b"".join(bytes(c) for c in chunks) == array.tobytes()


def test_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError):
        Rechunker(0)


def test_async_rechunk_and_hashing_stream() -> None:
    pieces = [bytes([i]) * (300_000 + i) for i in range(7)]

    async def source() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async def main() -> None:
        for src in (source(), pieces):
            stream = HashingStream(arechunk(src, 1 << 20))
            out = b"".join([bytes(c) async for c in stream])
            assert out == b"".join(pieces)
            assert await stream.result() == content_id(pieces)
            assert stream.chunks == 3

    asyncio.run(main())
