"""``DrainingSocket`` against real ZMQ sockets, on both event loops the services use.

ZMQ's FD is edge-triggered: these tests pin down the ways a reader-callback receive loop can lose
or stall messages (a backlog that predates the reader, a send that swallows the readable edge,
messages arriving while a handler runs) and that closing stops delivery for good.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from shared.zmq_drain import DrainingSocket


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _pair(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A ROUTER (to drain) and a connected DEALER peer with identity ``peer``."""
    router: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.IDENTITY, b"peer")
    peer.connect(f"tcp://127.0.0.1:{port}")
    return router, peer


def _wait_queued(sock: zmq.Socket[bytes], timeout: float = 5.0) -> None:
    """Block (without running the loop) until ``sock`` has a message; does not consume it."""
    assert sock.poll(int(timeout * 1000), zmq.POLLIN), "nothing arrived"


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached: a message was lost or stalled"
        await asyncio.sleep(0.005)


def test_backlog_queued_before_start_is_delivered_in_order(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    for i in range(500):
        peer.send(str(i).encode())
    _wait_queued(router)
    time.sleep(0.05)  # let the I/O thread queue the rest too
    got: list[bytes] = []

    async def main() -> None:
        drained = DrainingSocket(router, lambda frames: got.append(frames[1]), name="t")
        drained.start()
        await _until(lambda: len(got) == 500)
        drained.close()

    run(main())
    assert got == [str(i).encode() for i in range(500)]


def test_a_send_that_swallows_the_readable_edge_does_not_stall_a_waiting_message(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    got: list[bytes] = []

    async def main() -> None:
        drained = DrainingSocket(router, lambda frames: got.append(frames[1]), name="t")
        drained.start()
        peer.send(b"hello")
        await _until(lambda: got == [b"hello"])
        for i in range(50):
            # The message is queued while the loop is blocked; our own send then processes the
            # socket's mailbox, consuming the FD's edge before the loop ever sees it.
            peer.send(str(i).encode())
            _wait_queued(router)
            drained.send_multipart([b"peer", b"ack"])
            await _until(lambda i=i: len(got) == i + 2, timeout=2.0)
        drained.close()

    run(main())
    assert got == [b"hello", *(str(i).encode() for i in range(50))]


def test_messages_arriving_while_a_handler_runs_are_not_lost(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    got: list[bytes] = []

    async def main() -> None:
        drained: DrainingSocket

        def handler(frames: list[bytes]) -> None:
            got.append(frames[1])
            drained.send_multipart([frames[0], b"echo:" + frames[1]])  # answered inline, same socket
            if len(got) % 10 == 0:
                time.sleep(0.01)  # a slow handler: more arrive meanwhile

        drained = DrainingSocket(router, handler, name="t", max_batch=4)
        drained.start()
        echoes: list[bytes] = []
        for i in range(300):
            peer.send(str(i).encode())
            if i % 3 == 0:  # ping-pong part of the time, so arrivals interleave with the handler
                await _until(lambda: bool(peer.poll(0)))
                while peer.poll(0):
                    echoes.append(peer.recv())
        await _until(lambda: len(got) == 300)
        await _until(lambda: (echoes.extend(_drain_peer(peer)), len(echoes))[1] == 300)
        drained.close()
        assert echoes == [b"echo:" + str(i).encode() for i in range(300)]

    run(main())
    assert got == [str(i).encode() for i in range(300)]


def _drain_peer(peer: zmq.Socket[bytes]) -> list[bytes]:
    out = []
    while peer.poll(0):
        out.append(peer.recv())
    return out


def test_batch_limit_yields_to_the_loop_and_still_delivers_everything(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    for i in range(10):
        peer.send(str(i).encode())
    _wait_queued(router)
    time.sleep(0.05)
    got: list[bytes] = []
    batches: list[int] = []

    async def main() -> None:
        drained = DrainingSocket(
            router,
            lambda frames: got.append(frames[1]),
            name="t",
            max_batch=3,
            on_drained=lambda: batches.append(len(got)),
        )
        drained.start()
        await _until(lambda: len(got) == 10)
        drained.close()

    run(main())
    assert got == [str(i).encode() for i in range(10)]
    assert batches[:4] == [3, 6, 9, 10]


def test_a_failing_handler_does_not_stop_delivery(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    got: list[bytes] = []

    def handler(frames: list[bytes]) -> None:
        if frames[1] == b"bad":
            raise RuntimeError("boom")
        got.append(frames[1])

    async def main() -> None:
        drained = DrainingSocket(router, handler, name="t")
        drained.start()
        for payload in (b"a", b"bad", b"b"):
            peer.send(payload)
        await _until(lambda: got == [b"a", b"b"])
        drained.close()

    run(main())


def test_close_stops_delivery_and_closes_the_socket(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    got: list[bytes] = []

    async def main() -> None:
        drained: DrainingSocket

        def handler(frames: list[bytes]) -> None:
            got.append(frames[1])
            if frames[1] == b"last":
                drained.close()  # closing from inside a handler ends the drain at once

        drained = DrainingSocket(router, handler, name="t")
        drained.start()
        for payload in (b"a", b"last", b"after"):
            peer.send(payload)
        await _until(lambda: drained.closed)
        peer.send(b"later")
        await asyncio.sleep(0.1)  # a reader left armed on a closed socket would fire (or crash) here
        drained.close()  # idempotent
        assert router.closed

    run(main())
    assert got == [b"a", b"last"]


def test_stop_before_the_scheduled_first_drain_delivers_nothing(
    ctx: zmq.Context[Any], run: Callable[[Awaitable[Any]], Any]
) -> None:
    router, peer = _pair(ctx)
    peer.send(b"queued")
    _wait_queued(router)
    got: list[list[bytes]] = []

    async def main() -> None:
        drained = DrainingSocket(router, got.append, name="t")
        drained.start()
        drained.stop()
        await asyncio.sleep(0.05)
        assert not router.closed  # stop() leaves the socket to its owner
        with pytest.raises(RuntimeError):
            drained.start()

    run(main())
    assert got == []
    router.close(linger=0)


def test_an_asyncio_socket_is_refused_with_a_clear_error() -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(TypeError, match=r"plain zmq\.Socket"):
            DrainingSocket(sock, lambda frames: None, name="t")
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


def test_send_multipart_refuses_an_empty_message(ctx: zmq.Context[Any]) -> None:
    router, _ = _pair(ctx)
    with pytest.raises(ValueError, match="at least one frame"):
        DrainingSocket(router, lambda frames: None, name="t").send_multipart([])
