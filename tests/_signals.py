"""Signals from tests to the processes they started, never to a process that got one's pid later.

A test reads pids from ``cluster.json`` or a status answer and kills, pauses or resumes them, often
after the process may have died already (killed by an earlier test, replaced, or between the status
and the signal). Its pid may then belong to anything, another pytest-xdist worker included: the
suite runs thousands of processes and pid_max may be 32768. So a test signals a pid only while it
is a process this test run started (a descendant of this pytest process), pinned by a pidfd first
so that the check and the signal are about the same process (shared/process_signals.py).
"""

from __future__ import annotations

import os

from shared.process_signals import PinnedProcess, descends_from


def signal_ours(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is still one of this test run's processes; False: it is gone
    (its number is someone else's, or nobody's), and nothing was sent."""
    pinned = PinnedProcess.of_pid(pid, check=lambda p: descends_from(p, os.getpid()))
    if pinned is None:
        return False
    try:
        return pinned.signal(sig)
    finally:
        pinned.close()
