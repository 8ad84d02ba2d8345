"""A dead member in the election core: which log entries show it back, and what a standby waiting
for its DONE answers once it is removed from the group."""

from __future__ import annotations

from kernel_replica.election_core import Answer, ElectionCore, ElectionSettings, Propose, RaftView
from kernel_replica.log_entries import Done, Lead, LogEntry, Vote, Yield

VOTERS = ("r1", "r2", "r3")


def standby() -> ElectionCore:
    """A standby r2 of a running group whose log is fed by hand."""
    core = ElectionCore(
        "r2", ElectionSettings(), raft=lambda: RaftView(running=True, leader="r3", voters=VOTERS)
    )
    core.configure(VOTERS)
    core.started(last_index=0, voters=VOTERS, now=0.0)
    return core


def apply_all(core: ElectionCore, entries: list[LogEntry], now: float = 0.0) -> None:
    for index, entry in enumerate(entries, start=1):
        core.apply(index, entry, now)


def dead_after(entries: list[LogEntry]) -> set[str]:
    core = standby()
    core.member_lost("r1", [], now=0.0)
    apply_all(core, entries)
    return set(core._dead_members)


def test_a_stand_in_lead_proposed_for_a_dead_executor_does_not_bring_it_back() -> None:
    # the survivors propose the dead executor's LEAD on its behalf (member_lost, outcome_of):
    # a later election open at its death must still not wait election_wait_s for it
    assert dead_after([Lead("m", "r1")]) == {"r1"}


def test_an_entry_the_member_proposed_itself_shows_it_back() -> None:
    assert dead_after([Lead("m", "r1"), Vote("n", "r1", "r2")]) == set()
    assert dead_after([Yield("p", "r3", "r1")]) == set()


def test_a_standby_waiting_for_an_executor_removed_from_the_group_answers_executor_lost() -> None:
    core = standby()
    previous = Done("p", "r3", {"status": "ok"}, 7, False)  # the kernel's count is 7 after it
    apply_all(core, [Lead("p", "r3"), previous, Lead("m", "r1")])  # r1 runs m
    request = core.wait_done("m", "r1", 7, now=0.1)
    core.set_voters(("r2", "r3"), now=0.2, restored=True)  # r1 replaced
    core.tick(0.7)  # its watch wakes: no DONE of r1 can come, so it commits ExecutorLost itself
    proposed = [c.entry for c in core.take_commands() if isinstance(c, Propose) and isinstance(c.entry, Done)]
    assert len(proposed) == 1
    core.apply(4, proposed[0], 0.8)
    answers = [c for c in core.take_commands() if isinstance(c, Answer) and c.request == request]
    assert len(answers) == 1
    answer = answers[0].value
    assert isinstance(answer, Done), answer
    assert answer.content["ename"] == "ExecutorLost" and answer.execution_count == 7
    assert "removed from the kernel's Raft group" in answer.content["evalue"]
