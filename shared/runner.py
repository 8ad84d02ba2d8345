"""Run a service's main coroutine on uvloop and stop it cleanly on SIGTERM or Ctrl-C.

A service is ``async def main(stop: asyncio.Event) -> None``: it starts its sockets, waits for
``stop``, then closes everything it opened. A second signal while shutting down forces exit, so
an operator is never stuck with a hung process.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import structlog
import uvloop

ServiceMain = Callable[[asyncio.Event], Awaitable[None]]

SHUTDOWN_GRACE_S = 10.0


async def cancel_and_wait(tasks: Collection[asyncio.Future[Any]], *, again_s: float = 0.1) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling again while any runs.

    One ``cancel()`` is not always enough on Python 3.11: ``asyncio.wait_for`` swallows a
    cancellation that arrives as the awaitable it waits on completes (rewritten in 3.12), so a
    service loop that awaits ``wait_for`` (an RPC with a timeout, a heartbeat) can run on after its
    ``cancel()``; a shutdown gathering it then hung until SHUTDOWN_GRACE_S (a local scheduler
    stopped 35 ms after a replica start, 2 runs in ~120 of its test). Exceptions are retrieved, not raised."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()


def _pending_tasks() -> list[str]:
    """Where each unfinished task is suspended (innermost frame), so a hung shutdown names its cause."""
    where = []
    for task in asyncio.all_tasks():
        stack = task.get_stack()
        frame = stack[-1] if stack else None
        at = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"
        where.append(f"{task.get_coro()!r} at {at}")
    return where


def run_service(main: ServiceMain, *, name: str) -> int:
    log = structlog.get_logger(name)

    async def supervise() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals_seen = 0

        def on_signal(signum: int) -> None:
            nonlocal signals_seen
            signals_seen += 1
            if signals_seen > 1:
                log.warning("forced_exit", signal=signal.Signals(signum).name)
                os._exit(130)
            log.info("stopping", signal=signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        task = asyncio.ensure_future(main(stop))
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            stopper.cancel()
            task.result()  # re-raise a crash so the exit code says so
            return 0
        try:
            await asyncio.wait_for(task, SHUTDOWN_GRACE_S)
        except TimeoutError:
            log.error("shutdown_timed_out", grace_s=SHUTDOWN_GRACE_S, waiting_on=_pending_tasks())
            return 1
        return 0

    return uvloop.run(supervise())
