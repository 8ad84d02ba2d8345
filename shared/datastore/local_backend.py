"""Local directory backend, the embedded default.

Layout: ``<root>/objects/ab/cd/<blake3>`` (sharded so no directory grows huge) and ``<root>/tmp/``
for writes in progress. A write goes to a temp file in the same file system, is fsynced, then
renamed into place and the directory fsynced: a reader sees the whole object or nothing, even
across a crash. Blocking file calls run in worker threads so the event loop keeps serving Raft.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from shared.datastore.base import DEFAULT_CACHE_BYTES, DEFAULT_CHUNK_BYTES, DataStore, ObjectRef
from shared.datastore.chunking import HashingStream
from shared.datastore.errors import CorruptObject, DataStoreUnavailable, ObjectNotFound
from shared.datastore.keys import ChecksumVerifier, ContentId, object_path
from shared.private_files import open_private, private_dir

# Temp files older than this belong to a writer that died; swept when a store opens.
_STALE_TMP_S = 3600.0


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _write_views(fd: int, views: list[memoryview]) -> None:
    for view in views:
        _write_all(fd, view)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(DataStore):
    backend = "local"
    dedup_before_write = False

    def __init__(
        self,
        root: str | Path,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        fsync: bool = True,
    ) -> None:
        super().__init__(chunk_bytes=chunk_bytes, cache_bytes=cache_bytes)
        self.root = Path(root).expanduser()
        self.fsync = fsync
        try:
            private_dir(self.root / "objects")  # the notebooks' large variables: 0700/0600
            private_dir(self.root / "tmp")
        except OSError as exc:
            raise DataStoreUnavailable(f"datastore local: cannot use directory {self.root}: {exc}") from exc
        self._sweep_tmp()

    def key_for(self, digest: str) -> str:
        return f"objects/{object_path(digest)}"

    def path_of(self, key: str) -> Path:
        """The file holding ``key`` (for tests and operators)."""
        return self.root / key

    # ----- writes -----------------------------------------------------------------------------

    def _open_tmp(self) -> tuple[Path, int]:
        path = self.root / "tmp" / f"{uuid.uuid4().hex}.part"
        return path, open_private(path, os.O_WRONLY | os.O_EXCL)

    def _publish(self, fd: int, tmp: Path, key: str) -> None:
        """fsync, then rename into place; if the content is already there, drop the duplicate."""
        try:
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        final = self.path_of(key)
        if final.exists():
            tmp.unlink(missing_ok=True)
            return
        private_dir(final.parent)
        os.replace(tmp, final)
        if self.fsync:
            _fsync_dir(final.parent)

    def _write_whole(self, key: str, buffers: list[memoryview]) -> None:
        tmp, fd = self._open_tmp()
        try:
            _write_views(fd, buffers)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        self._publish(fd, tmp, key)

    async def _write_known(self, key: str, cid: ContentId, buffers: list[memoryview]) -> None:
        # The bytes are already in memory: one thread hop writes them all (no per-chunk overhead).
        await asyncio.to_thread(self._write_whole, key, buffers)

    async def _write_stream(self, stream: HashingStream, size_hint: int | None) -> ContentId:
        tmp, fd = await asyncio.to_thread(self._open_tmp)
        try:
            async for chunk in stream:
                await asyncio.to_thread(_write_all, fd, chunk)
            cid = await stream.result()
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        await asyncio.to_thread(self._publish, fd, tmp, self.key_for(cid.digest))
        return cid

    # ----- reads ------------------------------------------------------------------------------

    def _open_for_read(self, ref: ObjectRef) -> int:
        try:
            return os.open(self.path_of(ref.key), os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(self.backend, ref.key) from None

    def _read_whole(self, ref: ObjectRef, view: memoryview, verifier: ChecksumVerifier) -> int:
        fd = self._open_for_read(ref)
        try:
            stored = os.fstat(fd).st_size
            if stored != view.nbytes:
                raise CorruptObject(self.backend, ref.key, f"size {stored} bytes, expected {view.nbytes}")
            filled = 0
            while filled < view.nbytes:
                # a chunk at a time: the verifier hashes one while the next is read
                n = os.readv(fd, [view[filled : filled + self.chunk_bytes]])
                if n == 0:
                    break
                verifier.update(view[filled : filled + n])
                filled += n
            return filled
        finally:
            os.close(fd)

    async def _read_into(self, ref: ObjectRef, view: memoryview, verifier: ChecksumVerifier) -> int:
        return await asyncio.to_thread(self._read_whole, ref, view, verifier)

    async def _read_stream(self, ref: ObjectRef) -> AsyncIterator[bytes]:
        fd = await asyncio.to_thread(self._open_for_read, ref)
        try:
            while chunk := await asyncio.to_thread(os.read, fd, self.chunk_bytes):
                yield chunk
        finally:
            os.close(fd)

    # ----- the rest ---------------------------------------------------------------------------

    async def _exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    async def _delete(self, key: str) -> bool:
        # off the loop like every other file operation here: unlinking a large object takes
        # milliseconds, and a garbage collector deletes many in a row
        return await asyncio.to_thread(self._unlink, key)

    def _unlink(self, key: str) -> bool:
        try:
            self.path_of(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def _sweep_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        for entry in (self.root / "tmp").iterdir():
            try:
                if entry.stat().st_mtime < cutoff:
                    entry.unlink()
            except OSError:
                pass
