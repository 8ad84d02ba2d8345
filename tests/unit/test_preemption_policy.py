"""The preemption policy (FitGpp §3.2, and FIFO/LRTP/RAND) and the revocable lease, pure."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policies.preemption import (
    BEJob,
    CandidateHost,
    FitGpp,
    LeaseError,
    Lrtp,
    NoPreemption,
    RandomPreemption,
    RevocableLease,
    Victim,
    fits,
    make_policy,
    size,
)
from shared.resources import Resources

CAP = Resources(millicpus=32_000, memory_mb=256 * 1024, gpus=8)


def res(cpus: int = 1, ram_gb: int = 1, gpus: int = 1) -> Resources:
    return Resources(millicpus=cpus * 1000, memory_mb=ram_gb * 1024, gpus=gpus)


def job(job_id: str, gpus: int, gp_s: float = 60.0, *, cpus: int = 1, ram_gb: int = 1, **kw: object) -> BEJob:
    return BEJob(job_id, res(cpus, ram_gb, gpus), grace_period_s=gp_s, **kw)  # type: ignore[arg-type]


def host(
    host_id: str, free_gpus: int, *jobs: BEJob, free_cpus: int = 16, free_ram_gb: int = 128
) -> CandidateHost:
    return CandidateHost(host_id, CAP, res(free_cpus, free_ram_gb, free_gpus), tuple(jobs))


def test_size_is_the_norm_of_demand_over_node_capacity() -> None:
    assert size(res(8, 64, 2), CAP) == pytest.approx(math.sqrt(3 * 0.25**2))
    assert size(res(32, 256, 8), CAP) == pytest.approx(math.sqrt(3))
    # the same demand in other units gives the same size (Eq. 1 is scale-invariant)
    assert size(Resources(millicpus=4000, memory_mb=0, gpus=0), CAP) == pytest.approx(0.125)


def test_a_job_is_eligible_only_if_it_frees_enough_with_the_free_resources_on_its_node() -> None:
    # node has 1 free GPU; the job holds 2: a 3-GPU cell fits (Eq. 2), a 4-GPU cell does not
    h = host("a", 1, job("j", 2))
    assert FitGpp().decide(res(gpus=3), [h]).victims == (Victim("a", "j"),)
    decision = FitGpp().decide(res(gpus=4), [h])
    assert decision.blocked


def test_eligibility_is_element_wise_so_a_cpu_shortfall_disqualifies_a_gpu_rich_job() -> None:
    cpu_poor = host("a", 0, job("big", 4, cpus=1), free_cpus=0)
    cpu_rich = host("b", 0, job("small", 2, cpus=8), free_cpus=0)
    decision = FitGpp().decide(res(cpus=4, gpus=2), [cpu_poor, cpu_rich])
    assert decision.victims == (Victim("b", "small"),)


def test_the_score_weighs_grace_period_by_s() -> None:
    # "small" is small with a long GP, "short" is big with a short GP; both eligible
    small = job("small", 1, gp_s=600.0)
    short = job("short", 4, gp_s=60.0, cpus=8, ram_gb=64)
    hosts = [host("a", 0, small), host("b", 0, short)]
    demand = res(gpus=1)
    scores = FitGpp(s=4.0).scores(hosts)
    max_size = size(short.demand, CAP)
    assert scores[("a", "small")] == pytest.approx(size(small.demand, CAP) / max_size + 4.0 * 1.0)
    assert scores[("b", "short")] == pytest.approx(1.0 + 4.0 * 0.1)
    assert FitGpp(s=4.0).decide(demand, hosts).victims == (Victim("b", "short"),)
    assert FitGpp(s=0.0).decide(demand, hosts).victims == (Victim("a", "small"),)


def test_a_job_preempted_p_times_is_passed_over_for_one_within_budget() -> None:
    best_but_spent = job("spent", 1, gp_s=0.0, preemptions=1)
    worse = job("fresh", 2, gp_s=300.0)
    decision = FitGpp(max_preemptions=1).decide(res(gpus=1), [host("a", 0, best_but_spent, worse)])
    assert decision.victims == (Victim("a", "fresh"),)
    assert not decision.over_budget


def test_a_cell_is_never_blocked_when_every_eligible_job_is_over_budget() -> None:
    a = job("a", 2, gp_s=300.0, preemptions=1)
    b = job("b", 2, gp_s=30.0, preemptions=3)
    decision = FitGpp(max_preemptions=1).decide(res(gpus=2), [host("h", 0, a, b)])
    assert decision.victims == (Victim("h", "b"),)  # by the same score: shorter GP
    assert decision.over_budget


def test_a_replica_host_with_room_runs_the_cell_without_preemption_in_the_callers_order() -> None:
    busy = host("busy", 0, job("j", 4))
    first_roomy = host("r1", 2)
    second_roomy = host("r2", 8)
    for policy in (FitGpp(), Lrtp(), RandomPreemption(), NoPreemption()):
        decision = policy.decide(res(gpus=2), [busy, first_roomy, second_roomy])
        assert decision.host_id == "r1"
        assert decision.victims == ()


def test_the_executor_is_the_host_of_the_chosen_victim() -> None:
    decision = FitGpp().decide(res(gpus=2), [host("r1", 0, job("x", 1)), host("r2", 0, job("y", 2))])
    assert decision.host_id == "r2"
    assert decision.victims == (Victim("r2", "y"),)


def test_when_no_single_job_frees_enough_fitgpp_takes_the_fewest_lowest_score_jobs_on_one_host() -> None:
    three = host("three", 0, job("t1", 1, gp_s=10.0), job("t2", 1, gp_s=20.0), job("t3", 1, gp_s=30.0))
    two = host("two", 1, job("u1", 1, gp_s=100.0), job("u2", 1, gp_s=5.0))
    decision = FitGpp().decide(res(gpus=3), [three, two])
    assert decision.host_id == "two"
    assert set(decision.victims) == {Victim("two", "u1"), Victim("two", "u2")}


def test_a_cell_is_blocked_only_when_preempting_everything_on_a_host_cannot_fit_it() -> None:
    hosts = [host("a", 0, job("j", 2, remaining_s=60.0)), host("b", 1)]
    for policy in (FitGpp(), Lrtp(), RandomPreemption()):
        assert policy.decide(res(gpus=4), hosts).blocked
    assert NoPreemption().decide(res(gpus=1), [host("a", 0, job("j", 2))]).blocked


def test_lrtp_preempts_longest_remaining_first_until_some_host_has_room() -> None:
    hosts = [
        host("a", 0, job("long", 1, remaining_s=9000.0), job("short_a", 2, remaining_s=60.0)),
        host("b", 0, job("mid", 2, remaining_s=5000.0)),
    ]
    decision = Lrtp().decide(res(gpus=2), hosts)
    # "long" (a) alone is not enough; "mid" (b) then gives b room
    assert decision.victims == (Victim("a", "long"), Victim("b", "mid"))
    assert decision.host_id == "b"


def test_lrtp_needs_remaining_times() -> None:
    with pytest.raises(ValueError, match="remaining"):
        Lrtp().decide(res(gpus=1), [host("a", 0, job("j", 1))])


def test_rand_is_reproducible_from_its_seed() -> None:
    hosts = [host(f"h{i}", 0, *(job(f"j{i}{k}", 1) for k in range(4))) for i in range(5)]
    first = [RandomPreemption(seed=7).decide(res(gpus=2), hosts) for _ in range(3)]
    again = [RandomPreemption(seed=7).decide(res(gpus=2), hosts) for _ in range(3)]
    assert first == again


def test_make_policy_names_the_four_policies() -> None:
    assert [make_policy(n).name for n in ("fifo", "lrtp", "rand", "fitgpp")] == [
        "fifo",
        "lrtp",
        "rand",
        "fitgpp",
    ]
    assert not make_policy("fifo").preemptive
    with pytest.raises(ValueError):
        make_policy("sjf")


# --- properties -------------------------------------------------------------------------------

jobs_st = st.builds(
    lambda g, c, r, gp, p, rem: (g, c, r, gp, p, rem),
    st.integers(1, 8),
    st.integers(1, 16),
    st.integers(1, 128),
    st.floats(0, 1200),
    st.integers(0, 2),
    st.floats(0, 10_000),
)


@st.composite
def cluster(draw: st.DrawFn) -> tuple[list[CandidateHost], list[CandidateHost], Resources]:
    """Candidate hosts (the kernel's replica hosts), other hosts, and a cell's demand."""
    hosts = []
    for i in range(draw(st.integers(1, 6))):
        specs = draw(st.lists(jobs_st, max_size=5))
        jobs = tuple(
            BEJob(f"h{i}j{k}", res(c, r, g), grace_period_s=gp, preemptions=p, remaining_s=rem)
            for k, (g, c, r, gp, p, rem) in enumerate(specs)
        )
        used = sum((j.demand for j in jobs), Resources())
        free = Resources(
            millicpus=max(0, CAP.millicpus - used.millicpus) // 1000 * 1000 * draw(st.integers(0, 1)),
            memory_mb=max(0, CAP.memory_mb - used.memory_mb),
            gpus=max(0, CAP.gpus - used.gpus) * draw(st.integers(0, 1)),
        )
        hosts.append(CandidateHost(f"h{i}", CAP, free, jobs))
    k = draw(st.integers(1, len(hosts)))
    demand = res(draw(st.integers(1, 16)), draw(st.integers(1, 64)), draw(st.integers(1, 8)))
    return hosts[:k], hosts[k:], demand


POLICIES = (FitGpp, Lrtp, lambda: RandomPreemption(seed=3))


@settings(max_examples=300, deadline=None)
@given(cluster())
def test_victims_always_free_enough_and_only_on_candidate_hosts(case: tuple) -> None:
    candidates, others, demand = case
    for make in POLICIES:
        decision = make().decide(demand, candidates)  # type: ignore[operator]
        by_id = {h.host_id: h for h in candidates}
        assert not any(v.host_id == o.host_id for o in others for v in decision.victims)
        if decision.blocked:
            assert decision.victims == ()
            assert not any(
                fits(demand, h.free + sum((j.demand for j in h.jobs), Resources())) for h in candidates
            )
            continue
        assert decision.host_id in by_id
        chosen = by_id[decision.host_id]
        ids = {j.job_id: j for h in candidates for j in h.jobs}
        assert len(set(decision.victims)) == len(decision.victims)
        for v in decision.victims:
            assert v.job_id in {j.job_id for j in by_id[v.host_id].jobs}
        freed = sum(
            (ids[v.job_id].demand for v in decision.victims if v.host_id == chosen.host_id), Resources()
        )
        assert fits(demand, chosen.free + freed)


@settings(max_examples=200, deadline=None)
@given(cluster())
def test_fitgpp_preempts_on_one_host_and_picks_the_min_score_eligible_job(case: tuple) -> None:
    candidates, _, demand = case
    policy = FitGpp(s=4.0, max_preemptions=1)
    decision = policy.decide(demand, candidates)
    assert all(v.host_id == decision.host_id for v in decision.victims)
    scores = policy.scores(candidates)
    eligible = [
        scores[(h.host_id, j.job_id)]
        for h in candidates
        for j in h.jobs
        if j.preemptions < 1 and fits(demand, j.demand + h.free)
    ]
    if eligible and not any(fits(demand, h.free) for h in candidates):
        assert len(decision.victims) == 1
        v = decision.victims[0]
        assert scores[(v.host_id, v.job_id)] == min(eligible)


# --- revocable lease --------------------------------------------------------------------------


def test_the_lease_clock_stops_while_a_cell_suspends_it() -> None:
    lease = RevocableLease("l1", "app", term_s=100.0, granted_at=0.0)
    assert lease.used_s(30.0) == 30.0
    lease.suspend("cell", 30.0)
    assert lease.suspended
    assert lease.used_s(500.0) == 30.0  # the cell ran 470 s: not charged
    assert lease.resume("cell", 500.0) is True  # GPUs return to the same app
    assert lease.remaining_s(550.0) == pytest.approx(20.0)
    assert lease.expired(570.0)


def test_gpus_return_only_when_the_last_suspending_cell_ends() -> None:
    lease = RevocableLease("l1", "app", term_s=100.0, granted_at=0.0)
    lease.suspend("c1", 10.0)
    lease.suspend("c2", 20.0)
    assert lease.resume("c1", 30.0) is False
    assert lease.used_s(40.0) == 10.0
    assert lease.resume("c2", 40.0) is True
    assert lease.used_s(50.0) == 20.0


def test_a_lease_that_expired_in_unsuspended_time_does_not_come_back() -> None:
    lease = RevocableLease("l1", "app", term_s=50.0, granted_at=0.0)
    with pytest.raises(LeaseError):
        lease.suspend("late", 60.0)
    lease2 = RevocableLease("l2", "app", term_s=50.0, granted_at=0.0)
    lease2.suspend("c", 50.0 - 1e-9)
    assert lease2.resume("c", 1000.0) is True  # 1e-9 s of term left: still the app's
    assert lease2.expired(1000.1)


def test_lease_misuse_is_refused() -> None:
    lease = RevocableLease("l1", "app", term_s=50.0, granted_at=10.0)
    with pytest.raises(LeaseError):
        lease.resume("never", 11.0)
    lease.suspend("c", 12.0)
    with pytest.raises(LeaseError):
        lease.suspend("c", 13.0)
    with pytest.raises(LeaseError):
        lease.used_s(5.0)
    with pytest.raises(LeaseError):
        RevocableLease("bad", "app", term_s=0.0, granted_at=0.0)


# ---- the grace period from measurements, and the release mode (pause or rewind) ----------------


def test_grace_period_is_the_measured_pause_else_the_jobs_step_time_never_past_the_grace() -> None:
    from shared.policies.preemption import PAUSE, ReleaseFacts, release_plan

    assert release_plan(ReleaseFacts(), pause_grace_s=2.0).grace_period_s is None  # nothing reported yet
    by_step = release_plan(ReleaseFacts(step_s=0.3), pause_grace_s=2.0)
    assert by_step.mode == PAUSE and by_step.grace_period_s == 0.3
    measured = release_plan(ReleaseFacts(paused_s=0.12, step_s=0.3), pause_grace_s=2.0)
    assert measured.grace_period_s == 0.12
    frozen = release_plan(ReleaseFacts(step_s=30.0), pause_grace_s=2.0)  # SIGSTOP at the grace
    assert frozen.mode == PAUSE and frozen.grace_period_s == 2.0


def test_a_job_with_long_steps_and_an_image_is_rewound_not_frozen_with_its_memory() -> None:
    from shared.policies.preemption import PAUSE, REWIND, ReleaseFacts, release_plan

    plan = release_plan(ReleaseFacts(step_s=30.0, image_step=1200), pause_grace_s=2.0)
    assert plan.mode == REWIND and plan.grace_period_s == 2.0  # no kill measured yet: no slower than SIGSTOP
    killed = release_plan(ReleaseFacts(step_s=30.0, image_step=1200, killed_s=0.04), pause_grace_s=2.0)
    assert killed.mode == REWIND and killed.grace_period_s == 0.04
    short_steps = release_plan(ReleaseFacts(step_s=0.2, image_step=1200), pause_grace_s=2.0)
    assert short_steps.mode == PAUSE  # a pause loses nothing and is as quick


def test_fitgpp_prefers_the_job_whose_measured_release_is_quicker() -> None:
    from shared.policies.preemption import LeasedJob, gpu_candidate

    host = gpu_candidate("h", 2, 0, [LeasedJob("slow", (0,), 1.5), LeasedJob("quick", (1,), 0.05)])
    decision = FitGpp().decide(Resources(gpus=1), [host])
    assert [v.job_id for v in decision.victims] == ["quick"]
