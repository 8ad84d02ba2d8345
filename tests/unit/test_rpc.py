"""``RpcServer`` / ``RpcClient`` over real ZMQ sockets: validation, error answers, dispatch order,
slow handlers as tasks, timeouts and close(), on both event loops the services use."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from shared import messages
from shared.envelope import Envelope
from shared.rpc import Authorizer, RpcClient, RpcError, RpcServer, RpcTimeout


def _status(kernel_id: str) -> Envelope:
    return Envelope(messages.KERNEL_STATUS, {"kernel_id": kernel_id})


@asynccontextmanager
async def _link(
    handler: Callable[[bytes, Envelope], Any],
    on_message: Callable[[Envelope], Any] | None = None,
    authorize: Authorizer | None = None,
) -> AsyncIterator[tuple[RpcServer, RpcClient]]:
    ctx = zmq.asyncio.Context()
    server = RpcServer(ctx, handler, name="test-server", authorize=authorize)
    address = server.bind("tcp://127.0.0.1:0")
    server.start()
    client = RpcClient(ctx, identity=b"client", on_message=on_message, name="test-client")
    client.connect(address)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()
        ctx.destroy(linger=0)


def test_a_request_gets_the_handlers_reply(run: Callable[[Awaitable[Any]], Any]) -> None:
    async def main() -> None:
        async with _link(
            lambda identity, env: env.reply({"echo": env.body["kernel_id"], "peer": identity})
        ) as (
            _,
            client,
        ):
            answer = await client.request(_status("k1"), timeout=5)
            assert answer.body == {"echo": "k1", "peer": b"client"}

    run(main())


def test_pushes_are_handled_in_arrival_order(run: Callable[[Awaitable[Any]], Any]) -> None:
    seen: list[str] = []

    async def main() -> None:
        def handler(identity: bytes, env: Envelope) -> Envelope | None:
            seen.append(env.body["kernel_id"])
            return env.reply() if env.body["kernel_id"] == "last" else None

        async with _link(handler) as (_, client):
            for i in range(500):
                client.send(_status(str(i)))
            await client.request(_status("last"), timeout=5)

    run(main())
    assert seen == [*(str(i) for i in range(500)), "last"]


def test_a_slow_handler_runs_as_a_task_and_does_not_hold_up_later_messages(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def slow(env: Envelope) -> Envelope:
            await release.wait()
            return env.reply({"slow": True})

        def handler(identity: bytes, env: Envelope) -> Any:
            return slow(env) if env.body["kernel_id"] == "slow" else env.reply({"slow": False})

        async with _link(handler) as (_, client):
            slow_answer = asyncio.ensure_future(client.request(_status("slow"), timeout=5))
            fast = await client.request(_status("fast"), timeout=5)
            assert fast.body == {"slow": False} and not slow_answer.done()
            release.set()
            assert (await slow_answer).body == {"slow": True}

    run(main())


def test_handler_failures_become_error_answers(run: Callable[[Awaitable[Any]], Any]) -> None:
    async def main() -> None:
        async def refuses(env: Envelope) -> Envelope:
            raise RpcError("no room", code="no_capacity")

        def handler(identity: bytes, env: Envelope) -> Any:
            if env.body["kernel_id"] == "sync-crash":
                raise KeyError("boom")
            return refuses(env)

        async with _link(handler) as (_, client):
            with pytest.raises(RpcError) as crashed:
                await client.request(_status("sync-crash"), timeout=5)
            assert crashed.value.code == "internal" and "KeyError" in crashed.value.reason
            with pytest.raises(RpcError) as refused:
                await client.request(_status("async"), timeout=5)
            assert (refused.value.code, refused.value.reason) == ("no_capacity", "no room")

    run(main())


def test_an_invalid_envelope_is_answered_with_bad_message_naming_the_problem(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    async def main() -> None:
        async with _link(lambda identity, env: env.reply()) as (server, _):
            raw_ctx = zmq.asyncio.Context()
            raw = raw_ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            try:
                bad = msgpack.packb({"v": 1, "type": messages.KERNEL_STATUS, "id": "req-7", "body": {}})
                await raw.send(bad)
                answer = msgpack.unpackb(await asyncio.wait_for(raw.recv(), 5))
                assert answer["id"] == "req-7"
                assert answer["body"]["code"] == "bad_message"
                assert "kernel_id" in answer["body"]["reason"]
                await raw.send_multipart([b"one", b"two"])  # a second payload frame
                answer = msgpack.unpackb(await asyncio.wait_for(raw.recv(), 5))
                assert answer["type"] == messages.ERROR and "one payload frame" in answer["body"]["reason"]
            finally:
                raw.close(linger=0)
                raw_ctx.destroy(linger=0)

    run(main())


def test_server_pushes_reach_the_clients_handler_and_its_answer_comes_back(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    async def main() -> None:
        answers: asyncio.Queue[Envelope] = asyncio.Queue()

        def server_handler(identity: bytes, env: Envelope) -> None:
            if env.type == messages.REPLY:
                answers.put_nowait(env)

        async def on_push(env: Envelope) -> Envelope:
            await asyncio.sleep(0)
            return env.reply({"seen": env.body["kernel_id"]})

        async with _link(server_handler, on_message=on_push) as (server, client):
            client.send(Envelope(messages.HOST_HEARTBEAT, {"host_id": "h"}))  # makes the client known
            await asyncio.sleep(0.1)
            push = _status("pushed")
            server.send(b"client", push)
            answer = await asyncio.wait_for(answers.get(), 5)
            assert answer.id == push.id and answer.body == {"seen": "pushed"}

    run(main())


def test_a_request_nobody_answers_times_out_after_its_retries(run: Callable[[Awaitable[Any]], Any]) -> None:
    attempts: list[str] = []

    async def main() -> None:
        def handler(identity: bytes, env: Envelope) -> None:
            attempts.append(env.id)

        async with _link(handler) as (_, client):
            with pytest.raises(RpcTimeout, match="attempts: 2"):
                await client.request(_status("k"), timeout=0.2, retries=1)

    run(main())
    assert len(attempts) == 2 and attempts[0] == attempts[1]  # a retry resends the same id


def test_close_cancels_waiting_requests_and_running_handlers(run: Callable[[Awaitable[Any]], Any]) -> None:
    async def main() -> None:
        started = asyncio.Event()
        cancelled = asyncio.Event()

        async def never(env: Envelope) -> Envelope:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
            raise AssertionError("unreachable")

        ctx = zmq.asyncio.Context()
        server = RpcServer(ctx, lambda identity, env: never(env), name="test-server")
        address = server.bind("tcp://127.0.0.1:0")
        server.start()
        client = RpcClient(ctx, name="test-client")
        client.connect(address)
        waiting = asyncio.ensure_future(client.request(_status("k"), timeout=30))
        await asyncio.wait_for(started.wait(), 5)
        await server.close()
        assert cancelled.is_set()
        await client.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        ctx.destroy(linger=0)  # would hang if a socket were left open

    run(main())


def _batch_run(
    run: Callable[[Awaitable[Any]], Any], send: Callable[[RpcClient], None]
) -> tuple[list[str], list[str], int]:
    """What a server saw of the batch ``send`` sent: the kernel ids its handler ran, in order,
    the envelope types its authoriser judged, and how many it refused (kernel id ``refused``)."""
    ran: list[str] = []
    judged: list[str] = []
    refused = 0

    def handler(identity: bytes, env: Envelope) -> Envelope | None:
        ran.append(env.body["kernel_id"])
        return env.reply() if env.body["kernel_id"] == "last" else None

    def authorize(principal: str, identity: bytes, env: Envelope) -> str | None:
        judged.append(env.type)
        return "not this one" if env.body.get("kernel_id") == "refused" else None

    async def main() -> None:
        nonlocal refused
        async with _link(handler, authorize=authorize) as (server, client):
            send(client)
            await client.request(_status("last"), timeout=5)
            refused = server.refused

    run(main())
    return ran[:-1], judged[:-1], refused


def test_a_batch_runs_its_items_in_order_each_authorised_as_if_it_came_alone(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    envs = [_status("k1"), _status("refused"), _status("k2")]
    ran, judged, refused = _batch_run(run, lambda client: client.send_batch(envs))
    assert ran == ["k1", "k2"]
    assert judged == [messages.BATCH, *[messages.KERNEL_STATUS] * 3]
    assert refused == 1


def test_more_items_than_a_batch_holds_go_in_several_batches_in_order(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    envs = [_status(str(i)) for i in range(messages.MAX_BATCH_ITEMS + 5)]
    ran, judged, _ = _batch_run(run, lambda client: client.send_batch(envs))
    assert ran == [str(i) for i in range(len(envs))]
    assert judged.count(messages.BATCH) == 2


def test_a_batch_of_one_goes_as_that_envelope(run: Callable[[Awaitable[Any]], Any]) -> None:
    ran, judged, _ = _batch_run(run, lambda client: client.send_batch([_status("k1")]))
    assert (ran, judged) == (["k1"], [messages.KERNEL_STATUS])


def test_a_batch_inside_a_batch_and_an_invalid_item_are_refused_and_the_rest_runs(
    run: Callable[[Awaitable[Any]], Any],
) -> None:
    nested = Envelope(messages.BATCH, {"items": [_status("nested").encode()]})
    items = [nested.encode(), b"not an envelope", _status("k1").encode()]
    ran, _, _ = _batch_run(run, lambda client: client.send(Envelope(messages.BATCH, {"items": items})))
    assert ran == ["k1"]


def test_a_batch_must_hold_one_to_the_most_items_all_bytes() -> None:
    one = _status("k1").encode()
    assert messages.validate(messages.BATCH, {"items": [one]}) is None
    assert messages.validate(messages.BATCH, {"items": []}) is not None
    assert messages.validate(messages.BATCH, {"items": ["text"]}) is not None
    assert messages.validate(messages.BATCH, {"items": [one] * (messages.MAX_BATCH_ITEMS + 1)}) is not None
