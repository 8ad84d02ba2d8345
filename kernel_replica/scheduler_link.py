"""The replica's DEALER to its local scheduler (docs/protocol.md, "Kernel start" and execute steps 3-5).

It registers the replica, binds and releases GPUs around a cell, pushes ``replica.event``s, and
receives ``replica.configure`` / ``replica.stop``. It lives on the Raft thread's event loop (never
the kernel's main thread, which user code blocks for minutes), so the scheduler's messages are
answered while a cell runs.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq.asyncio

from shared import messages
from shared.envelope import Envelope
from shared.rpc import RpcClient

ConfigureHandler = Callable[[dict[str, str]], Awaitable[None]]
StopHandler = Callable[[], Awaitable[None]]


class SchedulerLink:
    """Typed requests and pushes to the local scheduler for one replica."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        kernel_id: str,
        replica_id: str,
        address: str,
        request_timeout_s: float = 10.0,
    ) -> None:
        self.kernel_id = kernel_id
        self.replica_id = replica_id
        self._address = address
        self._timeout = request_timeout_s
        self._log = structlog.get_logger("replica.scheduler_link").bind(kernel=kernel_id, replica=replica_id)
        self._client = RpcClient(
            ctx,
            identity=f"{kernel_id}/{replica_id}/{os.getpid()}".encode(),
            on_message=self._on_message,
            name=f"replica-{replica_id}",
        )
        self._on_configure: ConfigureHandler | None = None
        self._on_stop: StopHandler | None = None

    def set_handlers(self, *, on_configure: ConfigureHandler, on_stop: StopHandler) -> None:
        self._on_configure = on_configure
        self._on_stop = on_stop

    def connect(self) -> None:
        self._client.connect(self._address)

    def _ids(self) -> dict[str, Any]:
        return {"kernel_id": self.kernel_id, "replica_id": self.replica_id}

    async def register(self, raft_address: str) -> None:
        body = self._ids() | {"raft_address": raft_address, "pid": os.getpid()}
        await self._client.request(
            Envelope(messages.REPLICA_REGISTER, body), timeout=self._timeout, retries=2
        )

    async def gpu_commit(self, msg_id: str, gpus: int) -> list[int]:
        """Bind ``gpus`` devices for msg_id; ``RpcError`` when the node has none free."""
        answer = await self._client.request(
            Envelope(messages.GPU_COMMIT, self._ids() | {"msg_id": msg_id, "gpus": gpus}),
            timeout=self._timeout,
        )
        device_ids = answer.body.get("device_ids", [])
        if not isinstance(device_ids, list) or not all(isinstance(d, int) for d in device_ids):
            raise ValueError(f"gpu.commit answered with bad device_ids {device_ids!r}")
        return device_ids

    async def gpu_release(self, msg_id: str) -> None:
        await self._client.request(
            Envelope(messages.GPU_RELEASE, self._ids() | {"msg_id": msg_id}), timeout=self._timeout, retries=2
        )

    def event(self, event: str, msg_id: str | None = None, **detail: Any) -> None:
        body = self._ids() | {"event": event, "msg_id": msg_id, "detail": detail}
        self._client.send(Envelope(messages.REPLICA_EVENT, body))

    async def _on_message(self, env: Envelope) -> Envelope | None:
        if env.type == messages.REPLICA_CONFIGURE:
            if self._on_configure is None:
                return env.error("replica is not ready to be configured", code="not_ready")
            await self._on_configure({str(k): str(v) for k, v in env.body["peers"].items()})
            return env.reply({"replica_id": self.replica_id})
        if env.type == messages.REPLICA_STOP:
            if self._on_stop is not None:
                await self._on_stop()
            return env.reply({})
        self._log.warning("unexpected_message", type=env.type)
        return env.error(f"a replica does not handle {env.type}", code="unsupported")

    async def close(self) -> None:
        await self._client.close()
