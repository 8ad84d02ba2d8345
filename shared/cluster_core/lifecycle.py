"""A kernel's lifecycle as one explicit transition table, shared by the live scheduler and the
simulator: a move the table does not list is refused with an error naming both states, instead of
a raw assignment that silently revives a dead kernel.

    starting -> running   its replicas started and were configured (or a restarted scheduler
                          adopted it from its hosts' reports)
    starting -> stopping  shut down while starting
    starting -> dead      its start failed
    running  -> stopping  shut down (kernel.shutdown, or a shutdown_request through the gateway)
    running  -> dead      fewer live replicas than a Raft quorum
    stopping -> stopped   its replicas stopped
    stopping -> dead      its start failed while it was being shut down
    running  -> hibernating   idle for kernel.hibernate_after_s: its namespace is being saved
    hibernating -> hibernated its image is in the data store and its replicas stopped
    hibernating -> running    the image could not be made (or a request came first): it runs on
    hibernating -> stopping / dead   shut down, or its replicas lost, while saving
    hibernated -> starting    a request came: replicas start on hosts placement picks, and
                              restore the image (a resume is a start with a namespace)
    hibernated -> stopped     shut down while hibernated: there is nothing to stop
    starting -> hibernated    a resume whose start failed: the image is kept for the next try

``stopped`` and ``dead`` are final: a new start of the same kernel id is a new kernel.
"""

from __future__ import annotations

from typing import Protocol

STARTING, RUNNING, STOPPING, STOPPED, DEAD = "starting", "running", "stopping", "stopped", "dead"
HIBERNATING, HIBERNATED = "hibernating", "hibernated"

TRANSITIONS: dict[str, frozenset[str]] = {
    STARTING: frozenset({RUNNING, STOPPING, DEAD, HIBERNATED}),
    RUNNING: frozenset({STOPPING, DEAD, HIBERNATING}),
    HIBERNATING: frozenset({HIBERNATED, RUNNING, STOPPING, DEAD}),
    HIBERNATED: frozenset({STARTING, STOPPED}),
    STOPPING: frozenset({STOPPED, DEAD}),
    STOPPED: frozenset(),
    DEAD: frozenset(),
}
ACTIVE = frozenset({STARTING, RUNNING})  # a kernel that may still run cells
OVER = frozenset({STOPPED, DEAD})


class IllegalTransition(ValueError):
    """A lifecycle move the table does not allow; ``str`` names the kernel and both states."""


class HasState(Protocol):
    kernel_id: str
    state: str


def check(kernel_id: str, current: str, to: str) -> None:
    """Raise ``IllegalTransition`` unless ``current -> to`` is in the table."""
    allowed = TRANSITIONS.get(current)
    if allowed is None:
        raise IllegalTransition(f"kernel {kernel_id} is in an unknown state {current!r}")
    if to not in allowed:
        options = ", ".join(sorted(allowed)) or "nothing (final)"
        raise IllegalTransition(f"kernel {kernel_id} cannot go from {current} to {to} (allowed: {options})")


def transition(kernel: HasState, to: str) -> None:
    """Move ``kernel`` to ``to`` if the table allows it, else raise ``IllegalTransition``."""
    check(kernel.kernel_id, kernel.state, to)
    kernel.state = to


REPLACE = "replace"  # a verdict of ``after_replica_lost``: move the lost replica to another host


def after_replica_lost(state: str, live: int, quorum: int, *, restarting: bool) -> str | None:
    """What losing a replica means for its kernel: ``STOPPED`` (a stopping kernel lost its last
    one), ``DEAD`` (a running kernel is below a Raft quorum), ``REPLACE`` (a running kernel keeps
    its quorum: replace the replica, unless it is being restarted in place), else None."""
    if state == STOPPING and live == 0:
        return STOPPED
    if state == RUNNING and live < quorum:
        return DEAD
    if state == RUNNING and not restarting:
        return REPLACE
    return None
