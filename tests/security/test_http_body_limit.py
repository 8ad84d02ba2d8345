"""The HTTP API read a request's whole body before its token check: tornado buffers up to
100 MB per connection by default, so six connections without a token made the API process grow
by 340 MB (and a few dozen would exhaust the machine's memory). A body over 1 MiB is now refused
from its ``Content-Length``, before a byte of it is read."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest
import requests
from _cluster import ClusterHandle

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
