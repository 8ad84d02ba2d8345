"""How long the global scheduler's event loop stalls while 60 held 1 MB cells are journaled.

A quick measurement, not a benchmark: the Migrator's calls are replayed against ``HeldJournal``
on a running loop (hold the first cell, queue 59 more behind it, send them all on), while a
ticker records the longest gap between its 1 ms ticks. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.global_scheduler.held_journal import HeldJournal, HeldQueue

CELLS = 60
CELL_BYTES = 1 << 20


async def measure(directory: Path) -> dict[str, float]:
    journal = HeldJournal(directory)
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    cells = [(b"sig", b"{}", b"{}", b"{}", os.urandom(CELL_BYTES)) for _ in range(CELLS)]
    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    held: list[tuple[bytes, ...]] = []
    for cell in cells:
        held.append(cell)
        journal.save("kernel-1", HeldQueue("m0", 0, False, tuple(held)))
        await asyncio.sleep(0)  # the next request arrives on a later loop turn
    journal.save("kernel-1", None)  # sent on
    elapsed = time.perf_counter() - started
    await asyncio.sleep(0.05)
    done.set()
    await tick
    flush = getattr(journal, "close", None)
    if flush is not None:
        flush()
    return {"cells": CELLS, "max_stall_ms": round(max(gaps) * 1000, 1), "loop_busy_s": round(elapsed, 3)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(measure(Path(tmp)))))


if __name__ == "__main__":
    main()
