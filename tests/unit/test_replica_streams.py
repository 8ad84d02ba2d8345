"""The replica's stdout/stderr against ipykernel's real IOPub thread: a flush that could change
nothing costs no round trip to that thread, yet a flush stays an ordering barrier for everything
queued there (not only the stream's own text), and what a cell wrote is still published."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from ipykernel.iostream import IOPubThread
from jupyter_client.session import Session

from kernel_replica.streams import BarrierOutStream, _counter


@pytest.fixture
def stream() -> Iterator[tuple[BarrierOutStream, IOPubThread, zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    # PUB drops what it sends before the subscription reached it (a loaded run lost the cell's
    # text): probe until the subscriber hears, then drain the probes
    while True:
        pub.send(b"probe")
        if sub.poll(50):
            break
    while sub.poll(50):
        sub.recv_multipart()
    thread = IOPubThread(pub)
    thread.start()
    out = BarrierOutStream(Session(key=b""), thread, "stdout", watchfd=False)
    try:
        yield out, thread, sub
    finally:
        out.close()
        thread.stop()
        thread.close()
        sub.close(linger=0)
        ctx.term()


def published_text(sub: zmq.Socket[bytes], session: Session) -> str:
    text = ""
    while sub.poll(2000):
        _idents, msg = session.feed_identities(sub.recv_multipart())
        text += session.deserialize(msg)["content"].get("text", "")
        if not sub.poll(100):
            break
    return text


def test_a_flush_with_nothing_written_or_queued_hands_nothing_to_the_iopub_thread(stream: Any) -> None:
    out, thread, _sub = stream
    counter = _counter(thread)
    out.flush()  # whatever start-up queued is drained by this barrier
    before = counter.scheduled
    out.flush()
    out.flush()
    assert counter.scheduled == before


def test_a_flush_still_waits_for_what_others_queued_on_the_iopub_thread(stream: Any) -> None:
    out, thread, _sub = stream
    out.flush()
    gate, ran = threading.Event(), threading.Event()
    thread.schedule(gate.wait)  # an execute_result, say, still on its way out
    thread.schedule(ran.set)
    releaser = threading.Timer(0.2, gate.set)
    releaser.start()
    out.flush()  # the stream is empty, but the flush must not return before those ran
    assert ran.is_set()
    releaser.join()


def test_what_was_written_is_published_by_the_flush(stream: Any) -> None:
    out, _thread, sub = stream
    out.flush()
    out.write("hello from the cell\n")
    out.flush()
    assert published_text(sub, out.session) == "hello from the cell\n"
