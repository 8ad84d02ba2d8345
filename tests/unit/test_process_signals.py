"""The decision of shared/process_signals.py (pure, over a made-up process table) and its
/proc/<pid>/stat parser; the provoked-reuse tests with real processes are in
tests/integration/test_pid_reuse.py."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from services.cluster_file import pid_alive
from shared.process_signals import (
    GroupPlan,
    ProcStat,
    Route,
    descendants_of,
    parse_stat,
    plan_group_signal,
    read_stat,
)

LEADER = 4242


def proc(
    pid: int, *, ppid: int = 1, pgid: int = LEADER, sid: int = LEADER, start: int = 100, state: str = "S"
) -> ProcStat:
    return ProcStat(pid=pid, state=state, ppid=ppid, pgid=pgid, sid=sid, start_ticks=start)


def never_read() -> list[ProcStat]:
    raise AssertionError("the process table is read only after the leader's reap")


def test_a_pidfd_that_reaches_the_group_is_used_whatever_the_leader_state() -> None:
    for reaped_at in (None, 500):
        plan = plan_group_signal(LEADER, reaped_at=reaped_at, pidfd_group=True, table=never_read)
        assert plan == GroupPlan(Route.PIDFD_GROUP)


def test_the_group_number_is_signalled_only_while_its_leader_is_unreaped() -> None:
    assert (
        plan_group_signal(LEADER, reaped_at=None, pidfd_group=False, table=never_read).route is Route.KILLPG
    )
    after = plan_group_signal(LEADER, reaped_at=500, pidfd_group=False, table=lambda: [proc(LEADER + 1)])
    assert after.route is Route.MEMBERS


def test_after_the_reap_a_stranger_group_that_reused_the_number_is_not_signalled() -> None:
    ours = proc(5000, start=400)  # a child the replica left behind, older than the reap
    stranger_leader = proc(LEADER, start=900)  # got the number once our group was empty
    stranger_child = proc(5001, start=901)
    elsewhere = proc(6000, pgid=6000, sid=6000, start=10)
    zombie = proc(5002, start=300, state="Z")
    table = [ours, stranger_leader, stranger_child, elsewhere, zombie]
    plan = plan_group_signal(LEADER, reaped_at=500, pidfd_group=False, table=lambda: table)
    assert plan == GroupPlan(Route.MEMBERS, (ours,))


def test_a_member_that_started_in_the_reaps_own_tick_is_left_alone() -> None:
    plan = plan_group_signal(LEADER, reaped_at=500, pidfd_group=False, table=lambda: [proc(5000, start=500)])
    assert plan.members == ()


def test_a_process_of_the_group_number_in_another_session_is_not_ours() -> None:
    """Our group lives in the session its leader founded; a job-control group elsewhere is not it."""
    other_session = proc(5000, sid=77, start=10)
    assert (
        plan_group_signal(LEADER, reaped_at=500, pidfd_group=False, table=lambda: [other_session]).members
        == ()
    )


stats = st.builds(
    proc,
    st.integers(1, 40000),
    pgid=st.sampled_from([LEADER, LEADER + 1, 77]),
    sid=st.sampled_from([LEADER, 77]),
    start=st.integers(0, 1000),
    state=st.sampled_from(["R", "S", "Z", "T", "D"]),
)


@given(st.lists(stats, max_size=30), st.integers(0, 1000))
def test_after_the_reap_only_live_members_older_than_it_are_ever_signalled(
    table: list[ProcStat], reaped_at: int
) -> None:
    plan = plan_group_signal(LEADER, reaped_at=reaped_at, pidfd_group=False, table=lambda: table)
    expected = [
        p
        for p in table
        if p.pgid == LEADER and p.sid == LEADER and p.start_ticks < reaped_at and p.state != "Z"
    ]
    assert plan.route is Route.MEMBERS
    assert list(plan.members) == expected


@given(
    st.integers(1, 4_194_304),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0\n"), max_size=15),
    st.integers(0, 2**40),
)
def test_stat_lines_parse_whatever_the_command_name_holds(pid: int, comm: str, start: int) -> None:
    """The command name is the process's own choice: spaces, parentheses, digits."""
    line = f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 10 0 0 0 0 0 0 0 20 0 1 0 {start} 1000 100\n"
    assert parse_stat(line) == ProcStat(pid=pid, state="S", ppid=1, pgid=pid, sid=pid, start_ticks=start)


def test_descendants_come_children_first_and_stop_at_the_root() -> None:
    table = [proc(2, ppid=1), proc(3, ppid=2), proc(4, ppid=3), proc(9, ppid=7)]
    assert [p.pid for p in descendants_of(1, table)] == [2, 3, 4]


def test_a_recorded_pid_is_alive_only_while_it_still_has_its_recorded_start_time() -> None:
    """cluster.json records ``tandem up``'s start time: a pid reused since is not the cluster."""
    me = read_stat(os.getpid())
    assert me is not None
    assert pid_alive(os.getpid(), me.start_ticks)
    assert not pid_alive(os.getpid(), me.start_ticks + 1)
    assert pid_alive(os.getpid())  # a cluster.json from before the start time was recorded
