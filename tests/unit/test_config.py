"""Configuration keys checked together, where one alone cannot be wrong."""

from __future__ import annotations

import json

import pytest

from shared.config import ConfigError, config_from_json, load_config


def test_an_executor_silence_within_one_progress_beat_is_refused() -> None:
    """Standbys would give up on every cell longer than the silence, its executor alive."""
    with pytest.raises(
        ConfigError, match=r"executor_silence_s \(1.5\) must exceed election.progress_interval_s \(2\)"
    ):
        load_config(overrides={"election.executor_silence_s": "1.5"})
    with pytest.raises(ConfigError, match="inherited configuration"):
        config_from_json(json.dumps({"election": {"executor_silence_s": 2.0}}))
    config = load_config(
        overrides={"election.executor_silence_s": "1.5", "election.progress_interval_s": "0.5"}
    )
    assert config.get("election.executor_silence_s") == 1.5
