"""Hypothesis properties of partial allocation (Themis §3.3.1) on random bids and offers."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.arbiter import AppReport, Arbiter, ArbiterConfig, GpuSlot, JobReport
from shared.arbiter.agent import Bid, Bundle
from shared.arbiter.partial_allocation import partial_allocation, proportional_fair

hosts_st = st.dictionaries(st.sampled_from(["h0", "h1", "h2", "h3"]), st.integers(1, 8), min_size=1)


@st.composite
def bids_st(draw: st.DrawFn) -> tuple[list[Bid], dict[str, int]]:
    hosts = draw(hosts_st)
    n = draw(st.integers(1, 5))
    bids = []
    for i in range(n):
        rho_old = draw(st.floats(1.0, 50.0))
        rows = []
        for k in sorted(set(draw(st.lists(st.integers(1, 16), min_size=1, max_size=4)))):
            host = draw(st.sampled_from([None, *sorted(hosts)]))
            rows.append((Bundle(k, host), rho_old * draw(st.floats(0.05, 0.99))))
        bids.append(Bid(f"a{i}", rho_old, tuple(rows)))
    return bids, hosts


@settings(max_examples=60, deadline=None)
@given(bids_st())
def test_partial_allocation_keeps_c_in_0_1_and_fits_the_offer(case: tuple[list[Bid], dict[str, int]]) -> None:
    bids, hosts = case
    pa = partial_allocation(bids, hosts)
    assert set(pa.c) == set(pa.pf.choice) == set(pa.kept)
    for app_id, c in pa.c.items():
        assert 0.0 < c <= 1.0
        assert 1 <= pa.kept[app_id] <= pa.pf.choice[app_id].gpus
    assert sum(b.gpus for b in pa.pf.choice.values()) <= sum(hosts.values())
    for h, free in hosts.items():
        assert sum(b.gpus for b in pa.pf.choice.values() if b.host == h) <= free


@settings(max_examples=40, deadline=None)
@given(bids_st())
def test_proportional_fair_beats_every_single_winner_allocation(
    case: tuple[list[Bid], dict[str, int]],
) -> None:
    """The MILP's optimum is at least as good as giving any one feasible row to any one app."""
    bids, hosts = case
    best = proportional_fair(bids, hosts).objective
    total = sum(hosts.values())
    for bid in bids:
        for b, r in bid.table:
            if b.gpus <= total and (b.host is None or b.gpus <= hosts.get(b.host, 0)):
                assert best >= math.log(bid.rho_old / r) - 1e-6


@st.composite
def round_st(draw: st.DrawFn) -> tuple[list[AppReport], list[GpuSlot], float]:
    n_apps = draw(st.integers(1, 8))
    apps = []
    for i in range(n_apps):
        jobs = [
            JobReport(
                f"a{i}j{j}",
                f"a{i}",
                0,
                draw(st.integers(1, 8)),
                draw(st.integers(0, 50)),
                draw(st.integers(51, 500)),
                draw(st.floats(0.1, 10.0)),
                draw(st.sampled_from([1.0, 1.1, 1.3])),
            )
            for j in range(draw(st.integers(1, 4)))
        ]
        apps.append(AppReport(f"a{i}", -draw(st.floats(0.0, 5000.0)), jobs))
    per_host = draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    slots = [GpuSlot(f"h{h}", d) for h, n in enumerate(per_host) for d in range(n)]
    available = draw(st.lists(st.sampled_from(slots), unique=True))
    f = draw(st.sampled_from([0.0, 0.5, 0.8]))
    return apps, available, f


@settings(max_examples=60, deadline=None)
@given(round_st(), st.booleans())
def test_auction_never_awards_a_gpu_twice_nor_one_not_offered(
    case: tuple[list[AppReport], list[GpuSlot], float], to_bidders: bool
) -> None:
    apps, available, f = case
    out = Arbiter(ArbiterConfig(fairness_knob=f, leftovers_to_bidders=to_bidders)).auction(
        0.0, apps, available, max(1, len(available))
    )
    granted = [s for lease in out.leases for s in lease.slots]
    assert len(granted) == len(set(granted))
    assert set(granted) <= set(available)
    assert all(0.0 < c <= 1.0 for c in out.c_by_app.values())
    # Leftovers are conserved: PF shares kept plus leftovers make up the offer, and no more than
    # the leftovers is handed out beyond the kept shares.
    assert sum(out.kept_by_app.values()) + out.leftover_gpus == len(available)
    assert sum(out.won_by_app.values()) - sum(out.kept_by_app.values()) <= out.leftover_gpus
    by_app = {a.app_id: a for a in apps}
    for lease in out.leases:
        job = next(j for j in by_app[lease.app_id].jobs if j.job_id == lease.job_id)
        assert len(lease.slots) <= job.max_gpus
    if to_bidders:  # work conserving: a GPU stays idle only if no app can use more
        wants = sum(sum(j.max_gpus for j in a.jobs) for a in apps)
        assert len(granted) == min(len(available), wants)
