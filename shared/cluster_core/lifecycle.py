"""A kernel's lifecycle as one explicit transition table, shared by the live scheduler and the
simulator: a move the table does not list is refused with an error naming both states, instead of
a raw assignment that silently revives a dead kernel.

    starting -> running   its replicas started and were configured (or a restarted scheduler
                          adopted it from its hosts' reports)
    starting -> stopping  shut down while starting
    starting -> dead      its start failed
    running  -> stopping  shut down (kernel.shutdown, or a shutdown_request through the gateway)
    running  -> dead      fewer live replicas than a Raft quorum, and restarting in place the
                          ones whose process exited on a live host cannot bring one back
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

from collections import deque
from dataclasses import dataclass, field
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
RECOVER = "recover"  # a verdict of ``after_replica_lost``: restart lost replicas in place for a quorum


def after_replica_lost(
    state: str, live: int, quorum: int, *, restarting: bool, restartable: int = 0
) -> str | None:
    """What losing a replica means for its kernel: ``STOPPED`` (a stopping kernel lost its last
    one), ``RECOVER`` (a running kernel is below a Raft quorum, but ``restartable`` lost replicas,
    whose processes exited on live hosts and whose Raft storage is there, would give it one back
    if restarted in place), ``DEAD`` (below a quorum for good), ``REPLACE`` (a running kernel keeps
    its quorum: replace the replica, unless it is being restarted in place), else None.

    Two cells in a row that crash their executor's process (a segfault, ``os._exit``) lose two
    replicas within a second, before the first is replaced: the namespace is still in the
    survivor's log and on the dead ones' disks, so the kernel is not declared dead for it."""
    if state == STOPPING and live == 0:
        return STOPPED
    if state == RUNNING and live < quorum:
        return RECOVER if live + restartable >= quorum else DEAD
    if state == RUNNING and not restarting:
        return REPLACE
    return None


RETRIED = "retried"  # a verdict of ``start_verdict``: the same start again, answer with the kernel's status


@dataclass(frozen=True, slots=True)
class LostReplicaLook:
    """What the driver knows of a replica when deciding whether an in-place restart could
    bring it back."""

    alive: bool
    started: bool  # its replica.start was answered once: its Raft storage exists
    host_alive: bool
    being_replaced: bool  # a membership change is moving it to another host
    restarting: bool  # an in-place restart of it is already under way


def restartable_in_place(look: LostReplicaLook, *, within_budget: bool) -> bool:
    """A lost replica counts as coming back by an in-place restart: its process is gone on a
    live host, its storage exists, nothing else is moving it, and either a restart is already
    under way or its ``RestartBudget`` allows one."""
    if look.alive or not look.started or not look.host_alive or look.being_replaced:
        return False
    return look.restarting or within_budget


@dataclass
class RestartBudget:
    """How many automatic in-place restarts a replica gets (its kernel below a quorum, or no host
    for its replacement): ``limit`` per ``window_s``. A replica that keeps dying (a STATE whose loading crashes the process, say) is
    not restarted forever; past its budget, its kernel is dead as before."""

    limit: int
    window_s: float
    _at: dict[tuple[str, str], deque[float]] = field(default_factory=dict)

    def allows(self, key: tuple[str, str], now: float) -> bool:
        recent = self._at.get(key)
        if recent is None:
            return self.limit > 0
        while recent and now - recent[0] >= self.window_s:
            recent.popleft()
        return len(recent) < self.limit

    def spend(self, key: tuple[str, str], now: float) -> None:
        self._at.setdefault(key, deque()).append(now)

    def forget(self, kernel_id: str) -> None:
        for key in [k for k in self._at if k[0] == kernel_id]:
            del self._at[key]


def start_verdict(kernel_id: str, state: str | None, *, same_key: bool) -> str | None:
    """A start request for ``kernel_id``, whose record is in ``state`` (None: no record): None to
    start it (a new kernel, or a new one under the id of one that is over), ``RETRIED`` for the
    same running kernel's start sent again, else why it conflicts with the one there."""
    if state is None or state in OVER:
        return None
    if state == RUNNING and same_key:
        return RETRIED
    return f"kernel {kernel_id} is {state}"


@dataclass(frozen=True, slots=True)
class RestartLook:
    """What the driver knows when an in-place restart of a replica is asked for."""

    kernel_id: str
    state: str
    replica_id: str
    replica_alive: bool
    host_id: str
    host_alive: bool
    live: tuple[str, ...]  # the kernel's live replicas


def restart_refusal(look: RestartLook, quorum: int) -> tuple[str, str] | None:
    """Why an in-place restart of a replica is refused now, and the error code (None: go ahead):
    only a running kernel's replica on a live host, and never one whose stop would leave the
    kernel below a Raft quorum."""
    if look.state != RUNNING:
        return f"kernel {look.kernel_id} is {look.state}, not running", "conflict"
    if not look.host_alive:
        return f"host {look.host_id} of replica {look.replica_id} is not alive", "unavailable"
    if look.replica_alive and len(look.live) - 1 < quorum:
        return (
            f"restarting {look.replica_id} now would leave kernel {look.kernel_id} without a Raft "
            f"quorum (live: {', '.join(look.live)}); restart the dead replicas first",
            "conflict",
        )
    return None


def stops_on_request(msg_type: str, state: str) -> bool:
    """A client's ``shutdown_request`` starts stopping a kernel that may still run cells."""
    return msg_type == "shutdown_request" and state in ACTIVE


def keeps_reported_replica(state: str) -> bool:
    """A replica a (re)registering host reports: kept if its kernel may still run, else stopped."""
    return state in ACTIVE


def tells_members_lost(state: str, *, restarting: bool) -> bool:
    """A replica's process exited: its surviving members hear it at once (a running kernel whose
    replica is not being restarted in place), rather than after a silence timeout."""
    return state == RUNNING and not restarting


def shutdown_stops(state: str) -> bool:
    """A shutdown moves a kernel that may still run cells, or one saving its image, to
    ``stopping`` (and to ``stopped`` once its replicas are stopped); one already stopping, stopped
    or dead keeps its state, and the shutdown only stops what is left of it."""
    return state in ACTIVE or state == HIBERNATING


def rebuilding(now: float, started_at: float, heartbeat_timeout: float) -> bool:
    """A restarted scheduler learns its kernels from the hosts' registrations: until every host
    had time to register again (two heartbeat timeouts), an unknown kernel may still be one of
    ours and a kernel back with fewer replicas may get the others back."""
    return now - started_at < heartbeat_timeout * 2


def replicas_may_still_come(alive: bool, state: str, *, rebuilding: bool) -> bool:
    """In the rebuilding window, a kernel adopted from the first host that reported it may still
    get its other replicas back; a dead or hibernated kernel has none to wait for."""
    return not alive and state not in (DEAD, HIBERNATING, HIBERNATED) and rebuilding
