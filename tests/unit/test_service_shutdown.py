"""A service's shutdown ends its loops even when one of them ignores a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from shared.runner import cancel_and_wait


def test_a_loop_that_swallows_its_first_cancellation_is_cancelled_again_until_it_ends() -> None:
    """As Python 3.11's ``wait_for`` does when the cancel meets its awaitable's completion."""
    swallowed = 0

    async def stubborn_loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    async def scenario() -> None:
        loop_task = asyncio.ensure_future(stubborn_loop())
        failed = asyncio.ensure_future(asyncio.sleep(0))
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait([loop_task, failed], again_s=0.01), 2.0)
        assert loop_task.cancelled() and swallowed == 1

    asyncio.run(scenario())


def test_a_task_that_failed_does_not_fail_the_shutdown() -> None:
    async def boom() -> None:
        raise RuntimeError("loop crashed earlier")

    async def scenario() -> None:
        task = asyncio.ensure_future(boom())
        await asyncio.sleep(0)
        await cancel_and_wait([task])
        with pytest.raises(RuntimeError):
            task.result()

    asyncio.run(scenario())
