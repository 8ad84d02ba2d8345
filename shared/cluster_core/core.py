"""``ClusterCore``: the decisions the live global scheduler and the simulator share, stepped by
both with their own clock (ARCHITECTURE.md §3). Modelled on etcd-io/raft's RawNode: the driver
feeds events (a placement failed, a host registered, a release failed, ``tick(now, hosts)``) and
carries out what comes back (``ScaleOut``, ``ScaleIn``, ``RetryAt``/``GiveUp`` and maybe a
``ScaleOut`` for a held cell (``held.py``), a lifecycle move); nothing here does I/O or reads a clock.

It owns the autoscaler (what is pending and reserved), the idle-host judgement, the kernel
placement, the held-cell retry policy, the drain plan and the kernel lifecycle table; the GPU
ledger model is ``gpu_ledger.GpuLedger``, one per host in every driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shared.cluster_core import lifecycle, moves, starts
from shared.cluster_core.drain import DrainPlan, ReplicaToMove, plan_drain
from shared.cluster_core.held import HeldDecision, HeldFailure, HeldLook, HeldScaleOut, HeldStep, held_step
from shared.cluster_core.idle import HostFacts, IdleJudge
from shared.cluster_core.replicated import ReplicatedKernels
from shared.cluster_core.reservations import ArrivedReservations
from shared.cluster_core.sessions import Action, Session, SessionPolicy
from shared.config import Config
from shared.policies.autoscale import AutoscaleConfig, Autoscaler, ScaleDecision
from shared.policies.executor_choice import ReplicaView
from shared.policies.kernel_placement import KernelPlacement
from shared.policies.migration import GiveUp, MigrationPlan, NoTarget, RetryAt, RetrySchedule
from shared.policies.placement import HostView, PlacementDecision, PlacementRequest
from shared.resources import Resources


def autoscale_config(cfg: Config) -> AutoscaleConfig:
    """The autoscaler's knobs from ``[cluster]``, ``[host]``, ``[scheduler]`` and ``[autoscale]``."""
    hosts = int(cfg.get("cluster.hosts"))
    max_hosts = int(cfg.get("cluster.max_hosts")) or hosts
    if max_hosts < hosts:
        raise ValueError(f"cluster.max_hosts ({max_hosts}) must be at least cluster.hosts ({hosts})")
    return AutoscaleConfig(
        scaling_factor=float(cfg.get("autoscale.scaling_factor")),
        gpus_per_host=max(int(cfg.get("host.gpus")), 1),
        buffer_hosts=int(cfg.get("autoscale.buffer_hosts")),
        min_hosts=hosts,
        max_hosts=max_hosts,
        max_release=int(cfg.get("autoscale.max_release")),
        replicas_per_kernel=int(cfg.get("cluster.replicas_per_kernel")),
        max_ratio_after_scale_in=float(cfg.get("scheduler.subscription_ratio_watermark")),
    )


def retry_schedule(base_s: float, max_delay_s: float, deadline_s: float) -> RetrySchedule:
    """The held-cell (and replacement) retry policy: back off until the deadline decides."""
    return RetrySchedule(
        base_s=base_s, max_delay_s=max_delay_s, max_attempts=1_000_000, deadline_s=deadline_s
    )


@dataclass(frozen=True, slots=True)
class CoreConfig:
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    scale_in_idle_s: float = 30.0
    retry: RetrySchedule = field(default_factory=lambda: retry_schedule(0.5, 4.0, 30.0))
    # A commit released just now can come back for one heartbeat: a held cell's first migration
    # waits this long (the live ledger's staleness; the simulator models the same wait).
    ledger_settle_s: float = 1.0
    watermark: float = 3.0
    replicas_per_kernel: int = 3
    # how long a kernel start, or a held cell, waits for the hosts a scale-out asked for
    scale_out_timeout_s: float = 300.0

    @classmethod
    def from_config(cls, cfg: Config) -> CoreConfig:
        sched = cfg["scheduler"]
        return cls(
            autoscale=autoscale_config(cfg),
            scale_in_idle_s=float(cfg.get("autoscale.scale_in_idle_s")),
            retry=retry_schedule(
                float(sched["migration_retry_base_s"]),
                float(sched["migration_retry_max_s"]),
                float(sched["migration_deadline_s"]),
            ),
            ledger_settle_s=float(sched["heartbeat_interval_s"]),
            watermark=float(sched["subscription_ratio_watermark"]),
            replicas_per_kernel=int(cfg.get("cluster.replicas_per_kernel")),
            scale_out_timeout_s=float(cfg.get("autoscale.scale_out_timeout_s")),
        )


POLICIES = ("notebookos", "reservation", "batch", "lcp")


class ClusterCore:
    """One per driver: the live ``GlobalScheduler`` and the ``Simulator`` each build one.

    ``policy`` picks the session plug-in: ``notebookos`` (replicated kernels, ``replicated.py``)
    or a baseline (``shared.policies.baselines``); they share the core's ledgers model, autoscaler,
    idle judgement and retry policy."""

    def __init__(
        self,
        config: CoreConfig | None = None,
        *,
        policy: str = "notebookos",
        autoscaler: Autoscaler | None = None,
        hosts: Mapping[str, int] | None = None,
        prewarmed: dict[str, int] | None = None,
        lcp_pool_per_host: int = 8,
    ) -> None:
        self.config = config or CoreConfig()
        self.autoscaler = autoscaler if autoscaler is not None else Autoscaler(self.config.autoscale)
        self.placement = KernelPlacement(self.config.watermark, self.config.replicas_per_kernel)
        self.retry = self.config.retry
        # hosts that registered with reservations for kernels still waiting (both drivers place past them)
        self.arrived = ArrivedReservations()
        self.held = HeldScaleOut(self.autoscaler, self.retry, self.config.scale_out_timeout_s, self.arrived)
        self.sessions = self._plugin(policy, hosts, prewarmed, lcp_pool_per_host)
        # only replicated kernels leave replicas on a host that a drain must move first
        self.idle = IdleJudge(self.config.scale_in_idle_s, can_drain=policy == "notebookos")

    def _plugin(
        self, name: str, hosts: Mapping[str, int] | None, prewarmed: dict[str, int] | None, pool: int
    ) -> SessionPolicy:
        from shared.policies import baselines  # the plug-ins import this package's interface

        if name == "notebookos":
            return ReplicatedKernels(
                self.placement,
                self.autoscaler,
                hosts=dict(hosts or {}),
                prewarmed=prewarmed,
                arrived=self.arrived,
            )
        if name == "lcp":
            return baselines.LcpPolicy(hosts, pool_per_host=pool)
        if name in POLICIES:
            return baselines.make_policy(name, hosts)
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICIES)}")

    @property
    def replicated(self) -> ReplicatedKernels | None:
        """The replicated-kernel plug-in, if that is the policy."""
        return self.sessions if isinstance(self.sessions, ReplicatedKernels) else None

    # ---- sessions (the plug-in's events) ------------------------------------------------------

    def session_started(self, session: Session) -> list[Action]:
        return self.sessions.on_session_start(session)

    def cell_submitted(self, session_id: str, cell_id: str) -> list[Action]:
        return self.sessions.on_cell_submit(session_id, cell_id)

    def cell_ended(self, session_id: str, cell_id: str) -> list[Action]:
        return self.sessions.on_cell_end(session_id, cell_id)

    def session_ended(self, session_id: str) -> list[Action]:
        self.held.over(session_id)
        return self.sessions.on_session_end(session_id)

    def host_added(self, host_id: str, gpus: int) -> list[Action]:
        return self.sessions.add_host(host_id, gpus)

    def host_removed(self, host_id: str) -> None:
        self.sessions.remove_host(host_id)
        self.idle.released(host_id)

    def retry_held(self, session_id: str, cell_id: str) -> list[Action] | str:
        """Look again at a held cell at once (an executor, else a migration): its actions, or why
        it still cannot run. The simulator steps held cells through ``look_at_held`` instead."""
        return self._held_outcome(session_id, lambda plugin: plugin.retry_cell(session_id, cell_id))

    def look_at_held(
        self, session_id: str, cell_id: str, since: float, attempts: int, now: float, poll_s: float
    ) -> HeldStep | None:
        """The replicated plug-in's held cell through ``held_step``, as the live ``Migrator``
        looks at its own (None: the cell is not held)."""
        replicated = self.replicated
        seen = None if replicated is None else replicated.held_look(session_id, cell_id)
        if seen is None:
            return None
        own_cell_running, executor_now = seen
        look = HeldLook(since, attempts, own_cell_running, False, executor_now)
        return self.held_step(look, now, poll_s)

    def send_held(self, session_id: str, cell_id: str) -> list[Action]:
        """``SendOn``: run the held cell on the replica that can run it now."""
        replicated = self.replicated
        actions = [] if replicated is None else replicated.send_held(session_id, cell_id)
        if actions:
            self.held.over(session_id)
        return actions

    def migrate_held(self, session_id: str, cell_id: str) -> list[Action] | str:
        """``TryMigration``: move a replica and run the cell there, or why no host can take it
        (then ``held_migration_failed`` decides)."""
        return self._held_outcome(session_id, lambda plugin: plugin.migrate_held(session_id, cell_id))

    def _held_outcome(
        self, session_id: str, step: Callable[[ReplicatedKernels], list[Action] | str]
    ) -> list[Action] | str:
        """Carry out ``step`` on the replicated plug-in; a cell that runs ends its hold."""
        replicated = self.replicated
        if replicated is None:
            return "only replicated kernels hold cells"
        outcome = step(replicated)
        if not isinstance(outcome, str):
            self.held.over(session_id)
        return outcome

    def give_up_held(self, session_id: str, cell_id: str) -> None:
        """``held_migration_failed`` said GiveUp: the held cell fails."""
        self.held.over(session_id)
        replicated = self.replicated
        if replicated is not None:
            replicated.give_up(session_id, cell_id)

    def start_timed_out(self, session_id: str) -> list[Action]:
        """``start_deadline`` passed for a session still waiting for hosts: its start fails."""
        replicated = self.replicated
        if replicated is None:
            return []
        return replicated.fail_start(
            session_id, f"new hosts did not register within {self.config.scale_out_timeout_s:g}s"
        )

    # ---- the periodic check -----------------------------------------------------------------

    def tick(self, now: float, hosts: Iterable[HostFacts]) -> ScaleDecision:
        """Judge which hosts are idle at ``now`` and decide a scale-out or -in (or neither)."""
        return self.autoscaler.evaluate(self.idle.loads(hosts, now))

    # ---- hosts ------------------------------------------------------------------------------

    def placement_failed(self, request: PlacementRequest, feasible: int, live_hosts: int) -> ScaleDecision:
        """A kernel's replicas found no room: reserve them on hosts to be added (maybe ScaleOut)."""
        return self.autoscaler.on_placement_failed(request, feasible, live_hosts)

    def scale_out_asked(self, count: int) -> None:
        """The driver asked its provider for ``count`` hosts after a periodic ScaleOut."""
        self.autoscaler.expect_hosts(count)

    def scale_out_failed(self, count: int, why: str = "") -> tuple[str, ...]:
        """``count`` hosts asked for will never come: the kernels whose reservations are lost (a
        held cell among them is not asked for again: it fails at its migration deadline)."""
        lost = self.autoscaler.on_scale_out_failed(count)
        self.held.provider_failed(lost, why)
        return lost

    def start_deadline(self, asked_at: float) -> float:
        """When a kernel start that first asked for hosts at ``asked_at`` fails if still unplaced."""
        return asked_at + self.config.scale_out_timeout_s

    def host_registered(self, host_id: str) -> tuple[tuple[str, Resources], ...]:
        """A new host arrived: the replica slots reserved on it for kernels waiting to start."""
        return self.autoscaler.on_host_registered(host_id)

    def release_failed(self, host_id: str) -> int:
        """A scale-in of ``host_id`` failed (a replica no host could take): back off; failures in a row."""
        return self.idle.release_failed(host_id)

    def host_released(self, host_id: str) -> None:
        self.idle.released(host_id)

    def plan_drain(
        self,
        host_id: str,
        replicas: Sequence[ReplicaToMove],
        hosts: Iterable[HostView],
        prewarmed: Mapping[str, int] | None = None,
    ) -> DrainPlan:
        """Where each replica on ``host_id`` goes (per replica; those no host takes stay)."""
        return plan_drain(host_id, replicas, hosts, prewarmed=prewarmed, watermark=self.config.watermark)

    why_not_drained = staticmethod(moves.why_not_drained)

    # ---- starts and moves (moves.py, starts.py): the rules both drivers ask ------------------

    def can_add_hosts(self, live_hosts: int, *, enabled: bool = True) -> bool:
        """Whether a refused placement could still be helped by a scale-out."""
        return starts.can_add_hosts(self.autoscaler, live_hosts, enabled=enabled)

    def start_unplaced(
        self, request: PlacementRequest, decision: PlacementDecision, live_hosts: int
    ) -> ScaleDecision:
        """A kernel start found no room: reserve its missing replicas on hosts to come."""
        return starts.start_unplaced(self.autoscaler, request, decision, live_hosts)

    def start_waits(self, kernel_id: str) -> bool:
        """Whether hosts reserved for the kernel's start are still to come (else it fails, or
        asks again)."""
        return starts.start_waits(self.autoscaler, kernel_id)

    # the pure rules of moves.py, as the core's entry points (the shells name the core, not the leaves)
    executor_for = staticmethod(moves.executor_for)
    single_replica = staticmethod(moves.single_replica)
    queues_behind_held = staticmethod(moves.queues_behind_held)
    holds_cell = staticmethod(moves.holds_cell)
    interrupt_ends_held = staticmethod(moves.interrupt_ends_held)
    resumes_restored = staticmethod(moves.resumes_restored)
    migrates_after_failed_election = staticmethod(moves.migrates_after_failed_election)
    plan_held_migration = staticmethod(moves.plan_held_migration)

    def plan_replacement(
        self,
        replica_id: str,
        replicas: Sequence[ReplicaView],
        need: Resources,
        hosts: Iterable[HostView],
        prewarmed: Mapping[str, int] | None = None,
    ) -> MigrationPlan | NoTarget:
        """Where a dead or drained replica goes, under the subscription watermark."""
        return moves.plan_replacement(
            replica_id, replicas, need, hosts, prewarmed=prewarmed, watermark=self.config.watermark
        )

    replaces_lost_replica = staticmethod(moves.replaces_lost_replica)
    replacement_step = staticmethod(moves.replacement_step)

    def replacement_failed(
        self, attempts: int, started: float, now: float, why: str, *, no_target: bool, wait_for_target: bool
    ) -> RetryAt | GiveUp:
        """A move of a replica failed: retry (backoff, migration deadline) or give up."""
        return moves.replacement_failed(
            self.retry, attempts, started, now, why, no_target=no_target, wait_for_target=wait_for_target
        )

    # ---- held cells -------------------------------------------------------------------------

    def first_migration_at(self, held_since: float) -> float:
        """When a cell no replica could run is first tried for a migration."""
        return held_since + self.config.ledger_settle_s

    def held_step(self, look: HeldLook, now: float, poll_s: float) -> HeldStep:
        """What to do with a held cell now (wait, send it on, or migrate): the live ``Migrator``'s
        loop; the simulator's held cells take the same steps (first look at ``first_migration_at``,
        then ``ReplicatedKernels.retry_cell``: an executor, else a migration)."""
        return held_step(look, now, self.first_migration_at(look.since), poll_s)

    def migration_failed(self, attempts: int, held_since: float, now: float, reason: str) -> RetryAt | GiveUp:
        """``attempts`` moves of a replica (a dead one's replacement) failed: when to try again, or
        give up. Held cells use ``held_migration_failed``."""
        return self.retry.after_failure(attempts, held_since, now, reason)

    def held_migration_failed(
        self, failure: HeldFailure, *, live_hosts: int, can_add_hosts: bool = True
    ) -> HeldDecision:
        """A migration of a held cell failed (no host could take it, or the move broke): scale out
        for it as for a failed replica placement (NotebookOS §3.4.2) and wait for that host up to
        ``scale_out_timeout_s``; with no host coming, retry until the migration deadline."""
        return self.held.after_failure(failure, live_hosts=live_hosts, can_add_hosts=can_add_hosts)

    def held_over(self, kernel_id: str) -> None:
        """The kernel's held cell was sent on, failed, or the kernel stopped: free its host's reservation."""
        self.held.over(kernel_id)

    # ---- kernels ----------------------------------------------------------------------------

    @staticmethod
    def transition(kernel: lifecycle.HasState, to: str) -> None:
        """Move ``kernel`` through the lifecycle table (``IllegalTransition`` if it forbids it)."""
        lifecycle.transition(kernel, to)
