"""Threads that serve the process, not the user's code (a replica's Raft loop, data-store I/O,
state-image copies): a debugger attached to a kernel must neither trace nor stop them.

JupyterLab's debugger (ipykernel + debugpy) stops every thread it traces at a breakpoint. A
replica's Raft thread stopped with them falls silent, and after ``election.executor_silence_s``
the other replicas give the cell being debugged up as lost. debugpy (pydevd) leaves alone a
thread marked ``pydev_do_not_trace`` / ``is_pydev_daemon_thread``, as ipykernel marks its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


def mark_background(thread: threading.Thread | None = None) -> None:
    """Mark ``thread`` (default: the calling one) as one a debugger leaves running, untraced."""
    thread = thread or threading.current_thread()
    thread.pydev_do_not_trace = True  # type: ignore[attr-defined]
    thread.is_pydev_daemon_thread = True  # type: ignore[attr-defined]


def background_thread(target: Callable[[], object], *, name: str) -> threading.Thread:
    """A daemon thread (not started) a debugger leaves running."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    mark_background(thread)
    return thread


def background_pool(max_workers: int, *, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose workers a debugger leaves running."""
    return ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=mark_background
    )
