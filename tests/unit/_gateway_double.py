"""Test double of the global scheduler's ROUTER, and a harness running it with a real gateway.

The double answers ``kernel.start`` and plays one ipykernel for ``jupyter.request`` (busy, a stream
output, the reply, idle), signing with the kernel's key, so tests exercise exactly what the
gateway and provisioner own: sockets, signatures, routing by msg_id, heartbeat, lifecycle.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from services.gateway.service import Gateway
from shared import messages
from shared.config import load_config
from shared.envelope import Envelope
from shared.jupyter_wire import Signer, header_of, json_part
from shared.rpc import RpcClient, RpcServer
from shared.security import curve

KEY = "0123456789abcdef"


class FakeScheduler:
    """Stands in for the global scheduler: one ipykernel's worth of answers per request."""

    def __init__(self, ctx: zmq.asyncio.Context, keys_dir: Path) -> None:
        self.authority = curve.CurveAuthority.acquire(ctx)
        self.authority.serve(curve.SCHEDULER, curve.PeerDirectory(keys_dir, exclude=(curve.SCHEDULER,)))
        self.server = RpcServer(
            ctx, self.handle, name="fake-scheduler", curve=curve.server_curve(keys_dir, curve.SCHEDULER)
        )
        self.signers: dict[str, Signer] = {}
        self.requests: list[dict[str, Any]] = []
        self.started: list[str] = []
        self.start_bodies: list[dict[str, Any]] = []
        self.shutdowns: list[dict[str, Any]] = []
        self.dead = False
        self.unknown: set[str] = set()  # kernels it answers not_found for
        self.status_asked = 0
        self.silent = False  # keep requests unanswered (in self.requests), as a cell still running

    def handle(self, identity: bytes, env: Envelope) -> Envelope | None:
        if env.type == messages.KERNEL_START and env.body["kernel_id"].startswith("unplaceable"):
            return env.error("no 3 hosts with room for 1 GPU", code="no_capacity")
        if env.type == messages.KERNEL_START:
            self.started.append(env.body["kernel_id"])
            self.start_bodies.append(env.body)
            self.signers[env.body["kernel_id"]] = Signer(env.body["key"].encode())
            return env.reply({"replicas": {"r1": "host-0", "r2": "host-1", "r3": "host-2"}})
        if env.type == messages.KERNEL_SHUTDOWN:
            self.shutdowns.append(env.body)
            return env.reply({})
        if env.type == messages.KERNEL_STATUS:
            self.status_asked += 1
            if env.body["kernel_id"] in self.unknown:
                return env.error(f"unknown kernel {env.body['kernel_id']!r}", code="not_found")
            return env.reply({"alive": not self.dead})
        if env.type == messages.JUPYTER_REQUEST:
            self.requests.append(env.body)
            if not self.silent:
                self.play_kernel(identity, env.body)
        return None

    def msg(
        self,
        kernel_id: str,
        msg_type: str,
        parent: dict[str, Any],
        content: dict[str, Any],
        metadata: dict[str, Any] | None = None,
    ) -> list[bytes]:
        header = {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": "fake",
            "username": "x",
            "date": "2026-01-01T00:00:00Z",
            "version": "5.3",
        }
        parts = [json_part(header), json_part(parent), json_part(metadata or {}), json_part(content)]
        return [self.signers[kernel_id].sign(parts), *parts]

    def push(self, identity: bytes, kernel_id: str, channel: str, frames: list[bytes]) -> None:
        self.server.send(
            identity,
            Envelope(messages.JUPYTER_REPLY, {"kernel_id": kernel_id, "channel": channel, "frames": frames}),
        )

    def play_kernel(self, identity: bytes, body: dict[str, Any]) -> None:
        kernel_id, channel, frames = body["kernel_id"], body["channel"], body["frames"]
        header = header_of(frames)
        msg_type = header["msg_type"]
        if channel == "stdin" or not msg_type.endswith("_request"):
            return
        reply_type = msg_type.replace("_request", "_reply")
        self.push(
            identity, kernel_id, "iopub", self.msg(kernel_id, "status", header, {"execution_state": "busy"})
        )
        content: dict[str, Any] = {"status": "ok"}
        metadata: dict[str, Any] = {}
        if msg_type == "execute_request":
            code = json.loads(frames[4])["code"]
            self.push(
                identity,
                kernel_id,
                "iopub",
                self.msg(kernel_id, "stream", header, {"name": "stdout", "text": f"ran {code}\n"}),
            )
            content.update(execution_count=1, user_expressions={})
            metadata = {"tandem": {"replica_id": "r2", "role": "executor", "started_at": time.time()}}
        elif msg_type == "kernel_info_request":
            content.update(
                protocol_version="5.3",
                implementation="fake",
                implementation_version="0",
                language_info={"name": "python"},
                banner="",
                help_links=[],
            )
        self.push(identity, kernel_id, channel, self.msg(kernel_id, reply_type, header, content, metadata))
        self.push(
            identity, kernel_id, "iopub", self.msg(kernel_id, "status", header, {"execution_state": "idle"})
        )


class Harness:
    """Fake scheduler + gateway on an event loop in a background thread."""

    def __init__(self, **overrides: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ctx = zmq.asyncio.Context()
        self.cfg = load_config(None, {"gateway.status_poll_interval_s": "0.2", **overrides})
        self.keys_dir = self.cfg.keys_dir()
        curve.ensure_cluster_keys(self.keys_dir)
        self.scheduler: FakeScheduler
        self.gateway: Gateway
        self.api_address = ""
        self.call(self._start())

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.scheduler = FakeScheduler(self.ctx, self.keys_dir)
        self.scheduler_address = self.scheduler.server.bind("tcp://127.0.0.1:0")
        self.scheduler.server.start()
        await self._start_gateway("tcp://127.0.0.1:0")

    async def _start_gateway(self, api_address: str) -> None:
        self.gateway = Gateway(self.ctx, self.cfg, scheduler_address=self.scheduler_address)
        try:
            self.api_address = await self.gateway.start(api_address)
        except BaseException:
            await self.gateway.close()  # as its process's exit would: the ports are free again
            raise

    def restart_gateway(self) -> None:
        """A new gateway process in all but the process: nothing carried over but the state dir."""
        self.call(self.gateway.close())
        self.start_gateway_again()

    def start_gateway_again(self) -> None:
        deadline = time.monotonic() + 5.0
        while True:  # the old sockets close in ZMQ's I/O thread: the API port frees a moment later
            try:
                self.call(self._start_gateway(self.api_address))
                return
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def operator(self) -> curve.ClientCurve:
        return curve.client_curve(self.keys_dir, curve.OPERATOR, curve.GATEWAY)

    async def api(self, msg_type: str, body: dict[str, Any]) -> Envelope:
        client = RpcClient(self.ctx, name="test-api", curve=self.operator())
        client.connect(self.api_address)
        try:
            return await client.request(Envelope(msg_type, body), timeout=5.0)
        finally:
            await client.close()

    async def raw_api(self, payload: bytes) -> dict[str, Any]:
        sock = self.ctx.socket(zmq.DEALER)
        self.operator().apply(sock)
        sock.connect(self.api_address)
        try:
            await sock.send(payload)
            return msgpack.unpackb(await asyncio.wait_for(sock.recv(), 5.0))
        finally:
            sock.close(linger=0)

    def start_kernel(self) -> tuple[str, dict[str, Any]]:
        kernel_id = uuid.uuid4().hex
        answer = self.call(
            self.api(
                messages.KERNEL_START,
                {
                    "kernel_id": kernel_id,
                    "key": KEY,
                    "signature_scheme": "hmac-sha256",
                    "resources": {"gpus": 1},
                },
            )
        )
        return kernel_id, answer.body

    def close(self) -> None:
        self.call(self.gateway.close())
        self.call(self.scheduler.server.close())
        self.scheduler.authority.release()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.ctx.destroy(linger=0)  # term() would block forever on a socket a failed test left open
