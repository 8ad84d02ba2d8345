"""The data store interface: content-addressed, checksummed, streamed, with a bounded read cache.

Kernel replicas keep large objects (models, optimizers, arrays, DataFrames) here and put only an
``ObjectRef`` in the Raft log. The address is the content's BLAKE3 hash, so writing the same bytes twice
stores them once and a reference can never point at different bytes than it was made from. Every
read is verified against the reference's checksum: a damaged object raises ``CorruptObject``,
it is never returned.

Backends implement a handful of primitives (``_write_known``, ``_write_stream``, ``_read_stream``,
``_read_into``, ``_exists``, ``_delete``); hashing, verification and caching live here once.
"""

from __future__ import annotations

import asyncio
import mmap
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, ClassVar, Self

from shared.datastore.buffers import Buffer, as_bytes_view
from shared.datastore.cache import ByteLRU
from shared.datastore.chunking import HashingStream, arechunk
from shared.datastore.errors import CorruptObject
from shared.datastore.keys import ChecksumVerifier, ContentId, content_id, is_digest

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# Hash or verify on the event loop below this size; a thread hop costs more than the work.
_INLINE_BYTES = 1024 * 1024
_HEAP_MAX_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The pointer a replica puts in the Raft log: enough to fetch and verify the object anywhere.

    ``key`` is derived from ``digest`` by the backend (and checked on use, so a tampered log cannot
    steer a read elsewhere); ``checksum`` is verified on every read.
    """

    backend: str
    key: str
    digest: str
    size: int
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack/JSON-able form for the Raft log."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ObjectRef:
        try:
            ref = cls(
                backend=str(data["backend"]),
                key=str(data["key"]),
                digest=str(data["digest"]),
                size=int(data["size"]),
                checksum=str(data["checksum"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an object reference: {data!r} ({exc})") from exc
        if not is_digest(ref.digest) or ref.size < 0:
            raise ValueError(f"not an object reference: {data!r}")
        return ref


class DataStore(ABC):
    """Async store of immutable large objects. One instance per process; safe for concurrent tasks."""

    backend: ClassVar[str]
    # Hash in-memory content before writing it, to skip the write when the object exists. Worth a
    # serial hashing pass where writes are expensive (network uploads); where they are cheap
    # (local files, Redis) hashing overlaps the write instead and duplicates are dropped at publish.
    dedup_before_write: ClassVar[bool] = True

    def __init__(
        self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.cache = ByteLRU(cache_bytes)

    # ----- public API -------------------------------------------------------------------------

    async def put(self, data: Buffer) -> ObjectRef:
        """Store one in-memory buffer (bytes, bytearray, memoryview, a numpy array's buffer)."""
        return await self.put_stream((data,))

    async def put_stream(
        self, chunks: AsyncIterable[Buffer] | Iterable[Buffer], *, size_hint: int | None = None
    ) -> ObjectRef:
        """Store the concatenation of ``chunks``; returns its reference. Idempotent per content.

        Any iterable is consumed once, chunk by chunk, into a staging area that is published
        under the content key at the end. On backends with ``dedup_before_write`` a list or tuple
        of buffers (e.g. pickle protocol-5 out-of-band buffers, which alias the live tensors) is
        hashed first instead, so existing content is not uploaded again and new content goes
        straight to its final key. ``size_hint`` lets a backend size its parts (S3 allows 10,000).
        """
        if isinstance(chunks, bytes | bytearray | memoryview):
            raise TypeError("put_stream takes an iterable of buffers; use put() for a single buffer")
        if isinstance(chunks, Sequence) and self.dedup_before_write:
            buffers = [as_bytes_view(chunk) for chunk in chunks]
            total = sum(view.nbytes for view in buffers)
            cid = (
                content_id(buffers)
                if total <= _INLINE_BYTES
                else await asyncio.to_thread(content_id, buffers)
            )
            key = self.key_for(cid.digest)
            if not await self._exists(key):
                await self._write_known(key, cid, buffers)
        elif isinstance(chunks, Sequence):
            cid = await self._write_buffers([as_bytes_view(chunk) for chunk in chunks])
        else:
            cid = await self._write_stream(HashingStream(arechunk(chunks, self.chunk_bytes)), size_hint)
        return self.ref_for(cid)

    async def get(self, ref: ObjectRef) -> memoryview:
        """The whole object as a read-only view, verified; filled in place, so held once in memory.

        The same view may be handed to other readers from the cache, hence read-only;
        ``bytes(view)`` makes a private copy.
        """
        self._check_ref(ref)
        cached = self.cache.get(ref.digest)
        if cached is not None:
            return cached
        view = _allocate(ref.size)
        await self._read_verified(ref, view)
        view = view.toreadonly()
        self.cache.put(ref.digest, view)
        return view

    async def get_into(self, ref: ObjectRef, view: memoryview) -> None:
        """Fill the caller's writable ``view`` (exactly ``ref.size`` bytes) with the object, verified.

        For a decoder that must own the memory it unpickles from (writable arrays and tensors):
        the backend reads straight into it, so the object is neither held twice nor copied from
        chunk buffers. Bytes already in the cache are copied from there; what is read here is not
        cached (the caller will mutate it). On ``CorruptObject`` the view's content is undefined.
        """
        self._check_ref(ref)
        if view.nbytes != ref.size:
            raise ValueError(f"buffer of {view.nbytes} bytes for an object of {ref.size}")
        cached = self.cache.get(ref.digest)
        if cached is not None:
            view[:] = cached
            return
        await self._read_verified(ref, view)

    async def _read_verified(self, ref: ObjectRef, view: memoryview) -> None:
        """Read the object into ``view`` and check its size and checksum (``CorruptObject``)."""
        verifier = ChecksumVerifier()
        filled = await self._read_into(ref, view, verifier)
        if filled != ref.size:
            raise CorruptObject(self.backend, ref.key, f"size {filled} bytes, expected {ref.size}")
        reason = verifier.mismatch(ref.checksum, ref.size, ref.digest)
        if reason is not None:
            raise CorruptObject(self.backend, ref.key, reason)

    async def get_stream(self, ref: ObjectRef) -> AsyncIterator[memoryview]:
        """The object chunk by chunk, for objects too large to hold whole.

        Verification completes with the last chunk: the final chunk is held back until the whole
        checksum matches, and a mismatch raises ``CorruptObject`` instead of ending the iteration.
        Consumers must treat what they received as valid only once the iteration finished.
        """
        self._check_ref(ref)
        cached = self.cache.get(ref.digest)
        if cached is not None:
            for start in range(0, max(cached.nbytes, 1), self.chunk_bytes):
                yield cached[start : start + self.chunk_bytes]
            return
        verifier = ChecksumVerifier()
        held: memoryview | None = None
        async for chunk in self._read_stream(ref):
            view = as_bytes_view(chunk)
            verifier.update(view)
            if verifier.size > ref.size:
                raise CorruptObject(self.backend, ref.key, f"more than the expected {ref.size} bytes")
            if held is not None:
                yield held
            held = view
        reason = verifier.mismatch(ref.checksum, ref.size, ref.digest)
        if reason is not None:
            raise CorruptObject(self.backend, ref.key, reason)
        yield held if held is not None else memoryview(b"")

    async def exists(self, ref: ObjectRef) -> bool:
        """Whether the backend holds the object (asks the backend; the cache may outlive a delete elsewhere)."""
        self._check_ref(ref)
        return await self._exists(ref.key)

    async def delete(self, ref: ObjectRef) -> bool:
        """Remove the object; True if it was there. Content is shared by every ref with the same
        digest, so the caller (the replica's state GC) decides when no ref needs it any more."""
        self._check_ref(ref)
        self.cache.discard(ref.digest)
        return await self._delete(ref.key)

    async def delete_digest(self, digest: str) -> bool:
        """``delete`` by content digest alone: a garbage collector that keeps digests, not refs
        (the checkpoint service's book), removes what it no longer needs."""
        if not is_digest(digest):
            raise ValueError(f"not a content digest: {digest!r}")
        self.cache.discard(digest)
        return await self._delete(self.key_for(digest))

    async def close(self) -> None:
        """Release connections; the instance is unusable afterwards."""
        self.cache.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def ref_for(self, cid: ContentId) -> ObjectRef:
        """The reference of content with this id in this store."""
        return ObjectRef(self.backend, self.key_for(cid.digest), cid.digest, cid.size, cid.checksum)

    # ----- backend primitives -----------------------------------------------------------------

    @abstractmethod
    def key_for(self, digest: str) -> str:
        """The backend key (path, S3 key, Redis manifest key) of the content with this digest."""

    @abstractmethod
    async def _exists(self, key: str) -> bool: ...

    @abstractmethod
    async def _write_known(self, key: str, cid: ContentId, buffers: list[memoryview]) -> None:
        """Write content whose id is already known, directly under ``key``."""

    @abstractmethod
    async def _write_stream(self, stream: HashingStream, size_hint: int | None) -> ContentId:
        """Consume ``stream`` once into staging, then publish it under its content key."""

    async def _write_buffers(self, buffers: list[memoryview]) -> ContentId:
        """In-memory content on a ``dedup_before_write = False`` backend: hash while writing."""
        return await self._write_stream(HashingStream(arechunk(buffers, self.chunk_bytes)), None)

    @abstractmethod
    def _read_stream(self, ref: ObjectRef) -> AsyncIterator[Buffer]:
        """The stored bytes as they are (unverified); raises ``ObjectNotFound``."""

    async def _read_into(self, ref: ObjectRef, view: memoryview, verifier: ChecksumVerifier) -> int:
        """Fill ``view`` with the stored bytes and feed them to ``verifier`` while they are hot in
        cache (no second pass, no extra thread hop); return how many bytes there were."""
        filled = 0
        async for chunk in self._read_stream(ref):
            n = len(chunk) if not isinstance(chunk, memoryview) else chunk.nbytes
            if filled + n > view.nbytes:
                raise CorruptObject(self.backend, ref.key, f"more than the expected {ref.size} bytes")
            view[filled : filled + n] = chunk
            verifier.update(chunk)
            filled += n
        return filled

    @abstractmethod
    async def _delete(self, key: str) -> bool: ...

    def _check_ref(self, ref: ObjectRef) -> None:
        if ref.backend != self.backend:
            raise ValueError(
                f"reference {ref.key!r} belongs to backend {ref.backend!r}, not {self.backend!r}"
            )
        if not is_digest(ref.digest) or ref.key != self.key_for(ref.digest):
            raise ValueError(f"reference key {ref.key!r} does not match its digest {ref.digest!r}")


def _allocate(size: int) -> memoryview:
    """A writable buffer for a whole object.

    Up to glibc's largest mmap threshold (32 MiB) a bytearray comes from the heap, whose pages are
    usually already mapped, so its zero-fill is cheap. Above it malloc maps fresh pages anyway, and
    ``bytearray(n)`` would fault all n bytes in a separate memset pass before the read touches them
    again (~40% of a page-cache read of 256 MiB); an anonymous private map is zero-filled lazily by
    the kernel, during the read itself.
    """
    if size <= _HEAP_MAX_BYTES:
        return memoryview(bytearray(size))
    return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
