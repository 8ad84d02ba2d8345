"""Provoke pid reuse for real: run as pid 1 of a fresh pid namespace (``unshare -Urpf
--mount-proc``), where ``/proc/sys/kernel/ns_last_pid`` picks the next pid and nothing else runs.

Each scenario starts a process in its own session, lets it exit and be reaped, then starts a
stranger in its own session that gets the same pid (hence the same process group number), then
does what the product does after such an exit, and prints one JSON line: whether the stranger
survived (``held``). ``python _pid_reuse.py SCENARIO``; tests/integration/test_pid_reuse.py runs them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from shared import process_signals
from shared.process_signals import PinnedProcess


def stranger_at(pid: int) -> subprocess.Popen[bytes]:
    """A new session leader with exactly ``pid`` (so its group is ``pid`` too)."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    if stranger.pid != pid or os.getpgid(stranger.pid) != pid:
        raise RuntimeError(f"wanted pid {pid} for the stranger, got {stranger.pid}")
    return stranger


def survived(stranger: subprocess.Popen[bytes]) -> bool:
    time.sleep(0.2)  # a SIGKILL sent before this has been delivered by now
    alive = stranger.poll() is None
    stranger.kill()
    stranger.wait()
    return alive


def reaped_child() -> tuple[int, PinnedProcess]:
    """A session leader, pinned at its start, that exited and was reaped."""
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    pin = PinnedProcess.of_child(child.pid)
    child.kill()
    child.wait()
    pin.reaped()
    return child.pid, pin


def bare_killpg() -> bool:
    """The control: what an ``os.killpg`` of the remembered number does (it must kill the stranger,
    or the other scenarios prove nothing)."""
    pid, _ = reaped_child()
    stranger = stranger_at(pid)
    os.killpg(pid, signal.SIGKILL)
    return survived(stranger)


def pinned_group() -> bool:
    pid, pin = reaped_child()
    stranger = stranger_at(pid)
    pin.signal_group(signal.SIGKILL)
    pin.signal(signal.SIGKILL)
    return survived(stranger)


def pinned_group_fallback() -> bool:
    """As on Linux < 6.9, where a pidfd cannot signal a group (``plan_group_signal`` decides)."""
    process_signals._pidfd_group_works = False
    return pinned_group()


def pin_by_start_time() -> bool:
    """A pid recorded with its start time, read back after the reuse (a file, a status answer).
    Start times are clock ticks (10 ms): the stranger starts a few ticks later, as any real reuse
    does (it takes pid_max process starts to come back to a number)."""
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    recorded = process_signals.read_stat(child.pid)
    assert recorded is not None
    time.sleep(0.05)
    child.kill()
    child.wait()
    stranger = stranger_at(child.pid)
    pinned = PinnedProcess.of_pid(child.pid, start_ticks=recorded.start_ticks)
    if pinned is not None:
        pinned.signal(signal.SIGKILL)
    return survived(stranger)


async def replica_stop() -> bool:
    """A replica that exited on its own, stopped afterwards (the kernel's shutdown)."""
    from services.local_scheduler.replica_process import ReplicaProcess

    with tempfile.TemporaryDirectory() as tmp:
        replica = ReplicaProcess(
            host_id="h",
            kernel_id="k",
            replica_id="r1",
            key="x",
            signature_scheme="hmac-sha256",
            resources={},
            data_dir=Path(tmp) / "r1",
        )
        # /bin/true in the interpreter's place: a replica that exits at once
        await replica.spawn(python="/bin/true", local_scheduler="tcp://127.0.0.1:1", config_json="{}",
                            join=False, on_exit=lambda _: None, on_spawned=lambda _: None)  # fmt: skip
        await replica.wait_exit()
        replica.registered.exception()  # it exited before registering: seen
        assert replica.pid is not None
        stranger = stranger_at(replica.pid)
        await replica.stop(ask=None, grace_s=0.1)
        return survived(stranger)


async def job_rewind() -> bool:
    """A job that finished just before the preemption policy rewound it (``kill_now``)."""
    from services.local_scheduler.job_process import JobProcess, JobSpec

    with tempfile.TemporaryDirectory() as tmp:
        job = JobProcess(JobSpec("j", ["true"], tmp), directory=Path(tmp) / "job", device_ids=[], host_id="h")
        await job.start()
        await job.exited.wait()
        assert job.pid is not None
        stranger = stranger_at(job.pid)
        job.kill_now()
        await job.pause(0.1)
        job.resume()
        await job.stop(0.1)
        return survived(stranger)


def not_yet_a_leader() -> bool:
    """A forked runtime before its ``setsid``: still in its parent's group (here: ours, like the
    template's). A group signal must reach the runtime itself (its own group does not exist yet),
    and not the group it sits in. True when both hold."""
    got: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    child = subprocess.Popen(["sleep", "60"])  # no new session: our group
    pin = PinnedProcess.of_child(child.pid)
    pin.signal_group(signal.SIGUSR1)
    try:
        reached = child.wait(timeout=5) == -signal.SIGUSR1  # its default action ends it
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        reached = False
    time.sleep(0.2)
    return reached and not got


SCENARIOS: dict[str, Callable[[], bool] | Callable[[], Awaitable[bool]]] = {
    "bare_killpg": bare_killpg,
    "pinned_group": pinned_group,
    "pinned_group_fallback": pinned_group_fallback,
    "pin_by_start_time": pin_by_start_time,
    "replica_stop": replica_stop,
    "job_rewind": job_rewind,
    "not_yet_a_leader": not_yet_a_leader,
}


def main() -> None:
    if os.getpid() != 1:
        raise SystemExit("run me as pid 1 of a new pid namespace: unshare -Urpf --mount-proc")
    scenario = SCENARIOS[sys.argv[1]]
    result = scenario()
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    print(json.dumps({"scenario": sys.argv[1], "held": result}))


if __name__ == "__main__":
    main()
