"""Throughput of Tandem's data store against the raw backend underneath it, side by side.

For each backend (local directory, S3 via a moto server, Redis) and each object size, alternates
"raw" and "store" runs on the same fresh content, ``--repeat`` times:

- raw local: write + fsync of the whole buffer / read of the whole file
- raw s3:    one put_object / get_object + read (the same aiobotocore client settings)
- raw redis: SET / GET of the same 8 MiB chunks, 4 per pipelined round trip
- store:     ``put(buffer)`` / ``get(ref)`` (hash, dedup check, multipart/chunking, atomic
             publish, checksum verification; read cache disabled); also ``put_stream`` of a
             one-shot generator (``<B>_stream_write_*``, informational: staging + publish)

Prints one JSON line: ``<B>_write_ratio``, ``<B>_read_ratio`` (store / raw throughput: the
median over back-to-back raw/store pairs, which see the same machine load; ``*_ratio_of_best``
compares the best runs instead), ``<B>_write_mb_s``, ``<B>_read_mb_s`` (the store's best), plus
the raw figures. Servers are started on loopback unless ``--redis-url`` / ``--s3-endpoint`` point
at running ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from shared.datastore import DataStore, ObjectRef
from shared.datastore.local_backend import LocalStore
from shared.datastore.redis_backend import RedisStore
from shared.datastore.s3_backend import S3Store

MB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(argv: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{argv[0]} did not listen on {port}")


async def _timed(op: Awaitable[Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await op
    return time.perf_counter() - start, result


async def _stream(data: bytearray, chunk: int) -> AsyncIterator[memoryview]:
    """A one-shot producer, as a pickler streaming a large object would be."""
    view = memoryview(data)
    for start in range(0, len(data), chunk):
        yield view[start : start + chunk]


class Raw:
    """The raw backend operations a careful caller would write by hand."""

    async def write(self, name: str, data: bytearray) -> None:
        raise NotImplementedError

    async def read(self, name: str) -> Any:
        raise NotImplementedError

    async def remove(self, name: str) -> None:
        raise NotImplementedError


class RawLocal(Raw):
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, data: bytearray) -> None:
        with open(self.root / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    async def write(self, name: str, data: bytearray) -> None:
        await asyncio.to_thread(self._write, name, data)

    async def read(self, name: str) -> bytes:
        return await asyncio.to_thread((self.root / name).read_bytes)

    async def remove(self, name: str) -> None:
        (self.root / name).unlink()


class RawS3(Raw):
    def __init__(self, store: S3Store) -> None:
        self.client, self.bucket = store.client, store.bucket

    async def write(self, name: str, data: bytearray) -> None:
        await self.client.put_object(Bucket=self.bucket, Key=f"raw/{name}", Body=data)

    async def read(self, name: str) -> bytes:
        reply = await self.client.get_object(Bucket=self.bucket, Key=f"raw/{name}")
        async with reply["Body"] as body:
            return bytes(await body.read())

    async def remove(self, name: str) -> None:
        await self.client.delete_object(Bucket=self.bucket, Key=f"raw/{name}")


class RawRedis(Raw):
    def __init__(self, store: RedisStore, window: int = 4) -> None:
        self.client, self.chunk, self.window = store.client, store.chunk_bytes, window
        self.counts: dict[str, int] = {}

    async def write(self, name: str, data: bytearray) -> None:
        view = memoryview(data)
        pipe = self.client.pipeline(transaction=False)
        n = 0
        for start in range(0, len(data), self.chunk):
            pipe.set(f"raw:{name}:{n}", view[start : start + self.chunk])
            n += 1
            if n % self.window == 0:
                await pipe.execute()
        if len(pipe):
            await pipe.execute()
        self.counts[name] = n

    async def read(self, name: str) -> bytes:
        parts: list[bytes] = []
        n = self.counts[name]
        for start in range(0, n, self.window):
            pipe = self.client.pipeline(transaction=False)
            for i in range(start, min(start + self.window, n)):
                pipe.get(f"raw:{name}:{i}")
            parts += await pipe.execute()
        return b"".join(parts)

    async def remove(self, name: str) -> None:
        await self.client.delete(*(f"raw:{name}:{i}" for i in range(self.counts.pop(name))))


async def bench_backend(store: DataStore, raw: Raw, sizes: list[int], repeat: int) -> dict[str, float]:
    best: dict[str, dict[int, float]] = {k: {} for k in ("raw_w", "raw_r", "st_w", "st_r", "st_s")}
    paired: dict[str, list[float]] = {"w": [], "r": []}
    counter = 0
    for size in sizes:
        data = bytearray(os.urandom(size))
        for _ in range(repeat):
            times: dict[str, float] = {}
            for order in ("raw", "store") if counter % 2 == 0 else ("store", "raw"):
                counter += 1
                data[:8] = counter.to_bytes(8, "little")  # new content: no dedup between runs
                # Start every run with no dirty pages, or one side pays for the other's writeback.
                await asyncio.to_thread(os.sync)
                if order == "raw":
                    name = uuid.uuid4().hex
                    tw, _ = await _timed(raw.write(name, data))
                    tr, out = await _timed(raw.read(name))
                    assert len(out) == size
                    del out
                    await raw.remove(name)
                    keys = ("raw_w", "raw_r")
                else:
                    tw, ref = await _timed(store.put(data))
                    assert isinstance(ref, ObjectRef)
                    tr, out = await _timed(store.get(ref))
                    assert out.nbytes == size
                    del out
                    await store.delete(ref)
                    keys = ("st_w", "st_r")
                for key, t in zip(keys, (tw, tr), strict=True):
                    best[key][size] = min(best[key].get(size, float("inf")), t)
                    times[key] = t
            # Back-to-back runs see the same machine load: their ratio cancels most of the noise.
            paired["w"].append(times["raw_w"] / times["st_w"])
            paired["r"].append(times["raw_r"] / times["st_r"])
        # The one-shot stream path (staging + publish; on S3 a server-side copy), in its own pass
        # so its extra server work does not disturb the paired runs above.
        for _ in range(repeat):
            counter += 1
            data[:8] = counter.to_bytes(8, "little")
            await asyncio.to_thread(os.sync)
            ts, ref = await _timed(store.put_stream(_stream(data, store.chunk_bytes)))
            await store.delete(ref)
            best["st_s"][size] = min(best["st_s"].get(size, float("inf")), ts)
    total = sum(sizes) / MB

    def mb_s(key: str) -> float:
        return total / sum(best[key].values())

    return {
        "write_ratio": statistics.median(paired["w"]),
        "read_ratio": statistics.median(paired["r"]),
        "write_ratio_of_best": mb_s("st_w") / mb_s("raw_w"),
        "read_ratio_of_best": mb_s("st_r") / mb_s("raw_r"),
        "write_mb_s": mb_s("st_w"),
        "read_mb_s": mb_s("st_r"),
        "raw_write_mb_s": mb_s("raw_w"),
        "stream_write_ratio": mb_s("st_s") / mb_s("raw_w"),
        "stream_write_mb_s": mb_s("st_s"),
        "raw_read_mb_s": mb_s("raw_r"),
    }


async def main_async(args: argparse.Namespace, stack: ExitStack) -> dict[str, Any]:
    sizes = [int(s) * MB for s in args.sizes.split(",")]
    opts = {"chunk_bytes": args.chunk_mb * MB, "cache_bytes": 0}
    result: dict[str, Any] = {
        "sizes_mb": [s // MB for s in sizes],
        "repeat": args.repeat,
        "chunk_mb": args.chunk_mb,
    }
    for backend in args.backends.split(","):
        if backend == "local":
            tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-", dir=args.dir))
            stack.callback(shutil.rmtree, tmp, True)
            store: DataStore = LocalStore(tmp / "store", **opts)
            raw: Raw = RawLocal(tmp / "raw")
        elif backend == "s3":
            endpoint = args.s3_endpoint
            if not endpoint:
                port = _free_port()
                env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
                proc = _serve(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, env
                )
                stack.callback(proc.kill)
                endpoint = f"http://127.0.0.1:{port}"
                os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
                os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            s3 = await S3Store.open(f"bench-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, **opts)
            store, raw = s3, RawS3(s3)
        elif backend == "redis":
            url = args.redis_url
            if not url:
                binary = shutil.which("redis-server")
                if binary is None:
                    raise SystemExit("redis-server not installed (apt-get install -y redis-server)")
                port = _free_port()
                proc = _serve([binary, "--port", str(port), "--save", "", "--appendonly", "no"], port)
                stack.callback(proc.kill)
                url = f"redis://127.0.0.1:{port}/0"
            rs = await RedisStore.open(url, **opts)
            store, raw = rs, RawRedis(rs)
        else:
            raise SystemExit(f"unknown backend {backend!r}")
        async with store:
            figures = await bench_backend(store, raw, sizes, args.repeat)
        for key, value in figures.items():
            result[f"{backend}_{key}"] = round(value, 3 if "ratio" in key else 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="local,s3,redis")
    parser.add_argument("--sizes", default="64,256", help="object sizes in MiB, comma separated")
    parser.add_argument("--repeat", type=int, default=5, help="runs per size and side; the best counts")
    parser.add_argument("--chunk-mb", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where the local backend writes (default: $TMPDIR)")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--s3-endpoint", default="")
    args = parser.parse_args()
    with ExitStack() as stack:
        print(json.dumps(asyncio.run(main_async(args, stack))))


if __name__ == "__main__":
    main()
