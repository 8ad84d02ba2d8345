"""pytest plugin: a real redis-server and a real S3 API server (moto) on loopback, and the stores.

Both servers start once per session on free ports and are torn down at its end. Each test gets
a fresh store: its own bucket on S3, a flushed database on Redis, a temp directory locally.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.datastore import DataStore
from shared.datastore.local_backend import LocalStore
from shared.datastore.redis_backend import RedisStore
from shared.datastore.s3_backend import S3Store

REDIS_INSTALL = "apt-get update && apt-get install -y redis-server"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 10 s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_redis(workdir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(f"redis-server is not installed; CI installs it with: {REDIS_INSTALL}")
    port = free_port()
    proc = subprocess.Popen(
        [
            *(binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
            *("--dir", str(workdir), "--protected-mode", "no", "--loglevel", "warning"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_port(port, proc, "redis-server")
    return f"redis://127.0.0.1:{port}/0", proc


def start_moto() -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **S3_ENV},
    )
    _wait_for_port(port, proc, "moto S3 server", timeout_s=60.0)
    return f"http://127.0.0.1:{port}", proc


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop_process(proc)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    url, proc = start_moto()
    yield url
    stop_process(proc)


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)


async def open_store(
    backend: str, request: pytest.FixtureRequest, *, chunk_bytes: int, cache_bytes: int
) -> DataStore:
    """A fresh, empty store of ``backend`` (servers started on first use)."""
    if backend == "local":
        path = request.getfixturevalue("tmp_path") / "datastore"
        return LocalStore(path, chunk_bytes=chunk_bytes, cache_bytes=cache_bytes)
    if backend == "s3":
        request.getfixturevalue("s3_env")
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = f"t-{uuid.uuid4().hex[:20]}"
        return await S3Store.open(
            bucket, endpoint_url=endpoint, chunk_bytes=chunk_bytes, cache_bytes=cache_bytes
        )
    if backend == "redis":
        url = request.getfixturevalue("redis_url")
        store = await RedisStore.open(url, chunk_bytes=chunk_bytes, cache_bytes=cache_bytes)
        await store.client.flushdb()
        return store
    raise ValueError(backend)
