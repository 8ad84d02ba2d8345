"""The global scheduler's per-cell metrics (paper definitions, scheduler view) and the
configuration that selects scheduling, autoscaling and prewarm policies."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from services.global_scheduler.metrics import (
    REPLICA_STEPS,
    PrometheusExporter,
    SchedulerMetrics,
    parse_cell_timings,
    percentiles,
)
from shared.cluster_core.core import ClusterCore
from shared.config import CHOICES, ConfigError, load_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_interactivity_delay_and_task_completion_follow_arrival_election_and_reply() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    arrived = clock.now
    clock.now += 0.001
    metrics.cell_submitted("k", "m1", arrived, designated="r1", needs_gpus=True)
    clock.now += 0.010
    metrics.cell_elected("k", "m1", "r1", "host-0")
    clock.now += 0.500
    metrics.requests_finished("k", ["m1"])
    (cell,) = metrics.recent_cells(10)
    assert cell["interactivity_delay_ms"] == pytest.approx(11.0)
    assert cell["task_completion_ms"] == pytest.approx(511.0)
    assert cell["steps_ms"] == pytest.approx({"route_ms": 1.0, "elect_ms": 10.0, "run_ms": 500.0})
    assert cell["executor"] == "r1" and cell["host"] == "host-0" and cell["immediate"] is True
    assert metrics.cell_summary()["immediate_commit_ratio"] == 1.0


def test_a_cell_is_not_committed_immediately_when_every_replica_yielded_or_another_took_over() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    metrics.cell_submitted("k", "none-free", clock.now, designated=None, needs_gpus=True)
    metrics.cell_submitted("k", "yielded", clock.now, designated="r1", needs_gpus=True)
    metrics.cell_not_committed("k", "yielded")
    metrics.cell_submitted("k", "other", clock.now, designated="r1", needs_gpus=True)
    metrics.cell_elected("k", "other", "r2", "host-1")
    metrics.cell_submitted("k", "cpu-only", clock.now, designated=None, needs_gpus=False)
    metrics.requests_finished("k", ["none-free", "yielded", "other", "cpu-only", "not-a-cell"])
    summary = metrics.cell_summary()
    assert summary["cells_total"] == 4 and summary["cells_committed_immediately"] == 1
    assert [c["immediate"] for c in metrics.recent_cells(10)] == [False, False, False, True]


def test_percentiles_of_nothing_is_empty_and_of_values_is_ordered() -> None:
    assert percentiles([]) == {}
    report = percentiles([5.0, 1.0, 3.0])
    assert report["count"] == 3 and report["p50"] == 3.0 and report["p99"] == 5.0


def test_every_configurable_scheduling_policy_is_a_plug_in_of_the_cluster_core() -> None:
    for name in CHOICES["scheduler.policy"]:
        assert ClusterCore(policy=name).sessions.name == name


@pytest.mark.parametrize(
    ("key", "value"),
    [("scheduler.policy", "fifo"), ("prewarm.policy", "always"), ("autoscale.provider", "aws")],
)
def test_an_unknown_policy_name_is_refused_naming_the_key_and_the_choices(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(overrides={key: value})
    assert key in str(refused.value) and repr(value) in str(refused.value)
    assert all(choice in str(refused.value) for choice in CHOICES[key])


def test_a_cell_held_for_a_migration_keeps_its_arrival_and_counts_as_not_immediate() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    arrived = clock.now
    metrics.cell_submitted("k", "m", arrived, designated=None, needs_gpus=True)  # held: no host has GPUs
    clock.now += 2.0
    metrics.cell_submitted("k", "m", clock.now, designated="r4", needs_gpus=True)  # sent on after the move
    clock.now += 0.01
    metrics.cell_elected("k", "m", "r4", "host-3")
    metrics.requests_finished("k", ["m"])
    (cell,) = metrics.recent_cells(1)
    assert cell["immediate"] is False and cell["executor"] == "r4"
    assert cell["interactivity_delay_ms"] == pytest.approx(2010.0)
    assert cell["steps_ms"]["held_ms"] == pytest.approx(2000.0)


def _executed_cell(metrics: SchedulerMetrics, clock: Clock, msg_id: str, executor: str = "r1") -> None:
    metrics.cell_submitted("k", msg_id, clock.now, designated=executor, needs_gpus=True)
    metrics.cell_elected("k", msg_id, executor, "host-0")
    clock.now += 0.05
    metrics.requests_finished("k", [msg_id])


def test_the_executors_step_times_arriving_after_the_reply_join_the_cell_and_the_summary() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    seen: list[dict[str, float]] = []
    metrics.on_replica_timings = seen.append
    for n, run_ms in enumerate((10.0, 20.0, 30.0)):
        _executed_cell(metrics, clock, f"m{n}")
        timings = {"decide_ms": 1.5, "bind_ms": 0.01, "run_ms": run_ms, "replied_ms": run_ms + 2}
        assert metrics.cell_timings("k", f"m{n}", "r1", timings | {"state_bytes": 128})
    cell = metrics.recent_cells(1)[0]
    assert cell["replica_steps_ms"] == {"decide_ms": 1.5, "bind_ms": 0.01, "run_ms": 30.0, "replied_ms": 32.0}
    assert cell["replica_bytes"] == {"state_bytes": 128}
    summary = metrics.cell_summary()
    assert summary["replica_steps_ms"]["run_ms"]["p50"] == 20.0
    assert summary["replica_steps_ms"]["run_ms"]["p99"] == 30.0
    assert summary["replica_steps_ms"]["confirm_ms"] == {}  # no cell confirmed a LEAD late
    assert summary["replica_bytes"]["state_bytes"]["count"] == 3
    assert len(seen) == 3 and seen[0]["state_bytes"] == 128.0


def test_step_times_of_a_cell_still_running_are_kept_when_it_completes() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    metrics.cell_submitted("k", "m", clock.now, designated="r2", needs_gpus=True)
    metrics.cell_elected("k", "m", "r2", "host-1")
    assert metrics.cell_timings("k", "m", "r2", {"run_ms": 4})
    metrics.requests_finished("k", ["m"])
    assert metrics.recent_cells(1)[0]["replica_steps_ms"] == {"run_ms": 4.0}


@pytest.mark.parametrize(
    ("detail", "problem"),
    [
        ("fast", "mapping"),
        ({}, "mapping"),
        ({"run_ms": "12"}, "number"),
        ({"run_ms": True}, "number"),
        ({"run_ms": -1.0}, "out of range"),
        ({"run_ms": float("nan")}, "out of range"),
        ({"coffee_ms": 3.0}, "no known step (got ['coffee_ms'])"),
    ],
)
def test_a_malformed_cell_timings_event_is_dropped_naming_the_problem(detail: object, problem: str) -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    _executed_cell(metrics, clock, "m")
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_cell_timings(detail)
    with capture_logs() as logs:
        assert metrics.cell_timings("k", "m", "r1", detail) is False
    (logged,) = logs
    assert logged["event"] == "cell_timings_dropped" and problem in logged["reason"]
    assert logged["msg_id"] == "m" and logged["replica"] == "r1"
    assert metrics.recent_cells(1)[0]["replica_steps_ms"] == {}
    assert metrics.cell_summary()["cell_timings_dropped"] == 1


def test_unknown_steps_are_left_out_and_the_known_ones_kept() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    _executed_cell(metrics, clock, "m")
    assert parse_cell_timings({"run_ms": 1.0, "coffee_ms": "x"}) == ({"run_ms": 1.0}, ["coffee_ms"])
    with capture_logs() as logs:
        assert metrics.cell_timings("k", "m", "r1", {"run_ms": 2.0, "to_gpu_ms": 0.5, "coffee_ms": 3.0})
    assert [entry["steps"] for entry in logs] == [["coffee_ms"]]
    assert metrics.recent_cells(1)[0]["replica_steps_ms"] == {"run_ms": 2.0, "to_gpu_ms": 0.5}
    assert metrics.timings_dropped == 0


def test_every_step_the_replica_times_is_one_the_scheduler_keeps() -> None:
    """A step the replica reports and the scheduler does not know was logged as a warning on
    every cell and dropped (load_wait_ms, until it joined REPLICA_STEPS)."""
    source = "".join(p.read_text() for p in (Path(__file__).parents[2] / "kernel_replica").glob("*.py"))
    reported = set(re.findall(r'timing\["([a-z_]+)"\]', source)) - {"total_ms"}  # renamed replied_ms
    assert reported, "the replica's step names were not found: the pattern needs updating"
    assert reported <= set(REPLICA_STEPS), reported - set(REPLICA_STEPS)


def test_cell_timings_from_a_replica_other_than_the_executor_or_for_an_unknown_cell_are_dropped() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    _executed_cell(metrics, clock, "m", executor="r1")
    with capture_logs():
        assert metrics.cell_timings("k", "m", "r2", {"run_ms": 1.0}) is False
        assert metrics.cell_timings("k", "never-sent", "r1", {"run_ms": 1.0}) is False
    assert metrics.recent_cells(1)[0]["replica_steps_ms"] == {}
    assert metrics.timings_dropped == 2


def test_only_as_many_completed_cells_as_kept_accept_late_step_times() -> None:
    clock = Clock()
    metrics = SchedulerMetrics(cells_kept=2, clock=clock)
    for n in range(3):
        _executed_cell(metrics, clock, f"m{n}")
    with capture_logs():
        assert metrics.cell_timings("k", "m0", "r1", {"run_ms": 1.0}) is False  # forgotten with its record
    assert metrics.cell_timings("k", "m2", "r1", {"run_ms": 1.0}) is True


def test_the_exporter_serves_the_replica_steps_as_histograms() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    clock = Clock()
    metrics = SchedulerMetrics(clock=clock)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def no_cluster() -> dict[str, object]:
        raise RuntimeError("no cluster in this test")  # the exporter serves the cell metrics only

    try:
        exporter = PrometheusExporter(no_cluster, loop, metrics)
        _executed_cell(metrics, clock, "m")
        metrics.cell_timings("k", "m", "r1", {"bind_ms": 0.2, "run_ms": 12.0, "state_bytes": 64})
        text = prometheus_client.generate_latest(exporter.registry).decode()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    assert 'tandem_cell_replica_step_seconds_count{step="run"} 1.0' in text
    assert 'tandem_cell_replica_step_seconds_bucket{le="0.0005",step="bind"} 1.0' in text
    assert 'tandem_cell_replica_bytes_sum{kind="state"} 64.0' in text
