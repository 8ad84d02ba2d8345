"""Signal a process, or the process group it leads, and never a stranger that got its number.

A pid is only a number. Once its process is reaped (asyncio's child watcher, ``Popen.wait``, the
runtime template, ``tandem up`` as subreaper) the kernel may hand the number to any new process,
and a process group's number is free again once its last member is gone (pid_max is 32768 on many
machines: a busy host wraps it in minutes). ``os.kill``/``os.killpg`` on a remembered number can
then kill another kernel's replica, a job, or anything else of the same user.

So a process we will signal later is *pinned* while it surely is the one we mean
(``PinnedProcess``): a pidfd (Linux >= 5.3) keeps naming that process whatever happens to its
number, and with ``PIDFD_SIGNAL_PROCESS_GROUP`` (Linux >= 6.9) the group it founded, even after
the leader was reaped: the kernel signals the members that are left, and nobody else.

Where a pidfd cannot reach the group (Linux < 6.9, or no pidfd at all), ``plan_group_signal``
(pure: a process table in, a decision out) decides: the group's number is signalled only while
its leader is unreaped (its zombie keeps the number reserved, and with it the group); after the
reap only the members that started before it (provably ours: the number was still reserved then)
are signalled, one by one and each pinned by its start time. Start times are clock ticks (10 ms),
so "before" means an earlier tick: a member forked after the reap, or within its tick, escapes
that fallback.

A pid read from outside (a file, a status answer) is pinned only after its identity is checked
against what was recorded (its start time) or expected (its command line): ``PinnedProcess.of_pid``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import structlog

log = structlog.get_logger("process_signals")

# include/uapi/linux/pidfd.h (Linux 6.9): the flag that signals the pidfd's process group
PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2
_HAS_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
_pidfd_group_works: bool | None = None  # learnt at the first try: EINVAL before Linux 6.9


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` that say who a process is."""

    pid: int
    state: str  # R, S, D, Z (zombie), T (stopped), ...
    ppid: int
    pgid: int
    sid: int
    start_ticks: int  # clock ticks after boot: with the pid, one process for the machine's uptime


def parse_stat(text: str) -> ProcStat:
    """``/proc/<pid>/stat`` as a ProcStat (the command name may hold spaces and parentheses, so
    the fields are counted from the last ``)``); ValueError when it is not such a line."""
    head, sep, tail = text.rpartition(")")
    fields = tail.split()
    if not sep or len(fields) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    return ProcStat(
        pid=int(head.split("(", 1)[0]),
        state=fields[0],
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        start_ticks=int(fields[19]),
    )


def read_stat(pid: int) -> ProcStat | None:
    """The process that has ``pid`` now (None: none, or no /proc on this system)."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError):
        return None


def process_table() -> Iterator[ProcStat]:
    """Every process visible in /proc now (nothing where /proc is absent)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
                yield stat


def descendants_of(root: int, table: Iterable[ProcStat]) -> list[ProcStat]:
    """The descendants of ``root`` in ``table`` (children first); pure."""
    children: dict[int, list[ProcStat]] = {}
    for stat in table:
        children.setdefault(stat.ppid, []).append(stat)
    found: list[ProcStat] = []
    frontier = [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child.pid)
    return found


def descends_from(pid: int, root: int) -> bool:
    """Whether ``pid`` is a descendant of ``root`` now (its parent chain in /proc reaches it)."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        stat = read_stat(pid)
        if stat is None:
            return False
        if stat.ppid == root:
            return True
        pid = stat.ppid
    return False


def boot_ticks_now() -> int:
    """Now, on the clock of ``ProcStat.start_ticks`` (0 where there is no such clock)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is None or not hasattr(os, "sysconf"):
        return 0
    return int(time.clock_gettime(clock) * os.sysconf("SC_CLK_TCK"))


# ---- the decision (pure) -------------------------------------------------------------------


class Route(Enum):
    PIDFD_GROUP = "pidfd_group"  # the kernel signals the group the pidfd's process founded
    KILLPG = "killpg"  # the group's number: safe, the unreaped leader reserves it
    MEMBERS = "members"  # one by one: the members provably older than the leader's reap


@dataclass(frozen=True, slots=True)
class GroupPlan:
    route: Route
    members: tuple[ProcStat, ...] = ()


def plan_group_signal(
    leader: int, *, reaped_at: int | None, pidfd_group: bool, table: Callable[[], Iterable[ProcStat]]
) -> GroupPlan:
    """How to signal the process group that ``leader`` founded (``start_new_session``).

    ``reaped_at``: when its exit was collected (``boot_ticks_now``), None while it is not;
    ``pidfd_group``: whether a pidfd of the leader can signal its group; ``table``: the process
    table, read only when needed. After the reap, a process in group ``leader`` that started
    later may belong to a stranger that got the number once our group was empty; one that started
    in the reap's own clock tick cannot be told apart, so it is left alone too."""
    if pidfd_group:
        return GroupPlan(Route.PIDFD_GROUP)
    if reaped_at is None:
        return GroupPlan(Route.KILLPG)
    ours = tuple(
        p
        for p in table()
        if p.pgid == leader and p.sid == leader and p.start_ticks < reaped_at and p.state != "Z"
    )
    return GroupPlan(Route.MEMBERS, ours)


# ---- the shell ----------------------------------------------------------------------------


class PinnedProcess:
    """One process, named by a pidfd where the system has them, by its number otherwise.

    ``of_child``: a child we just spawned (before anything can have reaped it); ``of_pid``: a pid
    from outside, pinned only if it is the process meant. The owner of a child calls ``reaped()``
    once its wait returned, so the fallback knows the number may be reused from then on."""

    def __init__(self, pid: int, pidfd: int | None, stat: ProcStat | None) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.start_ticks = stat.start_ticks if stat is not None else None
        self.reaped_at: int | None = None
        self.gone = False  # known to be gone, or closed: nothing is ever signalled again

    @classmethod
    def of_child(cls, pid: int) -> PinnedProcess:
        """Our child, just spawned: opened before our wait for it returned (so it is still ours).
        On a loop that reaps elsewhere (asyncio's threaded watcher) a child that exits at once may
        be reaped first: then its number is checked to still be our child, or it counts as gone."""
        pidfd = _open_pidfd(pid)
        stat = read_stat(pid)
        pinned = cls(pid, pidfd, stat)
        if (_HAS_PIDFD and pidfd is None) or (stat is not None and stat.ppid != os.getpid()):
            pinned.close()  # already reaped (and maybe someone else's now): nothing to signal
        return pinned

    @classmethod
    def of_pid(
        cls, pid: int, *, start_ticks: int | None = None, check: Callable[[int], bool] | None = None
    ) -> PinnedProcess | None:
        """``pid`` pinned if it is the process meant: started at ``start_ticks`` (as recorded when
        it was spawned) and passing ``check``; None when it is not (any more). The pidfd is opened
        first and the identity checked after: a number reused in between fails the check."""
        pidfd = _open_pidfd(pid)
        if _HAS_PIDFD and pidfd is None:
            return None
        stat = read_stat(pid)
        same = stat is not None and start_ticks in (None, stat.start_ticks)
        if not same or (check is not None and not check(pid)):
            if pidfd is not None:
                os.close(pidfd)
            return None
        return cls(pid, pidfd, stat)

    def reaped(self) -> None:
        """Its exit status was collected: its number may belong to someone else from now on."""
        if self.reaped_at is None:
            self.reaped_at = boot_ticks_now()

    def signal(self, sig: int) -> bool:
        """Signal this process alone; False when it is gone (its number is never used then)."""
        if self.gone or (self._pidfd is None and self.reaped_at is not None):
            return False
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def signal_group(self, sig: int) -> bool:
        """Signal the process group this process founded, as far as it can be told apart from a
        stranger's (``plan_group_signal``); False when nothing was signalled."""
        if self.gone:
            return False
        if not self._leads_a_group():
            return self.signal(sig)  # still in its parent's group: that group is not its to signal
        if self._pidfd is not None and _pidfd_group_works is not False:
            sent = self._send_group(sig)
            if sent is not None:
                return sent
        if self._pidfd is not None and self.reaped_at is None and not self.signal(0):
            self.reaped()  # collected by a watcher whose news has not reached the owner yet
        plan = plan_group_signal(self.pid, reaped_at=self.reaped_at, pidfd_group=False, table=process_table)
        if plan.route is Route.KILLPG:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                return False
            return True
        sent = False
        for member in plan.members:
            pinned = PinnedProcess.of_pid(member.pid, start_ticks=member.start_ticks)
            if pinned is not None:
                sent = pinned.signal(sig) or sent
                pinned.close()
        return sent

    def _leads_a_group(self) -> bool:
        """False while this process, still running, is in another's group: a runtime that the
        template forked has not called ``setsid`` yet. A group signal names the group whose id is
        its pid, which does not exist yet, so it would reach nobody, not even the runtime: that
        one gets the signal itself. True once it is gone (only the group it founded, if any, is
        reached then) or where /proc cannot tell."""
        stat = read_stat(self.pid)
        if stat is None or self.start_ticks is None or stat.start_ticks != self.start_ticks:
            return True
        return stat.pgid == self.pid

    def _send_group(self, sig: int) -> bool | None:
        """Signal the group through the pidfd: whether a member got it, None where this kernel
        cannot (Linux < 6.9: the caller falls back). The group's number is never looked at."""
        global _pidfd_group_works
        assert self._pidfd is not None
        try:
            signal.pidfd_send_signal(self._pidfd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
        except OSError as exc:
            if exc.errno == errno.EINVAL and not _pidfd_group_works:
                _pidfd_group_works = False
                log.info("pidfd_group_signal_unsupported", fallback="killpg while the leader is unreaped")
                return None
            if exc.errno not in (errno.ESRCH, errno.EPERM):
                raise
            return False  # the group is empty (or not ours to signal)
        _pidfd_group_works = True
        return True

    def close(self) -> None:
        """Release the pidfd; nothing is signalled through this object afterwards."""
        self.gone = True
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)


def _open_pidfd(pid: int) -> int | None:
    if not _HAS_PIDFD:
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EPERM):  # Linux < 5.3, or a sandbox that forbids it
            _disable_pidfd()
            return None
        raise


def _disable_pidfd() -> None:
    global _HAS_PIDFD
    _HAS_PIDFD = False
    log.warning("pidfd_unavailable", fallback="signals go by number, checked against /proc")
