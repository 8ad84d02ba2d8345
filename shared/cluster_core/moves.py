"""Which replica runs a cell, which one moves where, and when a move is tried again or given up:
the rules of the live ``Migrator`` (held cells, replacements of dead replicas, host drains) and of
the simulator's replicated plug-in, written once (ARCHITECTURE.md §3, "one core, two drivers").

The drivers gather views (replicas, ledgers, hosts, warm pools) and carry the answers out (send
the cell, start and configure a replica, sleep); every choice between them is made here. Pure: no
clock (``now`` is passed in), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.cluster_core.held import WaitUntil
from shared.cluster_core.lifecycle import RUNNING
from shared.policies.executor_choice import ExecutorChoice, HostLedgerView, ReplicaView, choose_executor
from shared.policies.migration import GiveUp, MigrationPlan, NoTarget, RetryAt, RetrySchedule, plan_migration
from shared.policies.placement import HostView
from shared.resources import Resources

# a cell whose election failed this many rounds (each: its executor's host refused the GPUs) is
# answered with an error rather than held again
MAX_ELECTION_ROUNDS = 3


def executor_for(
    replicas: Sequence[ReplicaView],
    ledgers: Mapping[str, HostLedgerView],
    gpus: int,
    last_executor: str | None,
    *,
    pinned: str | None = None,
) -> ExecutorChoice:
    """The replica that runs a cell now (and the jobs its host revokes), or none: every driver's
    executor choice, for routing a cell and for judging a held one. ``pinned``: the replica the
    notebook pinned (``%tandem pin``), preferred while its host can run the cell."""
    return choose_executor(replicas, ledgers, gpus, last_executor, pinned=pinned)


def single_replica(replicas: Sequence[ReplicaView], last_executor: str | None) -> str | None:
    """The replica that answers requests answered by one: the last executor (freshest namespace)
    if alive, else the Raft leader, else None (the router picks the first live one)."""
    alive = {r.replica_id for r in replicas if r.alive}
    if last_executor is not None and last_executor in alive:
        return last_executor
    return next((r.replica_id for r in replicas if r.alive and r.raft_role == "leader"), None)


def plan_held_migration(
    replicas: Sequence[ReplicaView],
    need: Resources,
    hosts: Iterable[HostView],
    prewarmed: Mapping[str, int] | None = None,
) -> MigrationPlan | NoTarget:
    """A held cell's move: a replica to a host that can bind its GPUs now (no watermark: the cell
    waits on it)."""
    return plan_migration(replicas, need, hosts, prewarmed=prewarmed)


def plan_replacement(
    replica_id: str,
    replicas: Sequence[ReplicaView],
    need: Resources,
    hosts: Iterable[HostView],
    *,
    prewarmed: Mapping[str, int] | None = None,
    watermark: float | None = None,
) -> MigrationPlan | NoTarget:
    """Where ``replica_id`` goes when it is replaced (it died) or drained off its host: a host
    that may subscribe it under the watermark, its GPUs bound later (not now)."""
    return plan_migration(
        replicas, need, hosts, prewarmed=prewarmed, watermark=watermark, replica_id=replica_id, bind_now=False
    )


def explain(plan: NoTarget) -> str:
    """Why no host takes a replica, each rejected host's reason included."""
    if not plan.rejected:
        return plan.reason
    hosts = "; ".join(f"{host}: {why}" for host, why in sorted(plan.rejected.items()))
    return f"{plan.reason} ({hosts})"


# ---- replacements (a dead replica, a drained host) ------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplacementLook:
    """What the driver sees of a replica to replace when it looks at it."""

    kernel_id: str
    kernel_state: str
    replica_id: str
    present: bool  # still a member of the kernel
    executing: bool  # alive, and running a cell of the kernel (moving it would lose the cell)


@dataclass(frozen=True, slots=True)
class Abort:
    """The replacement ends without a move; ``reason`` says why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    """Plan the move now (``plan_replacement``) and carry it out."""


ReplacementStep = Abort | WaitUntil | Plan


def replacement_step(look: ReplacementLook, now: float, poll_s: float) -> ReplacementStep:
    """The next step of a replacement: over if the kernel stopped or the replica left it, wait
    while the replica runs a cell, else plan the move."""
    if look.kernel_state != RUNNING:
        return Abort(f"kernel {look.kernel_id} is {look.kernel_state}")
    if not look.present:
        return Abort(f"replica {look.replica_id} is no longer part of the kernel")
    if look.executing:
        return WaitUntil(now + poll_s)
    return Plan()


def replacement_failed(
    retry: RetrySchedule,
    attempts: int,
    started: float,
    now: float,
    why: str,
    *,
    no_target: bool,
    wait_for_target: bool,
) -> RetryAt | GiveUp:
    """A move of a replica failed: a scale-in's drain (not ``wait_for_target``) gives up at once
    when no host can take it; otherwise retry with backoff until the migration deadline."""
    if no_target and not wait_for_target:
        return GiveUp(why)
    return retry.after_failure(attempts, started, now, why)


def replaces_lost_replica(enabled: bool, kernel_state: str, replacing: bool) -> bool:
    """A replica that died for good is replaced on another host (``scheduler.replace_dead_replicas``)
    while its kernel runs, once (not while a replacement of it is under way)."""
    return enabled and kernel_state == RUNNING and not replacing


# ---- drains -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaOnHost:
    """A replica on a host being drained, as the driver sees it."""

    kernel_id: str
    replica_id: str
    alive: bool
    kernel_state: str


def replicas_to_drain(replicas: Iterable[ReplicaOnHost]) -> list[ReplicaOnHost]:
    """The replicas a drain moves: live ones of running kernels (others go with their kernel)."""
    return [r for r in replicas if r.alive and r.kernel_state == RUNNING]


def why_not_drained(failed: Sequence[tuple[str, str, str]], replicas_left: int) -> str:
    """Why a drain leaves its host unreleasable ("" when the host is empty): ``failed`` holds
    (kernel, replica, reason) of each replica that could not move."""
    if failed:
        kernel, replica, reason = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return f"replica {replica} of kernel {kernel} could not move: {reason}{more}"
    return f"{replicas_left} replica(s) still on the host after the drain" if replicas_left else ""


# ---- cells whose election failed --------------------------------------------------------------


def migrates_after_failed_election(gpus: int) -> bool:
    """A cell whose executor could not bind its GPUs goes through migration (NotebookOS §3.2.3);
    a cell without GPUs cannot be helped by one: its error reaches the client."""
    return gpus > 0


def failed_election_verdict(kernel_id: str, kernel_state: str, round_: int) -> str | None:
    """Why a cell whose election failed is answered with an error now, or None: hold it."""
    if kernel_state != RUNNING:
        return f"kernel {kernel_id} is {kernel_state}"
    if round_ > MAX_ELECTION_ROUNDS:
        return f"{round_} elections failed: the hosts' local schedulers refused the GPUs each time"
    return None


@dataclass(frozen=True, slots=True)
class Member:
    """A replica of a kernel as a membership change sees it."""

    replica_id: str
    role: str | None
    reachable: bool  # alive, and its replica.start answered


def membership_contact(members: Iterable[Member], exclude: Iterable[str] = ()) -> str | None:
    """The member to propose a membership change through: the Raft leader if we know it (a
    follower would only forward the proposal), else the lowest id (the same one each time); None
    when no reachable member is left."""
    left = set(exclude)
    live = [m for m in members if m.reachable and m.replica_id not in left]
    if not live:
        return None
    return min(live, key=lambda m: (m.role != "leader", m.replica_id)).replica_id


# ---- routing a cell -----------------------------------------------------------------------


def queues_behind_held(channel: str, holding: bool) -> bool:
    """A shell request of a kernel whose cell is held waits behind it (Jupyter runs a kernel's
    shell requests in order); control requests (interrupt, shutdown) go through."""
    return holding and channel == "shell"


def interrupt_ends_held(msg_type: str, holding: bool) -> bool:
    """An interrupt while a cell waits for a migration ends that cell, as it would end a running
    one (the move itself goes on)."""
    return holding and msg_type == "interrupt_request"


def resumes_restored(rebuilding: bool, live_replicas: int, replicas: int) -> bool:
    """A held queue a restarted scheduler restored is resolved once its kernel's replicas are
    all back, or once the rebuilding window is over (not from the first host that returns)."""
    return not rebuilding or live_replicas >= replicas


def holds_cell(msg_type: str, has_executor: bool, to_replicas: bool, kernel_state: str) -> bool:
    """An execute request that no replica can run now is held for a migration (rather than every
    replica yielding), while its kernel runs."""
    return msg_type == "execute_request" and to_replicas and not has_executor and kernel_state == RUNNING
