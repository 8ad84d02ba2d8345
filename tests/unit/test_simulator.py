"""The discrete-event simulator: same policy objects as the live scheduler, reproducible for a seed,
the paper's headline directions on a small synthetic trace, and the ``tandem sim --json`` shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.cluster_core import drain, moves, replicated
from shared.cluster_core.core import ClusterCore
from shared.cluster_core.sessions import Session, StartRuntime
from shared.policies import autoscale, executor_choice, migration, placement
from shared.policies.placement_index import PlacementIndex
from shared.resources import Resources
from shared.serving import ServingCore
from shared.simulator import engine
from shared.simulator.cli import JSON_KEYS, run_sim
from shared.simulator.engine import SimResult, Simulator
from shared.simulator.params import SimParams
from shared.simulator.results import reexecution_events, summarize_run
from shared.workload.idlt import DAY, excerpt_17_5h, generate
from shared.workload.model import Session as TraceSession
from shared.workload.model import Task, Trace
from shared.workload.trace_csv import write_trace_csv

ALL = ["notebookos", "reservation", "batch", "lcp"]


@pytest.fixture(scope="module")
def excerpt() -> Trace:
    return excerpt_17_5h(3)


def test_simulator_imports_the_same_policy_objects_as_the_live_scheduler() -> None:
    import services.global_scheduler.service as live
    import services.serving_controller.service as live_serving

    assert live.ClusterCore is engine.ClusterCore  # one core class, both drivers
    # the live shells reach these through the core (tests/unit/test_one_cluster_core.py scans them)
    assert moves.choose_executor is executor_choice.choose_executor
    assert replicated.executor_for is moves.executor_for
    assert live.PlacementRequest is placement.PlacementRequest is replicated.PlacementRequest
    assert moves.plan_migration is migration.plan_migration
    assert replicated.plan_held_migration is moves.plan_held_migration
    assert drain.plan_replacement is moves.plan_replacement
    assert replicated.PlacementIndex is PlacementIndex
    assert engine.ServingCore is live_serving.ServingCore  # warm pools: the serving controller's core


def test_simulator_decisions_go_through_the_shared_policy_functions(
    excerpt: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: dict[str, int] = {}

    def spy(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    spy(moves, "choose_executor")  # the very function object the live scheduler calls (above)
    spy(moves, "plan_migration")
    spy(PlacementIndex, "place")
    spy(autoscale.Autoscaler, "evaluate")
    spy(ServingCore, "report")  # the serving controller's core, as live (services/serving_controller)
    Simulator(excerpt, "notebookos", seed=1).run()
    assert set(calls) == {"choose_executor", "plan_migration", "place", "evaluate", "report"}
    assert calls["choose_executor"] >= excerpt.n_tasks  # every cell's executor is chosen by it


def _same(a: SimResult, b: SimResult) -> bool:
    arrays = ("commit_s", "exec_start_s", "exec_end_s", "end_s_task", "immediate", "host_intervals")
    return all(np.array_equal(getattr(a, k), getattr(b, k), equal_nan=True) for k in arrays) and (
        a.migration_s == b.migration_s and a.scale_out_s == b.scale_out_s
    )


def test_a_seed_reproduces_a_run_exactly(excerpt: Trace) -> None:
    first = Simulator(excerpt, "notebookos", seed=7).run()
    again = Simulator(excerpt, "notebookos", seed=7).run()
    other = Simulator(excerpt, "notebookos", seed=8).run()
    assert _same(first, again)
    assert not _same(first, other)  # the seed drives the container start times
    strip = lambda r: {k: v for k, v in summarize_run(r).numbers.items() if k not in ("wall_s", "cpu_s")}  # noqa: E731
    assert strip(first) == strip(again)


def test_small_trace_shows_the_papers_headline_directions() -> None:
    trace = generate(4.0, 1)
    _, summaries = run_sim(trace, ALL, seed=1, window_end_s=4 * DAY, progress=False)
    n = {name: s.numbers for name, s in summaries.items()}
    assert n["notebookos"]["gpu_hours"] < 0.7 * n["reservation"]["gpu_hours"]
    assert n["notebookos"]["gpu_hours_saved_vs_reservation"] > 0
    p50 = {name: n[name]["interactivity_delay_p50_s"] for name in ALL}
    assert max(p50, key=p50.get) == "batch"  # a cold container + data load before every cell
    assert n["notebookos"]["interactivity_delay_p50_s"] < 1.0  # close to reservation's 0
    assert n["lcp"]["gpu_hours"] < n["notebookos"]["gpu_hours"]
    assert n["notebookos"]["immediate_commit_fraction"] > 0.85
    assert n["reservation"]["immediate_commit_fraction"] == 1.0
    for name in ("reservation", "batch", "lcp"):
        assert n[name]["cells_run"] == trace.n_tasks and n[name]["cells_failed"] == 0
    # as live, a cell no replica could run within scheduler.migration_deadline_s fails (no scale-out)
    assert n["notebookos"]["cells_run"] + n["notebookos"]["cells_failed"] == trace.n_tasks
    assert n["notebookos"]["cells_failed"] < 0.02 * trace.n_tasks


def test_every_cell_runs_after_its_submit_and_for_its_duration(excerpt: Trace) -> None:
    for name in ALL:
        r = Simulator(excerpt, name, seed=2).run()
        ran = ~np.isnan(r.exec_start_s)  # the others were given up (held past the deadline)
        assert int((~ran).sum()) == r.cells_failed, name
        assert np.all(r.exec_start_s[ran] >= excerpt.task_submit_s[ran] - 1e-9), name
        assert np.allclose(r.exec_end_s[ran] - r.exec_start_s[ran], excerpt.task_duration_s[ran]), name
        assert np.all(r.end_s_task[ran] >= r.exec_end_s[ran]), name
        assert np.all(r.commit_s[ran] <= r.exec_start_s[ran]), name


def test_scale_in_drains_replicas_off_released_hosts() -> None:
    core = ClusterCore(policy="notebookos", hosts={h: 8 for h in "abcd"})
    kernels = core.replicated
    assert kernels is not None
    for sid in ("s1", "s2"):
        core.session_started(Session(sid, Resources(gpus=2)))
    busy = next(h for h in "abcd" if any(h in k.hosts for k in kernels.kernels.values()))
    before = kernels.index.live_subscribed_gpus
    plan = core.plan_drain(busy, kernels.replicas_on(busy), kernels.index.views())
    assert plan.complete and plan.moves and all(m.source_host == busy for _, m in plan.moves)
    for replica, move in plan.moves:
        kernels.move_replica(replica.kernel_id, move)
    assert all(busy not in k.hosts and len(set(k.hosts)) == 3 for k in kernels.kernels.values())
    assert kernels.index.live_subscribed_gpus == before  # moved, not dropped


def test_reexecution_savings_rerun_the_cells_since_the_kernel_last_started() -> None:
    sessions = [TraceSession("a", 0.0, 50_000.0, 2)]
    tasks = [
        Task("a", 100.0, 600.0, 2),
        Task("a", 1_000.0, 300.0, 2),
        Task("a", 9_000.0, 60.0, 2),  # after 7,700 s idle: re-run the first two
        Task("a", 20_000.0, 30.0, 2),  # after 10,940 s idle: re-run only the one since the restart
    ]
    trace = Trace.from_tasks(sessions, tasks)
    when, gpu_h = reexecution_events(trace, after_h=1.0)
    assert when.tolist() == [9_000.0, 20_000.0]
    assert gpu_h.tolist() == pytest.approx([2 * (600 + 300) / 3600, 2 * 60 / 3600])
    assert reexecution_events(trace, after_h=3.0)[0].tolist() == [20_000.0]


def test_a_session_larger_than_a_host_is_refused_with_its_name() -> None:
    trace = Trace.from_tasks([TraceSession("big", 0.0, 100.0, 8)], [Task("big", 1.0, 5.0, 8)])
    with pytest.raises(ValueError, match="'big' asks for 8 GPUs"):
        Simulator(trace, "batch", SimParams(gpus_per_host=4))


def _last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def test_cli_json_is_one_object_keyed_by_policy_on_the_last_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    out_dir = tmp_path / "figs"
    rc = main(
        ["sim", "--trace", "synthetic-idlt", "--days", "0.5", "--seed", "2", "--out", str(out_dir), "--json"]
    )
    assert rc == 0
    report = _last_json(capsys.readouterr().out)
    assert list(report) == ALL
    for numbers in report.values():
        assert set(JSON_KEYS) <= set(numbers)
        assert all(numbers[k] is None or isinstance(numbers[k], int | float) for k in JSON_KEYS)
    assert report["reservation"]["gpu_hours_saved_vs_reservation"] == 0
    assert {p.name for p in out_dir.glob("*.png")} >= {
        "fig9a_interactivity_delay_cdf.png",
        "fig9b_tct_cdf.png",
        "fig8_gpus_notebookos.png",
        "fig10_subscription_ratio.png",
    }


def test_cli_replays_a_csv_trace_for_the_chosen_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    path = tmp_path / "trace.csv"
    write_trace_csv(generate(0.5, 4), path)
    rc = main(["sim", "--trace", str(path), "--policies", "batch,notebookos", "--no-plots", "--json"])
    assert rc == 0
    report = _last_json(capsys.readouterr().out)
    assert list(report) == ["batch", "notebookos"]
    assert report["notebookos"]["gpu_hours_saved_vs_reservation"] is not None  # reservation ran as baseline


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "notebookos,slurm"], "unknown policy 'slurm'"),
        (["--trace", "/nonexistent/trace.csv"], "not synthetic-idlt"),
        (["--days", "-1"], "--days must be > 0"),
    ],
)
def test_cli_bad_input_is_refused_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    assert main(["sim", "--no-plots", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_idle_kernel_hibernates_and_its_next_cell_pays_the_measured_resume() -> None:
    """The live gateway's rule (shared/policies/hibernation.py) driven by simulated time: the
    replicas stop (their subscriptions and memory freed), never mid-cell, and the next cell
    waits for a resume drawn around ``resume_mean_s``, not a cold start."""
    sessions = [TraceSession("a", 0.0, 30_000.0, 2)]
    tasks = [
        Task("a", 100.0, 5_000.0, 2),  # longer than hibernate_after_s: never cut short
        Task("a", 20_000.0, 60.0, 2),  # after ~14,900 s idle: a resume
        Task("a", 20_200.0, 60.0, 2),  # right behind it: the replicas are there
    ]
    trace = Trace.from_tasks(sessions, tasks)
    on = SimParams(hibernate_after_s=1_000.0, min_hosts=3, initial_hosts=3)
    r = Simulator(trace, "notebookos", on, seed=4).run()
    off = Simulator(trace, "notebookos", SimParams(min_hosts=3, initial_hosts=3), seed=4).run()
    delays = r.exec_start_s - trace.task_submit_s
    assert len(r.hibernated_intervals) == 2 and len(r.resume_delays_s) == 1  # again after the last cell
    slept, woke, gpus = r.hibernated_intervals[0]
    assert r.hibernated_intervals[1, 1] == 30_000.0  # it sleeps until its session ends
    assert 5_100.0 + 1_000.0 <= slept <= 5_100.0 + 1_000.0 + on.autoscale_interval_s  # idle, then a look
    assert woke == 20_000.0 and gpus == 2
    assert r.resume_delays_s[0] == pytest.approx(delays[1])
    assert 0.5 * on.resume_mean_s < delays[1] < 2 * on.resume_mean_s  # lognormal sigma 0.25 around it
    assert delays[2] == pytest.approx(on.election_s) and delays[0] == pytest.approx(
        off.exec_start_s[0] - 100.0
    )
    assert (off.exec_start_s - trace.task_submit_s)[1] == pytest.approx(on.election_s)
    # the replicas were gone while it slept: two replica intervals around the hibernation
    assert [tuple(x) for x in r.replica_intervals[:, :2].tolist()][:1] == [(0.0, slept)]
    n = summarize_run(r).numbers
    hours = float(np.sum(r.hibernated_intervals[:, 1] - r.hibernated_intervals[:, 0])) / 3600
    assert n["hibernations"] == 2 and n["resumes"] == 1
    assert n["hibernated_kernel_hours"] == pytest.approx(hours, abs=1e-3)
    assert n["hibernation_memory_gb_hours_freed"] == pytest.approx(
        hours * on.kernel_memory_mb / 1024, abs=1e-3
    )
    assert n["hibernation_subscribed_gpu_hours_freed"] == pytest.approx(hours * 2 * 3, abs=1e-3)
    assert "hibernations" not in summarize_run(off).numbers


def test_the_one_core_places_a_kernel_on_hosts_with_warm_runtimes_among_equals() -> None:
    """The simulator's driver of WarmRuntimeScore (the live one: test_cluster_state.py): hosts
    with a ready runtime win ties, and the simulated start there is a warm one."""
    core = ClusterCore(policy="notebookos", hosts={h: 8 for h in "abcd"})
    kernels = core.replicated
    assert kernels is not None
    kernels.set_warm("c", 1)
    kernels.set_warm("d", 2)
    started = core.session_started(Session("s1", Resources(gpus=1)))
    assert sorted(a.host_id for a in started if isinstance(a, StartRuntime)) == ["a", "c", "d"]  # not a, b, c
    # a simulated run: every host keeps one warm runtime (ready a cold start after t=0), so a
    # kernel started later starts warm
    trace = Trace.from_tasks([TraceSession("x", 100.0, 1_000.0, 1)], [Task("x", 100.0, 10.0, 1)])
    params = SimParams(min_hosts=3, initial_hosts=3, start_jitter_sigma=0.0)
    r = Simulator(trace, "notebookos", params, seed=1).run()
    assert r.exec_start_s[0] == pytest.approx(100.0 + params.warm_start_s + params.election_s)
