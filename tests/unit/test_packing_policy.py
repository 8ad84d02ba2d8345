"""The packing policy (``shared.policies.packing``): §5.1 constraints hold for every placement the
policy offers (never a cell's GPU, at most two workers a GPU, a smaller job only with its set's
largest), and Algorithm 1 finds the exhaustive optimum of a concave trade-off in fewer trials,
stops after three trials without gain, and maps stragglers of J_max to LISS or to squeezing."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policies.packing import (
    EARLY_EXIT_TRIALS,
    EXIT_NO_GAIN,
    EXIT_NOTHING_TO_GAIN,
    FULL,
    OBJECTIVES,
    CoordinationSearch,
    DeadlineObjective,
    ExhaustiveSearch,
    JctObjective,
    JobInfo,
    JobMeasurement,
    MakespanObjective,
    PackingConfig,
    Placement,
    SequencedJctObjective,
    packable_gpus,
    packing_sets,
    run_search,
    violations,
)
from shared.simulator.packing_sim import pair_speeds

GPUS = [f"g{i}" for i in range(8)]


@settings(max_examples=150, deadline=None)
@given(
    cells=st.sets(st.sampled_from(GPUS), max_size=3),
    arrivals=st.lists(st.tuples(st.sampled_from([1, 2, 4]), st.integers(0, 5)), max_size=10),
)
def test_every_offered_placement_is_legal(cells: set[str], arrivals: list[tuple[int, int]]) -> None:
    jobs: dict[str, tuple[str, ...]] = {}
    for n, (size, pick) in enumerate(arrivals):
        held = {g for gs in jobs.values() for g in gs}
        free = [g for g in GPUS if g not in held]
        options = packable_gpus(size, Placement(jobs), cells, free_gpus=free)
        if not options:
            continue
        _partner, gpus = options[pick % len(options)]
        jobs[f"j{n}"] = gpus
        placement = Placement(jobs)
        assert violations(placement, cells) == []
        occupants = placement.occupants()
        assert not set(occupants) & cells, "a BE worker on a GPU a cell holds"
        assert all(len(js) <= 2 for js in occupants.values())
        for jmax, members in packing_sets(placement):
            for m in members:
                assert placement.world_size(m) <= placement.world_size(jmax)
                assert set(placement.jobs[m]) <= set(placement.jobs[jmax])


def test_violations_name_each_broken_rule() -> None:
    assert violations(Placement({"a": ("g0",)}), cell_gpus=["g0"])  # cell and BE worker
    assert violations(Placement({"a": ("g0",), "b": ("g0",), "c": ("g0",)}))  # three on a GPU
    chain = Placement({"a": ("g0", "g1", "g2", "g3"), "b": ("g3", "g4"), "c": ("g4",)})
    assert any("only with its J_max" in v for v in violations(chain))  # b shares with a and c
    skew = Placement({"a": ("g0", "g1"), "b": ("g1", "g2")})
    assert any("one world size" in v for v in violations(skew))
    star = Placement({"a": ("g0", "g1", "g2", "g3"), "b": ("g0", "g1"), "c": ("g2",)})
    assert violations(star) == []
    assert packing_sets(star) == [("a", ("b", "c"))]


def test_members_of_a_set_and_cells_are_never_offered() -> None:
    star = Placement({"a": ("g0", "g1", "g2", "g3"), "b": ("g0", "g1")})
    offers = packable_gpus(1, star, cell_gpus=["g2"])
    assert offers == [("a", ("g3",))]  # not b (a member), not g2 (a cell)
    assert packable_gpus(4, star) == []  # a has partners, an equal-size job cannot share all of it


# A synthetic pair on one device: squeezing "big" (high utilization: low JCT priority) speeds
# "small" up; the mean-JCT curve over big's cap is concave with its optimum inside the range.
def _pair(config: PackingConfig) -> dict[str, JobMeasurement]:
    c = config.caps["big"] / FULL
    return {
        "big": JobMeasurement(throughput=c, utilization=0.9 * c),
        "small": JobMeasurement(throughput=1.0 - 0.9 * c**2, utilization=0.3),
    }


PAIR = [JobInfo("big", ("g0",), 100.0), JobInfo("small", ("g0",), 100.0)]


def test_algorithm1_reaches_the_exhaustive_optimum_in_fewer_trials() -> None:
    alg = CoordinationSearch(PAIR, JctObjective())
    exh = ExhaustiveSearch(PAIR, JctObjective())
    best_alg, best_exh = run_search(alg, _pair), run_search(exh, _pair)
    obj = JctObjective()
    assert alg.low_priority == {"big"}  # lower priority = higher utilization under JCT
    assert best_alg.caps["small"] == FULL  # the high-priority side stays swelled
    assert obj.value(PAIR, _pair(best_alg)) <= 1.01 * obj.value(PAIR, _pair(best_exh))
    assert len(exh.trials) == 10
    assert len(alg.trials) < len(exh.trials)


def test_search_stops_after_three_trials_without_gain() -> None:
    search = CoordinationSearch(PAIR, JctObjective())
    run_search(search, _pair)
    values = [t.objective for t in search.trials]
    best_at = values.index(min(values))
    assert len(values) == best_at + 1 + EARLY_EXIT_TRIALS
    caps = [t.config.caps["big"] for t in search.trials]
    assert caps == sorted(caps, reverse=True) and caps[0] == FULL  # 10% squeezes from 100%
    assert all(a - b == 10 for a, b in itertools.pairwise(caps))


def test_a_gain_within_the_noise_margin_is_not_a_gain() -> None:
    """Each squeeze gains 1% (noise-sized): with a 3% margin none counts, the search ends after
    three and keeps free competition; without it the search walks down."""

    def flat(config: PackingConfig) -> dict[str, JobMeasurement]:
        gain = 1.01 ** ((FULL - config.caps["big"]) // 10)
        return {j: JobMeasurement(throughput=gain, utilization=u) for j, u in (("big", 0.9), ("small", 0.3))}

    strict = CoordinationSearch(PAIR, JctObjective(), skip_slack=False, min_gain=0.03)
    assert run_search(strict, flat).caps == {"big": FULL, "small": FULL}
    assert len(strict.trials) == 1 + EARLY_EXIT_TRIALS
    loose = CoordinationSearch(PAIR, JctObjective(), skip_slack=False)
    assert run_search(loose, flat).caps["big"] < FULL


def test_propose_repeats_until_observed_and_ends_with_none() -> None:
    search = CoordinationSearch(PAIR, JctObjective())
    first = search.propose()
    assert search.propose() is first
    with pytest.raises(RuntimeError):
        search.best()
    run_search(search, _pair)
    assert search.propose() is None


def _straggling(config: PackingConfig) -> dict[str, JobMeasurement]:
    """J_max "big" on g0,g1; "small" shares g0, so big's g0 worker straggles unless LISS moves
    samples away from it; squeezing small speeds that worker up."""
    c_small = config.caps["small"] / FULL
    f0 = config.fractions.get("g0", 0.5)
    speed_g0 = 1.0 - 0.5 * c_small
    step = {"g0": f0 * 2 / speed_g0, "g1": (1 - f0) * 2 / 1.0}
    return {
        "big": JobMeasurement(throughput=1 / max(step.values()), utilization=0.9, worker_step_s=step),
        "small": JobMeasurement(throughput=c_small, utilization=0.8 * c_small),
    }


def test_stragglers_of_a_low_priority_jmax_are_balanced_by_liss() -> None:
    jobs = [JobInfo("big", ("g0", "g1"), 100.0), JobInfo("small", ("g0",), 100.0)]
    search = CoordinationSearch(jobs, JctObjective())  # big: utilization 0.9 -> low priority
    search.observe(_straggling(search.propose()))  # type: ignore[arg-type]
    nxt = search.propose()
    assert nxt is not None
    assert nxt.caps == {"big": FULL, "small": FULL}  # LISS moves samples, LGRR stays put
    assert nxt.fractions["g0"] < 0.5 < nxt.fractions["g1"]  # the slow worker gave samples away
    search.observe(_straggling(nxt))
    assert search.trials[1].objective < search.trials[0].objective


def test_stragglers_of_a_high_priority_jmax_squeeze_their_neighbours() -> None:
    jobs = [JobInfo("big", ("g0", "g1"), 100.0), JobInfo("small", ("g0",), 100.0)]

    def measure(config: PackingConfig) -> dict[str, JobMeasurement]:
        m = _straggling(config)
        return {"big": JobMeasurement(m["big"].throughput, 0.1, m["big"].worker_step_s), "small": m["small"]}

    search = CoordinationSearch(jobs, JctObjective())  # big now low utilization: high priority
    search.observe(measure(search.propose()))  # type: ignore[arg-type]
    nxt = search.propose()
    # small used 80%: its first squeeze goes to 80% (the slack above its use skipped)
    assert nxt is not None and nxt.caps["small"] == 80 and nxt.caps["big"] == FULL


def test_objectives_rank_as_their_text_says() -> None:
    a, b = JobInfo("a", ("g0",), 100.0, deadline_s=150.0), JobInfo("b", ("g0",), 100.0, deadline_s=500.0)
    m = {"a": JobMeasurement(1.0, 0.5), "b": JobMeasurement(0.5, 0.5)}
    dl = DeadlineObjective()
    assert dl.priority(a, m["a"]) > dl.priority(b, m["b"])  # a has less headroom (50 s vs 300 s)
    assert dl.value([a, b], m) == pytest.approx(0.0, abs=1e-3)  # nobody late
    late = {"a": JobMeasurement(0.5, 0.5), "b": m["b"]}
    assert dl.value([a, b], late) == pytest.approx(50.0, abs=1e-3)  # a finishes at 200 s, due 150 s
    ms = MakespanObjective()
    assert ms.priority(b, m["b"]) > ms.priority(a, m["a"])  # the longer job is swelled
    assert ms.value([a, b], m) == pytest.approx(200.0)


def test_sequenced_jct_swells_the_job_with_least_device_work_left() -> None:
    """Of two busy jobs the shorter is swelled (SRPT); a job that waits for its input most of the
    time is swelled even when it runs longer: it needs less of the device to finish."""

    def squeezed(jobs: list[JobInfo], measured: dict[str, JobMeasurement]) -> frozenset[str]:
        search = CoordinationSearch(jobs, SequencedJctObjective())
        search.propose()
        search.observe(measured)
        return search.low_priority

    busy = [
        JobInfo("long", ("g0",), 2000.0, solo_throughput=100.0),
        JobInfo("short", ("g0",), 500.0, solo_throughput=100.0),
    ]
    assert squeezed(busy, {"long": JobMeasurement(50.0, 0.5), "short": JobMeasurement(50.0, 0.5)}) == {"long"}
    loader = JobInfo("loader", ("g0",), 900.0, solo_throughput=35.0)  # 26 s alone, 20% of the device
    compute = JobInfo("compute", ("g0",), 3000.0, solo_throughput=240.0)  # 12.5 s alone, all of it
    measured = {"loader": JobMeasurement(28.0, 0.2), "compute": JobMeasurement(170.0, 0.8)}
    assert squeezed([loader, compute], measured) == {"compute"}


def test_a_squeeze_skips_the_slack_above_what_a_job_uses() -> None:
    """A cap above a job's use is a no-op; three of them would trip the early exit before any cap
    bites. The first squeeze of a job that uses 45% goes to 50%, not to 90%."""

    def measure(config: PackingConfig) -> dict[str, JobMeasurement]:
        c = min(config.caps["big"] / FULL, 0.45)
        return {
            "big": JobMeasurement(throughput=c / 0.45, utilization=c),
            "small": JobMeasurement(throughput=1.0 - 0.8 * c, utilization=0.1),
        }

    jobs = [JobInfo("big", ("g0",), 100.0), JobInfo("small", ("g0",), 300.0)]
    search = CoordinationSearch(jobs, JctObjective())
    search.observe(measure(search.propose()))  # type: ignore[arg-type]
    assert search.propose().caps["big"] == 50  # type: ignore[union-attr]
    literal = CoordinationSearch(jobs, JctObjective(), skip_slack=False)
    run_search(literal, measure)
    assert [t.config.caps["big"] for t in literal.trials] == [100, 90, 80, 70]  # exits on the plateau


# The "nothing to gain" exit (not in the paper: ``CoordinationSearch(futile_exit=...)``).

LOADER = JobInfo("loader", ("g0",), 900.0, solo_throughput=33.0)  # waits for input: 20% of the device
COMPUTE = JobInfo("compute", ("g0",), 3000.0, solo_throughput=400.0)  # keeps the device busy


def _loader_beside_compute(loader_speed: float) -> Callable[[PackingConfig], dict[str, JobMeasurement]]:
    """The live bench's underusing pair: squeezing ``compute`` slows it and gives ``loader`` at most
    ``loader_speed`` back per 10% (the loader waits for its input, not for the device)."""

    def measure(config: PackingConfig) -> dict[str, JobMeasurement]:
        c = config.caps["compute"] / FULL
        loader = min(33.0, 31.5 + loader_speed * (1 - c) * 10)
        return {
            "loader": JobMeasurement(loader, 0.2),
            "compute": JobMeasurement(360.0 * c, 0.8 * c),
        }

    return measure


def test_a_search_with_nothing_to_gain_ends_after_its_first_trial() -> None:
    """Free competition gives the swelled loader 31.5 of its 33 steps/s alone: even at its solo
    speed the mean JCT would gain less than the 3% a trial must; the search keeps free competition
    after one trial, where Algorithm 1 runs three losing squeezes to the same end."""
    measure = _loader_beside_compute(0.0)
    search = CoordinationSearch([LOADER, COMPUTE], SequencedJctObjective(), skip_slack=False, min_gain=0.03)
    best = run_search(search, measure)
    assert search.low_priority == {"compute"}
    assert best.caps == {"loader": FULL, "compute": FULL}
    assert len(search.trials) == 1 and search.ended == EXIT_NOTHING_TO_GAIN
    literal = CoordinationSearch(
        [LOADER, COMPUTE], SequencedJctObjective(), skip_slack=False, min_gain=0.03, futile_exit=False
    )
    assert run_search(literal, measure) == best
    assert len(literal.trials) == 1 + EARLY_EXIT_TRIALS and literal.ended == EXIT_NO_GAIN


def test_a_search_with_something_to_gain_still_squeezes() -> None:
    """When the swelled job is well below its solo speed the bound leaves room: the search runs
    and keeps the squeeze that pays (each 10% off ``compute`` gives the loader, 150 steps from its
    end, 4 steps/s)."""

    def measure(config: PackingConfig) -> dict[str, JobMeasurement]:
        c = config.caps["compute"] / FULL
        return {
            "loader": JobMeasurement(min(33.0, 15.0 + 40.0 * (1 - c)), 0.2),
            "compute": JobMeasurement(360.0 * c, 0.8 * c),
        }

    near_its_end = JobInfo("loader", ("g0",), 150.0, solo_throughput=33.0)
    search = CoordinationSearch(
        [near_its_end, COMPUTE], SequencedJctObjective(), skip_slack=False, min_gain=0.03
    )
    best = run_search(search, measure)
    assert best.caps["compute"] < FULL and best.caps["loader"] == FULL
    assert search.trials[0].objective > min(t.objective for t in search.trials) * 1.03


def test_no_bound_without_the_swelled_jobs_solo_speed() -> None:
    """Without the high-priority job's speed alone nothing bounds what a squeeze could give it:
    the search runs as Algorithm 1 does."""
    unprofiled = JobInfo("loader", ("g0",), 900.0)
    search = CoordinationSearch(
        [unprofiled, COMPUTE], SequencedJctObjective(), skip_slack=False, min_gain=0.03
    )
    run_search(search, _loader_beside_compute(0.0))
    assert search.reachable(_loader_beside_compute(0.0)(search.best())) is None
    assert len(search.trials) == 1 + EARLY_EXIT_TRIALS and search.ended == EXIT_NO_GAIN


def test_a_straggling_low_priority_jmax_is_not_cut_short() -> None:
    """LISS can speed a low-priority J_max that straggles without squeezing anyone: no bound."""
    jobs = [
        JobInfo("big", ("g0", "g1"), 100.0, solo_throughput=1.0),
        JobInfo("small", ("g0",), 100.0, solo_throughput=1.0),
    ]
    search = CoordinationSearch(jobs, JctObjective())
    search.observe(_straggling(search.propose()))  # type: ignore[arg-type]
    assert search.low_priority == {"big"}
    assert search.reachable(_straggling(search.trials[0].config)) is None
    assert search.propose() is not None and search.ended is None


@settings(max_examples=200, deadline=None)
@given(
    u=st.tuples(st.floats(0.1, 1.0), st.floats(0.1, 1.0)),
    remaining=st.tuples(st.floats(10.0, 1000.0), st.floats(10.0, 1000.0)),
    deadlines=st.tuples(st.floats(10.0, 3000.0), st.floats(10.0, 3000.0)),
    objective=st.sampled_from(sorted(OBJECTIVES)),
    min_gain=st.sampled_from([0.0, 0.03]),
    skip_slack=st.booleans(),
)
def test_the_nothing_to_gain_exit_keeps_algorithm1s_result_in_no_more_trials(
    u: tuple[float, float],
    remaining: tuple[float, float],
    deadlines: tuple[float, float],
    objective: str,
    min_gain: float,
    skip_slack: bool,
) -> None:
    """On any pair of the contention model (a squeezed job never speeds up, no job beats its solo
    speed): the search ends on the configuration Algorithm 1 ends on, in at most its trials, and
    never on one measured worse than the free competition it started from."""
    jobs = [
        JobInfo(n, ("g0",), r, deadline_s=d, solo_throughput=1.0)
        for n, r, d in zip(("a", "b"), remaining, deadlines, strict=True)
    ]

    def measure(config: PackingConfig) -> dict[str, JobMeasurement]:
        sa, sb = pair_speeds(u[0], u[1], config.caps["a"], config.caps["b"])
        return {"a": JobMeasurement(sa, sa * u[0]), "b": JobMeasurement(sb, sb * u[1])}

    runs = {
        futile: CoordinationSearch(
            jobs, OBJECTIVES[objective](), skip_slack=skip_slack, min_gain=min_gain, futile_exit=futile
        )
        for futile in (True, False)
    }
    best = {futile: run_search(search, measure) for futile, search in runs.items()}
    assert best[True] == best[False]
    assert len(runs[True].trials) <= len(runs[False].trials)
    for search in runs.values():
        start = search.trials[0].objective
        assert min(t.objective for t in search.trials) <= start
        assert OBJECTIVES[objective]().value(jobs, measure(search.best())) <= start


# Trials cut short (not in the paper: ``CoordinationSearch.interim``).


def _both(loader: float, compute: float) -> dict[str, JobMeasurement]:
    return {"loader": JobMeasurement(loader, 0.2), "compute": JobMeasurement(compute, 0.8)}


def _searching_pair() -> CoordinationSearch:
    """The loader well below its solo speed: the search has room to gain and goes on squeezing."""
    search = CoordinationSearch([LOADER, COMPUTE], SequencedJctObjective(), skip_slack=False, min_gain=0.03)
    search.propose()
    assert not search.interim(_both(20.4, 360.0))  # no best yet: the first trial runs whole
    search.observe(_both(20.0, 360.0))  # the whole trial: its first window was 2% off
    assert search.propose() is not None
    return search


def test_a_trial_clearly_worse_in_its_first_window_is_cut_short() -> None:
    search = _searching_pair()
    first = search.trials[0].objective
    bad = _both(20.0, 200.0)  # the squeeze cost compute 44%: far beyond 3% + 2 x 2% noise
    assert search.interim(bad)
    search.observe(bad)  # the caller hands its first window in as the trial
    assert search.cut_short == 1 and search.trials[1].objective > first * 1.07
    assert search.best() == search.trials[0].config


def test_a_trial_worse_only_within_the_noise_runs_whole() -> None:
    search = _searching_pair()
    slightly = _both(20.0, 345.0)  # worse, but within min_gain + twice the noise seen
    assert search.trials[0].objective < SequencedJctObjective().value([LOADER, COMPUTE], slightly)
    assert not search.interim(slightly)
    assert search.cut_short == 0


def test_no_trial_is_cut_short_before_a_whole_one_measured_the_noise() -> None:
    search = CoordinationSearch([LOADER, COMPUTE], SequencedJctObjective(), skip_slack=False, min_gain=0.03)
    search.propose()
    search.observe(_both(20.0, 360.0))  # whole, but no first window was reported
    search.propose()
    assert not search.interim(_both(20.0, 100.0))
