"""A held cell whose migration finds no host is a failed replica placement (NotebookOS §3.4.2):
the core asks for a host reserved for it and waits for that host up to scale_out_timeout_s; the
simulator's kernel starts fail at the same deadline as live ones. Pure core first, then the
simulator driving it."""

from __future__ import annotations

import pytest

from shared.cluster_core.core import ClusterCore, CoreConfig, retry_schedule
from shared.cluster_core.held import (
    HeldDecision,
    HeldFailure,
    HeldLook,
    SendOn,
    TryMigration,
    WaitUntil,
    held_key,
)
from shared.cluster_core.sessions import Held, Migrate, RunCell, Session, StartFailed, WakeHeld
from shared.policies.autoscale import AutoscaleConfig, ScaleOut
from shared.policies.migration import GiveUp, RetryAt
from shared.resources import Resources
from shared.simulator.engine import Simulator
from shared.simulator.params import SimParams
from shared.workload.model import Session as TraceSession
from shared.workload.model import Task, Trace

ONE_GPU = Resources(gpus=1)


def contended_core(max_hosts: int) -> tuple[ClusterCore, str]:
    """Three 1-GPU hosts, four 1-GPU kernels, a cell each: the fourth cell is held; its kernel id."""
    config = CoreConfig(
        autoscale=AutoscaleConfig(gpus_per_host=1, min_hosts=3, max_hosts=max_hosts),
        retry=retry_schedule(0.5, 4.0, 30.0),
        scale_out_timeout_s=300.0,
    )
    core = ClusterCore(config, hosts={"h1": 1, "h2": 1, "h3": 1})
    for i in range(4):
        core.session_started(Session(f"s{i}", ONE_GPU))
    for i in range(3):
        assert isinstance(core.cell_submitted(f"s{i}", f"c{i}")[0], RunCell)
    assert isinstance(core.cell_submitted("s3", "c3")[0], Held)
    assert isinstance(core.retry_held("s3", "c3"), str)  # no host can bind the GPU
    return core, "s3"


def fail_once(core: ClusterCore, kernel: str, attempts: int, now: float, live_hosts: int = 3) -> HeldDecision:
    failure = HeldFailure(kernel, ONE_GPU, attempts, 0.0, now, "no host can bind 1 GPU")
    return core.held_migration_failed(failure, live_hosts=live_hosts)


def test_a_held_cell_scales_out_and_runs_on_the_host_when_it_registers() -> None:
    core, kernel = contended_core(max_hosts=4)
    held = fail_once(core, kernel, 1, 1.0)
    assert held.scale_out is not None and held.scale_out.count == 1
    assert isinstance(held.decision, RetryAt)
    assert core.autoscaler.reserved_for(held_key(kernel)) == 1
    actions = core.host_added("h4", 1)
    assert WakeHeld(kernel, "c3") in actions  # looked at on arrival, not at its next retry
    outcome = core.retry_held(kernel, "c3")
    assert not isinstance(outcome, str)
    migrate, run = outcome
    assert isinstance(migrate, Migrate) and migrate.plan.target_host == "h4"
    assert isinstance(run, RunCell) and run.host_id == "h4"
    assert core.autoscaler.reserved_for(held_key(kernel)) == 0


def test_with_no_host_coming_the_held_cell_fails_at_the_migration_deadline_saying_why() -> None:
    core, kernel = contended_core(max_hosts=3)
    first = fail_once(core, kernel, 1, 1.0)
    assert first.scale_out is None and isinstance(first.decision, RetryAt)
    last = fail_once(core, kernel, 9, 29.0)
    assert isinstance(last.decision, GiveUp)
    assert "no host is coming" in last.decision.reason and "max_hosts=3" in last.decision.reason


def test_the_migration_deadline_is_extended_only_while_a_reserved_host_is_pending() -> None:
    core, kernel = contended_core(max_hosts=4)
    assert fail_once(core, kernel, 1, 1.0).scale_out is not None  # asked at t=1
    waiting = fail_once(core, kernel, 20, 100.0).decision  # past the 30 s migration deadline
    assert isinstance(waiting, RetryAt) and waiting.at <= 301.0
    late = fail_once(core, kernel, 21, 301.0).decision
    assert isinstance(late, GiveUp) and "scale_out_timeout_s = 300" in late.reason
    assert core.autoscaler.reserved_for(held_key(kernel)) == 0  # its reservation is freed


def test_a_host_taken_by_another_cell_is_asked_for_again_within_the_first_requests_bound() -> None:
    core, kernel = contended_core(max_hosts=5)
    assert fail_once(core, kernel, 1, 1.0).scale_out is not None
    core.host_added("h4", 1)  # its reservation is consumed; say another cell took its GPU first
    again = fail_once(core, kernel, 2, 150.0, live_hosts=4)
    assert again.scale_out is not None and isinstance(again.decision, RetryAt)
    assert again.decision.at <= 301.0  # still bounded by the first request, not by this one


def test_a_held_cell_whose_scale_out_failed_is_not_asked_for_again_and_fails_saying_so() -> None:
    core, kernel = contended_core(max_hosts=4)
    assert fail_once(core, kernel, 1, 1.0).scale_out is not None
    assert core.scale_out_failed(1, "quota exceeded") == (held_key(kernel),)
    retry = fail_once(core, kernel, 2, 5.0)
    assert retry.scale_out is None and isinstance(retry.decision, RetryAt)
    end = fail_once(core, kernel, 9, 29.0).decision
    assert isinstance(end, GiveUp) and "quota exceeded" in end.reason


def test_a_kernel_start_still_waiting_at_its_deadline_fails_and_frees_its_reservations() -> None:
    config = CoreConfig(autoscale=AutoscaleConfig(gpus_per_host=8, min_hosts=1, max_hosts=4))
    core = ClusterCore(config, hosts={"h1": 8})
    actions = core.session_started(Session("s", Resources(gpus=2)))
    assert any(isinstance(a, ScaleOut) for a in actions)
    assert core.start_deadline(10.0) == 10.0 + config.scale_out_timeout_s
    assert core.start_timed_out("s") == [StartFailed("s", "new hosts did not register within 300s")]
    assert core.autoscaler.reserved_for("s") == 0
    assert core.start_timed_out("s") == []  # once


def contended_trace(sessions: int = 4) -> Trace:
    """1-GPU sessions on 1-GPU hosts, one cell each at t=10: those beyond the hosts are held."""
    ss = [TraceSession(f"s{i}", 0.0, 5_000.0, 1) for i in range(sessions)]
    tasks = [Task(f"s{i}", 10.0, 1_000.0, 1) for i in range(sessions)]
    return Trace.from_tasks(ss, tasks)


def test_the_simulator_runs_a_held_cell_on_the_host_scaled_out_for_it() -> None:
    params = SimParams(gpus_per_host=1, initial_hosts=3, max_hosts=4, host_provision_s=120.0)
    result = Simulator(contended_trace(), "notebookos", params).run()
    assert result.cells_failed == 0
    assert result.scale_out_s and result.scale_out_s[0] == pytest.approx(11.0)  # after the 1 s settle
    assert result.exec_start_s[3] >= 11.0 + 120.0  # it waited for the host, past the 30 s deadline


def test_the_simulator_fails_a_held_cell_when_no_host_can_come() -> None:
    params = SimParams(gpus_per_host=1, initial_hosts=3, max_hosts=3)
    result = Simulator(contended_trace(), "notebookos", params).run()
    assert result.cells_failed == 1 and result.scale_out_s == []


def test_a_simulated_kernel_start_with_no_host_coming_fails_with_its_cells() -> None:
    params = SimParams(gpus_per_host=1, initial_hosts=3, max_hosts=3, subscription_ratio_watermark=1.0)
    result = Simulator(contended_trace(sessions=4), "notebookos", params).run()
    assert result.sessions_never_started == 1
    assert result.cells_failed == 1  # the client sees its cell fail, as a live failed start


def test_the_simulator_refuses_a_scale_out_timeout_no_provisioning_can_meet() -> None:
    with pytest.raises(Exception, match="scale_out_timeout_s"):
        SimParams(host_provision_s=120.0, scale_out_timeout_s=60.0)


def test_a_kernel_whose_hosts_came_and_still_does_not_fit_asks_a_host_for_every_replica() -> None:
    """The watermark is the cluster's mean ratio: the empty hosts that arrive lower it, so hosts
    counted feasible at the first ask may fail it at the next (the 90-day simulation's stuck starts)."""
    from shared.policies.autoscale import Autoscaler
    from shared.policies.placement import PlacementRequest

    scaler = Autoscaler(AutoscaleConfig(gpus_per_host=8, min_hosts=3, max_hosts=20))
    request = PlacementRequest("k", Resources(gpus=2), replicas=3)
    first = scaler.on_placement_failed(request, feasible=2, live_hosts=8)
    assert isinstance(first, ScaleOut) and first.count == 1
    scaler.on_host_registered("h9")
    again = scaler.on_placement_failed(request, feasible=2, live_hosts=9)
    assert isinstance(again, ScaleOut) and again.count == 3
    scaler.cancel("k")  # placed: a later start of the same id asks afresh
    scaler.on_placement_failed(request, feasible=2, live_hosts=12)
    assert scaler.reserved_for("k") == 1


@pytest.mark.parametrize(
    ("look", "now", "expected"),
    [
        (HeldLook(0.0, 0, True, False, True), 5.0, WaitUntil(5.2)),  # its own previous cell runs
        (HeldLook(0.0, 0, False, True, True), 0.5, WaitUntil(1.0)),  # failed election: ledger settles
        (HeldLook(0.0, 0, False, False, True), 0.5, SendOn()),
        (HeldLook(0.0, 0, False, False, False), 0.5, WaitUntil(1.0)),  # first migration after a heartbeat
        (HeldLook(0.0, 0, False, False, False), 1.0, TryMigration()),
        (HeldLook(0.0, 3, False, False, False), 0.5, TryMigration()),
    ],
    ids=["own_cell", "settle_first", "executor", "first_settle", "migrate", "retry"],
)
def test_the_core_steps_a_held_cell_as_the_live_migrator_loop_did(
    look: HeldLook, now: float, expected: object
) -> None:
    core = ClusterCore(CoreConfig(ledger_settle_s=1.0))
    assert core.held_step(look, now, poll_s=0.2) == expected
