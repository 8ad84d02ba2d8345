"""One run of a best-effort training job on this host: a real OS process on leased GPUs.

The job runs ``argv`` in the submitter's working directory with the submitter's environment,
plus ``CUDA_VISIBLE_DEVICES`` / ``TANDEM_GPU_IDS`` (its leased device ids) and the variables of
the job-side API (``tandem_job``: its directory, id, and the iteration to resume from). It runs at
the lowest CPU priority (``nice 19`` and, where ``chrt`` exists, ``SCHED_IDLE``, both applied by
exec wrappers so every thread it ever starts inherits them) so that cells stay interactive on a
machine with few cores; in its own session, so stopping it signals its whole process group
(through a pin, ``shared.process_signals``: never a group that got its number later); and
under ``setpriv --pdeathsig`` where available, so a local scheduler killed outright takes it along.

Stopping is polite first: the control word ``stop`` (obeyed at the next step boundary by a job
that uses the API), then SIGTERM, then SIGKILL to the group, a grace apart; nothing it started
outlives it. Pausing is the control word ``pause``, answered by the job's ``paused`` report at its
next step boundary (or SIGSTOP for a job that cannot answer; SIGCONT resumes it). Its stdout and stderr are appended to ``output.log`` in the job's directory
(under the cluster's state dir), across runs and hosts; the control and progress files of a run
are in a subdirectory per host, so two hosts never share them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from shared.private_files import open_private_file, private_dir
from shared.process_signals import PinnedProcess
from tandem_job import CONTROL_FILE, PAUSE, PAUSE_POLL_S, PROGRESS_FILE, RUN, STOP, write_atomically
from tandem_job.checkpoints import ANNOUNCE_FILE

log = structlog.get_logger("job_process")

LOG_FILE = "output.log"
_LINUX = sys.platform.startswith("linux")
SETPRIV = shutil.which("setpriv") if _LINUX else None
CHRT = shutil.which("chrt") if _LINUX else None
NICE = shutil.which("nice")
KILL_GRACE_S = 2.0
POLL_S = 0.05
JOB_FILE_MAX_BYTES = 1 << 20  # progress.json and checkpoint.json are a few hundred bytes


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What starting a job needs; it travels in ``lease.grant``."""

    job_id: str
    argv: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    start_iteration: int = 0

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> JobSpec:
        return cls(
            job_id=str(raw["job_id"]),
            argv=[str(a) for a in raw["argv"]],
            cwd=str(raw["cwd"]),
            env={str(k): str(v) for k, v in dict(raw.get("env") or {}).items()},
            start_iteration=int(raw.get("start_iteration") or 0),
        )


def low_priority_prefix() -> list[str]:
    """Exec wrappers that put the job at the bottom of the CPU scheduler."""
    prefix: list[str] = []
    if SETPRIV is not None:
        prefix += [SETPRIV, "--pdeathsig", "TERM"]
    if CHRT is not None:
        prefix += [CHRT, "--idle", "0"]
    if NICE is not None:
        prefix += [NICE, "-n", "19"]
    return prefix


def job_dir(state_dir: Path, job_id: str) -> Path:
    return state_dir / "jobs" / job_id


def open_job_file(path: Path) -> int:
    """A descriptor of a file the job may have written, opened without blocking: the job (any
    command the operator submitted, as the host's user) can put a FIFO there, which blocks a
    plain ``open`` until a writer comes, on the loop that runs every replica of this host, or a
    symlink to ``/dev/zero``. Only a regular file, reached without a symlink, is opened (OSError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path.name} is not a regular file")
    return fd


def read_job_file(path: Path, limit: int = JOB_FILE_MAX_BYTES) -> bytes:
    """The bytes of a small file the job writes (``open_job_file``); ValueError when it is over
    ``limit`` bytes, OSError when it cannot be read."""
    with os.fdopen(open_job_file(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is over {limit} bytes")
    return data


class JobProcess:
    """A started job; ``outcome`` says how it ended once ``exited`` is set."""

    def __init__(self, spec: JobSpec, *, directory: Path, device_ids: list[int], host_id: str) -> None:
        """``directory``: the job's (``job_dir``); this host's run keeps its files below it."""
        self.spec = spec
        self.job_directory = directory
        self.directory = directory / host_id
        self.device_ids = list(device_ids)
        self.host_id = host_id
        self.process: asyncio.subprocess.Process | None = None
        self._pin: PinnedProcess | None = None  # what its signals go through
        self.returncode: int | None = None
        self.stop_requested = False
        self.frozen = False  # paused by SIGSTOP (not at a step boundary)
        self._resumed_at: float | None = None  # wall clock of the last resume
        self._confirmed_pause: float | None = None  # updated_at of the last "paused" report seen
        self.exited = asyncio.Event()
        self._watcher: asyncio.Future[None] | None = None
        self.log = log.bind(job=spec.job_id, host=host_id)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def log_path(self) -> Path:
        return self.job_directory / LOG_FILE

    def _env(self) -> dict[str, str]:
        env = dict(self.spec.env)
        devices = ",".join(str(d) for d in self.device_ids)
        env.update(
            CUDA_VISIBLE_DEVICES=devices,
            TANDEM_GPU_IDS=devices,
            TANDEM_JOB_ID=self.spec.job_id,
            TANDEM_JOB_DIR=str(self.directory),
            TANDEM_JOB_START=str(self.spec.start_iteration),
            TANDEM_HOST_ID=self.host_id,
            PYTHONUNBUFFERED="1",
        )
        return env

    async def start(self) -> None:
        """Spawn the process; OSError (no such program, no such directory) if it cannot start."""
        private_dir(self.directory)
        write_atomically(self.directory / CONTROL_FILE, RUN)
        (self.directory / PROGRESS_FILE).unlink(missing_ok=True)  # this run's progress only
        (self.directory / ANNOUNCE_FILE).unlink(missing_ok=True)  # and its images only
        with open_private_file(self.log_path, "ab") as out:
            out.write(f"--- tandem: started on {self.host_id} GPUs {self.device_ids} at iteration "
                      f"{self.spec.start_iteration}\n".encode())  # fmt: skip
            out.flush()
            self.process = await asyncio.create_subprocess_exec(
                *low_priority_prefix(),
                *self.spec.argv,
                cwd=self.spec.cwd,
                env=self._env(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        self._pin = PinnedProcess.of_child(self.process.pid)
        self.log.info("job_started", pid=self.process.pid, device_ids=self.device_ids)
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        assert self.process is not None
        self.returncode = await self.process.wait()
        assert self._pin is not None
        self._pin.reaped()
        self._kill_group(signal.SIGKILL)  # anything the job started goes with it
        self._pin.close()  # from now on nothing of it is signalled
        self.log.info("job_exited", returncode=self.returncode, stop_requested=self.stop_requested)
        self.exited.set()

    def progress(self) -> dict[str, Any] | None:
        """The job's last ``progress.json`` (None: it reports none, or not yet)."""
        try:
            raw = json.loads(read_job_file(self.directory / PROGRESS_FILE))
        except (OSError, ValueError):
            return None
        return raw if isinstance(raw, dict) else None

    async def pause(self, grace_s: float) -> bool:
        """The control word ``pause``, answered at the job's next step boundary; a job that does
        not answer within ``grace_s`` (it does not use the API, or has not reached its first step,
        still importing its libraries) is frozen with SIGSTOP instead. False if it exited."""
        asked = time.time()  # a "paused" report older than this is a previous pause's
        with contextlib.suppress(OSError):
            write_atomically(self.directory / CONTROL_FILE, PAUSE)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + grace_s
        while not self.exited.is_set() and loop.time() < deadline:
            progress = self.progress() or {}
            reported = float(progress.get("updated_at") or 0)
            if progress.get("state") == "paused" and (
                reported >= asked or self._still_paused(reported, loop.time() - started)
            ):
                self._confirmed_pause = reported
                self.log.info("job_paused", at="step boundary")
                return True
            if not self.at_steps():  # no API, or not at its first step yet: it cannot answer
                break
            await asyncio.sleep(POLL_S)
        if self.exited.is_set():
            return False
        self._kill_group(signal.SIGSTOP)
        self.frozen = True
        self.log.info("job_paused", at="SIGSTOP")
        return True

    def _still_paused(self, reported: float, waited_s: float) -> bool:
        """Paused again before it left the last pause: its report is the one last confirmed, and
        either no resume was written since, or it has not answered one (it reports "running"
        within a poll of reading it)."""
        if self._confirmed_pause is None or reported != self._confirmed_pause:
            return False
        resumed_since = self._resumed_at is not None and self._resumed_at > reported
        return not resumed_since or waited_s > 2 * PAUSE_POLL_S + POLL_S

    def resume(self) -> None:
        self._resumed_at = time.time()
        write_atomically(self.directory / CONTROL_FILE, RUN)
        self._thaw()
        self.log.info("job_resumed")

    def _thaw(self) -> None:
        if self.frozen:
            self._kill_group(signal.SIGCONT)
            self.frozen = False

    def outcome(self) -> str:
        """``finished`` | ``failed`` | ``stopped`` (resumable: it was asked to stop)."""
        progress = self.progress() or {}
        if progress.get("state") == "finished" and self.returncode == 0:
            return "finished"
        if self.stop_requested:
            return "stopped"
        return "finished" if self.returncode == 0 else "failed"

    def at_steps(self) -> bool:
        """Whether the job is in its step loop (it reads the control word at each boundary)."""
        return (self.progress() or {}).get("state") in ("running", "paused")

    async def stop(self, grace_s: float) -> int | None:
        """The control word ``stop``, then SIGTERM, then SIGKILL to the group, a grace apart; a
        job that cannot read the word (not in its step loop) gets SIGTERM at once."""
        self.stop_requested = True
        if self.process is None:
            return None
        if not self.exited.is_set():
            # Read before the word is written: a job in its step loop that reads it at once
            # reports "stopped", and read after, it looked like a job that cannot read the word
            # and got SIGTERM in the middle of its orderly stop (a suite run: returncode -15).
            at_steps = self.at_steps()
            with contextlib.suppress(OSError):
                write_atomically(self.directory / CONTROL_FILE, STOP)
            self._thaw()  # a frozen job reads the stop at its next step boundary
            for sig, wait_s in (
                (None, grace_s if at_steps else 0.0),
                (signal.SIGTERM, KILL_GRACE_S),
                (signal.SIGKILL, KILL_GRACE_S),
            ):
                if sig is not None:
                    self.log.info("signalling_job", signal=sig.name)
                    self._kill_group(sig)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.exited.wait(), wait_s)
                if self.exited.is_set():
                    break
        return self.returncode

    def kill_now(self) -> None:
        """Rewind: SIGKILL to the group at once (the job resumes from its last image: resumable)."""
        self.stop_requested = True
        self._kill_group(signal.SIGKILL)
        self._thaw()

    def _kill_group(self, sig: signal.Signals) -> None:
        if self._pin is not None:
            self._pin.signal_group(sig)
