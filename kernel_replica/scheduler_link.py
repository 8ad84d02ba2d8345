"""The replica's DEALER to its local scheduler (docs/protocol.md, "Kernel start" and execute steps 3-5).

It registers the replica, binds and releases GPUs around a cell, pushes ``replica.event``s, and
receives ``replica.configure`` / ``replica.stop``. It lives on the Raft thread's event loop (never
the kernel's main thread, which user code blocks for minutes), so the scheduler's messages are
answered while a cell runs.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq.asyncio

from shared import messages
from shared.envelope import Envelope
from shared.rpc import RpcClient, RpcError, RpcTimeout
from shared.security.curve import ClientCurve

BOUND_AHEAD_KEPT = 64
TIMINGS_FLUSH_S = 0.5  # cell_timings batches: at most this late
TIMINGS_BATCH = 64  # ... or this many cells
GPU_COMMIT_RETRIES = 10  # a designated replica's refused gpu.commit: the release is in flight
GPU_COMMIT_RETRY_S = 0.05

# peers, and the namespace image to restore first (a resumed kernel's), or None
ConfigureHandler = Callable[[dict[str, str], dict[str, Any] | None], Awaitable[None]]
HibernateHandler = Callable[[], Awaitable[dict[str, Any]]]
StopHandler = Callable[[], Awaitable[None]]
# (action, member, address, cells) -> this replica's view of the group after the change
MembershipHandler = Callable[[str, str, str, list[str]], Awaitable[dict[str, Any]]]


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
        curve: ClientCurve | None = None,
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
            curve=curve,
        )
        self._on_configure: ConfigureHandler | None = None
        self._on_stop: StopHandler | None = None
        self._on_membership: MembershipHandler | None = None
        self._on_hibernate: HibernateHandler | None = None
        # gpu.bound pushes not yet taken: msg_id -> (device ids bound ahead, or None if none
        # could be; whether the scheduler designated this replica as the cell's only candidate)
        self._bound_ahead: OrderedDict[str, tuple[list[int] | None, bool]] = OrderedDict()
        # cells already decided here: msg_id -> whether this replica executes it
        self._settled: OrderedDict[str, bool] = OrderedDict()
        self._late_releases: set[asyncio.Task[None]] = set()
        self._timings: list[dict[str, Any]] = []  # cell_timings not sent yet
        self._timings_timer: asyncio.TimerHandle | None = None

    def set_handlers(
        self,
        *,
        on_configure: ConfigureHandler,
        on_stop: StopHandler,
        on_membership: MembershipHandler | None = None,
        on_hibernate: HibernateHandler | None = None,
    ) -> None:
        self._on_configure = on_configure
        self._on_stop = on_stop
        self._on_membership = on_membership
        self._on_hibernate = on_hibernate

    def connect(self) -> None:
        self._client.connect(self._address)

    def _ids(self) -> dict[str, Any]:
        return {"kernel_id": self.kernel_id, "replica_id": self.replica_id}

    async def register(self, raft_address: str) -> None:
        body = self._ids() | {"raft_address": raft_address, "pid": os.getpid()}
        await self._client.request(
            Envelope(messages.REPLICA_REGISTER, body), timeout=self._timeout, retries=2
        )

    def bound_ahead(self, msg_id: str, gpus: int) -> list[int] | None:
        """What a ``gpu.bound`` push already bound for msg_id (taken once). Nothing is announced:
        binding is not winning; the election core sends ``elected`` once its LEAD has won."""
        ahead = self._bound_ahead.pop(msg_id, (None, False))[0]
        if ahead is None or len(ahead) != gpus:
            return None
        return ahead

    async def gpu_commit(self, msg_id: str, gpus: int) -> list[int]:
        """Bind ``gpus`` devices for msg_id; ``RpcError`` when the node has none free. Answered
        at once when the local scheduler bound them ahead of the request (``gpu.bound``). A
        designated replica retries a refusal for a moment: the scheduler saw the GPUs free, so
        the previous cell's release is on its way to the local scheduler."""
        retries = GPU_COMMIT_RETRIES if self.designated(msg_id) else 0
        ahead = self.bound_ahead(msg_id, gpus)
        if ahead is not None:
            return ahead
        for attempt in range(retries + 1):
            try:
                answer = await self._client.request(
                    Envelope(messages.GPU_COMMIT, self._ids() | {"msg_id": msg_id, "gpus": gpus}),
                    timeout=self._timeout,
                )
                break
            except RpcError as exc:
                if exc.code != "no_gpus" or attempt == retries:
                    raise
                await asyncio.sleep(GPU_COMMIT_RETRY_S)
        device_ids = answer.body.get("device_ids", [])
        if not isinstance(device_ids, list) or not all(isinstance(d, int) for d in device_ids):
            raise ValueError(f"gpu.commit answered with bad device_ids {device_ids!r}")
        return device_ids

    def settle_bound_ahead(self, msg_id: str, *, executing: bool) -> bool:
        """The replica has decided msg_id: drop its ``gpu.bound`` push. True when that push bound
        GPUs this replica will not use, which the caller releases. A push bound under the same
        ledger key as the cell's ``gpu.commit``, so when the cell runs here (the push may have
        arrived after the commit was sent) its GPUs are the ones in use and must stay bound. A
        push that arrives after this (none had come yet) is released on arrival unless the cell
        runs here."""
        self._settled[msg_id] = executing
        while len(self._settled) > BOUND_AHEAD_KEPT:
            self._settled.popitem(last=False)
        ahead = self._bound_ahead.pop(msg_id, None)
        return not executing and ahead is not None and ahead[0] is not None

    def designated(self, msg_id: str) -> bool:
        """The scheduler sent this replica the cell's only execute_request (the others yield)."""
        return self._bound_ahead.get(msg_id, (None, False))[1]

    async def _release_late(self, msg_id: str) -> None:
        try:
            await self.gpu_release(msg_id)
        except (RpcError, RpcTimeout) as exc:
            self._log.warning("late_gpu_bound_not_released", msg_id=msg_id, error=str(exc))

    async def gpu_release(self, msg_id: str) -> None:
        await self._client.request(
            Envelope(messages.GPU_RELEASE, self._ids() | {"msg_id": msg_id}), timeout=self._timeout, retries=2
        )

    def cell_timings(self, msg_id: str, steps: dict[str, float]) -> None:
        """The executor's step times of a cell, for the scheduler's metrics: sent in batches (one
        ``replica.event cell_timings`` with ``detail.cells`` every ``TIMINGS_FLUSH_S``, or per
        ``TIMINGS_BATCH`` cells), since one event per cell cost every hop a message right as the
        next cell arrives."""
        self._timings.append({"msg_id": msg_id, **steps})
        if len(self._timings) >= TIMINGS_BATCH:
            self.flush_timings()
        elif self._timings_timer is None:
            self._timings_timer = asyncio.get_running_loop().call_later(TIMINGS_FLUSH_S, self.flush_timings)

    def flush_timings(self) -> None:
        if self._timings_timer is not None:
            self._timings_timer.cancel()
            self._timings_timer = None
        cells, self._timings = self._timings, []
        if cells:
            self.event("cell_timings", None, cells=cells)

    def event(self, event: str, msg_id: str | None = None, **detail: Any) -> None:
        body = self._ids() | {"event": event, "msg_id": msg_id, "detail": detail}
        self._client.send(Envelope(messages.REPLICA_EVENT, body))

    def _on_message(self, env: Envelope) -> Awaitable[Envelope | None] | None:
        if env.type != messages.GPU_BOUND:
            return self._on_request(env)
        self._note_bound_ahead(env)  # at once, not in a task: the cell's gpu.commit may be next
        return None

    def _note_bound_ahead(self, env: Envelope) -> None:
        body = env.body
        device_ids = body.get("device_ids")
        if device_ids is not None and not all(isinstance(d, int) for d in device_ids):
            self._log.warning("bad_gpu_bound", device_ids=device_ids)  # gpu.commit asks instead
            device_ids = None
        msg_id = str(body["msg_id"])
        executing = self._settled.get(msg_id)
        if executing is not None:  # decided before the push came: bound for nothing unless run here
            if not executing and device_ids:
                task = asyncio.ensure_future(self._release_late(msg_id))
                self._late_releases.add(task)
                task.add_done_callback(self._late_releases.discard)
            return
        designated = body.get("designated") is True
        self._bound_ahead[msg_id] = (list(device_ids) if device_ids is not None else None, designated)
        while len(self._bound_ahead) > BOUND_AHEAD_KEPT:  # pushes for cells never run here
            self._bound_ahead.popitem(last=False)

    async def _on_request(self, env: Envelope) -> Envelope | None:
        if env.type == messages.REPLICA_CONFIGURE:
            if self._on_configure is None:
                return env.error("replica is not ready to be configured", code="not_ready")
            restore = env.body.get("restore")
            await self._on_configure({str(k): str(v) for k, v in env.body["peers"].items()}, restore)
            return env.reply({"replica_id": self.replica_id})
        if env.type == messages.REPLICA_HIBERNATE:
            if self._on_hibernate is None:
                return env.error("replica cannot write its namespace image", code="not_ready")
            return env.reply(await self._on_hibernate())
        if env.type == messages.REPLICA_MEMBERSHIP:
            if self._on_membership is None:
                return env.error("replica is not ready for membership changes", code="not_ready")
            body = env.body
            view = await self._on_membership(
                str(body["action"]),
                str(body.get("member") or ""),
                str(body.get("address") or ""),
                [str(c) for c in body.get("cells") or ()],
            )
            return env.reply(view)
        if env.type == messages.REPLICA_STOP:
            if self._on_stop is not None:
                await self._on_stop()
            return env.reply({})
        self._log.warning("unexpected_message", type=env.type)
        return env.error(f"a replica does not handle {env.type}", code="unsupported")

    async def close(self) -> None:
        self.flush_timings()
        await self._client.close()
