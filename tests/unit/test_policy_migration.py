"""Migration after every replica yields: replica choice, target choice, retry and give-up."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.policies.executor_choice import ReplicaView
from shared.policies.migration import GiveUp, MigrationPlan, NoTarget, RetryAt, RetrySchedule, plan_migration
from shared.policies.placement import HostView
from shared.resources import Resources

NEED = Resources(millicpus=1000, memory_mb=1024, gpus=4, vram_gb=16)


def kernel() -> list[ReplicaView]:
    return [
        ReplicaView("r1", "a", raft_role="leader"),
        ReplicaView("r2", "b", raft_role="follower"),
        ReplicaView("r3", "c", raft_role="follower"),
    ]


def cluster(**overrides: HostView) -> list[HostView]:
    hosts = {
        "a": HostView("a", 8, committed_gpus=8, subscribed_gpus=30),
        "b": HostView("b", 8, committed_gpus=6, subscribed_gpus=40),
        "c": HostView("c", 8, committed_gpus=8, subscribed_gpus=20),
        "d": HostView("d", 8, committed_gpus=2, subscribed_gpus=10),
        "e": HostView("e", 8, committed_gpus=0, subscribed_gpus=10),
        "f": HostView("f", 8, committed_gpus=6, subscribed_gpus=0),
    }
    hosts.update(overrides)
    return list(hosts.values())


def test_moves_a_follower_from_the_most_subscribed_host_to_the_most_idle_host() -> None:
    plan = plan_migration(kernel(), NEED, cluster())
    assert plan == MigrationPlan("r2", "b", "e", use_prewarmed=False)


def test_prefers_a_host_with_a_prewarmed_runtime_over_more_idle_gpus() -> None:
    plan = plan_migration(kernel(), NEED, cluster(), prewarmed={"d": 1, "f": 3})
    assert plan == MigrationPlan("r2", "b", "d", use_prewarmed=True)  # f has warm runtimes but 2 idle GPUs


def test_a_dead_replica_is_the_one_to_move_even_if_leader() -> None:
    replicas = [ReplicaView("r1", "a", alive=False, raft_role="leader"), *kernel()[1:]]
    plan = plan_migration(replicas, NEED, cluster())
    assert isinstance(plan, MigrationPlan) and plan.replica_id == "r1"


def test_never_targets_a_host_already_holding_a_replica_and_explains() -> None:
    hosts = cluster(d=HostView("d", 8, committed_gpus=8), e=HostView("e", 8, cordoned=True))
    replicas = [*kernel()[:2], ReplicaView("r3", "f")]  # f holds a replica of this kernel
    plan = plan_migration(replicas, NEED, hosts)
    assert isinstance(plan, NoTarget)
    assert plan.reason == "no host can bind 4 GPUs now"
    assert plan.rejected["f"] == "already hosts a replica of this kernel"
    assert plan.rejected["e"] == "host is cordoned"
    assert plan.rejected["d"] == "needs 4 GPUs now, 0 idle"


def test_optional_watermark_keeps_target_under_sr() -> None:
    hosts = cluster(e=HostView("e", 8, subscribed_gpus=70))
    plan = plan_migration(kernel(), NEED, hosts, watermark=3.0)
    assert isinstance(plan, MigrationPlan) and plan.target_host == "d"


@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 60), st.booleans()), max_size=12)
)
def test_any_target_can_bind_now_and_is_not_a_replica_host(specs: list[tuple[int, int, int, bool]]) -> None:
    hosts = [
        HostView(f"h{i}", g, committed_gpus=c, subscribed_gpus=s, alive=al)
        for i, (g, c, s, al) in enumerate(specs)
    ]
    replicas = [ReplicaView(f"r{i}", f"h{i}") for i in range(min(3, len(hosts)))]
    plan = plan_migration(replicas, NEED, hosts)
    if isinstance(plan, MigrationPlan):
        target = next(h for h in hosts if h.host_id == plan.target_host)
        assert target.alive and target.idle_gpus >= NEED.gpus
        assert target.host_id not in {r.host_id for r in replicas}
    else:
        assert all(h.idle_gpus < NEED.gpus or not h.alive or h.host_id in plan.rejected for h in hosts)


def test_retry_backoff_then_give_up_on_attempts() -> None:
    sched = RetrySchedule(base_s=1, factor=2, max_delay_s=5, max_attempts=4, deadline_s=100)
    assert [sched.delay(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
    assert sched.after_failure(1, 0.0, 0.0, "x") == RetryAt(1.0, 1)
    assert sched.after_failure(3, 0.0, 3.0, "x") == RetryAt(7.0, 3)
    give_up = sched.after_failure(4, 0.0, 7.0, "no host can bind 4 GPUs now")
    assert isinstance(give_up, GiveUp)
    assert give_up.reason == "migration aborted after 4 attempts: no host can bind 4 GPUs now"


def test_retry_gives_up_before_the_deadline_would_pass() -> None:
    sched = RetrySchedule(base_s=4, factor=2, max_delay_s=60, max_attempts=100, deadline_s=10)
    assert sched.after_failure(1, 0.0, 0.0, "r") == RetryAt(4.0, 1)
    out = sched.after_failure(2, 0.0, 4.0, "r")  # next would be at 12 > 10
    assert isinstance(out, GiveUp) and "deadline of 10 s" in out.reason


def test_a_named_replica_moves_to_a_busy_host_when_gpus_need_not_be_bound_now() -> None:
    full = {
        h: HostView(h, 8, committed_gpus=8, subscribed_gpus=s) for h, s in (("d", 10), ("e", 5), ("f", 9))
    }
    plan = plan_migration(kernel(), NEED, cluster(**full), replica_id="r1", bind_now=False)
    assert plan == MigrationPlan("r1", "a", "e", use_prewarmed=False)  # the least subscribed after the move
    assert isinstance(plan_migration(kernel(), NEED, cluster(**full)), NoTarget)  # none can bind now


def test_a_dead_replica_is_never_replaced_on_its_own_host() -> None:
    replicas = [ReplicaView("r1", "e", alive=False), *kernel()[1:]]
    plan = plan_migration(replicas, NEED, cluster(), replica_id="r1", bind_now=False)
    assert isinstance(plan, MigrationPlan) and plan.target_host not in ("e", "b", "c")


def test_an_unknown_replica_to_move_is_named() -> None:
    plan = plan_migration(kernel(), NEED, cluster(), replica_id="r9")
    assert isinstance(plan, NoTarget) and "r9" in plan.reason
