"""The global scheduler's per-cell metrics (paper definitions, scheduler view) and the
configuration that selects scheduling, autoscaling and prewarm policies."""

from __future__ import annotations

import pytest

from services.global_scheduler.metrics import SchedulerMetrics, percentiles
from shared.config import CHOICES, ConfigError, load_config
from shared.policies.baselines import make_policy


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


def test_every_configurable_scheduling_policy_is_one_the_baselines_know() -> None:
    for name in CHOICES["scheduler.policy"]:
        assert make_policy(name).name == name


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
