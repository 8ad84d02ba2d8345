"""Tandem's Kernel Gateway HTTP/WebSocket API, as remote Jupyter front ends use it (#19).

A real ``jupyter server --gateway-url=<Tandem>`` (jupyter_server's GatewayClient, what JupyterLab
and JupyterHub use for remote kernels) is driven through its own REST and WebSocket API: create a
kernel in a notebook folder, run cells, interrupt, restart, delete. The kernel behind it is a
Tandem kernel with three replicas. The token is checked on every route, WebSocket included.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import websocket
from _cluster import ClusterHandle, eventually
from _front_end import gateway_front_end
from _signals import signal_ours

from shared import messages

pytestmark = pytest.mark.integration

SERVER_TOKEN = "front-end-token"


@dataclass
class Server:
    """An HTTP endpoint of the Jupyter kernels API and the token it wants."""

    url: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return requests.request(method, self.url + path, headers=self.headers, timeout=60, **kwargs)

    def channels(self, kernel_id: str) -> WsKernel:
        ws_url = self.url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels"
        return WsKernel(websocket.create_connection(ws_url, header=self.headers, timeout=60))


@dataclass
class Cell:
    reply: dict[str, Any]
    stdout: str = ""
    errors: list[str] = field(default_factory=list)


class WsKernel:
    """The Jupyter protocol over a kernel's ``/channels`` WebSocket (JSON messages), as a front end speaks it."""

    def __init__(self, ws: websocket.WebSocket) -> None:
        self.ws = ws
        self.session = uuid.uuid4().hex

    def send(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        header = {
            "msg_id": msg_id,
            "msg_type": msg_type,
            "session": self.session,
            "username": "test",
            "version": "5.3",
        }
        self.ws.send(
            json.dumps(
                {
                    "header": header,
                    "parent_header": {},
                    "metadata": {},
                    "content": content,
                    "channel": channel,
                }
            )
        )
        return msg_id

    def submit(self, code: str) -> str:
        return self.send(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
            },
        )

    def wait(self, msg_id: str, timeout: float = 60.0) -> Cell:
        """Outputs and the execute_reply of ``msg_id``: done at the reply and the kernel's idle
        status (they travel on two channels, in either order)."""
        cell = Cell(reply={})
        idle = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ws.settimeout(max(deadline - time.monotonic(), 0.1))
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                cell.stdout += msg["content"]["text"]
            elif kind == "error":
                cell.errors.append(msg["content"]["ename"])
            elif kind == "execute_reply":
                cell.reply = msg["content"]
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
            if idle and cell.reply:
                return cell
        pytest.fail(f"no execute_reply and idle for {msg_id} within {timeout:g}s: {cell}")

    def run(self, code: str, timeout: float = 60.0) -> Cell:
        return self.wait(self.submit(code), timeout)

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def tandem_api(tandem_cluster: ClusterHandle) -> Server:
    url = tandem_cluster.info.get("http")
    assert url, f"tandem up published no Kernel Gateway API: {tandem_cluster.info}"
    token_file = tandem_cluster.state_dir / "keys" / "http.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    return Server(str(url), token_file.read_text().strip())


@pytest.fixture(scope="module")
def front_end(tandem_api: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """``jupyter server --gateway-url`` at Tandem, serving a folder of notebooks."""
    root, home = tmp_path_factory.mktemp("notebooks"), tmp_path_factory.mktemp("jupyter-home")
    gateway = (tandem_api.url, tandem_api.token)
    # GatewayClient forwards the server's KERNEL_* variables
    with gateway_front_end(
        "jupyter_server", gateway, SERVER_TOKEN, root, home, env={"KERNEL_FOO": "bar"}
    ) as url:
        yield Server(url, SERVER_TOKEN), root


def test_a_remote_jupyter_server_runs_interrupts_restarts_and_deletes_a_tandem_kernel(
    front_end: tuple[Server, Path], tandem_api: Server, tandem_cluster: ClusterHandle
) -> None:
    server, root = front_end
    (root / "project" / "data").mkdir(parents=True)
    (root / "project" / "data" / "values.csv").write_text("a,b\n1,2\n")
    assert "tandem" in server.request("GET", "/api/kernelspecs").json()["kernelspecs"]

    started = server.request(
        "POST", "/api/kernels", json={"name": "tandem", "path": "project/analysis.ipynb"}
    )
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    assert kernel_id in [k["id"] for k in tandem_api.request("GET", "/api/kernels").json()]
    status = tandem_cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
    assert len([r for r in status["replicas"] if r["alive"]]) == 3

    kernel = server.channels(kernel_id)
    try:
        # KERNEL_WORKING_DIR (the notebook's folder) and KERNEL_FOO came through GatewayClient
        cell = kernel.run("import os; print(os.getcwd()); print(os.environ['KERNEL_FOO'])")
        assert cell.reply["status"] == "ok", cell
        assert cell.stdout.split() == [str(root / "project"), "bar"]
        assert kernel.run("print(open('data/values.csv').read().split()[1]); x = 41").stdout.strip() == "1,2"
        assert kernel.run("print(x + 1)").stdout.strip() == "42"

        sleeping = kernel.submit("import time; time.sleep(60)")
        time.sleep(1.5)  # the cell is running
        interrupted_at = time.monotonic()
        assert server.request("POST", f"/api/kernels/{kernel_id}/interrupt").status_code == 204
        cell = kernel.wait(sleeping, timeout=20)
        assert cell.reply["status"] == "error" and cell.errors == ["KeyboardInterrupt"], cell
        assert time.monotonic() - interrupted_at < 15
        assert kernel.run("print(x)").stdout.strip() == "41"  # the namespace survives an interrupt
    finally:
        kernel.close()

    restarted = server.request("POST", f"/api/kernels/{kernel_id}/restart")
    assert restarted.status_code == 200, restarted.text
    kernel = server.channels(kernel_id)
    try:
        cell = kernel.run(
            "print('x' in globals(), os.getcwd() if 'os' in globals() else __import__('os').getcwd())"
        )
        assert cell.stdout.split() == ["False", str(root / "project")]  # fresh namespace, same folder
    finally:
        kernel.close()

    assert server.request("DELETE", f"/api/kernels/{kernel_id}").status_code == 204
    assert kernel_id not in [k["id"] for k in server.request("GET", "/api/kernels").json()]
    assert kernel_id not in [k["id"] for k in tandem_api.request("GET", "/api/kernels").json()]
    gone = tandem_cluster.ask_gateway(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
    assert gone["state"] == "stopped"


def test_requests_without_the_token_are_refused_and_told_how_to_authenticate(
    tandem_api: Server, tandem_cluster: ClusterHandle
) -> None:
    for headers in ({}, {"Authorization": "token wrong"}):
        refused = requests.get(tandem_api.url + "/api/kernels", headers=headers, timeout=10)
        assert refused.status_code == 401
        assert "Authorization: token" in refused.json()["message"]
    refused = requests.post(tandem_api.url + "/api/kernels", json={"name": "tandem"}, timeout=10)
    assert refused.status_code == 401
    with pytest.raises(websocket.WebSocketBadStatusException) as ws_refused:
        websocket.create_connection(
            tandem_api.url.replace("http", "ws", 1) + f"/api/kernels/{uuid.uuid4()}/channels", timeout=10
        )
    assert ws_refused.value.status_code == 401
    assert tandem_api.request("GET", "/api/kernels").status_code == 200
    in_query = requests.get(f"{tandem_api.url}/api/kernels?token={tandem_api.token}", timeout=10)
    assert in_query.status_code == 200
    requests.get(f"{tandem_api.url}/api/kernels?token=almost-{tandem_api.token}", timeout=10)
    # tornado writes the access line after the response has gone out: wait for it
    assert eventually(lambda: "/api/kernels?token=[secret]" in tandem_cluster.log_text("http-gateway"))
    assert tandem_api.token not in tandem_cluster.log_text("http-gateway")  # never logged


def test_a_start_request_env_reaches_every_replica_and_other_variables_stay_behind(
    tandem_api: Server, tandem_cluster: ClusterHandle, tmp_path: Path
) -> None:
    started = tandem_api.request(
        "POST",
        "/api/kernels",
        json={
            "name": "tandem",
            "env": {"KERNEL_FOO": "bar", "KERNEL_WORKING_DIR": str(tmp_path), "SECRET": "no"},
        },
    )
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    try:
        status = tandem_cluster.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
        pids = [r["pid"] for r in status["replicas"] if r["alive"]]
        assert len(pids) == 3
        assert [os.readlink(f"/proc/{pid}/cwd") for pid in pids] == [str(tmp_path)] * 3
        kernel = tandem_api.channels(kernel_id)
        try:
            cell = kernel.run("import os; print(os.environ.get('KERNEL_FOO'), os.environ.get('SECRET'))")
            assert cell.stdout.split() == ["bar", "None"]
        finally:
            kernel.close()
    finally:
        assert tandem_api.request("DELETE", f"/api/kernels/{kernel_id}").status_code == 204


def test_kernels_of_the_api_are_taken_back_after_its_process_crashes(
    tandem_cluster: ClusterHandle, tandem_api: Server
) -> None:
    started = tandem_api.request("POST", "/api/kernels", json={"name": "tandem"})
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    record = tandem_cluster.state_dir / "http" / "sessions" / f"{kernel_id}.json"
    assert record.stat().st_mode & 0o777 == 0o600
    ws = tandem_api.channels(kernel_id)
    try:
        assert ws.run("x = 41").reply["status"] == "ok"
    finally:
        ws.close()
    cluster_file = tandem_cluster.state_dir / "cluster.json"
    crashed = json.loads(cluster_file.read_text())["processes"]["http-gateway"]
    assert signal_ours(crashed, signal.SIGKILL)  # tandem up starts it again on the same URL

    def listed() -> bool:
        if json.loads(cluster_file.read_text())["processes"]["http-gateway"] == crashed:
            return False
        try:
            answer = tandem_api.request("GET", "/api/kernels")
        except requests.ConnectionError:
            return False
        return answer.status_code == 200 and kernel_id in {k["id"] for k in answer.json()}

    assert eventually(listed, timeout=60), tandem_cluster.log_text("http-gateway")[-3000:]
    ws = tandem_api.channels(kernel_id)
    try:
        cell = ws.run("print(x + 1)")
        assert (cell.reply["status"], cell.stdout) == ("ok", "42\n")
        # a kernel taken back restarts like any other: in place, with a fresh namespace
        assert tandem_api.request("POST", f"/api/kernels/{kernel_id}/restart").status_code == 200
        assert ws.run("print('x' in globals())").stdout == "False\n"
    finally:
        ws.close()
    assert tandem_api.request("DELETE", f"/api/kernels/{kernel_id}").status_code == 204
    assert not record.exists()
