"""The replica's stdout/stderr: a flush with nothing written costs no IOPub-thread round trip, and
what a cell wrote is still published by its flush (against ipykernel's real IOPub thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from ipykernel.iostream import IOPubThread
from jupyter_client.session import Session

from kernel_replica.streams import LazyFlushOutStream


class CountingIOPubThread(IOPubThread):
    """The real thread, counting what is handed to it."""

    scheduled = 0

    def schedule(self, f: Callable[[], Any]) -> None:
        self.scheduled += 1
        super().schedule(f)


@pytest.fixture
def stream() -> Iterator[tuple[LazyFlushOutStream, CountingIOPubThread, zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    thread = CountingIOPubThread(pub)
    thread.start()
    out = LazyFlushOutStream(Session(key=b""), thread, "stdout", watchfd=False)
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
        content = session.deserialize(msg)["content"]
        text += content.get("text", "")
        if not sub.poll(100):
            break
    return text


def test_flushing_with_nothing_written_hands_nothing_to_the_iopub_thread(stream: Any) -> None:
    out, thread, _sub = stream
    before = thread.scheduled
    out.flush()
    out.flush()
    assert thread.scheduled == before


def test_what_was_written_is_published_by_the_flush(stream: Any) -> None:
    out, thread, sub = stream
    out.write("hello from the cell\n")
    before = thread.scheduled
    out.flush()
    assert thread.scheduled > before
    assert published_text(sub, out.session) == "hello from the cell\n"
