"""The agent's link to the data store: an asyncio loop on its own thread, called from plain threads.

The store is async (its Redis and S3 clients belong to one event loop); the copying thread and the
restore thread are plain threads. ``StoreLink`` runs the store's loop and hands back
``concurrent.futures.Future`` objects. It also bounds the bytes in flight, so a slow store makes
the copying thread wait instead of buffering the whole model.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from shared.background_threads import background_thread
from shared.datastore import DataStore, ObjectRef
from shared.datastore.buffers import Buffer, as_bytes_view, nbytes

T = TypeVar("T")

DEFAULT_INFLIGHT_BYTES = 256 * 1024 * 1024


class StoreLink:
    """Puts and gets on a ``DataStore`` from any thread."""

    def __init__(
        self,
        store: DataStore,
        loop: asyncio.AbstractEventLoop,
        *,
        inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        owns_loop: bool = False,
    ) -> None:
        self.store = store
        self.loop = loop
        self._owns_loop = owns_loop
        self._thread: threading.Thread | None = None
        self._limit = inflight_bytes
        self._inflight = 0
        self._room = threading.Condition()
        # Told of every object a put stored (on the store's loop thread): a job journals them, so
        # what a capture killed mid-way stored is known and collected (no commit will name it).
        self.on_stored: Callable[[ObjectRef], None] | None = None

    @classmethod
    def start(
        cls, open_store: Callable[[], Awaitable[DataStore]], *, inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    ) -> StoreLink:
        """A link with a loop thread of its own, the store opened on that loop."""
        loop = asyncio.new_event_loop()
        thread = background_thread(loop.run_forever, name="checkpoint-store")
        thread.start()
        try:
            store = asyncio.run_coroutine_threadsafe(_await(open_store), loop).result()
        except BaseException:  # a store that does not open: no loop thread left behind per attempt
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        link = cls(store, loop, inflight_bytes=inflight_bytes, owns_loop=True)
        link._thread = thread
        return link

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def put(self, data: Buffer) -> Future[ObjectRef]:
        """Store ``data`` (kept alive by the caller until the future is done); blocks while the
        bytes already in flight exceed the limit."""
        size = nbytes(data)
        with self._room:
            self._room.wait_for(lambda: self._inflight == 0 or self._inflight + size <= self._limit)
            self._inflight += size
        future = self._submit(self.store.put(data))
        future.add_done_callback(lambda done: self._stored(done, size))
        return future

    def put_many(self, buffers: list[Any]) -> Future[ObjectRef]:
        """Store the concatenation of ``buffers`` as one object (a pack of pieces)."""
        views = [as_bytes_view(b) for b in buffers]
        size = sum(v.nbytes for v in views)
        with self._room:
            self._room.wait_for(lambda: self._inflight == 0 or self._inflight + size <= self._limit)
            self._inflight += size
        future = self._submit(self.store.put_stream(views, size_hint=size))
        future.add_done_callback(lambda done: self._stored(done, size))
        return future

    def _stored(self, done: Future[ObjectRef], size: int) -> None:
        with self._room:
            self._inflight -= size
            self._room.notify_all()
        if self.on_stored is not None and not done.cancelled() and done.exception() is None:
            self.on_stored(done.result())

    def get(self, ref: ObjectRef) -> Future[memoryview]:
        return self._submit(self.store.get(ref))

    def get_into(self, ref: ObjectRef, view: memoryview) -> Future[None]:
        return self._submit(self.store.get_into(ref, view))

    def delete(self, ref: ObjectRef) -> Future[bool]:
        return self._submit(self.store.delete(ref))

    def close(self) -> None:
        """Close the store; stop the loop thread if this link started it."""
        if self._owns_loop:
            self._submit(self.store.close()).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self._thread is not None:
                self._thread.join()
            self.loop.close()


async def _await(factory: Callable[[], Awaitable[DataStore]]) -> DataStore:
    return await factory()
