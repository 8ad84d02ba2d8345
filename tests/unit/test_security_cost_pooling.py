"""scripts/bench_security_cost.py: runs stripping either side, pooled, cancel what favours a side."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_security_cost import pooled

COST, SIDE_B_GAIN = 0.2, -0.1  # what security costs; what side B gains in every run


def fake_run(stripped: str, rounds: int = 10) -> dict[str, Any]:
    """A bench_ab result in which the secure side pays COST and side B gains SIDE_B_GAIN."""
    a = 5.0 + (COST if stripped == "b" else 0.0)
    b = 5.0 + (COST if stripped == "a" else 0.0) + SIDE_B_GAIN
    cpu_a, cpu_b = (
        {"replica": 4.0 + (0.3 if stripped == "b" else 0.0)},
        {"replica": 4.0 + (0.3 if stripped == "a" else 0.0)},
    )
    return {
        "without_security": stripped,
        "a": {"cpu_ms_per_cell_by_role": cpu_a},
        "b": {"cpu_ms_per_cell_by_role": cpu_b},
        "paired": {"p50_change_per_round": [round(b - a, 3)] * rounds},
    }


def test_pooling_both_kinds_of_run_recovers_the_cost_and_names_the_side_bias() -> None:
    figures = pooled([fake_run("a"), fake_run("b"), fake_run("a"), fake_run("b")])
    assert figures["cost_mean_ms"] == pytest.approx(COST)
    assert figures["side_bias_ms"] == pytest.approx(SIDE_B_GAIN)
    assert figures["cpu_cost_ms_per_cell_by_role"] == {"replica": pytest.approx(0.3)}
    assert [r["median_ms"] for r in figures["cost_per_run"]] == pytest.approx([0.1, 0.3, 0.1, 0.3])


def test_runs_of_one_kind_only_report_no_side_bias() -> None:
    assert pooled([fake_run("a")])["side_bias_ms"] is None
