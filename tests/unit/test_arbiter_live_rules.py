"""The arbiter core's rules for live jobs: unknown jobs are not "nearly done", rho ties are not
won by app id, a job's GPUs on one host, ``--gpus N`` a lower bound."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.arbiter import AppAgent, AppReport, Arbiter, ArbiterConfig, GpuSlot, JobReport
from shared.arbiter.estimate import FinishTimeModel


def _slots(hosts: int, per_host: int) -> list[GpuSlot]:
    return [GpuSlot(f"h{h}", d) for h in range(hosts) for d in range(per_host)]


def test_an_unreported_job_takes_its_siblings_median_time_and_total() -> None:
    measured = [JobReport(f"m{i}", "a", 0, 1, 0, 1000, t) for i, t in enumerate((2.0, 3.0, 4.0))]
    unknown = JobReport("u", "a", 0, 1, 0, None, None)
    model = FinishTimeModel(AppReport("a", 0.0, [*measured, unknown]), ArbiterConfig())
    assert model.phases[0][-1].seconds == pytest.approx(1000 * 3.0)


def test_an_unreported_job_with_no_measured_sibling_takes_the_prior_not_one_second() -> None:
    config = ArbiterConfig(unknown_job_gpu_s=3600.0)
    model = FinishTimeModel(AppReport("a", 0.0, [JobReport("u", "a", 0, 1, 0, None, None)]), config)
    assert model.remaining(1) == pytest.approx(3600.0)


def test_an_unreported_job_gets_a_lease_against_a_measured_app() -> None:
    fresh = AppReport("zz-fresh", 0.0, [JobReport("u", "zz-fresh", 0, 1, 0, None, None)])
    busy = AppReport("aa-busy", 0.0, [JobReport("b", "aa-busy", 1, 2, 10, 100_000, 1.0)])
    out = Arbiter(ArbiterConfig(fairness_knob=0.5)).auction(60.0, [fresh, busy], _slots(1, 1), 1)
    assert {lease.app_id for lease in out.leases} == {"zz-fresh"}


def _tied_apps(used: dict[str, float]) -> list[AppReport]:
    return [
        AppReport(a, 0.0, [JobReport(f"{a}-j", a, 0, 1, 0, 100, 10.0)], gpu_seconds_used=g)
        for a, g in used.items()
    ]


def test_a_rho_tie_goes_to_the_app_with_least_gpu_time() -> None:
    apps = _tied_apps({"a": 500.0, "b": 0.0, "c": 900.0})
    out = Arbiter(ArbiterConfig(fairness_knob=0.6)).auction(10.0, apps, _slots(1, 2), 2)
    assert out.bidders == ["b", "a"]
    one = Arbiter(ArbiterConfig(fairness_knob=0.6)).auction(10.0, apps, _slots(1, 1), 1)
    assert one.bidders == ["b"]  # the starving bidder one GPU can reach (admit_starving_worst_first)
    assert [lease.app_id for lease in one.leases] == ["b"]


def test_a_rho_tie_with_equal_gpu_time_is_not_always_won_by_the_first_app_id() -> None:
    apps = _tied_apps({"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0})
    winners = Counter()
    for round_no in range(40):
        arbiter = Arbiter(ArbiterConfig(fairness_knob=0.75, seed=round_no))
        winners[arbiter.auction(10.0, apps, _slots(1, 1), 1).bidders[0]] += 1
    assert len(winners) == 4 and winners["a"] < 40


def test_the_tie_order_is_reproducible_for_a_seed() -> None:
    apps = _tied_apps({"a": 0.0, "b": 0.0, "c": 0.0})
    first = Arbiter(ArbiterConfig(fairness_knob=0.5, seed=3)).auction(10.0, apps, _slots(1, 1), 1)
    again = Arbiter(ArbiterConfig(fairness_knob=0.5, seed=3)).auction(10.0, apps, _slots(1, 1), 1)
    assert first.bidders == again.bidders


LIVE = ArbiterConfig(fairness_knob=0.5, single_host_jobs=True)


def test_live_jobs_never_get_gpus_on_two_hosts() -> None:
    # one 4-GPU job; free: 2 + 2 on two hosts. A lease on two hosts would be one process on two.
    app = AppReport("a", 0.0, [JobReport("j", "a", 0, 4, 0, 1000, 1.0)])
    out = Arbiter(LIVE).auction(0.0, [app], _slots(2, 2), 4)
    assert out.leases and all(len({s.host_id for s in lease.slots}) == 1 for lease in out.leases)


def test_a_running_live_job_grows_only_on_its_own_host() -> None:
    job = JobReport("j", "a", 1, 4, 0, 1000, 1.0, host="h1")
    app = AppReport("a", 0.0, [job])
    out = Arbiter(LIVE).auction(0.0, [app], [GpuSlot("h0", 0), GpuSlot("h0", 1), GpuSlot("h1", 1)], 3)
    assert [s.host_id for lease in out.leases for s in lease.slots] == ["h1"]


def test_the_simulator_default_still_spans_hosts_for_a_multi_host_share() -> None:
    app = AppReport("a", 0.0, [JobReport("j", "a", 0, 4, 0, 1000, 1.0)])
    out = Arbiter(ArbiterConfig(fairness_knob=0.5)).auction(0.0, [app], _slots(2, 2), 4)
    assert sum(len(lease.slots) for lease in out.leases) == 4


def test_a_job_is_never_leased_fewer_gpus_than_it_asked_for() -> None:
    job = JobReport("j", "a", 0, 4, 0, 1000, 1.0, min_gpus=4)
    out = Arbiter(LIVE).auction(0.0, [AppReport("a", 0.0, [job])], _slots(3, 3), 9)
    assert out.leases == []  # no host has 4 free GPUs: nothing, rather than 3


def test_min_gpus_above_max_gpus_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_gpus"):
        JobReport("j", "a", 0, 2, 0, 10, 1.0, min_gpus=3)


@settings(max_examples=60, deadline=None)
@given(
    per_host=st.lists(st.integers(1, 8), min_size=1, max_size=5),
    jobs=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 4)), min_size=1, max_size=6),
    single_host=st.booleans(),
)
def test_leases_respect_lower_bounds_and_hosts(
    per_host: list[int], jobs: list[tuple[int, int]], single_host: bool
) -> None:
    reports = [
        JobReport(f"j{i}", "a", 0, lo + extra, 0, 1000, 1.0, min_gpus=lo)
        for i, (lo, extra) in enumerate(jobs)
    ]
    slots = [GpuSlot(f"h{h}", d) for h, n in enumerate(per_host) for d in range(n)]
    config = ArbiterConfig(fairness_knob=0.5, single_host_jobs=single_host)
    out = Arbiter(config).auction(0.0, [AppReport("a", 0.0, reports)], slots, len(slots))
    by_job = {r.job_id: r for r in reports}
    seen: set[GpuSlot] = set()
    for lease in out.leases:
        assert by_job[lease.job_id].min_gpus <= len(lease.slots) <= by_job[lease.job_id].max_gpus
        assert not seen & set(lease.slots)
        seen |= set(lease.slots)
        if single_host:
            assert len({s.host_id for s in lease.slots}) == 1


def test_an_agent_does_not_bid_on_bundles_below_its_smallest_start() -> None:
    job = JobReport("j", "a", 0, 8, 0, 1000, 1.0, min_gpus=4)
    agent = AppAgent(AppReport("a", 0.0, [job]), LIVE, now=0.0, capacity_gpus=8, n_avg=1)
    assert all(bundle.gpus >= 4 for bundle, _ in agent.bid({"h0": 8}).table)
