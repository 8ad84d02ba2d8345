"""The pure Themis arbiter: §4.3.3's worked example, the agent's bids, filtering, leases."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shared.arbiter import (
    APP_SUCCESSIVE_HALVING,
    AppAgent,
    AppReport,
    Arbiter,
    ArbiterConfig,
    CapacityMeter,
    GpuSlot,
    JobReport,
)
from shared.arbiter.agent import STARVING_RHO, Bundle, Contention
from shared.arbiter.halving import SuccessiveHalving, jobs_per_phase, plan_iterations


def _example_app(phase: int = 0, times: tuple[float, ...] = (80, 100, 100, 120), done: int = 0) -> AppReport:
    """§4.3.3: 4 jobs, successive halving, 80/100/100/120 s per iteration, 8/16/36 iterations per
    phase, job_demand_max 8, budget 10,000 GPU-seconds, S = 1."""
    jobs = [JobReport(f"j{i}", "A", 0, 8, done, None, t) for i, t in enumerate(times)]
    return AppReport("A", 0.0, jobs, APP_SUCCESSIVE_HALVING, (8, 16, 36), phase, budget_gpu_s=10_000)


def _one_job_app(app_id: str, iterations: int = 100, max_gpus: int = 1, t: float = 10.0) -> AppReport:
    return AppReport(app_id, 0.0, [JobReport(f"{app_id}-j", app_id, 0, max_gpus, 0, iterations, t)])


def _example_agent() -> AppAgent:
    # 16-GPU cluster, 3 other apps: N = 4.
    return AppAgent(_example_app(), ArbiterConfig(), now=0.0, capacity_gpus=16, n_avg=4)


def test_worked_example_t_id_is_budget_times_contention_over_cluster() -> None:
    assert _example_agent().t_id == pytest.approx(2500.0)


def test_worked_example_t_sh_on_two_gpus_is_5000_seconds_so_rho_is_2() -> None:
    agent = _example_agent()
    assert agent.t_sh(2) == pytest.approx(5000.0)  # 1600 + 1600 + 1800
    assert agent.rho(2) == pytest.approx(2.0)


def test_worked_example_bid_table_matches_table_3() -> None:
    agent = _example_agent()
    rhos = [agent.rho(g) for g in (1, 2, 4, 8, 16)]
    assert rhos == pytest.approx([4.0, 2.0, 1.0, 0.5, 0.34])


def test_worked_example_bid_for_a_16_gpu_offer_lists_table_3() -> None:
    bid = _example_agent().bid({"h0": 4, "h1": 4, "h2": 4, "h3": 4})
    table = {b.gpus: r for b, r in bid.table if b.host is None}
    assert table == pytest.approx({1: 4.0, 2: 2.0, 4: 1.0, 8: 0.5, 16: 0.34})


def test_worked_example_revised_when_slower_jobs_survive() -> None:
    """§4.3.3: if the 120 s and 100 s jobs survive, T_sh(2) = 120 * 16 and T_sh(3) = 120 * 36 / 2."""
    app = _example_app(phase=1, times=(120, 120), done=8)
    agent = AppAgent(app, ArbiterConfig(), now=0.0, capacity_gpus=16, n_avg=4)
    assert agent.t_sh(2) == pytest.approx(120 * 16 + 120 * 36 / 2)


def test_successive_halving_plan_and_kills_the_worse_half() -> None:
    assert jobs_per_phase(4) == [4, 2, 1]
    assert plan_iterations(4, 10_000, 100) == (8, 16, 33)  # §4.3.3 says "about 8, 16, 36"
    sh = SuccessiveHalving(["a", "b", "c", "d"], (8, 16, 36))
    assert not sh.phase_done({"a": 8, "b": 8, "c": 8, "d": 7})
    assert sh.phase_done({"a": 8, "b": 8, "c": 8, "d": 8})
    assert sh.advance({"a": 0.3, "b": 0.1, "c": 0.4, "d": 0.2}) == ["a", "c"]
    assert sh.live == ["b", "d"] and sh.target == 24
    assert sh.advance({"b": 0.5, "d": 0.2}) == ["b"]
    assert sh.advance({"d": 0.2}) == [] and sh.finished


def test_placement_sensitive_app_values_a_packed_bundle_above_a_spread_one() -> None:
    report = AppReport("V", 0.0, [JobReport("v", "V", 0, 4, 0, 1000, 1.0, placement_sensitivity=1.29)])
    agent = AppAgent(report, ArbiterConfig(), now=0.0, capacity_gpus=8, n_avg=2)
    assert agent.rho(4, {"h0": 4}) < agent.rho(4, {"h0": 2, "h1": 2})
    assert agent.rho(4, {"h0": 2, "h1": 2}) == pytest.approx(agent.rho(4, {"h0": 4}) * 1.29, rel=1e-6)
    bid = agent.bid({"h0": 4, "h1": 2, "h2": 2})
    assert Bundle(4, "h0") in dict(bid.table)


def test_a_starving_app_reports_a_finite_rho_and_bids_as_unbounded() -> None:
    agent = AppAgent(_one_job_app("x", max_gpus=4), ArbiterConfig(), now=0.0, capacity_gpus=8, n_avg=4)
    assert agent.starving
    assert math.isfinite(agent.rho_current)
    assert agent.rho_current == pytest.approx(agent.rho(2))  # its fair share: 8 GPUs / 4 apps
    bid = agent.bid({"h0": 4})
    assert bid.rho_old == STARVING_RHO and all(r < bid.rho_old for _, r in bid.table)


def test_when_gpus_do_not_reach_every_starving_bidder_the_furthest_from_fair_is_served() -> None:
    """Both bidders hold nothing (unbounded rho) and one GPU is free. "old" has waited three hours
    for its work, "new" just arrived with less: one GPU leaves "new" less unfair, so a PF
    objective over log(1 / rho(k)) alone served "new" every such round and "old" waited on
    (docs/arbiter.md, "Starving bidders"). §3.3.2 expects the far-from-fair app to win.
    When the GPUs do reach both, both bid."""
    old = AppReport("old", -10_800.0, [JobReport("o", "old", 0, 1, 0, 200, 10.0)])
    new = AppReport("new", 0.0, [JobReport("n", "new", 0, 1, 0, 30, 10.0)])
    out = Arbiter(ArbiterConfig(fairness_knob=0.0)).auction(0.0, [old, new], _slots(1, 1), 1)
    assert out.rho_by_app["old"] > 1.0 > out.rho_by_app["new"]
    assert out.bidders == ["old"]  # "new" bids in a later round
    assert out.kept_by_app == {"old": 1}
    both = Arbiter(ArbiterConfig(fairness_knob=0.0)).auction(0.0, [old, new], _slots(1, 2), 2)
    assert sorted(both.bidders) == ["new", "old"] and both.kept_by_app == {"new": 1, "old": 1}


def test_an_app_renewing_its_ended_leases_is_not_starving() -> None:
    """Leases that end this round are offered again; their app holds nothing at that instant but
    is renewing: it must not jump the queue as a starving app would (it did, and kept winning)."""
    ended = dataclasses.replace(_one_job_app("x", max_gpus=4), gpus_releasing=2)
    agent = AppAgent(ended, ArbiterConfig(), now=0.0, capacity_gpus=8, n_avg=4)
    assert not agent.starving
    assert agent.rho_current == pytest.approx(agent.rho(2))
    assert agent.bid({"h0": 4}).rho_old == pytest.approx(agent.rho(2))


def test_a_starving_sweep_with_little_left_outranks_a_fed_one() -> None:
    """Waiting counts: an app that has waited long for a little work bids before an app that
    holds a GPU, however slow that GPU alone would make it."""
    waited = AppReport("w", -5000.0, [JobReport("w1", "w", 0, 1, 90, 100, 10.0)])
    fed = AppReport("f", 0.0, [JobReport("f1", "f", 1, 8, 0, 10_000, 10.0)])
    out = Arbiter(ArbiterConfig(fairness_knob=0.5)).auction(0.0, [waited, fed], _slots(1, 2), 2)
    assert out.bidders == ["w"]


def test_which_starving_apps_bid_before_holders_follows_starving_priority() -> None:
    """Themis Eq. 1 makes rho(0) unbounded, so with "all" a starving app with no GPU bids before
    a holder however far behind that holder is. "none" ranks it by its fair-share rho (0.5 here)
    and the holder (rho ~6) bids; "at_risk" likewise once it has had GPU time, but a new arrival
    (no GPU time yet) still bids first."""
    fed = AppReport("s", 0.0, [JobReport("s1", "s", 0, 1, 0, 100, 10.0)], gpu_seconds_used=30.0)
    behind = AppReport("h", -5000.0, [JobReport("h1", "h", 1, 2, 0, 100, 10.0)])

    def bidders(mode: str, starving: AppReport) -> list[str]:
        arbiter = Arbiter(ArbiterConfig(fairness_knob=0.5, starving_priority=mode))
        out = arbiter.auction(0.0, [starving, behind], _slots(1, 2), 2)
        assert out.rho_by_app["s"] < 1.0 < out.rho_by_app["h"]
        return out.bidders

    assert bidders("all", fed) == ["s"]
    assert bidders("none", fed) == ["h"]
    assert bidders("at_risk", fed) == ["h"]
    assert bidders("at_risk", dataclasses.replace(fed, gpu_seconds_used=0.0)) == ["s"]
    with pytest.raises(ValueError, match="starving_priority"):
        ArbiterConfig(starving_priority="some")


def test_lifetime_contention_counts_the_rest_of_the_life_at_todays_count() -> None:
    # 1 app for the first hour, 9 now; 3 more hours to go: (3600 * 1 + 10800 * 9) / 14400 = 7.
    assert Contention(area=3600.0, seen_s=3600.0, now=9).lifetime_average(10_800.0) == pytest.approx(7.0)
    assert Contention(area=0.0, seen_s=0.0, now=3).lifetime_average(0.0) == 3.0
    assert Contention(area=0.0, seen_s=0.0, now=0).lifetime_average(100.0) == 1.0  # never below 1


def test_an_early_app_is_valued_over_its_whole_life_not_its_quiet_start() -> None:
    """An app that ran alone for an hour and now shares with 9 others: its T_id is the finish time
    in a 1 / N_avg share over its life, most of which is still to come at N = 10. With the average
    so far (N = 1) its rho looked ten times worse than a newcomer's with the same work left, so
    Themis fed early apps first and left late arrivals with the worst rho at the end."""
    early = AppReport("e", -3600.0, [JobReport("e1", "e", 1, 1, 0, 36_000, 1.0)])
    late = AppReport("l", 0.0, [JobReport("l1", "l", 1, 1, 0, 36_000, 1.0)])
    config = ArbiterConfig()
    past = AppAgent(
        early, dataclasses.replace(config, lifetime_contention=False), now=0.0, capacity_gpus=10, n_avg=1.0
    )
    life = AppAgent(
        early, config, now=0.0, capacity_gpus=10, n_avg=1.0, contention=Contention(3600.0, 3600.0, 10)
    )
    newcomer = AppAgent(
        late, config, now=0.0, capacity_gpus=10, n_avg=10.0, contention=Contention(0.0, 0.0, 10)
    )
    # T_sh = 1 h waited + 10 h on its one GPU = 11 h; T_id = 10 h * N_avg / 1 GPU.
    assert past.rho(1) == pytest.approx(11 / 10)
    assert life.rho(1) == pytest.approx(11 / (10 * (3600 + 10 * 36_000) / 39_600))
    assert newcomer.rho(1) == pytest.approx(10 / (10 * 10))
    assert life.rho(1) < past.rho(1) / 5


def test_the_arbiter_feeds_its_contention_to_the_agents() -> None:
    arbiter = Arbiter(ArbiterConfig())
    apps = [_one_job_app(f"a{i}") for i in range(3)]
    arbiter.agents(0.0, apps[:1], 4)
    (first, *_) = arbiter.agents(100.0, apps, 4)
    assert first.contention == Contention(area=100.0, seen_s=100.0, now=3)


def _slots(hosts: int, per_host: int) -> list[GpuSlot]:
    return [GpuSlot(f"h{h}", d) for h in range(hosts) for d in range(per_host)]


def test_only_the_worst_one_minus_f_apps_bid() -> None:
    # a0 is furthest behind: it has waited longest for the same work.
    apps = [
        AppReport(f"a{i}", -100.0 * (10 - i), [JobReport("j", f"a{i}", 0, 2, 0, 100, 10.0)])
        for i in range(10)
    ]
    out = Arbiter(ArbiterConfig(fairness_knob=0.8)).auction(1000.0, apps, _slots(2, 4), 8)
    assert out.bidders == ["a0", "a1"]  # ceil(0.2 * 10)
    assert max(out.rho_by_app, key=out.rho_by_app.get) == "a0"


def test_auction_leases_each_gpu_once_for_lease_s() -> None:
    apps = [_one_job_app(f"a{i}", max_gpus=4) for i in range(5)]
    out = Arbiter(ArbiterConfig(fairness_knob=0.5, lease_s=300.0)).auction(10.0, apps, _slots(3, 4), 12)
    granted = [s for lease in out.leases for s in lease.slots]
    assert len(granted) == len(set(granted)) == 12  # work conserving: every app can use 4
    assert all(lease.granted_at == 10.0 and lease.expires_at == 310.0 for lease in out.leases)
    assert set(out.c_by_app) <= set(out.bidders)


def test_winner_keeps_c_times_its_share_and_leftovers_go_to_non_bidders() -> None:
    apps = [_one_job_app(f"a{i}", iterations=1000, max_gpus=8) for i in range(4)]
    arb = Arbiter(ArbiterConfig(fairness_knob=0.5, leftovers_to_bidders=False))
    out = arb.auction(0.0, apps, _slots(2, 4), 8)
    for app_id in out.bidders:
        c = out.c_by_app.get(app_id)
        assert c is None or 0.0 < c <= 1.0
    non_bidders = set(out.rho_by_app) - set(out.bidders)
    won_by_bidders = sum(out.won_by_app.get(a, 0) for a in out.bidders)
    assert won_by_bidders + out.leftover_gpus == 8
    assert sum(out.won_by_app.get(a, 0) for a in non_bidders) == min(out.leftover_gpus, 16)


def test_f_outside_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="fairness_knob"):
        ArbiterConfig(fairness_knob=1.0)


def test_job_reports_without_progress_get_crude_estimates() -> None:
    report = AppReport("u", 0.0, [JobReport("u1", "u", 0, 1, 50, None, None)])
    agent = AppAgent(report, ArbiterConfig(), now=10.0, capacity_gpus=4, n_avg=1)
    assert math.isfinite(agent.rho(1)) and agent.rho(1) > 0


def test_capacity_meter_averages_be_usable_gpus_over_time() -> None:
    meter = CapacityMeter()
    assert meter.observe(0.0, 8) == 8  # no time passed yet: the current count
    assert meter.observe(100.0, 2) == pytest.approx(8.0)  # 8 GPUs held for [0, 100)
    assert meter.observe(300.0, 8) == pytest.approx((8 * 100 + 2 * 200) / 300)
    assert meter.average(400.0) == pytest.approx((8 * 100 + 2 * 200 + 8 * 100) / 400)
