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
import subprocess
import sys
from pathlib import Path

import pytest

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
    """Whether the stranger that got the exited process's pid survived ``name``."""
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
    return bool(result["stranger_survived"])


pytestmark = pytest.mark.skipif(REFUSAL is not None, reason=REFUSAL or "")


def test_a_killpg_of_a_reaped_leaders_number_kills_the_stranger_that_got_it() -> None:
    """The control: without it the other tests could pass on a reuse that never happened."""
    assert not run_scenario("bare_killpg")


def test_a_pinned_group_signal_after_the_reap_never_reaches_a_stranger_with_the_same_pgid() -> None:
    assert run_scenario("pinned_group")


def test_without_pidfd_group_signals_the_fallback_spares_a_stranger_with_the_same_pgid() -> None:
    assert run_scenario("pinned_group_fallback")


def test_a_pid_pinned_by_its_recorded_start_time_refuses_the_process_that_reused_it() -> None:
    assert run_scenario("pin_by_start_time")


def test_stopping_a_replica_that_already_exited_spares_the_process_that_got_its_pid() -> None:
    assert run_scenario("replica_stop")


def test_rewinding_pausing_and_stopping_a_finished_job_spares_the_process_that_got_its_pid() -> None:
    assert run_scenario("job_rewind")
