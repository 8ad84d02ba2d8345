"""The idle-host judgement behind scale-in, one rule for the live cluster and the simulator.

A host is *idle* (NotebookOS: no active replica) when nothing is committed on it, no kernel
waiting for new hosts has a replica slot reserved there, it holds no replica of a kernel with
work in flight (a cell running or held, a request pending, a replica being started or moved), and
either it holds no replica at all or the driver can drain them away first. It is *releasable* once
idle for ``scale_in_idle_s`` and only if the provider started it (the hosts the cluster was
created with are never released). A release that failed (a replica no host could take) makes the
host wait twice as long before the next try, and so on (``scale_in_idle_wanted``).

Pure: the driver passes the facts and the time; this keeps only when each host became idle and
how many releases of it failed in a row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from shared.policies.autoscale import HostLoad, scale_in_idle_wanted


class HostFacts(NamedTuple):
    """What the driver knows of one live host that is not being released already (a tuple: the
    simulator builds one per host at every check)."""

    host_id: str
    gpus: int
    committed_gpus: int = 0
    subscribed_gpus: int = 0
    replicas: int = 0  # replicas a release would move away first
    active: bool = False  # holds a replica of a kernel with work in flight
    reserved: bool = False  # a kernel waiting for new hosts has a replica slot reserved here
    owned: bool = True  # the provider started it: only those can be released


class KernelFacts(NamedTuple):
    """Where a kernel that is not over has replicas, and whether it has work in flight."""

    hosts: Sequence[str]  # one entry per replica placed (alive, or being started)
    busy: bool  # starting or stopping, a cell running or held, a request pending, a replica moving


def replicas_and_active_hosts(kernels: Iterable[KernelFacts]) -> tuple[Counter[str], set[str]]:
    """Replicas per host (what a release has to move), and the hosts that are not idle: they
    hold a replica of a busy kernel."""
    placed: list[str] = []
    active: set[str] = set()
    for hosts, busy in kernels:  # one Counter at the end: the simulator runs this at every check
        placed.extend(hosts)
        if busy:
            active.update(hosts)
    return Counter(placed), active


class IdleJudge:
    def __init__(self, idle_s: float, *, can_drain: bool = True) -> None:
        self.idle_s = idle_s
        self.can_drain = can_drain  # False: a host holding replicas is never idle
        self._idle_since: dict[str, float] = {}
        self._failures: dict[str, int] = {}  # host -> failed releases in a row

    def loads(self, hosts: Iterable[HostFacts], now: float) -> list[HostLoad]:
        """Each host's load for ``Autoscaler.evaluate``, ``releasable`` by the rule above."""
        out = []
        for h in hosts:
            idle = (
                not h.active
                and h.committed_gpus == 0
                and not h.reserved
                and (h.replicas == 0 or self.can_drain)
            )
            if idle:
                since = self._idle_since.setdefault(h.host_id, now)
            else:
                self._idle_since.pop(h.host_id, None)
                self._failures.pop(h.host_id, None)  # in use again: a fresh judgement
            releasable = idle and h.owned and now - since >= self.wanted(h.host_id)
            out.append(
                HostLoad(
                    h.host_id,
                    h.gpus,
                    h.committed_gpus,
                    h.subscribed_gpus,
                    releasable=releasable,
                    replicas=h.replicas,
                )
            )
        return out

    def wanted(self, host_id: str) -> float:
        """How long ``host_id`` must be idle before a release is tried."""
        return scale_in_idle_wanted(self.idle_s, self._failures.get(host_id, 0))

    def release_failed(self, host_id: str) -> int:
        """A release of ``host_id`` failed: it must be idle afresh, and longer; failures in a row."""
        failures = self._failures[host_id] = self._failures.get(host_id, 0) + 1
        self._idle_since.pop(host_id, None)
        return failures

    def released(self, host_id: str) -> None:
        """``host_id`` is gone (released, or lost): forget it."""
        self._idle_since.pop(host_id, None)
        self._failures.pop(host_id, None)
