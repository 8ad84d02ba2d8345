"""Which log entries show a member the scheduler reported dead to be back (``ReplicaCore``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kernel_replica import log_entries
from kernel_replica.log_entries import Lead, LogEntry, Vote, Yield
from kernel_replica.raft_bridge import ReplicaCore, ReplicaSettings
from shared.raft.types import Entry


def apply_all(core: ReplicaCore, entries: list[LogEntry]) -> None:
    for index, entry in enumerate(entries, start=1):
        core._on_apply(Entry(term=1, index=index, data=log_entries.encode(entry)))


def dead_after(tmp_path: Path, entries: list[LogEntry]) -> set[str]:
    async def scenario() -> set[str]:
        core = ReplicaCore(
            kernel_id="k",
            replica_id="r2",
            data_dir=tmp_path,
            raft_address="tcp://127.0.0.1:1",
            scheduler_address="tcp://127.0.0.1:2",
            settings=ReplicaSettings(),
            post_to_kernel=lambda *args: None,
        )
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
