"""Fixtures shared by unit tests of the asyncio shells."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,  # what the services run on
}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Iterator[Callable[[Awaitable[Any]], Any]]:
    """Runs a coroutine to completion on each event loop the services may use."""
    with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
        yield runner.run


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a service under test writes to its state dir (the scheduler's held queues, say)
    goes to the test's own directory, never the user's ``~/.tandem``, nor leaks into the next test."""
    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path / "tandem-state"))


@pytest.fixture
def gs() -> Iterator[Any]:
    """A global scheduler on its own event loop, not bound: for tests that call its handlers."""
    from services.global_scheduler.service import GlobalScheduler  # a heavy import: only when used
    from shared.config import load_config

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    scheduler = GlobalScheduler(load_config())
    yield scheduler
    scheduler._server._sock.close(linger=0)
    scheduler._ctx.destroy(linger=0)
    loop.close()
