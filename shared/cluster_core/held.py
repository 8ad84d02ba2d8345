"""A held cell whose migration finds no host is a failed replica placement (NotebookOS §3.4.2):
it asks the autoscaler for one host, reserved for that kernel's replica, and waits for it.

The rule both drivers follow (``ClusterCore.held_migration_failed``):

* a migration that found no target, with no host reserved for the hold yet (or the reserved one
  came and was taken), asks ``Autoscaler.on_placement_failed`` for one replica of the kernel,
  bound exclusively (its GPUs must be idle on arrival), under the key ``held_key(kernel_id)``;
* while a host reserved for the hold is pending, the hold does not fail at
  ``scheduler.migration_deadline_s``: it waits up to ``autoscale.scale_out_timeout_s`` from that
  scale-out request (the bound a kernel start has), retrying on the usual backoff (GPUs may free
  up) and at once when the host registers (the replicated plug-in's ``WakeHeld``);
* when no host is coming (at ``max_hosts``, the provider failed, a cell bigger than a host), the
  migration deadline decides as before and the reason names why no host came.

Pure: no clock, no I/O; the driver passes ``now`` and carries out the ``ScaleOut``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.cluster_core.reservations import ArrivedReservations
from shared.policies.autoscale import Autoscaler, ScaleOut
from shared.policies.migration import GiveUp, RetryAt, RetrySchedule
from shared.policies.placement import PlacementRequest
from shared.resources import Resources

HELD_SUFFIX = "/held"
# while a held cell's kernel still runs its previous cell (which holds the GPUs), look again this
# often rather than migrate
HELD_POLL_S = 0.2


def held_key(kernel_id: str) -> str:
    """The autoscaler's reservation key of a kernel's held cell (apart from its start's)."""
    return kernel_id + HELD_SUFFIX


def held_kernel(key: str) -> str | None:
    """The kernel whose held cell a reservation key names, or None for a kernel start's key."""
    return key[: -len(HELD_SUFFIX)] if key.endswith(HELD_SUFFIX) else None


@dataclass(frozen=True, slots=True)
class HeldLook:
    """What the driver sees of a held cell when it looks at it (``ClusterCore.held_step``)."""

    since: float
    attempts: int  # failed migrations so far
    own_cell_running: bool  # the kernel's previous cell still holds its GPUs
    settle_first: bool  # its election failed: the ledger was wrong, trust it only after a heartbeat
    executor_now: bool  # a replica's host can bind the GPUs now (``choose_executor``)
    kernel_gone: bool = False  # its kernel no longer runs (or was replaced): the router answers


@dataclass(frozen=True, slots=True)
class WaitUntil:
    """Look again at ``at`` (same clock as ``now``)."""

    at: float


@dataclass(frozen=True, slots=True)
class SendOn:
    """A replica can run the cell: send the held requests on."""


@dataclass(frozen=True, slots=True)
class TryMigration:
    """No replica can: move one to a host that can bind the GPUs (``plan_migration``)."""


HeldStep = WaitUntil | SendOn | TryMigration


def held_step(look: HeldLook, now: float, settle_at: float, poll_s: float) -> HeldStep:
    """The next step for a held cell: sent on at once when its kernel is gone (the router answers
    for it), wait while its own previous cell runs or the ledger settles, send it on when a
    replica can run it, else migrate (not before the first settle)."""
    if look.kernel_gone:
        return SendOn()
    if look.own_cell_running:
        return WaitUntil(now + poll_s)
    if look.settle_first and now < settle_at:
        return WaitUntil(settle_at)
    if look.executor_now:
        return SendOn()
    if look.attempts == 0 and now < settle_at:
        return WaitUntil(settle_at)
    return TryMigration()


@dataclass(frozen=True, slots=True)
class HeldFailure:
    """A held cell's failed migration: its kernel, what it needs, its retry history and why."""

    kernel_id: str
    resources: Resources
    attempts: int  # failed migrations of this hold, this one included
    held_since: float
    now: float
    reason: str
    no_host: bool = True  # no host could take the replica (not a move that broke on the way)


@dataclass(frozen=True, slots=True)
class HeldDecision:
    """What to do after a held cell's failed migration: ``decision`` (look again at, or give up),
    and a ``scale_out`` the driver asks its provider for first (None: no new host to ask for)."""

    decision: RetryAt | GiveUp
    scale_out: ScaleOut | None = None


class HeldScaleOut:
    """Per core: when each held cell's host was asked for (the start of its wait)."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        retry: RetrySchedule,
        scale_out_timeout_s: float,
        arrived: ArrivedReservations | None = None,
    ) -> None:
        self.autoscaler = autoscaler
        self.arrived = arrived if arrived is not None else ArrivedReservations()
        self.retry = retry
        self.timeout_s = scale_out_timeout_s
        self._asked_at: dict[str, float] = {}  # held key -> when its first host was asked for
        self._failed: dict[str, str] = {}  # held key -> why the provider did not add its host

    def waiting_for_host(self, kernel_id: str) -> bool:
        """Whether a host reserved for the kernel's held cell is still to register."""
        return self.autoscaler.reserved_for(held_key(kernel_id)) > 0

    def after_failure(
        self, failure: HeldFailure, *, live_hosts: int, can_add_hosts: bool = True
    ) -> HeldDecision:
        """A migration of the held cell failed: ask for a host if none is coming, then decide."""
        kernel_id, attempts, now, reason = failure.kernel_id, failure.attempts, failure.now, failure.reason
        key = held_key(kernel_id)
        scale_out: ScaleOut | None = None
        why_none = ""
        if failure.no_host and not self.waiting_for_host(kernel_id):
            if key in self._failed:  # the provider failed for this hold: do not ask it again
                why_none = self._failed[key]
            elif can_add_hosts:
                outcome = self.autoscaler.on_placement_failed(
                    PlacementRequest(key, failure.resources, replicas=1), 0, live_hosts, exclusive=True
                )
                why_none = outcome.reason
                if isinstance(outcome, ScaleOut):
                    scale_out = outcome  # carried out even if the hold gives up: the host is pending
            else:
                why_none = "the cluster cannot add hosts (autoscaling is off)"
            if self.waiting_for_host(kernel_id):
                # the first request bounds the wait: a host taken by another cell is asked for
                # again, within what is left of it (so a hold cannot wait for ever)
                self._asked_at.setdefault(key, now)
        if self.waiting_for_host(kernel_id):
            deadline = self._asked_at[key] + self.timeout_s
            if now >= deadline:
                self.over(kernel_id)
                return HeldDecision(
                    GiveUp(
                        f"migration aborted: no host added for it could bind the GPUs within "
                        f"autoscale.scale_out_timeout_s = {self.timeout_s:g} s of the scale-out ({reason})"
                    ),
                    scale_out,
                )
            at = min(now + self.retry.delay(attempts), deadline)
            return HeldDecision(RetryAt(at, attempts), scale_out)
        decision = self.retry.after_failure(attempts, failure.held_since, now, reason)
        if isinstance(decision, GiveUp):
            if why_none:
                decision = GiveUp(f"{decision.reason}; no host is coming: {why_none}")
            self.over(kernel_id)
        return HeldDecision(decision, scale_out)

    def provider_failed(self, keys: tuple[str, ...], why: str) -> None:
        """A scale-out failed and dropped these reservations: those holds are not asked for again."""
        for key in keys:
            if held_kernel(key) is not None:
                self._failed[key] = f"the provider failed to add a host: {why}"

    def over(self, kernel_id: str) -> None:
        """The hold ended (the cell runs, failed, or the kernel stopped): free its reservation."""
        key = held_key(kernel_id)
        self._asked_at.pop(key, None)
        self._failed.pop(key, None)
        self.autoscaler.cancel(key)
        self.arrived.done(key)


def held_again(held_msg_id: str | None, msg_id: str) -> bool:
    """The cell being held is the one already held (its election failed again, or its migration
    sent it on and no replica could run it): it keeps its attempts and its deadline, so a cell
    that keeps failing is still given up in time."""
    return held_msg_id == msg_id
