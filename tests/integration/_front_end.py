"""A Jupyter front-end server (``jupyter_server`` or ``jupyterlab``) started with ``--gateway-url``
at Tandem's Kernel Gateway API, as a remote Lab or JupyterHub runs one: its own Jupyter
directories, a token of its own, gone when the block ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests
from _cluster import eventually
from datastore_fixtures import free_port, stop_process


@contextmanager
def gateway_front_end(
    module: str,
    gateway: tuple[str, str],
    token: str,
    root: Path,
    home: Path,
    *extra_args: str,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """``python -m <module> --gateway-url=<gateway URL>`` (``gateway``: URL and token) serving
    ``root``; yields its URL once ``/api/status`` answers."""
    gateway_url, gateway_token = gateway
    port = free_port()
    environment = {
        **os.environ,
        **(env or {}),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
    }
    log_path = home / "server.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed below, after the process)
    process = subprocess.Popen(
        [
            sys.executable, "-m", module,
            f"--gateway-url={gateway_url}", f"--GatewayClient.auth_token={gateway_token}",
            f"--IdentityProvider.token={token}",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            "--ServerApp.open_browser=False", f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",  # CI runs as root
            *extra_args,
        ],
        env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return requests.get(f"{url}/api/status", params={"token": token}, timeout=5).status_code == 200
        except requests.ConnectionError:
            return process.poll() is not None  # gave up: reported below

    try:
        assert eventually(ready, timeout=60) and process.poll() is None, log_path.read_text()
        yield url
    finally:
        stop_process(process)
        log.close()
