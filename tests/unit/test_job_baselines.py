"""Tiresias (job-level discretized 2D-LAS) and Gandiva-fair (ticket stride), pure cores."""

from __future__ import annotations

from collections import Counter

import pytest

from shared.arbiter import AppReport, Arbiter, ArbiterConfig, GpuSlot, JobReport
from shared.arbiter.baselines import BASELINES, las_app, make_policy
from shared.arbiter.job_baselines import GandivaFairPolicy, TiresiasParams, TiresiasPolicy

LEASE_S = 60.0
CONFIG = ArbiterConfig(lease_s=LEASE_S)


def _gpus(*per_host: int) -> list[GpuSlot]:
    return [GpuSlot(f"h{h}", d) for h, n in enumerate(per_host) for d in range(n)]


def _app(app_id: str, submitted_at: float, jobs: list[tuple[int, int]], sens: float = 1.0) -> AppReport:
    """``jobs``: (GPUs held, GPUs asked) per job, each 10,000 one-second iterations."""
    return AppReport(
        app_id,
        submitted_at,
        [JobReport(f"{app_id}-{i}", app_id, g, m, 0, 10_000, 1.0, sens) for i, (g, m) in enumerate(jobs)],
    )


def _jobs_granted(outcome: object) -> list[str]:
    return [lease.job_id for lease in outcome.leases]  # type: ignore[attr-defined]


def test_tiresias_fifo_within_the_first_queue_serves_the_earlier_app_whole() -> None:
    """Job-level: the earlier app's fresh jobs all precede the later app's (same queue, FIFO by
    arrival), even after the earlier app has had GPU time (its jobs are still under the queue's
    threshold). Themis §6.1's app-level LAS serves the app with less service instead."""
    policy = TiresiasPolicy(CONFIG)
    policy.auction(0.0, [_app("early", 0.0, [(0, 1)] * 4)], _gpus(2), 2.0)  # early-0/1 run
    apps = [_app("late", 10.0, [(0, 1)] * 4), _app("early", 0.0, [(1, 1)] * 2 + [(0, 1)] * 2)]
    tiresias = policy.auction(20.0, apps, _gpus(2), 4.0)
    assert Counter(lease.app_id for lease in tiresias.leases) == {"early": 2}
    used = AppReport("early", 0.0, apps[1].jobs, gpu_seconds_used=40.0)
    assert las_app(CONFIG).auction(20.0, [apps[0], used], _gpus(2), 4.0).won_by_app == {"late": 2}


def test_tiresias_demotes_a_job_past_the_queue_threshold_behind_fresh_jobs() -> None:
    policy = TiresiasPolicy(CONFIG, TiresiasParams(thresholds_gpu_s=(100.0,)))
    first = policy.auction(0.0, [_app("a", 0.0, [(0, 2)])], _gpus(2), 2.0)
    assert _jobs_granted(first) == ["a-0"]
    # a-0 ran 2 GPUs x 60 s = 120 GPU-s > 100: queue 1; b's job, though later, is in queue 0.
    apps = [_app("a", 0.0, [(0, 2)]), _app("b", 30.0, [(0, 2)])]
    second = policy.auction(60.0, apps, _gpus(2), 2.0)
    assert policy.queue_of("a-0") == 1 and policy.queue_of("b-0") == 0
    assert _jobs_granted(second) == ["b-0"]


def test_tiresias_gang_schedules_and_lets_a_smaller_job_past_one_that_does_not_fit() -> None:
    apps = [_app("big", 0.0, [(0, 4)]), _app("small", 5.0, [(0, 1)])]
    outcome = TiresiasPolicy(CONFIG).auction(10.0, apps, _gpus(2, 1), 3.0)
    assert _jobs_granted(outcome) == ["small-0"]


def test_tiresias_promotes_a_starved_job_back_to_the_first_queue() -> None:
    policy = TiresiasPolicy(CONFIG, TiresiasParams(thresholds_gpu_s=(50.0,), promote_knob=2.0))
    policy.auction(0.0, [_app("a", 0.0, [(0, 1)])], _gpus(1), 1.0)
    apps = [_app("a", 0.0, [(0, 1)]), _app("b", 1.0, [(0, 1)])]
    policy.auction(60.0, apps, _gpus(1), 1.0)  # a-0: 60 GPU-s, queue 1; b-0 runs
    assert policy.queue_of("a-0") == 1
    waiting = [_app("a", 0.0, [(0, 1)]), _app("b", 1.0, [(1, 1)])]
    policy.auction(120.0, waiting, [], 1.0)
    assert policy.queue_of("a-0") == 1  # waited 60 s < 2 x its 60 s run
    policy.auction(180.0, waiting, [], 1.0)
    assert policy.queue_of("a-0") == 0  # waited 120 s: promoted


def test_tiresias_consolidates_placement_sensitive_jobs_on_one_host() -> None:
    apps = [_app("vgg", 0.0, [(0, 2)], sens=1.29)]
    outcome = TiresiasPolicy(CONFIG).auction(0.0, apps, [GpuSlot("h0", 0), *_gpus(0, 2)], 3.0)
    (lease,) = outcome.leases
    assert {s.host_id for s in lease.slots} == {"h1"}


def _rounds(
    policy: GandivaFairPolicy, apps: dict[str, tuple[float, int, int]], n: int, gpus: int
) -> Counter[str]:
    """``n`` rounds of one-quantum leases (all expire each round) on ``gpus`` one-GPU hosts;
    ``apps``: id -> (submitted, jobs, GPUs per job). GPU-rounds each app got."""
    got: Counter[str] = Counter()
    for r in range(n):
        reports = [_app(a, t, [(0, g)] * k) for a, (t, k, g) in apps.items() if t <= r * LEASE_S]
        outcome = policy.auction(r * LEASE_S, reports, _gpus(*[1] * gpus), float(gpus))
        for lease in outcome.leases:
            got[lease.app_id] += len(lease.slots)
    return got


def test_gandiva_fair_gives_equal_ticket_apps_equal_gpu_time_whatever_their_job_counts() -> None:
    got = _rounds(GandivaFairPolicy(CONFIG), {"many": (0.0, 20, 1), "few": (0.0, 2, 1)}, 30, 4)
    assert got["many"] == got["few"] == 60


def test_gandiva_fair_charges_a_gang_its_gpus() -> None:
    got = _rounds(GandivaFairPolicy(CONFIG), {"wide": (0.0, 3, 2), "narrow": (0.0, 6, 1)}, 40, 4)
    assert abs(got["wide"] - got["narrow"]) <= 2


def test_gandiva_fair_a_late_app_starts_at_the_floor_not_with_banked_time() -> None:
    """B arrives after A ran alone for 20 rounds: from then on they alternate evenly; B does not
    get the 20 rounds A had (stride's global pass for arrivals)."""
    policy = GandivaFairPolicy(CONFIG)
    _rounds(policy, {"a": (0.0, 4, 1)}, 20, 2)
    got: Counter[str] = Counter()
    for r in range(20, 30):
        reports = [_app("a", 0.0, [(0, 1)] * 4), _app("b", 20 * LEASE_S, [(0, 1)] * 4)]
        for lease in policy.auction(r * LEASE_S, reports, _gpus(1, 1), 2.0).leases:
            got[lease.app_id] += 1
    assert got["a"] == got["b"] == 10


def test_policies_by_name_for_the_simulator_and_the_live_service() -> None:
    assert isinstance(make_policy("themis"), Arbiter)
    assert isinstance(make_policy("tiresias", CONFIG, 0.05), TiresiasPolicy)
    assert make_policy("tiresias", CONFIG, 0.05).params.thresholds_gpu_s == (180.0,)  # type: ignore[attr-defined]
    assert all(make_policy(name) is not None for name in BASELINES)
    with pytest.raises(ValueError, match="unknown BE policy"):
        make_policy("drf")


def test_gandiva_fair_an_app_back_from_idle_does_not_bank_its_idle_time() -> None:
    policy = GandivaFairPolicy(CONFIG)
    idle_b = AppReport("b", 0.0, [JobReport("b-done", "b", 0, 1, 10, 10, 1.0)])
    for r in range(20):  # b is present but has nothing to run: a runs alone
        policy.auction(r * LEASE_S, [_app("a", 0.0, [(0, 1)] * 4), idle_b], _gpus(1, 1), 2.0)
    got: Counter[str] = Counter()
    for r in range(20, 30):
        reports = [_app("a", 0.0, [(0, 1)] * 4), _app("b", 0.0, [(0, 1)] * 4)]
        for lease in policy.auction(r * LEASE_S, reports, _gpus(1, 1), 2.0).leases:
            got[lease.app_id] += 1
    assert got["a"] == got["b"] == 10


def test_optimus_gives_each_gpu_to_the_highest_throughput_scaling() -> None:
    """Themis §6.1's Optimus: an app with nothing scales infinitely; then "wide" (eight 1-GPU jobs
    on 1 GPU: 2x with one more) before "narrow" (one 4-GPU job on 3: 4/3x)."""
    wide = AppReport(
        "wide", 0.0, [JobReport(f"w{i}", "wide", int(i == 0), 1, 0, 1000, 1.0) for i in range(8)]
    )
    narrow = AppReport("narrow", 0.0, [JobReport("n0", "narrow", 3, 4, 0, 1000, 1.0)])
    fresh = _app("fresh", 0.0, [(0, 1)])
    policy = make_policy("optimus", CONFIG)
    assert policy.auction(0.0, [narrow, wide, fresh], _gpus(1), 8.0).won_by_app == {"fresh": 1}
    assert policy.auction(0.0, [narrow, wide], _gpus(1), 8.0).won_by_app == {"wide": 1}


def test_srtf_gives_a_lone_free_gpu_to_the_app_that_would_finish_soonest_on_it() -> None:
    """Themis §6.1's SRTF ranks by "remaining time with allocations from the available resource":
    with one GPU free, a wide sweep (ten 1-GPU jobs of 100 s: 1,000 s on one more GPU) waits for a
    single 500-s job (500 s), although its remaining work per GPU of demand (100 s) is smaller."""
    wide = AppReport("wide", 0.0, [JobReport(f"w{i}", "wide", 0, 1, 0, 100, 1.0) for i in range(10)])
    single = AppReport("single", 0.0, [JobReport("s0", "single", 0, 1, 0, 500, 1.0)])
    policy = make_policy("srtf", CONFIG)
    assert policy.auction(0.0, [wide, single], _gpus(1), 8.0).won_by_app == {"single": 1}
    # With room for every job, the wide sweep (100 s on ten GPUs) goes first.
    assert policy.auction(0.0, [wide, single], _gpus(4, 4, 3), 11.0).won_by_app == {"wide": 10, "single": 1}
