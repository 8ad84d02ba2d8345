"""Redis backend (redis-py asyncio), for small clusters that already run Redis.

A Redis value is capped at 512 MB and a multi-megabyte command stalls every other client of the
single-threaded server, so an object is split into ``chunk_bytes`` values plus a manifest:

    <prefix>obj:<blake3>          JSON {"v", "size", "checksum", "chunks"}   (written last)
    <prefix>chunk:<blake3>:<i>    the i-th chunk

The manifest is written after all chunks, so a visible manifest means a complete object. One-shot
streams go to ``<prefix>staging:<uuid>:<i>`` keys with a TTL (a dead writer leaves nothing behind
for long) and are renamed into place in one MULTI transaction with the manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.datastore.base import DEFAULT_CACHE_BYTES, DEFAULT_CHUNK_BYTES, DataStore, ObjectRef
from shared.datastore.chunking import HashingStream, rechunk
from shared.datastore.errors import CorruptObject, DataStoreUnavailable, ObjectNotFound
from shared.datastore.keys import ContentId

STAGING_TTL_S = 3600
# Chunks per pipeline round trip on write, and chunks fetched ahead on read: enough to keep the
# socket busy, few enough to bound memory to a handful of chunks.
_WINDOW = 4


class RedisStore(DataStore):
    backend = "redis"
    dedup_before_write = False

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "tandem:",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """Use ``open()``; this takes an already connected client."""
        super().__init__(chunk_bytes=chunk_bytes, cache_bytes=cache_bytes)
        self.client = client
        self.prefix = prefix

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        prefix: str = "tandem:",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        connect_timeout_s: float = 5.0,
    ) -> RedisStore:
        """Connect and PING, or raise ``DataStoreUnavailable`` naming the URL."""
        try:
            client = aioredis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s)
        except ValueError as exc:
            raise DataStoreUnavailable(f"datastore redis: bad url {url!r}: {exc}") from exc
        try:
            await client.ping()  # type: ignore[misc]  # redis-py types its sync and async clients alike
        except (RedisError, OSError) as exc:
            await client.aclose()
            raise DataStoreUnavailable(f"datastore redis: {url} unreachable: {exc}") from exc
        return cls(client, prefix=prefix, chunk_bytes=chunk_bytes, cache_bytes=cache_bytes)

    async def close(self) -> None:
        await super().close()
        await self.client.aclose()

    def key_for(self, digest: str) -> str:
        return f"{self.prefix}obj:{digest}"

    def chunk_key(self, digest: str, index: int) -> str:
        return f"{self.prefix}chunk:{digest}:{index}"

    # ----- writes -----------------------------------------------------------------------------

    def _manifest(self, cid: ContentId, chunks: int) -> bytes:
        return json.dumps({"v": 1, "size": cid.size, "checksum": cid.checksum, "chunks": chunks}).encode()

    async def _set_chunks(self, names: Iterable[str], chunks: Iterable[memoryview], ttl: int | None) -> int:
        """SET chunks pipelined, ``_WINDOW`` per round trip; returns how many."""
        count = 0
        pipe = self.client.pipeline(transaction=False)
        for name, chunk in zip(names, chunks, strict=False):
            pipe.set(name, chunk, ex=ttl)
            count += 1
            if count % _WINDOW == 0:
                await pipe.execute()
        if len(pipe):
            await pipe.execute()
        return count

    async def _write_known(self, key: str, cid: ContentId, buffers: list[memoryview]) -> None:
        digest = cid.digest
        count = await self._set_chunks(
            (self.chunk_key(digest, i) for i in itertools.count()), rechunk(buffers, self.chunk_bytes), None
        )
        await self.client.set(key, self._manifest(cid, count))

    async def _write_stream(self, stream: HashingStream, size_hint: int | None) -> ContentId:
        token = uuid.uuid4().hex
        staged: list[str] = []
        # Up to _WINDOW SETs in flight, so sending chunk i overlaps hashing chunk i+1.
        slots = asyncio.Semaphore(_WINDOW)
        sends: list[asyncio.Task[Any]] = []

        async def send(name: str, chunk: memoryview) -> None:
            try:
                await self.client.set(name, chunk, ex=STAGING_TTL_S)
            finally:
                slots.release()

        try:
            async for chunk in stream:
                await slots.acquire()
                for task in sends:
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                name = f"{self.prefix}staging:{token}:{len(staged)}"
                staged.append(name)
                sends.append(asyncio.create_task(send(name, chunk)))
            await asyncio.gather(*sends)
            cid = await stream.result()
            key = self.key_for(cid.digest)
            if await self.client.exists(key):
                raise _AlreadyStored
            tx = self.client.pipeline(transaction=True)
            for i, name in enumerate(staged):
                target = self.chunk_key(cid.digest, i)
                tx.rename(name, target)
                tx.persist(target)
            tx.set(key, self._manifest(cid, len(staged)))
            await tx.execute()
            return cid
        except _AlreadyStored:
            if staged:
                await self.client.delete(*staged)
            return await stream.result()
        except BaseException:
            for task in sends:
                task.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            if staged:
                await asyncio.shield(self._forget(staged))
            raise

    async def _forget(self, names: list[str]) -> None:
        with contextlib.suppress(RedisError, OSError):  # else the TTL removes them
            await self.client.delete(*names)

    # ----- reads ------------------------------------------------------------------------------

    async def _load_manifest(self, ref: ObjectRef) -> int:
        raw = await self.client.get(ref.key)
        if raw is None:
            raise ObjectNotFound(self.backend, ref.key)
        try:
            manifest: dict[str, Any] = json.loads(raw)
            size, checksum, chunks = int(manifest["size"]), str(manifest["checksum"]), int(manifest["chunks"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptObject(self.backend, ref.key, f"unreadable manifest: {exc}") from None
        if size != ref.size or checksum != ref.checksum:
            raise CorruptObject(self.backend, ref.key, "manifest disagrees with the reference")
        return chunks

    async def _read_stream(self, ref: ObjectRef) -> AsyncIterator[bytes]:
        chunks = await self._load_manifest(ref)
        windows = [
            [self.chunk_key(ref.digest, i) for i in range(start, min(start + _WINDOW, chunks))]
            for start in range(0, chunks, _WINDOW)
        ]
        # One pipelined round trip per window; the next window is in flight while this one is used.
        ahead: asyncio.Future[list[Any]] | None = self._fetch(windows[0]) if windows else None
        try:
            for w, names in enumerate(windows):
                assert ahead is not None
                values = await ahead
                ahead = self._fetch(windows[w + 1]) if w + 1 < len(windows) else None
                for offset, value in enumerate(values):
                    if value is None:
                        index = w * _WINDOW + offset
                        raise CorruptObject(self.backend, ref.key, f"chunk {index} of {chunks} is missing")
                    yield value
                del values, names
        finally:
            if ahead is not None and not ahead.done():
                ahead.cancel()

    def _fetch(self, names: list[str]) -> asyncio.Future[list[Any]]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return asyncio.ensure_future(pipe.execute())

    # ----- the rest ---------------------------------------------------------------------------

    async def _exists(self, key: str) -> bool:
        return bool(await self.client.exists(key))

    async def _delete(self, key: str) -> bool:
        raw = await self.client.get(key)
        if raw is None:
            return False
        digest = key.removeprefix(f"{self.prefix}obj:")
        try:
            names = [self.chunk_key(digest, i) for i in range(int(json.loads(raw)["chunks"]))]
        except (ValueError, KeyError, TypeError):  # damaged manifest: find the chunks by name
            names = [
                k.decode() async for k in self.client.scan_iter(match=self.chunk_key(digest, 0)[:-1] + "*")
            ]
        # Manifest first: from then on the object is absent, never half there.
        await self.client.delete(key)
        for start in range(0, len(names), 1000):
            await self.client.delete(*names[start : start + 1000])
        return True


class _AlreadyStored(Exception):
    """Control flow: the content was published by an earlier or concurrent writer."""
