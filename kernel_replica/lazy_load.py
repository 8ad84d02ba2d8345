"""On-demand restore of a standby's large objects (issue #17): what is still loading, and in which order.

A committed STATE entry's large groups (a data store pointer or a background image) are not read
before the standby does anything else: the entry records which names they carry, and a loader
reads them in the background, in log order (``LazyLoader`` below, the thread-and-store shell the kernel drives).
When this replica must run code first (it became the executor, a comm message came), the groups
holding the names the code may touch are loaded first (``demand``) and the rest go on loading.

``PendingLoads`` is the pure core of that: no I/O, no threads. It keeps, per pending group, the
names still wanted from it. A later entry that binds or deletes a name (an import, a small group
applied at once, a later large group, a deletion) supersedes the earlier load of that name: that
load no longer takes it, and a load left wanting nothing is dropped. So a value that lands late
never overwrites a newer one, and a name is pending in at most one load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kernel_replica.object_codec import EncodedGroup, fill_group, group_values, payload_buffer
from shared.background_threads import background_thread
from shared.checkpoint.manifest import ReadInterrupted
from shared.checkpoint.pusher import StoreLink
from shared.datastore import DataStore


@dataclass(eq=False)
class Load:
    """One large group of a STATE entry, still to be read: ``names`` are those still wanted."""

    seq: int  # log order of the entry (and group) it came from
    group: Mapping[str, Any]  # EncodedGroup.to_dict()
    names: set[str]
    msg_id: str = ""
    demanded: bool = False  # code waits for it: read before the others
    interrupted: bool = False  # being read, but a demanded load must go first: give up, read later

    @property
    def nbytes(self) -> int:
        return sum(int(size) for size in self.group.get("sizes", ()))


@dataclass
class PendingLoads:
    """The large groups not loaded yet, and which name each one still gives."""

    _loads: list[Load] = field(default_factory=list)  # log order
    _by_name: dict[str, Load] = field(default_factory=dict)
    _seq: int = 0

    def __bool__(self) -> bool:
        return bool(self._loads)

    def __len__(self) -> int:
        return len(self._loads)

    def names(self) -> frozenset[str]:
        """Every name whose value (as the log holds it) is still loading."""
        return frozenset(self._by_name)

    def add(self, group: Mapping[str, Any], names: Iterable[str], msg_id: str = "") -> Load | None:
        """A large group to load, taking ``names`` of it; they supersede earlier loads of them.
        None when it takes no name."""
        wanted = set(names)
        self.supersede(wanted)
        if not wanted:
            return None
        load = Load(self._seq, group, wanted, msg_id)
        self._seq += 1
        self._loads.append(load)
        for name in wanted:
            self._by_name[name] = load
        return load

    def supersede(self, names: Iterable[str]) -> None:
        """``names`` got a newer value (or were deleted) by a later entry applied at once: no
        pending load may take them any more."""
        for name in names:
            load = self._by_name.pop(name, None)
            if load is None:
                continue
            load.names.discard(name)
            if not load.names:
                self._loads.remove(load)

    def demand(self, names: Collection[str] | None) -> list[Load]:
        """The loads that give any of ``names`` (None: every load), in log order, marked to go
        first; what code that touches ``names`` must wait for."""
        if names is None:
            wanted = list(self._loads)
        else:
            found = {id(self._by_name[n]): self._by_name[n] for n in names if n in self._by_name}
            wanted = [load for load in self._loads if id(load) in found]
        for load in wanted:
            load.demanded = True
        return wanted

    def next(self) -> Load | None:
        """The load to read next: the oldest demanded one, else the oldest."""
        for load in self._loads:
            if load.demanded:
                return load
        return self._loads[0] if self._loads else None

    def finish(self, load: Load) -> frozenset[str]:
        """``load`` was read (or failed): the names to take from it now, those no later entry
        superseded meanwhile; it leaves the pending set."""
        if load in self._loads:
            self._loads.remove(load)
        taken = frozenset(load.names)
        for name in taken:
            if self._by_name.get(name) is load:
                del self._by_name[name]
        load.names.clear()
        return taken

    def pending(self, load: Load) -> bool:
        return any(entry is load for entry in self._loads)


class LazyLoader:
    """The shell around ``PendingLoads``, on the kernel's main loop: reads one pending group at a
    time on a loader thread (the store through a ``StoreLink``, its own loop thread), then
    unpickles it and hands the still-wanted names to ``take`` on the main loop (the namespace's
    thread). Neither the Raft thread nor the main loop reads or copies a payload; memory: the
    group being read (the buffer that becomes its values) plus a few packs read ahead."""

    def __init__(
        self,
        open_store: Callable[[], Awaitable[DataStore]],
        take: Callable[[Load, frozenset[str], Mapping[str, Any] | None, BaseException | None], None],
        namespace: Callable[[], dict[str, Any] | None],
        *,
        pacer: Callable[[], None] | None = None,
    ) -> None:
        """``take(load, names, values, error)``: values None and ``error`` set when the read failed.
        ``pacer``: called on the loader thread before each piece of an image (tests hold it)."""
        self.pending = PendingLoads()
        self._open_store = open_store
        self._take = take
        self._namespace = namespace
        self._link: StoreLink | None = None
        self._task: asyncio.Future[None] | None = None
        self._current: Load | None = None  # being read
        self._pacer = pacer
        self._changed = asyncio.Event()
        self.loading_since: float | None = None  # monotonic: when the pending set last became non-empty
        self.on_busy: Callable[[], None] | None = None  # the pending set became non-empty
        self.on_idle: Callable[[], None] | None = None  # and emptied again

    def add(self, group: Mapping[str, Any], names: Iterable[str], msg_id: str = "") -> None:
        if self.pending.add(group, names, msg_id) is not None:
            if self.loading_since is None:
                self.loading_since = time.monotonic()
                if self.on_busy is not None:
                    self.on_busy()
            self._run()

    def supersede(self, names: Iterable[str]) -> None:
        self.pending.supersede(names)
        current = self._current
        if current is not None and not current.names:
            current.interrupted = True  # no name left to take from it: stop reading it
        self._notify()

    async def demand(self, names: Collection[str] | None) -> None:
        """Load the groups giving ``names`` (None: all) before anything else; return once they are
        taken (or failed: ``take`` was told)."""
        loads = self.pending.demand(names)
        if not loads:
            return
        current = self._current
        if current is not None and not current.demanded:
            current.interrupted = True  # read again after the demanded ones
        self._run()
        while any(self.pending.pending(load) for load in loads):
            changed = self._changed
            await changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if not self.pending and self.loading_since is not None:
            self.loading_since = None
            if self.on_idle is not None:
                self.on_idle()

    def _run(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._load_all())

    async def _load_all(self) -> None:
        while (load := self.pending.next()) is not None:
            values: Mapping[str, Any] | None = None
            error: BaseException | None = None
            self._current = load
            try:
                group = EncodedGroup.from_dict(load.group)
                whole = await asyncio.wrap_future(self._fill_behind(group, load))
                if load.names:  # not superseded meanwhile: unpickle here (the namespace's thread)
                    values = group_values(group, whole, self._namespace())
            except ReadInterrupted:  # a demanded load goes first; this one stays pending
                load.interrupted = False
                continue
            except Exception as exc:  # a store down, a module missing here: told, never silent
                error = exc
            finally:
                self._current = None
            taken = self.pending.finish(load)
            try:
                self._take(load, taken, values, error)
            finally:
                self._notify()

    def _fill_behind(self, group: EncodedGroup, load: Load) -> Future[memoryview]:
        """``_fill`` on a daemon thread of its own (one group at a time: ``_load_all`` awaits it):
        a read stuck on a store that went away never holds up the process's exit."""
        future: Future[memoryview] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._fill(group, lambda: self._stop(load)))
                except BaseException as exc:
                    future.set_exception(exc)

        background_thread(run, name="lazy-load").start()
        return future

    def _stop(self, load: Load) -> bool:
        """Before each piece of ``load``'s image: whether to give up for a demanded load."""
        if self._pacer is not None:
            self._pacer()
        return load.interrupted

    def _fill(self, group: EncodedGroup, stop: Callable[[], bool]) -> memoryview:
        """On the loader thread: the group's payload, read from the store (``stop``: give up)."""
        if self._link is None:
            self._link = StoreLink.start(self._open_store)
        whole = payload_buffer(group)
        fill_group(group, whole, self._link.get, self._link.get_into, stop)
        return whole

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._link is not None:
            self._link.close()


class LoopLag:
    """The longest a loop went without running its callbacks while watched: a standby's silence
    (a loop that reads an image on its own thread cannot answer the scheduler or Raft meanwhile).
    ``start``/``stop`` from any thread; the probe ticks on ``loop`` every ``interval_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = 0.02) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.max_s = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._last = 0.0
        self._watching = False

    def start(self) -> None:
        self.max_s = 0.0
        self._watching = True
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # its own thread, which may block before the loop turns again
            self._arm()
        else:
            self.loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        if self._watching and self._handle is None:
            self._last = time.perf_counter()
            self._handle = self.loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        self.max_s = max(self.max_s, now - self._last - self.interval_s)
        self._handle = None
        self._arm()

    def stop(self) -> float:
        """Stop watching; the longest silence seen (ms), the one in progress included."""
        self._watching = False
        silence = (
            max(self.max_s, time.perf_counter() - self._last - self.interval_s)
            if self._handle
            else self.max_s
        )
        return max(0.0, silence) * 1000


class Silence:
    """How long the main loop and the Raft loop go silent during some work (``LoopLag`` each)."""

    def __init__(self, main: asyncio.AbstractEventLoop, raft: asyncio.AbstractEventLoop | None) -> None:
        self._lags = [LoopLag(loop) for loop in (main, raft) if loop is not None]
        self._started = time.perf_counter()
        for lag in self._lags:
            lag.start()

    def end(self) -> dict[str, float | None]:
        """``main_lag_ms``, ``raft_lag_ms`` (None without a Raft loop), ``took_ms``."""
        lags = [round(lag.stop(), 1) for lag in self._lags]
        return {
            "main_lag_ms": lags[0],
            "raft_lag_ms": lags[1] if len(lags) > 1 else None,
            "took_ms": round((time.perf_counter() - self._started) * 1000, 1),
        }
