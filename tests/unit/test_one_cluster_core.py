"""One cluster core, two drivers: the live global scheduler and the simulator build the same
``ClusterCore`` class and step it through the same entry points; its idle judgement and drain
plan are pure (no I/O, the time passed in)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.global_scheduler.autoscaling import ClusterAutoscaler
from services.global_scheduler.cluster_state import ClusterState
from services.global_scheduler.service import GlobalScheduler
from shared.cluster_core.core import ClusterCore, CoreConfig
from shared.cluster_core.drain import ReplicaToMove, plan_drain
from shared.cluster_core.idle import HostFacts, IdleJudge
from shared.config import load_config
from shared.policies.autoscale import AutoscaleConfig, NoScale, ScaleIn
from shared.policies.executor_choice import ReplicaView
from shared.policies.migration import GiveUp, RetryAt
from shared.policies.placement import HostView
from shared.resources import Resources
from shared.simulator.engine import Simulator
from shared.simulator.params import SimParams
from shared.workload.model import Session, Task, Trace


class OwningProvider:
    """A provider that started every host and stops them when asked."""

    can_provision = True

    def owns(self, host_id: str) -> bool:
        return True

    async def provision(self, count: int) -> list[str]:
        return []

    async def release(self, host_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


def record_calls(monkeypatch: pytest.MonkeyPatch, *names: str) -> list[tuple[str, ClusterCore]]:
    """Every call of these ``ClusterCore`` methods, with the core it was made on."""
    calls: list[tuple[str, ClusterCore]] = []
    for name in names:
        real = getattr(ClusterCore, name)

        def spy(self: ClusterCore, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append((_name, self))
            return _real(self, *args, **kw)

        monkeypatch.setattr(ClusterCore, name, spy)
    return calls


def contended_trace() -> Trace:
    """Four 1-GPU sessions on three 1-GPU hosts, a cell each at once: the fourth is held."""
    sessions = [Session(f"s{i}", 0.0, 5_000.0, 1) for i in range(4)]
    tasks = [Task(f"s{i}", 10.0, 1_000.0, 1) for i in range(4)]
    return Trace.from_tasks(sessions, tasks)


def test_the_live_scheduler_and_the_simulator_build_the_same_core_class(gs: GlobalScheduler) -> None:
    sim = Simulator(contended_trace(), "notebookos", SimParams(gpus_per_host=1))
    assert type(gs.core) is type(sim.core) is ClusterCore
    assert gs.autoscaling.core is gs.core  # the live autoscaler steps the scheduler's one core
    assert gs.placement is gs.core.placement
    assert sim.autoscaler is sim.core.autoscaler and sim.policy is sim.core.sessions


def test_both_drivers_step_the_core_through_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, "tick")
    cfg = load_config(None, {"cluster.hosts": "1", "cluster.max_hosts": "4"})
    state = ClusterState()
    state.register_host("h1", Resources(gpus=8), "virtual", "", 0.0)
    live_core = ClusterCore(CoreConfig.from_config(cfg))
    scaler = ClusterAutoscaler(cfg, state, OwningProvider(), core=live_core, clock=lambda: 0.0)  # type: ignore[arg-type]
    asyncio.run(scaler.evaluate_once())
    sim = Simulator(contended_trace(), "notebookos", SimParams(gpus_per_host=1, max_hosts=3))
    sim.run()
    assert {id(core) for name, core in calls} == {id(live_core), id(sim.core)}
    assert all(name == "tick" and type(core) is ClusterCore for name, core in calls)


def test_a_held_cell_is_retried_and_given_up_by_the_core_in_the_simulator_as_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = record_calls(monkeypatch, "held_step", "held_migration_failed")
    params = SimParams(gpus_per_host=1, initial_hosts=3, max_hosts=3, migration_deadline_s=30.0)
    result = Simulator(contended_trace(), "notebookos", params).run()
    assert result.cells_failed == 1  # at max_hosts no host can come: an error after 30 s
    assert result.scale_out_s == []
    # each look goes through the live Migrator's step function, then its failure rule
    assert [name for name, _ in calls][:2] == ["held_step", "held_migration_failed"]
    live_core = ClusterCore(CoreConfig.from_config(load_config()))
    assert live_core.first_migration_at(5.0) == 6.0  # one heartbeat interval, as the live Migrator waits
    assert isinstance(live_core.migration_failed(1, 0.0, 6.0, "no host"), RetryAt)
    assert isinstance(live_core.migration_failed(9, 0.0, 29.0, "no host"), GiveUp)


# ---- the idle judgement, pure ------------------------------------------------------------------


def test_a_host_is_releasable_only_after_being_idle_for_scale_in_idle_s() -> None:
    judge = IdleJudge(30.0)
    host = HostFacts("h1", 8)
    assert not judge.loads([host], 0.0)[0].releasable  # idle from now on
    assert not judge.loads([host], 29.0)[0].releasable
    assert judge.loads([host], 30.0)[0].releasable


def test_a_host_the_provider_did_not_start_is_never_released() -> None:
    judge = IdleJudge(0.0)
    assert not judge.loads([HostFacts("initial", 8, owned=False)], 100.0)[0].releasable


@pytest.mark.parametrize(
    "busy",
    [
        HostFacts("h1", 8, committed_gpus=1),
        HostFacts("h1", 8, active=True),
        HostFacts("h1", 8, reserved=True),
    ],
    ids=["committed", "active_replica", "reserved_for_a_waiting_kernel"],
)
def test_a_busy_host_is_not_idle_and_restarts_its_idle_period(busy: HostFacts) -> None:
    judge = IdleJudge(10.0)
    judge.loads([HostFacts("h1", 8)], 0.0)
    assert not judge.loads([busy], 20.0)[0].releasable
    assert not judge.loads([HostFacts("h1", 8)], 25.0)[0].releasable  # idle again since 25
    assert judge.loads([HostFacts("h1", 8)], 35.0)[0].releasable


def test_a_host_holding_replicas_is_idle_only_where_they_can_be_drained() -> None:
    with_replicas = HostFacts("h1", 8, replicas=2)
    assert IdleJudge(0.0, can_drain=True).loads([with_replicas], 0.0)[0].releasable
    assert not IdleJudge(0.0, can_drain=False).loads([with_replicas], 0.0)[0].releasable


def test_each_failed_release_doubles_the_idle_period_until_the_host_is_used() -> None:
    judge = IdleJudge(10.0)
    judge.loads([HostFacts("h1", 8)], 0.0)
    assert judge.release_failed("h1") == 1 and judge.wanted("h1") == 20.0
    judge.loads([HostFacts("h1", 8)], 10.0)  # idle afresh from 10
    assert not judge.loads([HostFacts("h1", 8)], 29.0)[0].releasable
    assert judge.loads([HostFacts("h1", 8)], 30.0)[0].releasable
    judge.loads([HostFacts("h1", 8, committed_gpus=1)], 31.0)  # used again: a fresh judgement
    assert judge.wanted("h1") == 10.0


def test_tick_releases_only_hosts_the_idle_judgement_allows() -> None:
    config = CoreConfig(autoscale=AutoscaleConfig(min_hosts=1, buffer_hosts=0), scale_in_idle_s=60.0)
    core = ClusterCore(config)
    hosts = [HostFacts("a", 8, owned=False), HostFacts("b", 8), HostFacts("c", 8, active=True)]
    assert isinstance(core.tick(0.0, hosts), NoScale)  # b only just became idle
    decision = core.tick(60.0, hosts)
    assert isinstance(decision, ScaleIn) and decision.host_ids == ("b",)


# ---- the drain plan, pure ----------------------------------------------------------------------


def replica(kernel_id: str, hosts: tuple[str, ...]) -> ReplicaToMove:
    views = tuple(ReplicaView(f"r{i}", h) for i, h in enumerate(hosts))
    return ReplicaToMove(kernel_id, "r0", Resources(gpus=1), views)


def test_a_drain_moves_each_replica_it_can_and_reports_the_others() -> None:
    views = [HostView(h, 8, replicas_per_kernel=3) for h in "abc"] + [
        HostView("d", 8, cordoned=True, replicas_per_kernel=3)
    ]
    stuck_one = replica("k1", ("a", "b", "c"))  # only d is left for it, and d is cordoned
    movable = replica("k2", ("a", "b", "d"))  # c can take it
    plan = plan_drain("a", [stuck_one, movable], views)
    assert [(r.kernel_id, m.target_host) for r, m in plan.moves] == [("k2", "c")]
    assert [(r.kernel_id, why) for r, why in plan.stuck] == [
        ("k1", "no host can take another replica of this kernel")
    ]
    assert not plan.complete


def test_a_drain_counts_each_placed_replica_before_planning_the_next() -> None:
    views = [HostView(h, 1, replicas_per_kernel=1) for h in "ab"]  # watermark 1: one 1-GPU replica each
    plan = plan_drain("a", [replica("k1", ("a",)), replica("k2", ("a",))], views, watermark=1.0)
    assert [m.target_host for _, m in plan.moves] == ["b"]
    assert [r.kernel_id for r, _ in plan.stuck] == ["k2"]


# ---- the shells hold no copy of the core's decisions --------------------------------------------

ROOT = Path(__file__).resolve().parents[2]

# shell -> the core's entry points it must step (each decision it used to make itself)
SHELL_CALLS: dict[str, set[str]] = {
    "services/global_scheduler/service.py": {
        "executor_for",
        "queues_behind_held",
        "holds_cell",
        "migrates_after_failed_election",
        "single_replica",
        "interrupt_ends_held",
    },
    "services/global_scheduler/migration.py": {
        "executor_for",
        "plan_held_migration",
        "held_step",
        "held_migration_failed",
        "plan_replacement",
        "replacement_step",
        "replacement_failed",
        "replaces_lost_replica",
        "resumes_restored",
    },
    "services/global_scheduler/autoscaling.py": {
        "can_add_hosts",
        "start_unplaced",
        "start_waits",
        "start_deadline",
        "why_not_drained",
        "tick",
        "release_failed",
    },
    "shared/simulator/engine.py": {
        "look_at_held",
        "send_held",
        "migrate_held",
        "held_migration_failed",
        "plan_drain",
        "tick",
        "release_failed",
        "placement_failed",
    },
}
# the core's own rules, shared functions the core modules wrap: a shell naming one decides itself
POLICY_LEAVES = {
    "choose_executor",
    "plan_migration",
    "feasible_hosts",
    "on_placement_failed",
    "reserved_for",
    "after_failure",
    "scale_in_idle_wanted",
    "retry_cell",
    "retry_held",
    "MAX_ELECTION_ROUNDS",
}
# private copies the shells had before the rule moved into the core
PRIVATE_COPIES = {"_why_not_drained", "_explain", "_kernel_busy", "_can_add_hosts", "_place_once_room"}
# pure rules the shells call as functions of the core package
CORE_FUNCTIONS: dict[str, set[str]] = {
    "services/global_scheduler/service.py": {
        "after_replica_lost",
        "start_verdict",
        "restart_refusal",
        "restartable_in_place",
        "keeps_reported_replica",
        "tells_members_lost",
        "stops_on_request",
        "transition",
        "rebuilding",
        "replicas_may_still_come",
        "shutdown_stops",
    },
    "services/global_scheduler/migration.py": {
        "failed_election_verdict",
        "replicas_to_drain",
        "explain",
        "membership_contact",
        "held_again",
    },
    "services/global_scheduler/autoscaling.py": {"kernel_facts"},
    "shared/simulator/engine.py": {"kernel_facts"},
}


def _names(tree: ast.AST) -> tuple[set[str], set[str], set[str], set[str]]:
    """(attributes read on a ``core``/``_core``, every name or attribute used, functions defined,
    names imported from ``shared.cluster_core``)."""
    on_core: set[str] = set()
    used: set[str] = set()
    defined: set[str] = set()
    from_core: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("core", "_core"):
                on_core.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            used.update(a.name for a in node.names)
            if (node.module or "").startswith("shared.cluster_core"):
                from_core.update(a.name for a in node.names)
    return on_core, used, defined, from_core


@pytest.mark.parametrize("shell", sorted(SHELL_CALLS))
def test_the_shells_step_the_core_for_each_decision_and_keep_no_copy_of_it(shell: str) -> None:
    on_core, used, defined, from_core = _names(ast.parse((ROOT / shell).read_text()))
    assert SHELL_CALLS[shell] <= on_core, f"{shell} no longer asks the core {SHELL_CALLS[shell] - on_core}"
    assert CORE_FUNCTIONS.get(shell, set()) <= from_core
    assert not used & POLICY_LEAVES, f"{shell} calls a policy leaf itself: {used & POLICY_LEAVES}"
    assert not defined & PRIVATE_COPIES, f"{shell} keeps a private copy: {defined & PRIVATE_COPIES}"


def test_the_simulator_steps_a_held_cell_through_held_step_as_the_live_migrator_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = record_calls(monkeypatch, "held_step", "send_held", "migrate_held")
    Simulator(contended_trace(), "notebookos", SimParams(gpus_per_host=1, max_hosts=4)).run()
    names = [name for name, _ in calls]
    assert names[0] == "held_step" and "migrate_held" in names  # no room on the 3 first hosts: moved
