"""The Jupyter project's kernel test suite against a Tandem kernel reached through the Kernel
Gateway HTTP API: started with ``POST /api/kernels``, spoken to over its ``/channels`` WebSocket,
deleted with ``DELETE`` (#19). The same samples as the ZMQ run (test_kernel_conformance.py)."""

from __future__ import annotations

import unittest
from typing import Any

import pytest
import requests
from _websocket_client import WebSocketKernelClient
from test_kernel_conformance import TandemKernelTests

from services.cluster_file import read_cluster


class _RestKernel:
    """What the test suite asks of a kernel manager: a kernel started and stopped over REST."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.headers = url, {"Authorization": f"token {token}"}
        started = requests.post(
            f"{url}/api/kernels", json={"name": "tandem"}, headers=self.headers, timeout=120
        )
        started.raise_for_status()
        self.kernel_id: str = started.json()["id"]

    def shutdown_kernel(self, **_: Any) -> None:
        requests.delete(f"{self.url}/api/kernels/{self.kernel_id}", headers=self.headers, timeout=60)


@pytest.mark.integration
@pytest.mark.usefixtures("tandem_cluster")
class TandemKernelOverWebSocketTests(TandemKernelTests):
    @classmethod
    def setUpClass(cls) -> None:
        cluster = read_cluster()
        url = str(cluster.raw["http"])
        token = (cluster.keys_dir / "http.token").read_text().strip()  # type: ignore[operator]
        cls.km = _RestKernel(url, token)  # type: ignore[assignment]
        cls.kc = WebSocketKernelClient(url, token, cls.km.kernel_id)  # type: ignore[attr-defined]
        cls.kc.start_channels()
        cls.kc.wait_for_ready(timeout=60)


del TandemKernelTests  # imported for its samples: collected in its own module, not twice

if __name__ == "__main__":
    unittest.main()
