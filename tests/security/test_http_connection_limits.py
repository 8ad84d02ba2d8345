"""What a peer without the token can make the HTTP API hold.

- Memory: the API read a request's whole body before its token check, and tornado buffers up to
  100 MB per connection by default, so six connections without a token made the API process
  grow by 340 MB (a few dozen would exhaust the machine's memory). A body over 1 MiB is now
  refused from its ``Content-Length``, before a byte of it is read.
- Connections: one that sent nothing, or stalled in a body, was kept an hour (tornado's
  default), so silent connections could pile up to the process's file limit and lock every
  client out. They are closed after ``http.idle_timeout_s`` (60 s)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from _cluster import ClusterHandle
from test_http_gateway_service import _address, _serve

from services.http_gateway.app import MAX_BODY_BYTES

pytestmark = pytest.mark.integration


def test_a_large_body_is_refused_before_it_is_read(tandem_cluster: ClusterHandle) -> None:
    url = urlsplit(str(tandem_cluster.info["http"]))
    assert url.hostname and url.port
    with socket.create_connection((url.hostname, url.port), timeout=5) as conn:
        length = 64 * MAX_BODY_BYTES
        conn.sendall(f"POST /api/kernels HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        conn.settimeout(5)
        answer = conn.recv(200)  # before: nothing, the server waiting for the 64 MiB
    assert answer.startswith(b"HTTP/1.1 400"), answer

    # what the API's clients send is far below the limit: a kernel start with its environment
    token = (tandem_cluster.state_dir / "keys" / "http.token").read_text().strip()
    headers = {"Authorization": f"token {token}"}
    api = str(tandem_cluster.info["http"])
    listed = requests.get(f"{api}/api/kernels", headers=headers, timeout=30)
    assert listed.status_code == 200
    refused = requests.post(f"{api}/api/kernels", data=b"x" * (MAX_BODY_BYTES // 2), timeout=30)
    assert refused.status_code == 401  # read, then the token check: within the limit


def _closed_within(conn: socket.socket, seconds: float) -> float | None:
    """How long until the server closed ``conn`` (None: still open after ``seconds``)."""
    started = time.monotonic()
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_a_silent_or_stalled_connection_is_closed(tmp_path: Path) -> None:
    process = _serve(tmp_path, "http.idle_timeout_s=1")
    try:
        url = urlsplit(_address(process, tmp_path))
        assert url.hostname and url.port
        with (
            socket.create_connection((url.hostname, url.port)) as silent,
            socket.create_connection((url.hostname, url.port)) as stalled,
        ):
            stalled.sendall(b"POST /api/kernels HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
            assert _closed_within(silent, 8.0) is not None, "a connection that sent nothing was kept"
            assert _closed_within(stalled, 8.0) is not None, "a connection stalled in its body was kept"
    finally:
        process.terminate()
        process.wait(timeout=20)
