"""Who may connect to a local scheduler's replica link over ``ipc://``: the processes it spawned.

Why not CURVE on that link: a replica always runs on its local scheduler's host (the local
scheduler spawns it, cold, from its warm pool or from its runtime template), so the link can be a
Unix socket, and there the kernel itself tells the server who connected. libzmq passes ZAP the
peer's credentials (``SO_PEERCRED``, taken at ``connect``) as the address ``<host>:<uid>:<gid>:<pid>``;
a connection is admitted only if that pid is a replica this local scheduler started and still
watches, and only as that replica (the ZAP User-Id, which every message of the connection
carries and ``shared.security.authorization`` keys its rules on). This saves a CURVE box and unbox
on every message of the link (``gpu.bound``, ``replica.event``, ``gpu.commit``: several per cell).

A pid names a process only while it lives (or is an unreaped zombie): once reaped, the kernel may
give the number to another process. So each allowed pid is bound to its process's start time (in
clock ticks since boot, ``/proc/<pid>/stat``), read while that process was known to be the
spawned one, and compared again at each handshake; and it is forgotten when the exit is seen.

``SpawnedPeers`` is the policy, pure (the start-time reader is handed in); the ZAP handler in
``shared.security.curve`` is its shell.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from shared.process_signals import ProcStat

# how long a handshake from an unknown pid may wait while a start is under way: a forked or
# warm runtime can connect before its launcher has read the pid it got (ZMQ never retries a
# refused handshake, so refusing it then would fail the start)
PENDING_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """What the kernel reported about the process at the other end of a Unix socket."""

    uid: int
    gid: int
    pid: int


def parse_peer_address(address: str) -> PeerCredentials | None:
    """libzmq's ZAP address of an IPC peer, ``<host>:<uid>:<gid>:<pid>``; None for anything else
    (a TCP peer's address, or a platform that reports no pid)."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(part.isascii() and part.isdigit() for part in parts[1:]):
        return None
    uid, gid, pid = (int(part) for part in parts[1:])
    return PeerCredentials(uid, gid, pid) if pid > 0 else None


@dataclass(frozen=True, slots=True)
class Admit:
    principal: str


@dataclass(frozen=True, slots=True)
class Refuse:
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Not known yet, but a start is under way whose pid may be this one: ask again shortly."""

    reason: str


Decision = Admit | Refuse | Wait


@dataclass(frozen=True, slots=True)
class _Spawned:
    principal: str
    start_ticks: int | None  # None: unknown (no /proc), then the pid alone binds


class SpawnedPeers:
    """pid -> the replica principal it was spawned as, for the processes a local scheduler
    started and has not seen end. Written on the event loop, read by the ZAP thread (single
    dict operations, atomic under the GIL). ``launcher``: the local scheduler's pid; a process
    started by another launcher of its (its runtime template) is admitted the same way."""

    def __init__(self, uid: int, launcher: int) -> None:
        self._uid = uid
        self._launchers = {launcher}
        self._by_pid: dict[int, _Spawned] = {}
        self._starting = 0

    def add_launcher(self, pid: int) -> None:
        """A process that starts replicas for the local scheduler (its runtime template)."""
        self._launchers.add(pid)

    def allow(self, pid: int, principal: str, start_ticks: int | None) -> None:
        self._by_pid[pid] = _Spawned(principal, start_ticks)

    def forget(self, pid: int, principal: str) -> None:
        """The process ended: its pid may be given to another process from now on."""
        spawned = self._by_pid.get(pid)
        if spawned is not None and spawned.principal == principal:
            del self._by_pid[pid]

    def start_began(self) -> None:
        self._starting += 1

    def start_ended(self) -> None:
        self._starting = max(self._starting - 1, 0)

    def decide(self, address: str, stat_of: Callable[[int], ProcStat | None]) -> Decision:
        """Whether the peer at ``address`` (the ZAP address of an IPC connection) is admitted,
        and as whom; ``stat_of(pid)`` reads a live process's parent and start time (None: gone).
        An unknown pid waits only while a start is under way and only if one of this local
        scheduler's launchers is its parent (a just-spawned replica whose pid is not recorded
        yet); anything else, a process a notebook cell started for one, is refused at once."""
        peer = parse_peer_address(address)
        if peer is None:
            return Refuse(f"no peer credentials in the address {address!r} (not an ipc peer?)")
        if peer.uid != self._uid:
            return Refuse(
                f"pid {peer.pid} runs as uid {peer.uid}, not this local scheduler's uid {self._uid}"
            )
        spawned = self._by_pid.get(peer.pid)
        if spawned is None:
            reason = f"pid {peer.pid} is not a replica this local scheduler started"
            if self._starting > 0:
                stat = stat_of(peer.pid)
                if stat is not None and stat.ppid in self._launchers:
                    return Wait(reason)
            return Refuse(reason)
        if spawned.start_ticks is not None:
            stat = stat_of(peer.pid)
            if stat is None or stat.start_ticks != spawned.start_ticks:
                return Refuse(
                    f"pid {peer.pid} is no longer the process started as {spawned.principal} (it ended; pid reused)"
                )
        return Admit(spawned.principal)


@dataclass(frozen=True, slots=True)
class ServerPeerCredentials:
    """What a ROUTER needs to admit IPC peers by their kernel-reported credentials: no CURVE, but
    every handshake goes to ZAP (``ZAP_ENFORCE_DOMAIN``: no handler running refuses all)."""

    domain: str

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.zap_domain = self.domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def ipc_peer_credentials_supported() -> bool:
    """Linux reports an IPC peer's pid to ZAP (``SO_PEERCRED``); BSD and macOS only its uid."""
    return os.uname().sysname == "Linux"
