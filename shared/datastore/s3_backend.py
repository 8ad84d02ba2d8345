"""S3 backend (aiobotocore), for clusters whose nodes share no disk.

Layout in the bucket: ``objects/ab/cd/<blake3>``, the read checksum in the object's metadata, and
``staging/<uuid>`` for one-shot streams whose address is only known at their end. Objects larger
than one chunk go up as multipart uploads, several parts in flight, so nothing is held whole.
Content that is already in memory is hashed first: existing objects are not uploaded again and new
ones go straight to their final key. One-shot streams are staged and then copied server side
(no bytes pass through this node twice). Credentials come from the standard AWS chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles, instance roles).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from shared.datastore.base import DEFAULT_CACHE_BYTES, DEFAULT_CHUNK_BYTES, DataStore, ObjectRef
from shared.datastore.chunking import HashingStream, rechunk
from shared.datastore.errors import DataStoreUnavailable, ObjectNotFound
from shared.datastore.keys import CHECKSUM_ALGORITHM, ChecksumVerifier, ContentId, object_path

MIN_PART_BYTES = 5 * 1024 * 1024  # S3's minimum for every part but the last
MAX_PARTS = 10_000
MAX_COPY_BYTES = 5 * 1024**3
# Content already whole in memory goes up in one PUT below this: no part is copied and there is
# no multipart assembly (which costs moto ~1.4 s per 256 MiB); larger objects use parallel parts.
DEFAULT_SINGLE_PUT_BYTES = 1024**3  # CopyObject's limit; larger objects are copied part by part
_META = CHECKSUM_ALGORITHM  # x-amz-meta-xxh3-128: the read checksum, for operators and audits


def _missing(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


class S3Store(DataStore):
    backend = "s3"

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        concurrency: int = 4,
        single_put_bytes: int = DEFAULT_SINGLE_PUT_BYTES,
        exit_stack: AsyncExitStack | None = None,
    ) -> None:
        """Use ``open()``; this takes an already created aiobotocore S3 client."""
        super().__init__(chunk_bytes=max(chunk_bytes, MIN_PART_BYTES), cache_bytes=cache_bytes)
        self.client = client
        self.bucket = bucket
        self.concurrency = concurrency
        self.single_put_bytes = single_put_bytes
        self._stack = exit_stack

    @classmethod
    async def open(
        cls,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        concurrency: int = 4,
        single_put_bytes: int = DEFAULT_SINGLE_PUT_BYTES,
        create_bucket: bool = True,
    ) -> S3Store:
        """Connect, check the bucket (creating it when allowed), or raise ``DataStoreUnavailable``."""
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = AioConfig(
            # Our own checksums cover integrity end to end; botocore's per-request CRCs would be a
            # second full pass over every byte.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=max(10, 2 * concurrency),
            connect_timeout=5,
            retries={"max_attempts": 3, "mode": "standard"},
        )
        stack = AsyncExitStack()
        where = endpoint_url or f"AWS S3 ({region})"
        try:
            client = await stack.enter_async_context(
                get_session().create_client(
                    "s3", endpoint_url=endpoint_url or None, region_name=region, config=config
                )
            )
            await cls._ensure_bucket(client, bucket, region, create_bucket, where)
        except DataStoreUnavailable:
            await stack.aclose()
            raise
        except NoCredentialsError as exc:
            await stack.aclose()
            raise DataStoreUnavailable(
                f"datastore s3: no AWS credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from exc
        except (BotoCoreError, ClientError, OSError) as exc:
            await stack.aclose()
            raise DataStoreUnavailable(f"datastore s3: {where} unreachable: {exc}") from exc
        return cls(
            client,
            bucket,
            chunk_bytes=chunk_bytes,
            cache_bytes=cache_bytes,
            concurrency=concurrency,
            exit_stack=stack,
        )

    @staticmethod
    async def _ensure_bucket(client: Any, bucket: str, region: str, create: bool, where: str) -> None:
        try:
            await client.head_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            if not _missing(exc):
                raise DataStoreUnavailable(f"datastore s3: bucket {bucket!r} at {where}: {exc}") from exc
            if not create:
                raise DataStoreUnavailable(
                    f"datastore s3: bucket {bucket!r} does not exist at {where}"
                ) from exc
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            await client.create_bucket(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise DataStoreUnavailable(
                    f"datastore s3: cannot create bucket {bucket!r} at {where}: {exc}"
                ) from exc

    async def close(self) -> None:
        await super().close()
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    def key_for(self, digest: str) -> str:
        return f"objects/{object_path(digest)}"

    # ----- writes -----------------------------------------------------------------------------

    async def _write_known(self, key: str, cid: ContentId, buffers: list[memoryview]) -> None:
        metadata = {_META: cid.checksum}
        if cid.size <= self.single_put_bytes:
            # One request: no part is copied and there is no multipart assembly. The body is the
            # caller's own buffer when it is one bytes/bytearray, else a reader over its buffers
            # (a pickle and its out-of-band arrays), so nothing is joined into a second copy.
            whole = _whole_buffer(buffers, cid.size)
            body: Any = whole if whole is not None else BuffersReader(buffers)
            await self.client.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentLength=cid.size, Metadata=metadata
            )
            return
        await self._multipart(key, _aiter(rechunk(buffers, self._part_bytes(cid.size))), metadata)

    async def _write_stream(self, stream: HashingStream, size_hint: int | None) -> ContentId:
        first = await anext(stream, None)
        second = await anext(stream, None) if first is not None else None
        if second is None:  # one chunk: its address is known before anything is sent
            cid = await stream.result()
            key = self.key_for(cid.digest)
            if not await self._exists(key):
                await self._write_known(key, cid, [first] if first is not None else [])
            return cid
        staging = f"staging/{uuid.uuid4().hex}"
        chunks = _prepend((first, second), stream) if first is not None else stream
        await self._multipart(staging, chunks, {})
        try:
            cid = await stream.result()
            key = self.key_for(cid.digest)
            if not await self._exists(key):
                await self._copy(staging, key, cid)
        finally:
            with contextlib.suppress(ClientError, BotoCoreError):
                await self.client.delete_object(Bucket=self.bucket, Key=staging)
        return cid

    def _part_bytes(self, size: int | None) -> int:
        part = self.chunk_bytes
        if size is not None and size > part * MAX_PARTS:
            part = -(-size // MAX_PARTS)
        return part

    async def _multipart(self, key: str, chunks: AsyncIterator[memoryview], metadata: dict[str, str]) -> None:
        """Upload ``chunks`` as parts, ``concurrency`` in flight; aborts the upload on any failure."""
        upload = await self.client.create_multipart_upload(Bucket=self.bucket, Key=key, Metadata=metadata)
        upload_id = upload["UploadId"]
        slots = asyncio.Semaphore(self.concurrency)
        tasks: list[asyncio.Task[dict[str, Any]]] = []

        async def send(number: int, body: bytes) -> dict[str, Any]:
            try:
                reply = await self.client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                )
                return {"PartNumber": number, "ETag": reply["ETag"]}
            finally:
                slots.release()

        try:
            number = 0
            async for chunk in chunks:
                await slots.acquire()
                for task in tasks:  # fail fast instead of streaming the rest for nothing
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                number += 1
                # botocore takes bytes, not views: one part is copied, bounded by `concurrency`.
                tasks.append(asyncio.create_task(send(number, bytes(chunk))))
            parts = await asyncio.gather(*tasks)
            await self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(ClientError, BotoCoreError):
                await self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    async def _copy(self, source: str, key: str, cid: ContentId) -> None:
        """Server-side copy with the final metadata; part by part above CopyObject's 5 GiB limit."""
        metadata = {_META: cid.checksum}
        src = {"Bucket": self.bucket, "Key": source}
        if cid.size <= MAX_COPY_BYTES:
            await self.client.copy_object(
                Bucket=self.bucket, Key=key, CopySource=src, Metadata=metadata, MetadataDirective="REPLACE"
            )
            return
        upload = await self.client.create_multipart_upload(Bucket=self.bucket, Key=key, Metadata=metadata)
        upload_id = upload["UploadId"]
        part = max(1024**3, -(-cid.size // MAX_PARTS))
        try:
            parts = []
            for number, start in enumerate(range(0, cid.size, part), start=1):
                end = min(start + part, cid.size) - 1
                reply = await self.client.upload_part_copy(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=src,
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]})
            await self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(ClientError, BotoCoreError):
                await self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    # ----- reads ------------------------------------------------------------------------------

    async def _get_body(self, ref: ObjectRef) -> Any:
        try:
            reply = await self.client.get_object(Bucket=self.bucket, Key=ref.key)
        except ClientError as exc:
            if _missing(exc):
                raise ObjectNotFound(self.backend, ref.key) from None
            raise
        return reply["Body"]

    async def _read_stream(self, ref: ObjectRef) -> AsyncIterator[bytes]:
        async with await self._get_body(ref) as body:
            async for chunk in body.iter_chunks(self.chunk_bytes):
                yield chunk

    async def _read_into(self, ref: ObjectRef, view: memoryview, verifier: ChecksumVerifier) -> int:
        filled = 0
        async with await self._get_body(ref) as body:
            while filled < view.nbytes:
                n = await body.readinto(view[filled:])
                if n == 0:
                    return filled
                verifier.update(view[filled : filled + n])
                filled += n
            if await body.read(1):  # longer than the reference says
                return filled + 1
        return filled

    # ----- the rest ---------------------------------------------------------------------------

    async def _exists(self, key: str) -> bool:
        try:
            await self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _missing(exc):
                return False
            raise
        return True

    async def _delete(self, key: str) -> bool:
        existed = await self._exists(key)
        await self.client.delete_object(Bucket=self.bucket, Key=key)
        return existed


class BuffersReader(io.RawIOBase):
    """A seekable read-only file over a list of buffers, without joining them: botocore sends a
    file body in blocks (and seeks back to resend it on a retry)."""

    def __init__(self, buffers: list[memoryview]) -> None:
        super().__init__()
        self._buffers = [b for b in buffers if b.nbytes]
        self._starts: list[int] = []
        total = 0
        for buffer in self._buffers:
            self._starts.append(total)
            total += buffer.nbytes
        self._size = total
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + offset, 0), self._size)
        return self._pos

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")
        written = 0
        index = bisect.bisect_right(self._starts, self._pos) - 1
        while written < out.nbytes and self._pos < self._size:
            buffer = self._buffers[index]
            offset = self._pos - self._starts[index]
            n = min(buffer.nbytes - offset, out.nbytes - written)
            out[written : written + n] = buffer[offset : offset + n]
            written += n
            self._pos += n
            index += 1
        return written


def _whole_buffer(buffers: list[memoryview], size: int) -> bytes | bytearray | None:
    """The caller's object itself when the content is exactly one bytes/bytearray (no copy)."""
    if len(buffers) == 1 and isinstance(buffers[0].obj, bytes | bytearray) and len(buffers[0].obj) == size:
        return buffers[0].obj
    return None


async def _aiter(chunks: Any) -> AsyncIterator[memoryview]:
    for chunk in chunks:
        yield chunk


async def _prepend(
    head: tuple[memoryview, ...], rest: AsyncIterator[memoryview]
) -> AsyncIterator[memoryview]:
    for chunk in head:
        yield chunk
    async for chunk in rest:
        yield chunk
