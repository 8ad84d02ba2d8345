"""A dead member in ``ReplicaCore``: which log entries show it back, and what a standby waiting for
its DONE answers once it is removed from the group."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kernel_replica import log_entries
from kernel_replica.log_entries import Done, Lead, LogEntry, Vote, Yield
from kernel_replica.raft_bridge import ReplicaCore, ReplicaSettings
from shared.raft.types import ConfState, Entry


def apply_all(core: ReplicaCore, entries: list[LogEntry]) -> None:
    for index, entry in enumerate(entries, start=1):
        core._on_apply(Entry(term=1, index=index, data=log_entries.encode(entry)))


def make_core(tmp_path: Path) -> ReplicaCore:
    """A standby r2 that never starts Raft (entries are applied by hand); built on a running loop."""
    return ReplicaCore(
        kernel_id="k",
        replica_id="r2",
        data_dir=tmp_path,
        raft_address="tcp://127.0.0.1:1",
        scheduler_address="tcp://127.0.0.1:2",
        settings=ReplicaSettings(),
        post_to_kernel=lambda *args: None,
    )


def dead_after(tmp_path: Path, entries: list[LogEntry]) -> set[str]:
    async def scenario() -> set[str]:
        core = make_core(tmp_path)
        try:
            core.book.set_voters(["r1", "r2", "r3"])
            core._dead_members.add("r1")
            apply_all(core, entries)
            return set(core._dead_members)
        finally:
            await core.stop()

    return asyncio.run(scenario())


def test_a_stand_in_lead_proposed_for_a_dead_executor_does_not_bring_it_back(tmp_path: Path) -> None:
    # the survivors propose the dead executor's LEAD on its behalf (member_lost, outcome_of):
    # a later election open at its death must still not wait election_wait_s for it
    assert dead_after(tmp_path, [Lead("m", "r1")]) == {"r1"}


def test_an_entry_the_member_proposed_itself_shows_it_back(tmp_path: Path) -> None:
    assert dead_after(tmp_path, [Lead("m", "r1"), Vote("n", "r1", "r2")]) == set()
    assert dead_after(tmp_path, [Yield("p", "r3", "r1")]) == set()


def test_a_standby_waiting_for_an_executor_removed_from_the_group_answers_executor_lost(
    tmp_path: Path,
) -> None:
    async def scenario() -> Done | str:
        core = make_core(tmp_path)
        try:
            core.book.set_voters(["r1", "r2", "r3"])
            apply_all(core, [Lead("m", "r1")])  # r1 runs m
            waiting = asyncio.ensure_future(core._wait_done("m", "r1", 7))
            await asyncio.sleep(0)
            core._on_conf_change(None, ConfState(voters=("r2", "r3")))  # r1 replaced
            return await asyncio.wait_for(waiting, 5)
        finally:
            await core.stop()

    answer = asyncio.run(scenario())
    assert isinstance(answer, Done), answer
    assert answer.content["ename"] == "ExecutorLost" and answer.execution_count == 7
    assert "removed from the kernel's Raft group" in answer.content["evalue"]
