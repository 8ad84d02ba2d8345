"""This host's pool of pre-warmed replica runtimes (``kernel_replica.warm`` processes).

A ``replica.start`` takes a ready runtime when there is one and hands it the replica's launch
arguments (kernel and replica ids, connection file, Raft data dir...; see ``kernel_replica/warm.py``),
skipping the interpreter start and the imports; the pool then refills in the background. How many
runtimes to keep is the prewarm policy's answer (``shared/policies/prewarm.py``: fixed, minimum
per host, or Little's law from the observed rate of replica starts here and the observed time a
runtime takes to warm up), reconciled after every take and every ``prewarm.interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from shared.config import Config
from shared.policies.prewarm import (
    ArrivalRate,
    FixedCapacity,
    LittlesLaw,
    MinCapacity,
    PoolView,
    PrewarmPolicy,
    reconcile,
)
from shared.private_files import open_private_file, private_dir
from shared.process_signals import PinnedProcess

log = structlog.get_logger("warm_pool")

SETPRIV = "setpriv"
STOP_GRACE_S = 2.0
DEFAULT_WARMUP_S = 5.0  # W before any runtime has been seen warming up


class WarmRuntime:
    """One ``python -m kernel_replica.warm`` process: starting, ready, then assigned (or stopped)."""

    def __init__(self, process: asyncio.subprocess.Process, log_file: Path, started: float) -> None:
        self.process = process
        self.pin = PinnedProcess.of_child(process.pid)  # its signals, also once it is a replica
        self.log_file = log_file
        self.started = started
        self.ready: asyncio.Future[float] = asyncio.get_running_loop().create_future()  # warm-up seconds
        self.assigned = False
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    @classmethod
    async def spawn(
        cls, *, python: str, imports: list[str], log_file: Path, env: dict[str, str], setpriv: str | None
    ) -> WarmRuntime:
        argv = [python, "-m", "kernel_replica.warm", *(x for name in imports for x in ("--import", name))]
        if setpriv is not None:
            argv = [setpriv, "--pdeathsig", "TERM", *argv]  # dies with this local scheduler
        private_dir(log_file.parent)
        with open_private_file(log_file, "ab") as err:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                env=env,
            )
        runtime = cls(process, log_file, time.monotonic())
        runtime._reader = asyncio.ensure_future(runtime._read())
        return runtime

    async def _read(self) -> None:
        """The ``ready`` line, then drain to end of file (the pipe closes when it becomes a replica,
        and asyncio's ``wait()`` returns only once every pipe is closed)."""
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        if line.startswith(b"ready") and not self.ready.done():
            self.ready.set_result(time.monotonic() - self.started)
        elif not self.ready.done():
            self.ready.set_exception(RuntimeError(f"warm runtime {self.pid} ended before it was ready"))
        await self.process.stdout.read()

    async def assign(
        self, *, argv: list[str], env: dict[str, str], log_file: Path, cwd: str | None = None
    ) -> None:
        """Hand over the replica's launch arguments; from now on the process is that replica.
        ``cwd``: the directory it moves to, as a cold start's ``Popen(cwd=...)`` (None: stay)."""
        assert self.process.stdin is not None
        self.assigned = True
        payload = {"argv": argv, "env": env, "log_file": str(log_file), "cwd": cwd}
        self.process.stdin.write(json.dumps(payload).encode() + b"\n")
        await self.process.stdin.drain()
        self.process.stdin.close()
        with contextlib.suppress(OSError):
            self.log_file.unlink()  # its warm-up output; the replica logs to its own file

    async def stop(self) -> None:
        """End an unassigned runtime: end of input (it exits), then SIGTERM/SIGKILL its group."""
        await end_process(self.process, self.pin)
        if self._reader is not None:
            self._reader.cancel()
        with contextlib.suppress(OSError):
            self.log_file.unlink()


def make_prewarm_policy(
    name: str, *, per_host: int, max_per_host: int, headroom: float, arrival_rate: float, warmup_s: float
) -> PrewarmPolicy | None:
    if name == "fixed":
        return FixedCapacity(per_host)
    if name == "min":
        return MinCapacity(per_host)
    if name == "littles_law":
        return LittlesLaw(arrival_rate, warmup_s, headroom=headroom, min_per_host=per_host)
    if name == "none":
        return None
    raise ValueError(f"unknown prewarm policy {name!r}; known: none, fixed, min, littles_law")


class WarmPool:
    def __init__(
        self,
        cfg: Config,
        *,
        host_id: str,
        directory: Path,
        idle_gpus: Callable[[], int] = lambda: 0,
        python: str | None = None,
    ) -> None:
        section = cfg["prewarm"]
        self.host_id = host_id
        self.policy_name = str(section["policy"])
        self.per_host = int(section["per_host"])
        self.max_per_host = int(section["max_per_host"])
        self.headroom = float(section["headroom"])
        self.interval = float(section["interval_s"])
        self.imports = [str(m) for m in section["imports"]]
        make_prewarm_policy(  # a bad name fails at start-up, not at the first refill
            self.policy_name, per_host=1, max_per_host=1, headroom=1.0, arrival_rate=0.0, warmup_s=1.0
        )
        self.arrivals = ArrivalRate(half_life_s=float(section["half_life_s"]))
        self.warmup_s: deque[float] = deque(maxlen=50)
        self.directory = directory
        self.idle_gpus = idle_gpus
        self.python = python or str(cfg.get("kernel.python")) or sys.executable
        self.ready: list[WarmRuntime] = []
        self.starting: set[WarmRuntime] = set()
        self.taken = 0
        self.misses = 0  # replica starts that found no ready runtime
        self._counter = 0
        self._spawning = 0  # processes being created, not yet in ``starting``
        self._wake = asyncio.Event()
        self.taken_event = asyncio.Event()  # a runtime was taken: report to the controller now
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # the serving controller's target for this host, and when it came (``follow``)
        self._followed: tuple[int, float] | None = None
        self._follow_fresh_s = max(3 * self.interval, 5.0)

    @property
    def enabled(self) -> bool:
        return self.policy_name != "none"

    def follow(self, target: int) -> None:
        """The serving controller's target for this host: kept until a newer one comes, or until
        none came for a while (the controller is gone: the local policy decides again)."""
        changed = self._followed is None or self._followed[0] != target
        self._followed = (max(0, target), time.monotonic())
        if changed:
            self._wake.set()

    def policy(self) -> PrewarmPolicy | None:
        if self.enabled and self._followed is not None:
            target, at = self._followed
            if time.monotonic() - at <= self._follow_fresh_s:
                return FixedCapacity(target)
        warmup = statistics.median(self.warmup_s) if self.warmup_s else DEFAULT_WARMUP_S
        return make_prewarm_policy(
            self.policy_name,
            per_host=self.per_host,
            max_per_host=self.max_per_host,
            headroom=self.headroom,
            arrival_rate=self.arrivals.rate(time.monotonic()),
            warmup_s=warmup,
        )

    def view(self) -> PoolView:
        self.ready = [r for r in self.ready if r.alive]
        return PoolView(
            self.host_id,
            warm=len(self.ready),
            starting=len(self.starting) + self._spawning,
            idle_gpus=self.idle_gpus(),
            max_warm=self.max_per_host,
        )

    def report(self) -> dict[str, int]:
        """What the heartbeat carries (``cluster.status`` shows it per host)."""
        view = self.view()
        policy = self.policy()
        target = policy.targets([view]).get(self.host_id, 0) if policy is not None else 0
        return {
            "warm": view.warm,
            "starting": view.starting,
            "target": target,
            "taken": self.taken,
            "misses": self.misses,
        }

    def pool_report(self) -> dict[str, Any]:
        """What the serving controller decides from (``pool.report``)."""
        view = self.view()
        body: dict[str, Any] = {
            "host_id": self.host_id,
            "warm": view.warm,
            "starting": view.starting,
            "idle_gpus": view.idle_gpus,
            "taken": self.taken,
            "misses": self.misses,
        }
        if self.warmup_s:
            body["warmup_s"] = statistics.median(self.warmup_s)
        return body

    def take(self) -> WarmRuntime | None:
        """A ready runtime for a replica start (None: start cold); the pool refills behind it."""
        if not self.enabled:
            return None
        self.arrivals.observe(time.monotonic())
        runtime = None
        while self.ready:
            candidate = self.ready.pop(0)
            if candidate.alive:
                runtime = candidate
                break
        if runtime is None:
            self.misses += 1
        else:
            self.taken += 1
        self._wake.set()
        self.taken_event.set()
        return runtime

    async def run(self) -> None:
        """Keep the pool at its policy's target until cancelled."""
        if not self.enabled:
            return
        while not self._closed:
            try:
                await self._reconcile()
            except Exception:
                log.exception("warm_pool_reconcile_failed", host=self.host_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()

    async def _reconcile(self) -> None:
        policy = self.policy()
        if policy is None:
            return
        for action in reconcile(policy, [self.view()]):
            for _ in range(action.start):
                self._start_one()
            for _ in range(action.stop):
                if self.ready:
                    runtime = self.ready.pop()
                    self._background(runtime.stop())

    def _start_one(self) -> None:
        async def warm_up() -> None:
            self._counter += 1
            env = runtime_env(self.host_id)
            self._spawning += 1
            try:
                runtime = await WarmRuntime.spawn(
                    python=self.python,
                    imports=self.imports,
                    log_file=self.directory / f"warm-{os.getpid()}-{self._counter}.log",
                    env=env,
                    setpriv=setpriv_path(),
                )
            finally:
                self._spawning -= 1
            if self._closed:
                await runtime.stop()
                return
            self.starting.add(runtime)
            try:
                seconds = await runtime.ready
            except Exception as exc:
                log.warning("warm_runtime_failed", host=self.host_id, pid=runtime.pid, reason=str(exc))
                await runtime.stop()
                return
            finally:
                self.starting.discard(runtime)
            self.warmup_s.append(seconds)
            if self._closed:
                await runtime.stop()
                return
            self.ready.append(runtime)
            log.debug("warm_runtime_ready", host=self.host_id, pid=runtime.pid, seconds=round(seconds, 3))

        self._background(warm_up())

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop every unassigned runtime (the local scheduler is stopping)."""
        self._closed = True
        self._wake.set()
        runtimes = [*self.ready, *self.starting]
        self.ready.clear()
        await asyncio.gather(*(r.stop() for r in runtimes), return_exceptions=True)
        # warm-ups in flight see the pool closed (or their runtime stopped) and stop it themselves
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=STOP_GRACE_S * 3)
        for task in list(self._tasks):
            task.cancel()


async def end_process(process: asyncio.subprocess.Process, pin: PinnedProcess) -> None:
    """End of input (a runtime or a template exits on it), then SIGTERM, then SIGKILL to its group
    (through ``pin``: never a group that got its number once it was reaped)."""
    if process.stdin is not None and not process.stdin.is_closing():
        process.stdin.close()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            pin.signal_group(sig)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), STOP_GRACE_S)
        except TimeoutError:
            continue
        pin.reaped()
        pin.close()
        return


def runtime_env(host_id: str) -> dict[str, str]:
    """A runtime's environment before its assignment: ours, with this checkout first on its path."""
    env = dict(os.environ)
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    env["TANDEM_HOST_ID"] = host_id
    return env


def setpriv_path() -> str | None:
    import shutil

    return shutil.which(SETPRIV) if sys.platform.startswith("linux") else None
