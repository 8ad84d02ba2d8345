"""The quorum of a replica group: every count of "enough replicas" derives from its size."""

from __future__ import annotations


def majority(members: int) -> int:
    """Members a Raft group of ``members`` voters needs to commit or elect (2 of 3, 3 of 5)."""
    if members < 1:
        raise ValueError(f"a group has at least one member, got {members}")
    return members // 2 + 1
