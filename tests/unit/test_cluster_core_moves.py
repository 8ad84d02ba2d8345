"""The cluster core's move and start rules (``shared.cluster_core.moves``, ``starts``), pure: the
live global scheduler's shells and the simulator both ask them, so they are proved here once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.cluster_core import lifecycle, moves, starts
from shared.cluster_core.core import ClusterCore, CoreConfig
from shared.cluster_core.held import HeldLook, SendOn, TryMigration, WaitUntil, held_again, held_step
from shared.cluster_core.lifecycle import DEAD, OVER, RUNNING, STARTING, STOPPED, STOPPING
from shared.cluster_core.moves import Abort, Plan, ReplacementLook, ReplicaOnHost
from shared.policies.autoscale import AutoscaleConfig, Autoscaler, NoScale, ScaleOut
from shared.policies.executor_choice import ReplicaView
from shared.policies.migration import GiveUp, MigrationPlan, NoTarget, RetryAt
from shared.policies.placement import HostView, PlacementDecision, PlacementRequest
from shared.resources import Resources

STATES = st.sampled_from([STARTING, RUNNING, STOPPING, STOPPED, DEAD])
MSG_TYPES = st.sampled_from(
    ["execute_request", "kernel_info_request", "interrupt_request", "shutdown_request"]
)


# ---- replacements ------------------------------------------------------------------------------


@given(state=STATES, present=st.booleans(), executing=st.booleans(), now=st.floats(0, 1e6))
def test_a_replacement_ends_with_its_kernel_or_replica_and_waits_while_the_replica_runs_a_cell(
    state: str, present: bool, executing: bool, now: float
) -> None:
    step = moves.replacement_step(ReplacementLook("k", state, "r1", present, executing), now, 0.2)
    if state != RUNNING:
        assert step == Abort(f"kernel k is {state}")
    elif not present:
        assert step == Abort("replica r1 is no longer part of the kernel")
    elif executing:
        assert step == WaitUntil(now + 0.2)
    else:
        assert step == Plan()


def test_a_scale_in_drain_gives_up_at_once_when_no_host_can_take_the_replica() -> None:
    core = ClusterCore()
    decision = core.replacement_failed(1, 0.0, 0.5, "no host", no_target=True, wait_for_target=False)
    assert decision == GiveUp("no host")


@given(
    attempts=st.integers(1, 50),
    elapsed=st.floats(0, 100),
    no_target=st.booleans(),
    wait=st.booleans(),
)
def test_other_failed_moves_follow_the_retry_schedule(
    attempts: int, elapsed: float, no_target: bool, wait: bool
) -> None:
    core = ClusterCore()
    decision = core.replacement_failed(attempts, 0.0, elapsed, "x", no_target=no_target, wait_for_target=wait)
    if no_target and not wait:
        assert decision == GiveUp("x")
    else:
        assert decision == core.retry.after_failure(attempts, 0.0, elapsed, "x")
        assert isinstance(decision, RetryAt | GiveUp)


@given(enabled=st.booleans(), state=STATES, replacing=st.booleans())
def test_a_lost_replica_is_replaced_only_while_its_kernel_runs_and_once(
    enabled: bool, state: str, replacing: bool
) -> None:
    assert moves.replaces_lost_replica(enabled, state, replacing) == (
        enabled and state == RUNNING and not replacing
    )


def test_a_replacement_plans_under_the_watermark_and_a_held_cell_on_idle_gpus() -> None:
    core = ClusterCore(CoreConfig(watermark=1.0))
    replicas = [ReplicaView("r0", "a"), ReplicaView("r1", "b")]
    full = HostView("c", 1, subscribed_gpus=3, replicas_per_kernel=3)  # over watermark 1.0
    busy = HostView("d", 1, committed_gpus=1, replicas_per_kernel=3)  # no idle GPU: fine, binds later
    plan = core.plan_replacement("r0", replicas, Resources(gpus=1), [full, busy])
    assert isinstance(plan, MigrationPlan) and (plan.replica_id, plan.target_host) == ("r0", "d")
    held = core.plan_held_migration(replicas, Resources(gpus=1), [full, busy])
    # a held cell needs GPUs it can bind now, and waits on them: no watermark
    assert isinstance(held, MigrationPlan) and held.target_host == "c"
    assert isinstance(core.plan_held_migration(replicas, Resources(gpus=1), [busy]), NoTarget)


# ---- drains --------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.booleans(), STATES), max_size=8))
def test_a_drain_moves_the_live_replicas_of_running_kernels_only(replicas: list[tuple[bool, str]]) -> None:
    on_host = [ReplicaOnHost(f"k{i}", "r0", alive, state) for i, (alive, state) in enumerate(replicas)]
    chosen = moves.replicas_to_drain(on_host)
    assert chosen == [r for r in on_host if r.alive and r.kernel_state == RUNNING]


def test_why_a_drain_left_its_host_names_the_first_stuck_replica_and_counts_the_rest() -> None:
    assert moves.why_not_drained([], 0) == ""
    assert moves.why_not_drained([], 2) == "2 replica(s) still on the host after the drain"
    failed = [("k1", "r0", "no host"), ("k2", "r1", "full")]
    assert moves.why_not_drained(failed, 2) == "replica r0 of kernel k1 could not move: no host (and 1 more)"


# ---- cells: hold, queue, failed elections ------------------------------------------------------


@given(msg_type=MSG_TYPES, executor=st.booleans(), to_replicas=st.booleans(), state=STATES)
def test_only_an_execute_request_no_replica_can_run_is_held_and_only_while_its_kernel_runs(
    msg_type: str, executor: bool, to_replicas: bool, state: str
) -> None:
    held = moves.holds_cell(msg_type, executor, to_replicas, state)
    assert held == (msg_type == "execute_request" and not executor and to_replicas and state == RUNNING)


@given(channel=st.sampled_from(["shell", "control", "stdin"]), holding=st.booleans())
def test_only_shell_requests_wait_behind_a_held_cell(channel: str, holding: bool) -> None:
    assert moves.queues_behind_held(channel, holding) == (holding and channel == "shell")


@given(state=STATES, round_=st.integers(0, 10))
def test_a_failed_election_is_held_again_until_the_round_limit_while_the_kernel_runs(
    state: str, round_: int
) -> None:
    verdict = moves.failed_election_verdict("k", state, round_)
    assert (verdict is None) == (state == RUNNING and round_ <= moves.MAX_ELECTION_ROUNDS)


def test_a_cell_without_gpus_is_not_migrated_after_a_failed_election() -> None:
    assert not moves.migrates_after_failed_election(0)
    assert moves.migrates_after_failed_election(1)


def test_a_held_cell_of_a_kernel_that_is_gone_is_sent_on_for_the_router_to_answer() -> None:
    gone = HeldLook(0.0, 0, own_cell_running=True, settle_first=True, executor_now=False, kernel_gone=True)
    assert held_step(gone, 0.0, 1.0, 0.2) == SendOn()
    there = HeldLook(0.0, 1, own_cell_running=False, settle_first=False, executor_now=False)
    assert held_step(there, 5.0, 1.0, 0.2) == TryMigration()


# ---- kernel starts -------------------------------------------------------------------------------


@given(live=st.integers(0, 10), pending=st.integers(0, 5), max_hosts=st.integers(1, 12), on=st.booleans())
def test_placement_may_count_on_new_hosts_only_below_max_hosts_with_autoscaling_on(
    live: int, pending: int, max_hosts: int, on: bool
) -> None:
    scaler = Autoscaler(AutoscaleConfig(min_hosts=1, max_hosts=max_hosts, gpus_per_host=1))
    for _ in range(pending):
        scaler.expect_hosts(1)
    assert starts.can_add_hosts(scaler, live, enabled=on) == (on and live + pending < max_hosts)
    assert not starts.can_add_hosts(None, live)


def test_a_start_that_does_not_fit_waits_for_the_hosts_it_asked_for_and_fails_without_them() -> None:
    config = CoreConfig(autoscale=AutoscaleConfig(min_hosts=1, max_hosts=4, gpus_per_host=1))
    core = ClusterCore(config)
    request = PlacementRequest("k1", Resources(gpus=1), replicas=3)
    unplaced = PlacementDecision((), {"h1": "full"})
    outcome = core.start_unplaced(request, unplaced, live_hosts=1)
    assert isinstance(outcome, ScaleOut) and outcome.count == 3
    assert core.start_waits("k1")
    core = ClusterCore(config)
    outcome = core.start_unplaced(request, unplaced, live_hosts=4)  # at max_hosts
    assert isinstance(outcome, NoScale) and not core.start_waits("k1")


@given(
    state=STATES,
    in_flight=st.booleans(),
    held=st.booleans(),
    starting=st.booleans(),
)
def test_a_kernel_is_busy_while_not_running_or_with_work_in_flight_and_an_over_one_counts_nowhere(
    state: str, in_flight: bool, held: bool, starting: bool
) -> None:
    facts = starts.kernel_facts(
        ["a", "b"], kernel_state=state, cell_in_flight=in_flight, held=held, replica_starting=starting
    )
    if state in OVER:
        assert facts == (tuple(), False)
    else:
        assert facts.hosts == ("a", "b")
        assert facts.busy == (state != RUNNING or in_flight or held or starting)


# ---- which replica answers, kernel starts and restarts (lifecycle rules) -----------------------


@given(
    alive=st.lists(st.booleans(), min_size=1, max_size=4),
    leader=st.integers(0, 3),
    last=st.one_of(st.none(), st.integers(0, 3)),
)
def test_a_single_reply_comes_from_the_live_last_executor_else_the_live_leader(
    alive: list[bool], leader: int, last: int | None
) -> None:
    replicas = [
        ReplicaView(f"r{i}", f"h{i}", a, "leader" if i == leader else "follower") for i, a in enumerate(alive)
    ]
    chosen = moves.single_replica(replicas, None if last is None else f"r{last}")
    if last is not None and last < len(alive) and alive[last]:
        assert chosen == f"r{last}"
    elif leader < len(alive) and alive[leader]:
        assert chosen == f"r{leader}"
    else:
        assert chosen is None


@given(state=st.one_of(st.none(), STATES), same_key=st.booleans())
def test_a_start_request_is_new_a_retry_or_a_conflict_by_the_kernel_there(
    state: str | None, same_key: bool
) -> None:
    verdict = lifecycle.start_verdict("k", state, same_key=same_key)
    if state is None or state in OVER:
        assert verdict is None
    elif state == RUNNING and same_key:
        assert verdict == lifecycle.RETRIED
    else:
        assert verdict == f"kernel k is {state}"


@given(
    state=STATES,
    replica_alive=st.booleans(),
    host_alive=st.booleans(),
    live=st.integers(0, 3),
)
def test_a_restart_in_place_never_leaves_a_running_kernel_below_its_quorum(
    state: str, replica_alive: bool, host_alive: bool, live: int
) -> None:
    live_ids = tuple(f"r{i}" for i in range(live))
    look = lifecycle.RestartLook("k", state, "r0", replica_alive, "h0", host_alive, live_ids)
    refusal = lifecycle.restart_refusal(look, quorum=2)
    ok = state == RUNNING and host_alive and not (replica_alive and live - 1 < 2)
    assert (refusal is None) == ok
    if state != RUNNING:
        assert refusal is not None and refusal[1] == "conflict"
    elif not host_alive:
        assert refusal is not None and refusal[1] == "unavailable"


@given(state=STATES, restarting=st.booleans())
def test_a_reported_replica_is_kept_only_for_a_kernel_that_may_run_and_its_loss_is_told_if_it_runs(
    state: str, restarting: bool
) -> None:
    assert lifecycle.keeps_reported_replica(state) == (state in (STARTING, RUNNING))
    assert lifecycle.tells_members_lost(state, restarting=restarting) == (state == RUNNING and not restarting)


@given(msg_type=MSG_TYPES, holding=st.booleans(), state=STATES)
def test_an_interrupt_ends_a_held_cell_and_a_shutdown_request_stops_a_kernel_that_may_run(
    msg_type: str, holding: bool, state: str
) -> None:
    assert moves.interrupt_ends_held(msg_type, holding) == (holding and msg_type == "interrupt_request")
    assert lifecycle.stops_on_request(msg_type, state) == (
        msg_type == "shutdown_request" and state in (STARTING, RUNNING)
    )


@given(rebuilding=st.booleans(), live=st.integers(0, 3))
def test_a_restored_held_queue_waits_for_its_replicas_only_while_the_scheduler_rebuilds(
    rebuilding: bool, live: int
) -> None:
    assert moves.resumes_restored(rebuilding, live, 3) == (not rebuilding or live == 3)


# ---- membership changes, a restarted scheduler's window, shutdown, held cells ------------------


def test_a_membership_change_goes_through_the_leader_else_the_lowest_live_id() -> None:
    members = [
        moves.Member("r1", "follower", True),
        moves.Member("r2", "leader", True),
        moves.Member("r3", None, True),
    ]
    assert moves.membership_contact(members) == "r2"
    assert moves.membership_contact(members, {"r2"}) == "r1"
    unreachable_leader = [moves.Member("r2", "leader", False), moves.Member("r3", "follower", True)]
    assert moves.membership_contact(unreachable_leader) == "r3"
    assert moves.membership_contact(members, {"r1", "r2", "r3"}) is None
    assert moves.membership_contact([]) is None


@given(
    members=st.lists(
        st.builds(
            moves.Member,
            st.sampled_from(["r1", "r2", "r3", "r4", "r5"]),
            st.sampled_from([None, "follower", "candidate", "leader"]),
            st.booleans(),
        ),
        max_size=5,
        unique_by=lambda m: m.replica_id,
    ),
    exclude=st.sets(st.sampled_from(["r1", "r2", "r3", "r4", "r5"])),
)
def test_the_contact_is_a_reachable_member_not_excluded_and_a_known_leader_wins(
    members: list[moves.Member], exclude: set[str]
) -> None:
    chosen = moves.membership_contact(members, exclude)
    candidates = [m for m in members if m.reachable and m.replica_id not in exclude]
    if not candidates:
        assert chosen is None
        return
    assert chosen in {m.replica_id for m in candidates}
    leaders = sorted(m.replica_id for m in candidates if m.role == "leader")
    assert chosen == (leaders or sorted(m.replica_id for m in candidates))[0]


def test_a_restarted_scheduler_rebuilds_for_two_heartbeat_timeouts() -> None:
    assert lifecycle.rebuilding(100.0, 100.0, 5.0)
    assert lifecycle.rebuilding(109.9, 100.0, 5.0)
    assert not lifecycle.rebuilding(110.0, 100.0, 5.0)


@given(alive=st.booleans(), state=st.sampled_from(sorted(lifecycle.TRANSITIONS)), window=st.booleans())
def test_only_a_kernel_short_of_replicas_in_the_window_waits_for_them(
    alive: bool, state: str, window: bool
) -> None:
    waits = lifecycle.replicas_may_still_come(alive, state, rebuilding=window)
    has_replicas = state not in (lifecycle.DEAD, lifecycle.HIBERNATING, lifecycle.HIBERNATED)
    assert waits == (window and not alive and has_replicas)


@given(state=st.sampled_from(sorted(lifecycle.TRANSITIONS)))
def test_a_shutdown_stops_what_may_run_or_is_saving_and_leaves_an_ending_kernel_as_it_is(state: str) -> None:
    stops = lifecycle.shutdown_stops(state)
    assert stops == (state in (STARTING, RUNNING, lifecycle.HIBERNATING))
    if stops:
        lifecycle.check("k", state, STOPPING)  # a move the table allows


def test_the_same_cell_held_again_keeps_its_attempts_another_starts_afresh() -> None:
    assert held_again("m1", "m1")
    assert not held_again("m1", "m2")
    assert not held_again(None, "m1")
