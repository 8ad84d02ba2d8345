"""Which replica of a kernel is offered a cell (``execute_request``) and which are told to yield.

The global scheduler designates at most ONE executor candidate per request (protocol.md, execute
path step 2) so two kernels are never both sent to the same free GPU; every other live replica
gets ``yield_request``. Preference among replicas whose host can bind the GPUs now: the replica
the notebook pinned (``%tandem pin``: objects that exist only there, GPU residency), then the last
executor (its namespace is the freshest, its imports and GPU state are warm: NotebookOS reuses the
executor for 89% of consecutive cells, §5.3.2), then the Raft leader (its LEAD commits fastest), then
replica id. Leader before last executor moved a kernel's cells whenever leadership moved: the
first cell of a kernel often runs before its group has a leader, so a torch notebook's second cell
went to the new leader and waited ~1 s for it to import torch. A follower executor pays a
forwarded proposal until leadership follows it (``raft.leader_follows_executor`` cells).
A pinned replica whose host cannot run the cell is passed over like any other (the cell runs, and
the replica that runs it names what it lacks).
If no host has the GPUs idle but some have GPUs leased to best-effort jobs, the executor and the
victims are ONE decision: FitGpp (``shared.policies.preemption``) over the replica hosts, in the
same order of preference, picks the host; that host's local scheduler suspends the victims' leases
as it binds (a cell is never blocked by BE work). Only if not even that frees enough does every
replica yield and the election fail by design (migration then follows). Pure: the simulator uses
the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.policies.preemption import FitGpp, LeasedJob, PreemptionPolicy, Victim, gpu_candidate
from shared.resources import Resources


@dataclass(frozen=True, slots=True)
class ReplicaView:
    replica_id: str
    host_id: str
    alive: bool = True
    raft_role: str | None = None  # "leader", "follower", "candidate", or unknown


@dataclass(frozen=True, slots=True)
class HostLedgerView:
    host_id: str
    idle_gpus: int  # GPUs neither committed nor tentatively reserved nor leased
    cordoned: bool = False
    alive: bool = True
    total_gpus: int = 0
    leased: tuple[LeasedJob, ...] = ()  # jobs on leased GPUs: revocable for a cell, at a cost


@dataclass(frozen=True, slots=True)
class ExecutorChoice:
    executor: str | None  # the one replica that gets execute_request, if any
    yielders: tuple[str, ...]  # the live replicas that get yield_request
    reasons: dict[str, str]  # replica_id -> why it yields (for logs)
    victims: tuple[Victim, ...] = field(default=())  # jobs the executor's host revokes for the cell


def host_can_run(host: HostLedgerView | None, gpus: int) -> str | None:
    """Why the host cannot bind ``gpus`` now, or None if it can."""
    if host is None:
        return "host unknown"
    if not host.alive:
        return "host not alive"
    if host.cordoned:
        return "host cordoned"
    if gpus > host.idle_gpus:
        return f"needs {gpus} GPUs, {host.idle_gpus} idle"
    return None


def choose_executor(
    replicas: Sequence[ReplicaView],
    hosts: Mapping[str, HostLedgerView],
    gpus: int,
    last_executor: str | None = None,
    policy: PreemptionPolicy | None = None,
    pinned: str | None = None,
) -> ExecutorChoice:
    reasons: dict[str, str] = {}
    candidates: list[ReplicaView] = []
    for replica in replicas:
        if not replica.alive:
            continue
        why = host_can_run(hosts.get(replica.host_id), gpus)
        if why is None:
            candidates.append(replica)
        else:
            reasons[replica.replica_id] = why

    def preference(r: ReplicaView) -> tuple[int, int, int, str]:
        return (r.replica_id != pinned, r.replica_id != last_executor, r.raft_role != "leader", r.replica_id)

    executor = min(candidates, key=preference).replica_id if candidates else None
    victims: tuple[Victim, ...] = ()
    if executor is None and gpus > 0:
        executor, victims = _revoke_choice(replicas, hosts, gpus, preference, policy or FitGpp())
    yielders = tuple(r.replica_id for r in replicas if r.alive and r.replica_id != executor)
    for rid in yielders:
        reasons.setdefault(rid, "another replica was designated executor")
    return ExecutorChoice(executor, yielders, reasons, victims)


def _revoke_choice(
    replicas: Sequence[ReplicaView],
    hosts: Mapping[str, HostLedgerView],
    gpus: int,
    preference: Callable[[ReplicaView], tuple[int, int, int, str]],
    policy: PreemptionPolicy,
) -> tuple[str | None, tuple[Victim, ...]]:
    """No replica host has ``gpus`` idle: FitGpp over the hosts (alive, not cordoned) where a
    replica lives and jobs hold leases, in replica preference order."""
    ordered = sorted((r for r in replicas if r.alive), key=preference)
    by_host: dict[str, ReplicaView] = {}
    for replica in ordered:
        view = hosts.get(replica.host_id)
        if view is not None and view.alive and not view.cordoned and view.leased:
            by_host.setdefault(replica.host_id, replica)
    candidates = [gpu_candidate(h, hosts[h].total_gpus, hosts[h].idle_gpus, hosts[h].leased) for h in by_host]
    if not candidates:
        return None, ()
    decision = policy.decide(Resources(gpus=gpus), candidates)
    if decision.host_id is None or decision.host_id not in by_host:
        return None, ()
    return by_host[decision.host_id].replica_id, decision.victims
