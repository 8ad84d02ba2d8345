"""This host's runtime template (``kernel_replica.template``, a fork server): with
``prewarm.template`` on, a replica start forks a runtime from it in milliseconds instead of taking
a pre-warmed one or starting an interpreter, and a resumed kernel's recorded modules (its image's
``imports``) are imported by the template first, so the forked replica only loads its namespace.

A forked runtime is the template's child, not this process's: the template reports its pid when
it forks and its exit status when it ends, and ``ForkedProcess`` turns those lines into what
``ReplicaProcess`` needs of an ``asyncio.subprocess.Process`` (pid, returncode, ``wait()``). The
template is started with ``setpriv --pdeathsig`` (it dies with this local scheduler) and its
children die with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import structlog

from services.local_scheduler.warm_pool import end_process
from shared.private_files import open_private_file, private_dir
from shared.process_signals import PinnedProcess

log = structlog.get_logger("runtime_template")

FORK_TIMEOUT_S = 120.0  # the template imports the image's modules first (torch: seconds)


class TemplateGone(RuntimeError):
    """The template ended (or never became ready): the start goes on without it."""


class ForkedProcess:
    """A runtime forked by the template, as ``ReplicaProcess`` sees a process. ``pin``: pinned by
    the start time the template read before it could reap it (None: it was gone already)."""

    def __init__(self, pid: int, start_ticks: int | None) -> None:
        self.pid = pid
        self.pin = PinnedProcess.of_pid(pid, start_ticks=start_ticks)
        self.returncode: int | None = None
        self._done = asyncio.get_running_loop().create_future()

    def ended(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
        if not self._done.done():
            self._done.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


class RuntimeTemplate:
    def __init__(
        self, *, python: str, imports: list[str], directory: Path, env: dict[str, str], setpriv: str | None
    ) -> None:
        self.python = python
        self.imports = imports
        self.directory = directory
        self.env = env
        self.setpriv = setpriv
        self.ready: asyncio.Future[float] | None = None
        self.forks = 0
        self._process: asyncio.subprocess.Process | None = None
        self._pin: PinnedProcess | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, int | None]]] = {}  # -> (pid, start ticks)
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exit lines that came before their fork answer was read
        self._lock = asyncio.Lock()
        self._counter = 0

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.returncode is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Start the template (its imports run in the background; ``fork`` waits for them)."""
        argv = [
            self.python,
            "-m",
            "kernel_replica.template",
            *(x for m in self.imports for x in ("--import", m)),
        ]
        if self.setpriv is not None:
            argv = [self.setpriv, "--pdeathsig", "TERM", *argv]
        private_dir(self.directory)
        started = time.monotonic()
        with open_private_file(self.directory / f"template-{os.getpid()}.log", "ab") as err:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                env=self.env,
            )
        self._pin = PinnedProcess.of_child(self._process.pid)
        self.ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read(started))
        log.info("runtime_template_started", pid=self._process.pid, imports=self.imports)

    async def _read(self, started: float) -> None:
        assert self._process is not None and self._process.stdout is not None and self.ready is not None
        try:
            while line := await self._process.stdout.readline():
                word, _, rest = line.decode().strip().partition(" ")
                if word == "ready" and not self.ready.done():
                    self.ready.set_result(time.monotonic() - started)
                elif word == "forked":
                    ident, pid, *start = rest.split()  # its start ticks: -1 where unknown
                    self._settle(int(ident), int(pid), int(start[0]) if start and start[0] != "-1" else None)
                elif word == "failed":
                    ident, _, reason = rest.partition(" ")
                    future = self._pending.pop(int(ident), None)
                    if future is not None and not future.done():
                        future.set_exception(TemplateGone(reason))
                elif word == "exit":
                    pid, code = rest.split()
                    child = self._children.pop(int(pid), None)
                    if child is None:
                        self._early_exits[int(pid)] = int(code)
                    else:
                        child.ended(int(code))
        finally:
            self._gone("the runtime template ended")

    def _settle(self, ident: int, pid: int, start_ticks: int | None) -> None:
        future = self._pending.pop(ident, None)
        if future is not None and not future.done():
            future.set_result((pid, start_ticks))

    def _gone(self, reason: str) -> None:
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(TemplateGone(reason))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(TemplateGone(reason))
        self._pending.clear()
        for child in self._children.values():  # they got SIGTERM with it (PR_SET_PDEATHSIG)
            child.ended(-signal.SIGTERM)
        self._children.clear()

    async def fork(self, assignment: dict[str, Any], imports: list[str]) -> ForkedProcess:
        """A runtime that becomes the replica ``assignment`` describes (the launch of
        ``kernel_replica/warm.py``), after the template imported ``imports``; TemplateGone if the
        template cannot fork one."""
        if not self.alive or self.ready is None:
            raise TemplateGone("no runtime template running")
        await asyncio.shield(self.ready)
        process = self._process
        assert process is not None and process.stdin is not None
        async with self._lock:  # one request line at a time
            self._counter += 1
            ident = self._counter
            future: asyncio.Future[tuple[int, int | None]] = asyncio.get_running_loop().create_future()
            self._pending[ident] = future
            request = {"id": ident, "imports": imports, "assignment": assignment}
            try:
                process.stdin.write(json.dumps(request).encode() + b"\n")
                await process.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                self._pending.pop(ident, None)
                raise TemplateGone(f"the runtime template is gone: {exc}") from None
        pid, start_ticks = await asyncio.wait_for(future, FORK_TIMEOUT_S)
        child = ForkedProcess(pid, start_ticks)
        early = self._early_exits.pop(pid, None)
        if early is not None:
            child.ended(early)
        else:
            self._children[pid] = child
        self.forks += 1
        return child

    async def close(self) -> None:
        """End of input, then SIGTERM/SIGKILL its group (its runtimes are stopped before this)."""
        if self._process is None:
            return
        assert self._pin is not None
        await end_process(self._process, self._pin)
        if self._reader is not None:
            self._reader.cancel()
