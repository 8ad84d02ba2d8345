"""Where new hosts come from when the autoscaler asks for them (NotebookOS §3.4.2).

The global scheduler only knows a ``HostProvider``: ``provision(n)`` starts ``n`` hosts and returns
the ids they will register with; ``release(host_id)`` stops one it provisioned. A cloud deployment
would call its instance API here; the embedded cluster's ``LocalProcessHostProvider`` starts and
stops real local-scheduler processes on this machine.

Those hosts must outlive the scheduler that started them (a restarted scheduler rebuilds its view
from the hosts and must lose no kernel), so they are not tied to its life: their pids are kept in
``<state_dir>/autoscaled-hosts.json`` and a restarted scheduler adopts the ones still running (it
can release them later; such a host is pinned after its command line was checked, so releasing it
never signals a process that got its pid since: ``shared.process_signals``). No orphans still holds: ``tandem up`` is their subreaper once the scheduler
is gone and kills every descendant when it stops, and a scheduler that stops releases its hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from shared.config import Config
from shared.private_files import open_private_file, private_dir, write_private
from shared.process_signals import PinnedProcess, read_stat
from shared.security import curve

log = structlog.get_logger("host_provider")

RELEASE_GRACE_S = 10.0


def hosts_file_name(scheduler_address: str) -> str:
    """Per scheduler address: a scheduler restarted on it adopts its predecessor's hosts."""
    return "autoscaled-hosts-" + "".join(c if c.isalnum() else "-" for c in scheduler_address) + ".json"


HostExited = Callable[[str, int], None]  # (host_id, returncode): a provisioned host's process ended


class HostProvider(Protocol):
    @property
    def can_provision(self) -> bool: ...

    def owns(self, host_id: str) -> bool:
        """Whether ``host_id`` was provisioned here (only those can be released)."""

    async def provision(self, count: int) -> list[str]:
        """Start ``count`` hosts; their ids, which they will register under."""

    async def release(self, host_id: str) -> None:
        """Stop a host this provider started (its local scheduler stops its replicas)."""

    async def close(self) -> None:
        """Release every host still running (the scheduler is stopping)."""


class NoHostProvider:
    """A fixed cluster: nothing to provision (the default outside ``tandem up --max-hosts``)."""

    can_provision = False

    def owns(self, host_id: str) -> bool:
        return False

    async def provision(self, count: int) -> list[str]:
        raise RuntimeError("this cluster has no host provider (autoscale.provider = none)")

    async def release(self, host_id: str) -> None:
        raise RuntimeError(f"host {host_id} was not provisioned by this scheduler")

    async def close(self) -> None:
        return None


class LocalProcessHostProvider:
    """Hosts as ``python -m services.local_scheduler`` processes on this machine."""

    can_provision = True

    def __init__(
        self,
        *,
        scheduler_address: str,
        config_json: str,
        log_dir: Path,
        first_index: int,
        hosts_file: Path | None = None,
        python: str | None = None,
        log_format: str = "json",
        on_exit: HostExited | None = None,
        keys_dir: Path | None = None,
    ) -> None:
        """``keys_dir``: where to issue each new host's key (the operator here is ``tandem up``)."""
        self.scheduler_address = scheduler_address
        self.keys_dir = keys_dir
        self.config_json = config_json
        self.log_dir = log_dir
        self.hosts_file = hosts_file
        self.python = python or sys.executable
        self.log_format = log_format
        self.on_exit = on_exit
        self._next_index = first_index
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._pins: dict[str, PinnedProcess] = {}  # what the signals to a provisioned host go through
        self._adopted: dict[str, PinnedProcess] = {}  # host -> its process, started by a previous scheduler
        self._watchers: set[asyncio.Task[None]] = set()
        self._releasing: set[str] = set()
        self._adopt()

    @classmethod
    def from_config(
        cls, cfg: Config, *, scheduler_address: str, on_exit: HostExited | None = None
    ) -> LocalProcessHostProvider:
        """Host ids continue the embedded cluster's ``host-<n>`` numbering after ``cluster.hosts``."""
        log_dir_cfg = cfg.get("embedded.log_dir")
        log_dir = Path(os.path.expanduser(log_dir_cfg)) if log_dir_cfg else cfg.state_dir() / "logs"
        return cls(
            scheduler_address=scheduler_address,
            config_json=cfg.to_json(),
            log_dir=log_dir,
            first_index=int(cfg.get("cluster.hosts")),
            hosts_file=cfg.state_dir() / hosts_file_name(scheduler_address),
            log_format=str(cfg.get("log.format")),
            on_exit=on_exit,
            keys_dir=cfg.keys_dir(),
        )

    def owns(self, host_id: str) -> bool:
        return host_id in self._processes or host_id in self._adopted

    @property
    def running(self) -> list[str]:
        return sorted([*self._processes, *self._adopted])

    def _runs(self, pid: int, host_id: str) -> bool:
        return runs_host(pid, host_id, self.scheduler_address)

    @staticmethod
    def _still_runs(pinned: PinnedProcess) -> bool:
        """Whether the adopted process still runs (not a zombie, and its pid not someone else's)."""
        stat = read_stat(pinned.pid)
        return stat is not None and stat.state != "Z" and stat.start_ticks == pinned.start_ticks

    def _adopt(self) -> None:
        """Hosts a previous scheduler of this cluster started and that still run."""
        if self.hosts_file is None:
            return
        try:
            recorded = json.loads(self.hosts_file.read_text())
        except (OSError, ValueError):
            return
        for host_id, pid in recorded.items() if isinstance(recorded, dict) else ():
            pinned = (
                PinnedProcess.of_pid(pid, check=lambda p, h=host_id: self._runs(p, h))
                if isinstance(pid, int)
                else None
            )
            if pinned is not None:
                self._adopted[host_id] = pinned
                log.info("host_adopted", host=host_id, pid=pid)
        for host_id in self._adopted:
            index = host_id.rpartition("-")[2]
            if index.isdigit():
                self._next_index = max(self._next_index, int(index) + 1)
        self._save()

    def _save(self) -> None:
        if self.hosts_file is None:
            return
        pids = {h: p.pid for h, p in self._adopted.items()} | {h: p.pid for h, p in self._processes.items()}
        tmp = self.hosts_file.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            write_private(tmp, json.dumps(pids))
            os.replace(tmp, self.hosts_file)

    async def provision(self, count: int) -> list[str]:
        private_dir(self.log_dir)
        started: list[str] = []
        for _ in range(count):
            host_id = f"host-{self._next_index}"
            self._next_index += 1
            if self.keys_dir is not None:
                curve.issue(self.keys_dir, curve.host_principal(host_id))
            argv = [
                self.python, "-m", "services.local_scheduler", "--host-id", host_id,
                "--scheduler", self.scheduler_address, "--config-json", self.config_json,
                "--log-format", self.log_format,
            ]  # fmt: skip
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            repo_root = str(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
            with open_private_file(self.log_dir / f"{host_id}.log", "ab") as out:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,  # outlives this scheduler: see the module docstring
                    env=env,
                )
            self._processes[host_id] = process
            self._pins[host_id] = PinnedProcess.of_child(process.pid)
            self._save()
            watcher = asyncio.ensure_future(self._watch(host_id, process))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            log.info("host_provisioned", host=host_id, pid=process.pid)
            started.append(host_id)
        return started

    async def _watch(self, host_id: str, process: asyncio.subprocess.Process) -> None:
        returncode = await process.wait()
        if self._processes.get(host_id) is process:
            del self._processes[host_id]
            self._pins.pop(host_id).close()  # reaped: its number is no longer its own
            self._save()
        expected = host_id in self._releasing
        self._releasing.discard(host_id)
        log.log(20 if expected else 30, "host_process_exited", host=host_id, returncode=returncode)
        if not expected and self.on_exit is not None:
            self.on_exit(host_id, returncode)

    async def release(self, host_id: str) -> None:
        if host_id in self._adopted:
            await self._release_adopted(host_id)
            return
        process = self._processes.get(host_id)
        if process is None:
            raise RuntimeError(f"host {host_id} was not provisioned by this scheduler (or already released)")
        self._releasing.add(host_id)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)  # the local scheduler stops its replicas, then exits
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), RELEASE_GRACE_S)
        except TimeoutError:
            log.warning("host_kill", host=host_id, reason=f"still running {RELEASE_GRACE_S:g}s after SIGTERM")
            pin = self._pins.get(host_id)
            if pin is not None:
                pin.signal_group(signal.SIGKILL)
            await process.wait()
        log.info("host_released", host=host_id)

    async def _release_adopted(self, host_id: str) -> None:
        """Not our child: signal it and poll until it is gone (its parent, ``tandem up``, reaps it)."""
        pinned = self._adopted[host_id]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if sig == signal.SIGKILL:
                pinned.signal_group(sig)  # its replicas too (it runs in its own session)
            else:
                pinned.signal(sig)
            deadline = time.monotonic() + RELEASE_GRACE_S
            while self._still_runs(pinned) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if not self._still_runs(pinned):
                break
        pinned.close()
        del self._adopted[host_id]
        self._save()
        log.info("host_released", host=host_id, adopted=True)

    async def close(self) -> None:
        hosts = [*self._processes, *self._adopted]
        await asyncio.gather(*(self.release(h) for h in hosts), return_exceptions=True)
        for watcher in list(self._watchers):
            watcher.cancel()


def runs_host(pid: int, host_id: str, scheduler_address: str) -> bool:
    """Whether ``pid`` is a live (not zombie) local scheduler of ``host_id`` for this scheduler."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    stat = read_stat(pid)
    wanted = (b"services.local_scheduler", host_id.encode(), scheduler_address.encode())
    return stat is not None and stat.state != "Z" and all(part in cmdline for part in wanted)


def make_host_provider(
    cfg: Config, *, scheduler_address: str, on_exit: HostExited | None = None
) -> HostProvider:
    """The provider ``autoscale.provider`` names."""
    if cfg.get("autoscale.provider") == "embedded":
        return LocalProcessHostProvider.from_config(cfg, scheduler_address=scheduler_address, on_exit=on_exit)
    return NoHostProvider()
