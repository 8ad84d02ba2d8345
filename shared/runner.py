"""Run a service's main coroutine on uvloop and stop it cleanly on SIGTERM or Ctrl-C.

A service is ``async def main(stop: asyncio.Event) -> None``: it starts its sockets, waits for
``stop``, then closes everything it opened. A second signal while shutting down forces exit, so
an operator is never stuck with a hung process.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

import structlog
import uvloop

ServiceMain = Callable[[asyncio.Event], Awaitable[None]]

SHUTDOWN_GRACE_S = 10.0


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
            log.error("shutdown_timed_out", grace_s=SHUTDOWN_GRACE_S)
            return 1
        return 0

    return uvloop.run(supervise())
