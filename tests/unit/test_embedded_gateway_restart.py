"""``tandem up``'s supervisor and the gateway's restarts (services/embedded.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.embedded import (
    GATEWAY_RESTARTS_PER_WINDOW,
    ClusterStartError,
    EmbeddedCluster,
    forget_kernel_table,
)
from shared.config import load_config


def test_a_gateway_that_keeps_dying_is_not_restarted_again(tmp_path: Path) -> None:
    cluster = EmbeddedCluster(load_config(), state_dir=tmp_path)
    cluster._gateway_restarts = [time.monotonic()] * GATEWAY_RESTARTS_PER_WINDOW
    with pytest.raises(ClusterStartError, match="the gateway died 6 times within 60s"):
        cluster.restart_gateway()
    assert cluster.children == []  # nothing was started


def test_a_new_cluster_does_not_restore_the_previous_clusters_kernels(tmp_path: Path) -> None:
    table = tmp_path / "gateway" / "kernels.json"
    table.parent.mkdir()
    table.write_text(json.dumps({"version": 1, "kernels": []}))
    forget_kernel_table(tmp_path)
    assert not table.exists()
    forget_kernel_table(tmp_path)  # nothing to forget: fine
