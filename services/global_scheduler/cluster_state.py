"""The global scheduler's model of the cluster: hosts, their GPU ledgers as last reported, kernels
and their replicas. Pure (time is passed in), so the rules live here and the service only does I/O.

The local schedulers are the authority on committed GPUs; each host's record keeps a mirror of
its ledger (``shared.cluster_core.gpu_ledger.GpuLedger``, the one ledger model of the cluster)
plus the scheduler's own tentative commits (an executor candidate designated but not yet
elected), keyed by (kernel, msg_id) like the heartbeat's ``committed`` map, so a reservation and
the commit that replaces it are never counted twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.live_index import LiveIndex, Placed, WatchedDict
from shared.cluster_core.gpu_ledger import GpuLedger
from shared.cluster_core.lifecycle import DEAD, RUNNING, STARTING, STOPPED, STOPPING  # noqa: F401 (re-exported)
from shared.kernel_launch import KernelLaunch
from shared.policies.executor_choice import HostLedgerView, ReplicaView
from shared.policies.placement import HostView
from shared.policies.placement_index import PlacementIndex
from shared.policies.preemption import LeasedJob
from shared.resources import Resources

# Record fields that enter a HostView: writing one marks the host for re-indexing (live_index.py).
_HOST_VIEW_FIELDS = frozenset({"capacity", "cordoned", "alive", "ledger", "warm_runtimes"})
_REPLICA_VIEW_FIELDS = frozenset({"host_id", "alive"})
_KERNEL_VIEW_FIELDS = frozenset({"state", "resources"})


@dataclass(slots=True)
class HostRecord:
    host_id: str
    capacity: Resources
    gpu_kind: str
    address: str = ""
    cordoned: bool = False
    alive: bool = True
    last_seen: float = 0.0
    leased_jobs: list[LeasedJob] = field(default_factory=list)  # as last reported: cells may revoke them
    warm_runtimes: int = 0  # its pool's ready runtimes, as last reported (placement's tie-break)
    # the host's ledger as last reported (heartbeats, elected events) plus tentative commits
    ledger: GpuLedger = field(init=False, repr=False, compare=False)
    _index: LiveIndex | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.ledger = GpuLedger(range(self.capacity.gpus), on_change=self._view_changed)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _HOST_VIEW_FIELDS:
            self._view_changed()

    def _view_changed(self) -> None:
        index = getattr(self, "_index", None)
        if index is not None:
            index.touch(self.host_id)

    @property
    def identity(self) -> bytes:
        return self.host_id.encode()

    @property
    def gpus(self) -> int:
        return self.capacity.gpus

    @property
    def committed_gpus(self) -> int:
        return self.ledger.committed_count


@dataclass(slots=True)
class ReplicaRecord:
    replica_id: str
    host_id: str
    pid: int | None = None
    raft_address: str = ""
    role: str | None = None
    alive: bool = True
    started: bool = False  # replica.start answered
    leaving: bool = False  # its namespace diverged from the log: it exits; no cell goes to it
    _kernel: KernelRecord | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        before = getattr(self, "host_id", None) if name == "host_id" else None
        object.__setattr__(self, name, value)
        if name in _REPLICA_VIEW_FIELDS:
            kernel = getattr(self, "_kernel", None)
            if kernel is None or kernel._index is None:
                return
            if before is not None and before != value:
                kernel._index.unlink(self, before)
                kernel._index.link(kernel, self)
            else:
                kernel._index.touch(self.host_id)


@dataclass(slots=True)
class KernelRecord:
    kernel_id: str
    key: str
    signature_scheme: str
    resources: Resources
    router: KernelRouter
    state: str = STARTING
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    dead_reason: str | None = None
    reserved_on: dict[str, str] = field(default_factory=dict)  # msg_id -> host holding a reservation
    # shell requests held while a replica migrates (the first is the cell no replica could run)
    held: list[list[bytes]] | None = None
    migrations: int = 0  # replicas moved to another host (all-yield, dead replica, drain)
    last_migration: dict[str, Any] | None = None
    # the working directory and environment every replica starts with, migrations included
    launch: KernelLaunch = field(default_factory=KernelLaunch)
    # hibernation: the namespace image its replicas restore (an ObjectRef map), its size, when
    # it was written, and how often it was resumed; replica ids carry the generation after one
    image: dict[str, Any] | None = None
    image_bytes: int = 0
    image_modules: list[str] = field(default_factory=list)  # what its runtimes import first
    hibernated_at: float | None = None
    generation: int = 0
    resumes: int = 0
    last_resume_s: float | None = None
    hibernated_s_total: float = 0.0  # over its hibernations that ended (resumed or stopped)
    # the replica the notebook pinned its cells to (``%tandem pin``), preferred as executor
    pinned: str | None = None
    pinned_at: float = 0.0  # wall clock of the latest pin / unpin (the latest one wins on adoption)
    exit_after: str | None = None  # the cell that called exit(): the kernel stops once it is answered
    # below a quorum while replicas whose processes exited are restarted in place (not dead):
    # why it fell below (None: not recovering)
    recovering: str | None = None
    _index: LiveIndex | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "replicas" and not isinstance(value, WatchedDict):
            for replica in getattr(self, "replicas", {}).values():
                self._replica_slot_changed(replica, None)
            value = WatchedDict(value, self._replica_slot_changed)
            for replica in value.values():
                self._replica_slot_changed(None, replica)
        object.__setattr__(self, name, value)
        if name in _KERNEL_VIEW_FIELDS:
            index = getattr(self, "_index", None)
            if index is not None:
                for replica in self.replicas.values():
                    index.touch(replica.host_id)

    def _replica_slot_changed(self, old: ReplicaRecord | None, new: ReplicaRecord | None) -> None:
        index = getattr(self, "_index", None)
        if old is not None and old is not new:
            object.__setattr__(old, "_kernel", None)
            if index is not None:
                index.unlink(old)
        if new is not None:
            object.__setattr__(new, "_kernel", self)
            if index is not None:
                index.link(self, new)

    def attach(self, index: LiveIndex | None) -> None:
        """Report to ``index`` (None: to nothing) from now on; the kernel's hosts need re-indexing."""
        before = getattr(self, "_index", None)
        object.__setattr__(self, "_index", index)
        for replica in getattr(self, "replicas", {}).values():
            if before is not None and before is not index:
                before.unlink(replica)
            if index is not None:
                index.link(self, replica)

    def live_replicas(self) -> list[str]:
        return [r.replica_id for r in self.replicas.values() if r.alive]

    @property
    def alive(self) -> bool:
        return self.state in (STARTING, RUNNING) and (
            len(self.live_replicas()) >= self.router.quorum or self.recovering is not None
        )

    def next_replica_id(self) -> str:
        n = 1
        while f"r{n}" in self.replicas:
            n += 1
        return f"r{n}"


def _subscription(host_id: str, placed: Iterable[Placed]) -> tuple[int, Resources]:
    gpus = 0
    total = Resources()
    for kernel, replica in placed:
        if kernel.state in (STARTING, RUNNING) and replica.alive and replica.host_id == host_id:
            gpus += kernel.resources.gpus
            total = total + kernel.resources
    return gpus, total


class ClusterState:
    def __init__(self, *, replicas_per_kernel: int = 3) -> None:
        self._live_index = LiveIndex(self._indexed_view)
        self.hosts: dict[str, HostRecord] = WatchedDict(on_change=self._host_slot_changed)
        self.kernels: dict[str, KernelRecord] = WatchedDict(on_change=self._kernel_slot_changed)
        self.replicas_per_kernel = replicas_per_kernel

    # ---- the placement index ----------------------------------------------------------------

    def placement_index(self) -> PlacementIndex:
        """Every host's view, indexed for placement; equal to ``PlacementIndex(host_views())``."""
        return self._live_index.index()

    def _host_slot_changed(self, old: HostRecord | None, new: HostRecord | None) -> None:
        if old is not None and old is not new:
            object.__setattr__(old, "_index", None)
            self._live_index.touch(old.host_id)
        if new is not None:
            object.__setattr__(new, "_index", self._live_index)
            self._live_index.touch(new.host_id)

    def _kernel_slot_changed(self, old: KernelRecord | None, new: KernelRecord | None) -> None:
        if old is not None and old is not new:
            old.attach(None)
        if new is not None:
            new.attach(self._live_index)

    def _indexed_view(self, host_id: str, placed: Iterable[Placed]) -> HostView | None:
        host = self.hosts.get(host_id)
        if host is None:
            return None
        return self._view(host, *_subscription(host_id, placed))

    # ---- hosts ------------------------------------------------------------------------------

    def register_host(
        self, host_id: str, capacity: Resources, gpu_kind: str, address: str, now: float
    ) -> HostRecord:
        host = self.hosts.get(host_id)
        if host is None:
            host = self.hosts[host_id] = HostRecord(host_id, capacity, gpu_kind, address)
        else:  # a reconnecting host keeps its cordon: an operator's decision outlives a restart
            resized = capacity.gpus != host.capacity.gpus
            host.capacity, host.gpu_kind, host.address = capacity, gpu_kind, address
            if resized:  # its next heartbeat reports what is committed on the new devices
                host.ledger = GpuLedger(range(capacity.gpus), on_change=host._view_changed)
        host.alive = True
        host.last_seen = now
        return host

    def heartbeat(
        self, host_id: str, committed: dict[str, Any] | None, now: float, *, leased: list[Any] | None = None
    ) -> HostRecord | None:
        """``leased``: the host's jobs on leased GPUs (``LeasedJob`` wire form); the mirror marks
        their devices leased, and executor choice sees them as revocable, not idle."""
        host = self.hosts.get(host_id)
        if host is None or not host.alive:
            return None  # unknown (or declared dead): the host must register again
        host.last_seen = now
        jobs: list[LeasedJob] | None = None
        if leased is not None:
            jobs = []  # malformed: none shown (the host still revokes, choosing its victims itself)
            with contextlib.suppress(ValueError, TypeError, IndexError):
                jobs = [LeasedJob.from_wire(raw) for raw in leased]
            host.leased_jobs = jobs
        if committed is not None:
            host.ledger.mirror(
                {k: v if isinstance(v, list) else int(v) for k, v in committed.items()},
                None if jobs is None else {j.job_id: j.device_ids for j in jobs},
            )
        return host

    def silent_hosts(self, now: float, timeout: float) -> list[HostRecord]:
        """Hosts alive in our view whose last report is older than ``timeout``."""
        return [h for h in self.hosts.values() if h.alive and now - h.last_seen > timeout]

    def subscribed_on(self, host_id: str) -> tuple[int, Resources]:
        """GPUs and resources subscribed by the live replicas of active kernels placed on a host
        (O(replicas there): the live index keeps which replicas sit on which host)."""
        return _subscription(host_id, self._live_index.placed_on(host_id))

    def host_views(self) -> list[HostView]:
        """Every host's view, computed now (placement uses the incrementally kept ``placement_index``)."""
        views = []
        for host in self.hosts.values():
            gpus, subscribed = self.subscribed_on(host.host_id)
            views.append(self._view(host, gpus, subscribed))
        return views

    def _view(self, host: HostRecord, subscribed_gpus: int, subscribed: Resources) -> HostView:
        return HostView(
            host_id=host.host_id,
            gpus=host.gpus,
            committed_gpus=host.committed_gpus,
            subscribed_gpus=subscribed_gpus,
            capacity=host.capacity,
            subscribed=subscribed,
            cordoned=host.cordoned,
            alive=host.alive,
            replicas_per_kernel=self.replicas_per_kernel,
            warm_runtimes=host.warm_runtimes,
        )

    def ledger_views(self, host_ids: Iterable[str]) -> dict[str, HostLedgerView]:
        views = {}
        for host_id in host_ids:
            host = self.hosts.get(host_id)
            if host is not None:
                views[host_id] = HostLedgerView(
                    host_id,
                    max(host.gpus - host.committed_gpus - host.ledger.leased_count, 0),
                    host.cordoned,
                    host.alive,
                    total_gpus=host.gpus,
                    leased=tuple(host.leased_jobs),
                )
        return views

    # ---- GPU reservations -------------------------------------------------------------------

    def reserve(self, kernel: KernelRecord, msg_id: str, host_id: str) -> None:
        host = self.hosts.get(host_id)
        if host is not None and kernel.resources.gpus > 0:
            host.ledger.reserve(kernel.kernel_id, msg_id, kernel.resources.gpus)
            kernel.reserved_on[msg_id] = host_id

    def committed_by_election(
        self, kernel: KernelRecord, msg_id: str, host_id: str, device_ids: list[int], replica_id: str = ""
    ) -> None:
        """The local scheduler bound ``device_ids`` for ``msg_id``: the reservation becomes a commit."""
        self.release(kernel, msg_id)
        host = self.hosts.get(host_id)
        if host is not None and device_ids:
            host.ledger.record(kernel.kernel_id, replica_id, msg_id, device_ids)

    def release(self, kernel: KernelRecord, msg_id: str) -> None:
        """The request finished (the replica released before its reply): forget its GPUs now
        rather than at the next heartbeat, so the next cell does not see a stale commit."""
        kernel.reserved_on.pop(msg_id, None)
        for replica in kernel.replicas.values():
            host = self.hosts.get(replica.host_id)
            if host is not None:
                host.ledger.forget(kernel.kernel_id, msg_id)

    # ---- kernels ----------------------------------------------------------------------------

    def replica_views(self, kernel: KernelRecord) -> list[ReplicaView]:
        return [ReplicaView(r.replica_id, r.host_id, r.alive, r.role) for r in kernel.replicas.values()]

    def routable_views(self, kernel: KernelRecord) -> list[ReplicaView]:
        """``replica_views`` for choosing where a request goes: a replica leaving (its namespace
        diverged, it exits) counts as gone."""
        return [
            ReplicaView(r.replica_id, r.host_id, r.alive and not r.leaving, r.role)
            for r in kernel.replicas.values()
        ]

    def replicas_on(self, host_id: str) -> list[tuple[KernelRecord, ReplicaRecord]]:
        return [(k, r) for k in self.kernels.values() for r in k.replicas.values() if r.host_id == host_id]

    # ---- reports ----------------------------------------------------------------------------

    def kernel_status(self, kernel: KernelRecord) -> dict[str, Any]:
        return {
            "id": kernel.kernel_id,
            "state": kernel.state,
            "alive": kernel.alive,
            "reason": kernel.dead_reason,
            "last_executor": kernel.router.last_executor,
            "pinned": kernel.pinned,
            "recovering": kernel.recovering,
            "resources": kernel.resources.to_dict(),
            "migrations": kernel.migrations,
            "last_migration": kernel.last_migration,
            "held_requests": len(kernel.held or ()),
            "hibernation": {
                "image_bytes": kernel.image_bytes,
                "hibernated_at": kernel.hibernated_at,
                "resumes": kernel.resumes,
                "last_resume_s": kernel.last_resume_s,
                "hibernated_s_total": round(kernel.hibernated_s_total, 3),
            }
            if kernel.image is not None
            else None,
            "replicas": [
                {
                    "id": r.replica_id,
                    "host": r.host_id,
                    "pid": r.pid,
                    "role": r.role,
                    "alive": r.alive,
                    "raft_address": r.raft_address,
                }
                for r in kernel.replicas.values()
            ],
        }

    def cluster_status(self) -> dict[str, Any]:
        hosts = []
        for host in sorted(self.hosts.values(), key=lambda h: h.host_id):
            subscribed, _ = self.subscribed_on(host.host_id)
            hosts.append(
                {
                    "id": host.host_id,
                    "gpus": host.gpus,
                    "gpu_kind": host.gpu_kind,
                    "committed": host.committed_gpus,
                    "subscribed": subscribed,
                    "subscription_ratio": round(subscribed / (host.gpus * self.replicas_per_kernel), 4)
                    if host.gpus
                    else 0.0,
                    "cordoned": host.cordoned,
                    "alive": host.alive,
                }
            )
        return {
            "hosts": hosts,
            "kernels": [self.kernel_status(k) for k in self.kernels.values()],
            "migrations": sum(k.migrations for k in self.kernels.values()),
        }
