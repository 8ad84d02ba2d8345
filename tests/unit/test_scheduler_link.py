"""The replica's link to its local scheduler, against a real ROUTER and the real GPU ledger.

The local scheduler binds a designated replica's GPUs as it forwards the cell and pushes
``gpu.bound`` on the replica's control link, while the cell itself travels on the kernel's shell
socket: the cell can reach the replica first, so the replica's ``gpu.commit`` and the push cross.
Both name the same ledger entry, and the GPUs of a cell that runs must stay bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq.asyncio

from kernel_replica.scheduler_link import SchedulerLink
from shared import messages
from shared.cluster_core.gpu_ledger import GpuLedger, LedgerError
from shared.envelope import Envelope
from shared.rpc import RpcServer

KERNEL, REPLICA, CELL = "k1", "r1", "cell-1"


class LocalSchedulerDouble:
    """A ROUTER with the real ledger that answers gpu.commit / gpu.release like the service."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ledger = GpuLedger([0])
        self.server = RpcServer(ctx, self.handle, name="local-scheduler-double")
        self.identity: bytes | None = None
        self.commits_seen = asyncio.Event()
        self.push_before_commit_answer = False

    def push_bound(self, msg_id: str) -> None:
        commit = self.ledger.commit(KERNEL, REPLICA, msg_id, 1)
        assert self.identity is not None
        body = {"kernel_id": KERNEL, "replica_id": REPLICA, "msg_id": msg_id, "designated": True}
        self.server.send(
            self.identity, Envelope(messages.GPU_BOUND, body | {"device_ids": list(commit.device_ids)})
        )

    def handle(self, identity: bytes, env: Envelope) -> Envelope | None:
        self.identity = identity
        body = env.body
        if env.type == messages.GPU_COMMIT:
            self.commits_seen.set()
            if self.push_before_commit_answer:  # the push was sent before this request arrived
                self.push_bound(body["msg_id"])
            try:
                commit = self.ledger.commit(KERNEL, REPLICA, body["msg_id"], body["gpus"])
            except LedgerError as exc:
                return env.error(str(exc), code="no_gpus")
            return env.reply({"device_ids": list(commit.device_ids)})
        if env.type == messages.GPU_RELEASE:
            return env.reply({"device_ids": list(self.ledger.release(KERNEL, REPLICA, body["msg_id"]))})
        return env.reply({})


@asynccontextmanager
async def linked() -> AsyncIterator[tuple[SchedulerLink, LocalSchedulerDouble]]:
    ctx = zmq.asyncio.Context()
    scheduler = LocalSchedulerDouble(ctx)
    address = scheduler.server.bind("tcp://127.0.0.1:0")
    scheduler.server.start()
    link = SchedulerLink(ctx, kernel_id=KERNEL, replica_id=REPLICA, address=address, request_timeout_s=5.0)
    link.connect()
    try:
        yield link, scheduler
    finally:
        await link.close()
        await scheduler.server.close()
        ctx.destroy(linger=0)


async def settle_messages() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


def test_a_push_that_crosses_the_cells_commit_leaves_the_running_cells_gpus_bound() -> None:
    async def scenario() -> None:
        async with linked() as (link, scheduler):
            scheduler.push_before_commit_answer = True
            device_ids = await link.gpu_commit(CELL, 1)  # the push arrives just before this answer
            assert device_ids == [0]
            assert not link.settle_bound_ahead(CELL, executing=True)
            await settle_messages()
            assert scheduler.ledger.committed_count == 1  # still bound while the cell runs

    asyncio.run(scenario())


def test_a_push_for_a_cell_run_elsewhere_is_released() -> None:
    async def scenario() -> None:
        async with linked() as (link, scheduler):
            await link.gpu_release("warm-up")  # the double learns the link's identity
            scheduler.push_bound(CELL)
            await settle_messages()
            assert link.settle_bound_ahead(CELL, executing=False)  # the caller releases it

    asyncio.run(scenario())


def test_a_push_arriving_after_the_cell_was_decided_elsewhere_is_released_on_arrival() -> None:
    async def scenario() -> None:
        async with linked() as (link, scheduler):
            await link.gpu_release("warm-up")
            assert not link.settle_bound_ahead(CELL, executing=False)  # nothing had come yet
            scheduler.push_bound(CELL)
            await settle_messages()
            assert scheduler.ledger.committed_count == 0

    asyncio.run(scenario())


def test_a_push_arriving_after_the_cell_started_here_keeps_its_gpus() -> None:
    async def scenario() -> None:
        async with linked() as (link, scheduler):
            await link.gpu_commit(CELL, 1)
            assert not link.settle_bound_ahead(CELL, executing=True)
            scheduler.push_bound(CELL)  # same ledger entry: idempotent
            await settle_messages()
            assert scheduler.ledger.committed_count == 1

    asyncio.run(scenario())


def test_cell_timings_go_upstream_in_batches_not_one_event_per_cell() -> None:
    async def scenario() -> None:
        async with linked() as (link, scheduler):
            events: list[Envelope] = []
            handle = scheduler.handle

            def record(identity: bytes, env: Envelope) -> Envelope | None:
                if env.type == messages.REPLICA_EVENT:
                    events.append(env)
                    return None
                return handle(identity, env)

            scheduler.server._handler = record
            for n in range(3):
                link.cell_timings(f"cell-{n}", {"run_ms": float(n)})
            await settle_messages()
            assert events == []  # held for TIMINGS_FLUSH_S
            link.flush_timings()
            await settle_messages()
            (event,) = events
            assert event.body["event"] == "cell_timings" and event.body["msg_id"] is None
            assert [c["msg_id"] for c in event.body["detail"]["cells"]] == ["cell-0", "cell-1", "cell-2"]
            assert event.body["detail"]["cells"][2]["run_ms"] == 2.0

    asyncio.run(scenario())
