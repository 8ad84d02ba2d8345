"""Turning whatever a caller streams into fixed-size chunks, and hashing them on the way.

Backends need equal chunks (S3 parts >= 5 MiB, one Redis key per chunk, few syscalls for files).
Large input buffers are sliced as views, never copied; only small pieces are coalesced. The caller
must not mutate a buffer while it is being written.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from shared.datastore.buffers import Buffer, as_bytes_view
from shared.datastore.keys import ContentHasher, ContentId

# Below this a thread hop costs more than hashing inline on the event loop.
_INLINE_HASH_BYTES = 256 * 1024


class Rechunker:
    """Pure core: feed buffers of any size, get views of exactly ``size`` bytes (the last may be short)."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        self.size = size
        self._pending = bytearray()

    def feed(self, buf: Buffer) -> Iterator[memoryview]:
        view = as_bytes_view(buf)
        size = self.size
        if self._pending:
            take = min(size - len(self._pending), view.nbytes)
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < size:
                return
            yield memoryview(self._pending)
            self._pending = bytearray()  # the yielded view keeps the full one alive
        while view.nbytes >= size:
            yield view[:size]
            view = view[size:]
        if view.nbytes:
            self._pending += view

    def flush(self) -> Iterator[memoryview]:
        if self._pending:
            yield memoryview(self._pending)
            self._pending = bytearray()


def rechunk(chunks: Iterable[Buffer], size: int) -> Iterator[memoryview]:
    rechunker = Rechunker(size)
    for chunk in chunks:
        yield from rechunker.feed(chunk)
    yield from rechunker.flush()


async def arechunk(chunks: AsyncIterable[Buffer] | Iterable[Buffer], size: int) -> AsyncIterator[memoryview]:
    """``rechunk`` for sync or async sources, so backends consume one kind of stream."""
    rechunker = Rechunker(size)
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            for piece in rechunker.feed(chunk):
                yield piece
    else:
        for chunk in chunks:
            for piece in rechunker.feed(chunk):
                yield piece
    for piece in rechunker.flush():
        yield piece


class HashingStream:
    """Yields a stream's chunks while hashing each in a worker thread, overlapping the consumer's I/O.

    Chunk ``i`` is hashed while the backend writes it; the hash of ``i`` is awaited before ``i+1``
    is handed out, so the hasher sees chunks in order and at most one chunk is in flight.
    """

    def __init__(self, chunks: AsyncIterator[memoryview]) -> None:
        self._source = chunks
        self._hasher = ContentHasher()
        self._pending: asyncio.Future[None] | None = None
        self.chunks = 0

    def __aiter__(self) -> HashingStream:
        return self

    async def __anext__(self) -> memoryview:
        await self._settle()
        chunk = await anext(self._source)
        self.chunks += 1
        if chunk.nbytes < _INLINE_HASH_BYTES:
            self._hasher.update(chunk)
        else:
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._hasher.update, chunk))
        return chunk

    async def _settle(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending

    async def result(self) -> ContentId:
        """The content id; call after the stream is exhausted."""
        await self._settle()
        return self._hasher.result()
