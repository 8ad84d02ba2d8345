"""Deterministic fault-injection runs of the Raft core (harness: ``shared.raft.simulation``).

Every seed is a full scenario: message loss, duplication, delay and reordering, symmetric and
one-way partitions, crashes (also in the middle of a Ready) with restarts from what was persisted,
membership changes, leadership transfers and compactions; safety is checked at every step and
liveness after healing. A failure names the seed and the one command that replays it.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from shared.raft import core
from shared.raft.log import RaftLog
from shared.raft.simulation import (
    Checker,
    SafetyViolation,
    Scenario,
    SimNode,
    reproduce_command,
    run_seed,
)
from shared.raft.types import ConfState, Entry, HardState, Snapshot, SnapshotMeta

CI_SEEDS = 2000
CI_CHAOS_TICKS = 120  # ~20 ms a seed; the torture script defaults to longer runs
CHUNK = 50


def _failures_in(start: int, count: int, chaos_ticks: int) -> list[str]:
    failures = []
    for seed in range(start, start + count):
        result = run_seed(seed, Scenario.for_seed(seed, chaos_ticks=chaos_ticks))
        if not result.ok:
            failures.append(
                f"seed {seed}: {result.violations[0]}\n  reproduce: {reproduce_command(seed, chaos_ticks)}"
            )
    return failures


def _run_seeds(first: int, count: int, chaos_ticks: int) -> list[str]:
    starts = range(first, first + count, CHUNK)
    sizes = [min(CHUNK, first + count - s) for s in starts]
    workers = min(2, os.cpu_count() or 1)
    if workers == 1:
        return [f for s, n in zip(starts, sizes, strict=True) for f in _failures_in(s, n, chaos_ticks)]
    # spawned, not forked: a fork of this process copies locks other tests' threads held at that
    # instant, and a worker that needs one waits forever (a pool hung a loaded run)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = pool.map(_failures_in, starts, sizes, [chaos_ticks] * len(sizes))
        return [f for part in parts for f in part]


# 2,000 seeds take ~100 s of a loaded 2-core machine: past the suite's 180 s per-test limit
# (whose thread method ends the whole session) only when it is far more loaded than CI
@pytest.mark.timeout(600)
def test_raft_keeps_every_invariant_across_2000_seeds_of_faults() -> None:
    failures = _run_seeds(0, CI_SEEDS, CI_CHAOS_TICKS)
    assert not failures, "\n".join(failures[:10])


def test_long_histories_stay_safe_and_live() -> None:
    failures = _run_seeds(1_000_000, 8, 1500)
    assert not failures, "\n".join(failures)


def test_a_seed_replays_identically() -> None:
    first, second = run_seed(4242), run_seed(4242)
    assert first.ok and second.ok
    assert (first.ticks, first.heal_ticks, first.stats) == (second.ticks, second.heal_ticks, second.stats)
    assert first.stats["elections"] > 0 and first.stats["committed"] > 0


def test_reproduce_command_names_the_seed() -> None:
    assert reproduce_command(1234) == "python scripts/raft_torture.py --seeds 1 --start 1234 --verbose"
    assert "--chaos-ticks 50" in reproduce_command(1234, 50)


# ====================================================================== the checker has teeth


def _stored(node_id: str, terms: list[int], commit: int) -> SimNode:
    """A crashed node whose disk holds the bootstrap snapshot, then entries with these terms."""
    node = SimNode(node_id, original=True)
    node.disk.snapshot = Snapshot(SnapshotMeta(1, 1, ConfState(("s1", "s2", "s3"))))
    node.disk.entries = [Entry(t, i + 2) for i, t in enumerate(terms)]
    node.disk.hard_state = HardState(max(terms, default=1), None, commit)
    return node


def test_checker_flags_two_leaders_in_one_term() -> None:
    checker = Checker()

    class FakeLeader:
        term = 3
        log = RaftLog(0, 0, [], 0)

    checker.on_leader(SimNode("a", original=True), FakeLeader())  # type: ignore[arg-type]
    with pytest.raises(SafetyViolation, match="election safety"):
        checker.on_leader(SimNode("b", original=True), FakeLeader())  # type: ignore[arg-type]


def test_checker_flags_different_entries_applied_at_one_index() -> None:
    checker = Checker()
    a, b = SimNode("a", original=True), SimNode("b", original=True)
    a.app.applied = b.app.applied = 1
    checker.on_apply(a, Entry(2, 2, data=b"x"))
    with pytest.raises(SafetyViolation, match="state machine safety"):
        checker.on_apply(b, Entry(2, 2, data=b"y"))


def test_checker_flags_an_electable_node_that_lacks_a_committed_entry() -> None:
    # Figure 8 (d): index 2 (term 2) is on s1 and s3, but s2 holds term 3 there and is as up to
    # date as s3: it could win s3's vote and overwrite the entry. Committing it was unsafe.
    checker = Checker()
    nodes = {"s1": _stored("s1", [2], 2), "s2": _stored("s2", [3], 1), "s3": _stored("s3", [2], 1)}
    checker.committed[2] = Entry(2, 2)
    checker.max_committed = 2
    with pytest.raises(SafetyViolation, match="leader completeness at risk"):
        checker.on_commit_advanced(nodes, retired=set())
    nodes["s2"] = _stored("s2", [2, 4], 2)  # now holding it: nothing to flag
    checker.on_commit_advanced(nodes, retired=set())


@pytest.fixture
def unsafe_vote_rule() -> Iterator[None]:
    """A core that grants votes without the up-to-date check (a classic Raft bug)."""
    original = RaftLog.is_up_to_date
    RaftLog.is_up_to_date = lambda self, index, term: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        RaftLog.is_up_to_date = original  # type: ignore[method-assign]


@pytest.fixture
def forgetful_voter() -> Iterator[None]:
    """A core that forgets whom it voted for in a term."""
    original = core.RaftNode._on_vote_request

    def vote_again(self: core.RaftNode, m: object) -> None:
        self._vote = None
        self._leader = None
        original(self, m)  # type: ignore[arg-type]

    core.RaftNode._on_vote_request = vote_again  # type: ignore[method-assign]
    try:
        yield
    finally:
        core.RaftNode._on_vote_request = original  # type: ignore[method-assign]


@pytest.mark.parametrize("mutant", ["unsafe_vote_rule", "forgetful_voter"])
def test_simulation_catches_a_broken_core(mutant: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(mutant)
    caught = [seed for seed in range(40) if not run_seed(seed, Scenario.for_seed(seed, chaos_ticks=80)).ok]
    assert caught, f"{mutant} survived 40 seeds: the simulation lost its teeth"
