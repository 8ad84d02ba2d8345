"""The kernel lifecycle table (shared/cluster_core/lifecycle.py): every listed move is allowed,
every other one refused with an error naming the kernel and both states."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.cluster_core.lifecycle import (
    DEAD,
    HIBERNATED,
    HIBERNATING,
    RECOVER,
    REPLACE,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    TRANSITIONS,
    IllegalTransition,
    LostReplicaLook,
    RestartBudget,
    after_replica_lost,
    restartable_in_place,
    transition,
)

STATES = (STARTING, RUNNING, STOPPING, STOPPED, DEAD, HIBERNATING, HIBERNATED)


@dataclass
class Kernel:
    kernel_id: str
    state: str


def test_a_kernel_lives_through_start_run_stop() -> None:
    kernel = Kernel("k", STARTING)
    for to in (RUNNING, STOPPING, STOPPED):
        transition(kernel, to)
    assert kernel.state == STOPPED


def test_an_idle_kernel_hibernates_and_resumes_through_a_start() -> None:
    kernel = Kernel("k", RUNNING)
    for to in (HIBERNATING, HIBERNATED, STARTING, RUNNING, HIBERNATING, HIBERNATED, STOPPED):
        transition(kernel, to)
    assert kernel.state == STOPPED


def test_a_failed_resume_keeps_the_kernel_hibernated() -> None:
    kernel = Kernel("k", HIBERNATED)
    transition(kernel, STARTING)
    transition(kernel, HIBERNATED)
    with pytest.raises(IllegalTransition, match="from hibernated to running"):
        transition(kernel, RUNNING)  # only through a start: its replicas must exist first


def test_a_dead_kernel_is_never_revived() -> None:
    kernel = Kernel("k", DEAD)
    with pytest.raises(IllegalTransition, match="kernel k cannot go from dead to running"):
        transition(kernel, RUNNING)
    assert kernel.state == DEAD


def test_a_stopped_kernel_cannot_be_declared_dead() -> None:
    with pytest.raises(IllegalTransition, match=r"from stopped to dead \(allowed: nothing \(final\)\)"):
        transition(Kernel("k", STOPPED), DEAD)


def test_a_running_kernel_cannot_go_back_to_starting() -> None:
    with pytest.raises(IllegalTransition, match=r"allowed: dead, hibernating, stopping"):
        transition(Kernel("k", RUNNING), STARTING)


def test_an_unknown_state_is_named() -> None:
    with pytest.raises(IllegalTransition, match="unknown state 'zombie'"):
        transition(Kernel("k", "zombie"), DEAD)


@given(st.sampled_from(STATES), st.sampled_from(STATES))
def test_the_table_decides_every_move(current: str, to: str) -> None:
    kernel = Kernel("k", current)
    if to in TRANSITIONS[current]:
        transition(kernel, to)
        assert kernel.state == to
    else:
        with pytest.raises(IllegalTransition):
            transition(kernel, to)
        assert kernel.state == current


@pytest.mark.parametrize(
    ("state", "live", "restarting", "verdict"),
    [
        (STOPPING, 0, False, STOPPED),
        (STOPPING, 1, False, None),
        (RUNNING, 1, False, DEAD),  # below the quorum of 2 (3 replicas)
        (RUNNING, 2, False, REPLACE),
        (RUNNING, 2, True, None),  # restarted in place: no replacement
        (STARTING, 0, False, None),  # the start itself fails
        (HIBERNATING, 0, False, None),  # its replicas stop on purpose: nothing to replace
    ],
)
def test_what_losing_a_replica_means_for_its_kernel(
    state: str, live: int, restarting: bool, verdict: str | None
) -> None:
    assert after_replica_lost(state, live, 2, restarting=restarting) == verdict


@pytest.mark.parametrize(
    ("live", "restartable", "verdict"),
    [
        (1, 1, RECOVER),  # one restart in place gives the quorum of 2 back
        (0, 2, RECOVER),
        (0, 1, DEAD),  # not enough to come back: dead, as before
        (1, 0, DEAD),  # the lost replica's host is gone, or its restarts are used up
    ],
)
def test_a_kernel_below_quorum_is_recovered_when_restarts_in_place_can_give_it_one(
    live: int, restartable: int, verdict: str
) -> None:
    assert after_replica_lost(RUNNING, live, 2, restarting=False, restartable=restartable) == verdict


def test_a_replica_gets_a_limited_number_of_restarts_in_place_per_window() -> None:
    budget = RestartBudget(limit=2, window_s=600.0)
    key = ("k", "r1")
    assert budget.allows(key, 0.0)
    budget.spend(key, 0.0)
    budget.spend(key, 10.0)
    assert not budget.allows(key, 20.0)  # a replica that keeps dying is not restarted forever
    assert budget.allows(("k", "r2"), 20.0)  # per replica
    assert budget.allows(key, 600.0)  # the first restart left the window
    budget.forget("k")
    assert budget.allows(key, 30.0)
    assert not RestartBudget(limit=0, window_s=600.0).allows(key, 0.0)


@pytest.mark.parametrize(
    ("look", "within_budget", "restartable"),
    [
        (LostReplicaLook(False, True, True, False, False), True, True),
        (LostReplicaLook(False, True, True, False, False), False, False),  # its budget is spent
        (LostReplicaLook(False, True, True, False, True), False, True),  # already coming back
        (LostReplicaLook(True, True, True, False, False), True, False),  # not lost
        (LostReplicaLook(False, False, True, False, False), True, False),  # never started: no storage
        (LostReplicaLook(False, True, False, False, False), True, False),  # its host is gone
        (LostReplicaLook(False, True, True, True, False), True, False),  # being replaced elsewhere
    ],
)
def test_which_lost_replicas_an_in_place_restart_can_bring_back(
    look: LostReplicaLook, within_budget: bool, restartable: bool
) -> None:
    assert restartable_in_place(look, within_budget=within_budget) is restartable
