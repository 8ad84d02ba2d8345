"""After a process we started was reaped, its pid and process group number belong to whoever gets
them next: nothing of ours may signal that stranger (shared/process_signals.py).

Each scenario of ``_pid_reuse.py`` runs as pid 1 of a fresh pid namespace, where the test picks
the next pid (``ns_last_pid``): a stranger gets the exact pid, and so the process group number,
of a process that just exited. The control (``bare_killpg``) shows that this reuse is real: an
``os.killpg`` of the remembered number kills the stranger, as main's replica stop and job rewind
did.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import process_signals
from shared.process_signals import PinnedProcess, read_stat

SCRIPT = Path(__file__).with_name("_pid_reuse.py")
REPO = Path(__file__).resolve().parents[2]
UNSHARE = shutil.which("unshare")


def _namespace_refusal() -> str | None:
    if not sys.platform.startswith("linux") or UNSHARE is None:
        return "needs Linux and unshare(1)"
    tried = subprocess.run(
        [UNSHARE, "-Urpf", "--mount-proc", "sh", "-c", "echo 1 > /proc/sys/kernel/ns_last_pid"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if tried.returncode != 0:
        return f"cannot make a pid namespace whose next pid we pick: {tried.stderr.strip()}"
    return None


REFUSAL = _namespace_refusal()


def run_scenario(name: str) -> bool:
    """Whether what ``name`` checks held (mostly: the stranger that got an exited process's pid survived)."""
    assert UNSHARE is not None
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [UNSHARE, "-Urpf", "--mount-proc", sys.executable, str(SCRIPT), name],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["scenario"] == name
    return bool(result["held"])


needs_namespace = pytest.mark.skipif(REFUSAL is not None, reason=REFUSAL or "")


@needs_namespace
def test_a_killpg_of_a_reaped_leaders_number_kills_the_stranger_that_got_it() -> None:
    """The control: without it the other tests could pass on a reuse that never happened."""
    assert not run_scenario("bare_killpg")


@needs_namespace
def test_a_pinned_group_signal_after_the_reap_never_reaches_a_stranger_with_the_same_pgid() -> None:
    assert run_scenario("pinned_group")


@needs_namespace
def test_without_pidfd_group_signals_the_fallback_spares_a_stranger_with_the_same_pgid() -> None:
    assert run_scenario("pinned_group_fallback")


@needs_namespace
def test_a_pid_pinned_by_its_recorded_start_time_refuses_the_process_that_reused_it() -> None:
    assert run_scenario("pin_by_start_time")


@needs_namespace
def test_stopping_a_replica_that_already_exited_spares_the_process_that_got_its_pid() -> None:
    assert run_scenario("replica_stop")


@needs_namespace
def test_rewinding_pausing_and_stopping_a_finished_job_spares_the_process_that_got_its_pid() -> None:
    assert run_scenario("job_rewind")


def leader_with_a_leftover_child() -> tuple[subprocess.Popen[str], int]:
    """A session leader that leaves a child in its group behind when it exits (in 0.1 s)."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; sleep 0.1"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert leader.stdout is not None
    return leader, int(leader.stdout.readline())


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while (stat := read_stat(pid)) is not None and stat.state != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    return stat is None or stat.state == "Z"


@pytest.mark.parametrize("pidfd_group", [True, False], ids=["pidfd_group", "fallback"])
def test_a_group_signal_after_the_leaders_reap_still_kills_what_it_left_behind(
    pidfd_group: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No orphans: the replica's own children die with it, whichever route the kernel allows."""
    if not pidfd_group:
        monkeypatch.setattr(process_signals, "_pidfd_group_works", False)  # as on Linux < 6.9
    leader, leftover = leader_with_a_leftover_child()
    pin = PinnedProcess.of_child(leader.pid)
    left = PinnedProcess.of_pid(leftover)  # for the clean-up: its number may be reused once it died
    try:
        leader.wait(timeout=10)
        pin.reaped()
        stat = read_stat(leftover)
        assert stat is not None and stat.pgid == leader.pid
        assert pin.signal_group(signal.SIGKILL)
        assert gone(leftover)
    finally:
        pin.close()
        if left is not None:
            left.signal(signal.SIGKILL)  # only does something if the test failed
            left.close()


def test_the_fallback_signals_the_group_by_number_while_its_leader_is_an_unreaped_zombie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process_signals, "_pidfd_group_works", False)
    leader, leftover = leader_with_a_leftover_child()
    pin = PinnedProcess.of_child(leader.pid)
    try:
        while (stat := read_stat(leader.pid)) is not None and stat.state != "Z":
            time.sleep(0.02)  # exited, not reaped: its zombie keeps the group's number ours
        assert pin.signal_group(signal.SIGKILL)
        assert gone(leftover)
    finally:
        pin.close()
        leader.wait(timeout=10)


@needs_namespace
def test_a_group_signal_to_a_runtime_not_yet_leading_its_group_reaches_it_and_spares_its_parents() -> None:
    assert run_scenario("not_yet_a_leader")
