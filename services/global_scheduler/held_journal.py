"""A kernel's held cells on the global scheduler's disk, so a restarted scheduler still runs them.

A cell held for a migration, and the kernel's later shell requests queued behind it, were never
sent to any replica (a cell held after a failed election was, but no replica ran it): they live
only in the scheduler, and were lost with it, leaving their client waiting. The migrator writes
a kernel's held queue here on every change, and removes it just before sending the cells on, so
a crash in between loses them (a window of microseconds) rather than sending them twice, which
could run a cell twice. A restarted scheduler reads the queue back when it adopts the kernel.

One msgpack file per kernel, replaced atomically and fsync'd (a change is rare: a hold, a queued
request, a dispatch). Written by hand because it is twenty lines of ``os.replace``; no library
in the stack keeps a small durable map.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import msgpack
import structlog

log = structlog.get_logger("global_scheduler.held_journal")

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True, slots=True)
class HeldQueue:
    """What a restarted scheduler needs to hold a kernel's cells again."""

    msg_id: str  # the cell at the head
    round_: int  # its election round (a cell held after a failed election is sent as the next)
    busy_sent: bool  # the client already saw busy for it
    requests: tuple[tuple[bytes, ...], ...]  # the client's frames, head first


class HeldJournal:
    def __init__(self, directory: Path) -> None:
        self._dir = directory

    def _path(self, kernel_id: str) -> Path:
        name = kernel_id if _SAFE_NAME.match(kernel_id) else hashlib.sha256(kernel_id.encode()).hexdigest()
        return self._dir / f"{name}.msgpack"

    def save(self, kernel_id: str, queue: HeldQueue | None) -> None:
        """Record the kernel's held queue (None: nothing held any more). A failure is logged,
        not raised: the scheduler keeps serving, only a restart would lose the cells."""
        path = self._path(kernel_id)
        try:
            if queue is None:
                path.unlink(missing_ok=True)
                return
            self._dir.mkdir(parents=True, exist_ok=True)
            data = msgpack.packb(
                {
                    "kernel_id": kernel_id,
                    "msg_id": queue.msg_id,
                    "round": queue.round_,
                    "busy_sent": queue.busy_sent,
                    "requests": [list(frames) for frames in queue.requests],
                },
                use_bin_type=True,
            )
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("held_queue_not_saved", kernel=kernel_id, path=str(path), error=str(exc))

    def load(self, kernel_id: str) -> HeldQueue | None:
        """The kernel's held queue as last saved; None if there is none or it cannot be read
        (then logged with the reason)."""
        path = self._path(kernel_id)
        try:
            raw = msgpack.unpackb(path.read_bytes(), raw=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            log.warning("held_queue_unreadable", kernel=kernel_id, path=str(path), error=str(exc))
            return None
        try:
            if raw["kernel_id"] != kernel_id:
                raise ValueError(f"the file is for kernel {raw['kernel_id']!r}")
            requests = tuple(tuple(bytes(f) for f in frames) for frames in raw["requests"])
            queue = HeldQueue(str(raw["msg_id"]), int(raw["round"]), bool(raw["busy_sent"]), requests)
            if not requests:
                raise ValueError("no requests")
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("held_queue_unreadable", kernel=kernel_id, path=str(path), error=f"malformed: {exc}")
            return None
        return queue
