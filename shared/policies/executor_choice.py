"""Which replica of a kernel is offered a cell (``execute_request``) and which are told to yield.

The global scheduler designates at most ONE executor candidate per request (protocol.md, execute
path step 2) so two kernels are never both sent to the same free GPU; every other live replica
gets ``yield_request``. Preference among replicas whose host can bind the GPUs now: the Raft
leader (its LEAD commits fastest), then the last executor (its GPU state is warm), then replica id.
If no host can bind the GPUs, every replica yields and the election fails by design (migration
then follows). Pure: the simulator uses the same function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaView:
    replica_id: str
    host_id: str
    alive: bool = True
    raft_role: str | None = None  # "leader", "follower", "candidate", or unknown


@dataclass(frozen=True, slots=True)
class HostLedgerView:
    host_id: str
    idle_gpus: int  # GPUs neither committed nor tentatively reserved
    cordoned: bool = False
    alive: bool = True


@dataclass(frozen=True, slots=True)
class ExecutorChoice:
    executor: str | None  # the one replica that gets execute_request, if any
    yielders: tuple[str, ...]  # the live replicas that get yield_request
    reasons: dict[str, str]  # replica_id -> why it yields (for logs)


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

    def preference(r: ReplicaView) -> tuple[int, int, str]:
        return (r.raft_role != "leader", r.replica_id != last_executor, r.replica_id)

    executor = min(candidates, key=preference).replica_id if candidates else None
    yielders = tuple(r.replica_id for r in replicas if r.alive and r.replica_id != executor)
    for rid in yielders:
        reasons.setdefault(rid, "another replica was designated executor")
    return ExecutorChoice(executor, yielders, reasons)
