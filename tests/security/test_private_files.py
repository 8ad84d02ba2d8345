"""``cluster.json`` says where the keys are, the keys open the cluster, and the state directory
holds namespaces: none of them may be readable by another user."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from _cluster import ClusterHandle

pytestmark = pytest.mark.integration


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cluster_file_keys_and_state_dir_are_private_to_their_user(tandem_cluster: ClusterHandle) -> None:
    keys = tandem_cluster.state_dir / "keys"
    assert _mode(tandem_cluster.state_dir) & 0o077 == 0
    assert _mode(tandem_cluster.state_dir / "cluster.json") == 0o600
    assert _mode(keys) == 0o700
    secrets = sorted(keys.glob("*.key_secret"))
    assert {p.name for p in secrets} >= {"scheduler.key_secret", "gateway.key_secret", "operator.key_secret"}
    assert {oct(_mode(p)) for p in secrets} == {oct(0o600)}
