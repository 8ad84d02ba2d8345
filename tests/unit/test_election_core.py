"""The replica's election core without I/O: inputs in, commands out (``ElectionCore``)."""

from __future__ import annotations

from typing import Any

from kernel_replica.election_core import (
    COMMITTED,
    SUPERSEDED,
    UNCOMMITTED,
    Answer,
    BindGpus,
    Command,
    ElectionCore,
    ElectionSettings,
    Execute,
    ExitDiverged,
    NotifyScheduler,
    Propose,
    RaftView,
    ReleaseGpus,
    Standby,
    TransferLeadership,
    Unavailable,
)
from kernel_replica.log_entries import Done, Lead, LogEntry, Progress, State, Vote, Votes, Yield

VOTERS = ("r1", "r2", "r3")


class Replica:
    """One core with its log fed by hand; ``leader`` is what its Raft view says."""

    def __init__(self, rid: str = "r1", settings: ElectionSettings | None = None, leader: str = "r1") -> None:
        self.leader = leader
        self.core = ElectionCore(
            rid, settings or ElectionSettings(), raft=lambda: RaftView(True, self.leader, VOTERS)
        )
        self.core.configure(VOTERS)
        self.core.started(last_index=0, voters=VOTERS, now=0.0)
        self.index = 0
        self.commands: list[Command] = []

    def take(self) -> list[Command]:
        self.commands += self.core.take_commands()
        taken, self.commands = self.commands, []
        return taken

    def commit(self, entry: LogEntry, now: float) -> None:
        self.index += 1
        self.core.apply(self.index, entry, now)

    def proposals(self, commands: list[Command]) -> list[Propose]:
        return [c for c in commands if isinstance(c, Propose)]

    def lead_and_bind(self, device_ids: list[int], now: float) -> tuple[int, Propose]:
        """Designated for cell "m": propose LEAD and get ``device_ids`` bound (the LEAD not yet
        committed). The request and the LEAD's proposal."""
        request = self.core.decide("m", lead=True, now=now)
        commands = self.take()
        [lead] = self.proposals(commands)
        [bind] = [c for c in commands if isinstance(c, BindGpus)]
        self.core.bind_settled(bind.token, device_ids, now=now + 0.001)
        return request, lead

    def answers(self, commands: list[Command], request: int) -> list[Any]:
        return [c.value for c in commands if isinstance(c, Answer) and c.request == request]


def test_a_candidate_is_told_to_execute_only_once_its_own_lead_is_the_committed_winner() -> None:
    r = Replica("r1")
    request = r.core.decide("m", lead=True, now=0.0)
    commands = r.take()
    [lead] = r.proposals(commands)
    [bind] = [c for c in commands if isinstance(c, BindGpus)]
    assert lead.entry == Lead("m", "r1")
    r.core.bind_settled(bind.token, [0], now=0.001)  # GPUs bound before the LEAD commits...
    r.core.proposal_settled(lead.token, 1, now=0.002)  # ...and even "applied" without the entry
    assert r.answers(r.take(), request) == []
    r.commit(Lead("m", "r1"), now=0.003)
    r.core.proposal_settled(lead.token, 1, now=0.003)
    [decision] = r.answers(r.take(), request)
    assert isinstance(decision, Execute) and decision.device_ids == [0]


def test_a_lead_that_loses_to_an_earlier_one_gives_its_gpus_back() -> None:
    r = Replica("r1")
    request = r.core.decide("m", lead=True, now=0.0)
    commands = r.take()
    [lead] = r.proposals(commands)
    [bind] = [c for c in commands if isinstance(c, BindGpus)]
    r.commit(Lead("m", "r2"), now=0.001)
    r.commit(Lead("m", "r1"), now=0.002)
    r.core.proposal_settled(lead.token, 2, now=0.002)
    assert r.answers(r.take(), request) == [Standby("r2")]
    r.core.bind_settled(bind.token, [0], now=0.003)  # bound after it lost: released at once
    assert ReleaseGpus("m") in r.take()


def test_a_replica_told_to_yield_gives_the_candidate_its_grace_before_appending_a_yield() -> None:
    r = Replica("r2", ElectionSettings(yield_grace_s=0.05))
    request = r.core.decide("m", lead=False, now=0.0)
    assert r.proposals(r.take()) == []
    r.core.tick(0.049)
    assert r.proposals(r.take()) == []
    r.core.tick(0.05)
    [yielded] = r.proposals(r.take())
    assert yielded.entry == Yield("m", "r2", "r2")
    r.commit(yielded.entry, now=0.06)
    r.core.proposal_settled(yielded.token, 1, now=0.06)
    r.commit(Lead("m", "r1"), now=0.07)
    assert r.answers(r.take(), request) == [Standby("r1")]


def _stand_in_for_hung_r1(r: Replica) -> tuple[int, Propose]:
    """r2, told that the designated candidate r1 is hung, yields, sees r3 yield, binds GPU 3 and
    proposes its own LEAD: the request and that proposal."""
    request = r.core.decide("m", lead=False, silent="r1", now=0.0)
    [own] = r.proposals(r.take())
    r.commit(own.entry, now=0.01)
    r.core.proposal_settled(own.token, 1, now=0.01)
    assert r.proposals(r.take()) == []  # r3 has not answered yet
    r.commit(Yield("m", "r3", "r3"), now=0.02)  # only the hung candidate r1 is silent now
    [bind] = [c for c in r.take() if isinstance(c, BindGpus)]
    r.core.bind_settled(bind.token, [3], now=0.03)
    [stand_in] = r.proposals(r.take())
    assert stand_in.entry == Lead("m", "r2")
    return request, stand_in


def test_a_hung_candidate_is_replaced_by_the_first_answering_voter_leading_in_its_place() -> None:
    r = Replica("r2", ElectionSettings(yield_grace_s=0.0))
    request, stand_in = _stand_in_for_hung_r1(r)
    r.commit(stand_in.entry, now=0.04)
    r.core.proposal_settled(stand_in.token, 3, now=0.04)
    [decision] = r.answers(r.take(), request)
    assert isinstance(decision, Execute) and decision.device_ids == [3]


def _announced(commands: list[Command]) -> list[NotifyScheduler]:
    return [c for c in commands if isinstance(c, NotifyScheduler) and c.event == "elected"]


def test_a_candidate_announces_itself_elected_only_once_its_lead_won_and_its_gpus_are_bound() -> None:
    r = Replica("r1")
    _, lead = r.lead_and_bind([2], now=0.0)
    assert _announced(r.take()) == []  # bound, not yet won
    r.commit(Lead("m", "r1"), now=0.002)
    r.core.proposal_settled(lead.token, 1, now=0.002)
    assert _announced(r.take()) == [NotifyScheduler("elected", "m", (2,))]


def test_a_stand_in_whose_lead_loses_to_the_silent_candidates_never_announces_itself_elected() -> None:
    # The scheduler shows the client the output of the first replica to announce itself: a
    # stand-in that announced at binding and then lost left the client an ok without its output.
    r = Replica("r2", ElectionSettings(yield_grace_s=0.0))
    request, stand_in = _stand_in_for_hung_r1(r)
    r.commit(Lead("m", "r1"), now=0.04)  # the candidate woke up and its LEAD committed first
    r.commit(stand_in.entry, now=0.05)
    r.core.proposal_settled(stand_in.token, 4, now=0.05)
    commands = r.take()
    assert r.answers(commands, request) == [Standby("r1")]
    assert _announced(commands) == [] and ReleaseGpus("m") in commands


def test_a_standby_watch_ends_on_a_done_applied_in_the_same_batch_as_its_lead() -> None:
    # one Raft Ready often carries a short cell's LEAD and DONE together: the watch must not miss
    # that DONE, take the executor for dead after the silence and commit a stray ExecutorLost
    r = Replica("r2", ElectionSettings(executor_silence_s=1.0, propose_votes=False), leader="r1")
    r.commit(Lead("m", "r1"), now=0.0)
    r.commit(Done("m", "r1", {"status": "ok"}, 1, False), now=0.0)
    for now in (0.5, 1.0, 1.5, 2.0, 2.5):
        r.core.tick(now)
    assert r.proposals(r.take()) == [] and r.core.next_deadline() is None


def test_an_executors_done_not_yet_committed_is_never_answered_ok_and_is_proposed_again() -> None:
    r = Replica("r1")
    done = Done("m", "r1", {"status": "ok"}, 1, True)
    r.core.decide("m", lead=True, now=0.0)  # its own cell: this process proposed the LEAD
    r.take()
    r.commit(Lead("m", "r1"), now=0.0)
    r.core.finish_cell(done, State("m", "r1"), now=0.1)
    done_token, state_token = (p.token for p in r.proposals(r.take()))  # DONE, then STATE
    r.core.proposal_settled(done_token, TimeoutError("no quorum"), now=5.1)
    r.core.proposal_settled(state_token, TimeoutError("no quorum"), now=5.1)
    content, verdict = r.core.committed_answer("m", done.content, 1)
    assert verdict == UNCOMMITTED and content["ename"] == "ReplicationFailed"
    r.core.tick(5.6)
    [again] = r.proposals(r.take())
    assert again.entry == done
    r.commit(done, now=5.7)
    assert r.core.committed_answer("m", done.content, 1) == (done.content, COMMITTED)


def test_a_replica_whose_cell_the_log_overruled_leaves_and_runs_nothing_else() -> None:
    r = Replica("r1")
    done = Done("m", "r1", {"status": "ok"}, 1, True)
    r.core.decide("m", lead=True, now=0.0)  # its own cell: this process proposed the LEAD
    r.take()
    r.commit(Lead("m", "r1"), now=0.0)
    r.core.finish_cell(done, State("m", "r1"), now=1.0)
    done_token, state_token = (p.token for p in r.proposals(r.take()))  # DONE, then STATE
    lost = Done("m", "r2", {"status": "error", "ename": "ExecutorLost"}, 1, False)
    r.commit(lost, now=1.1)  # the standbys declared it dead while it was paused
    r.commit(done, now=1.2)
    r.core.proposal_settled(done_token, 3, now=1.2)
    r.commit(State("m", "r1"), now=1.3)
    r.core.proposal_settled(state_token, 4, now=1.3)
    commands = r.take()
    assert ExitDiverged("m") in commands and NotifyScheduler("leaving", "m") in commands
    assert r.core.committed_answer("m", done.content, 1) == (lost.content, SUPERSEDED)
    request = r.core.decide("n", lead=True, now=1.4)
    commands = r.take()
    [decision] = r.answers(commands, request)
    # nothing proposed or bound for it here: the scheduler may send it to another replica
    assert isinstance(decision, Unavailable) and "leaving" in decision.reason and decision.declined
    assert not [c for c in commands if isinstance(c, Propose | BindGpus)]


def test_the_leader_hands_leadership_to_a_replica_that_ran_three_cells_in_a_row() -> None:
    r = Replica("r1", ElectionSettings(leader_follows_executor=3, propose_votes=False), leader="r1")
    for n in range(3):
        r.commit(Lead(f"m{n}", "r2"), now=n)
        r.commit(Done(f"m{n}", "r2", {"status": "ok"}, n + 1, False), now=n)
    assert [c for c in r.take() if isinstance(c, TransferLeadership)] == [TransferLeadership("r2")]


def test_votes_wait_for_the_replicas_next_proposal_and_ride_with_it() -> None:
    r = Replica("r3", ElectionSettings(vote_flush_s=0.5), leader="r1")
    r.commit(Lead("a", "r1"), now=0.0)
    r.commit(Lead("b", "r2"), now=0.1)
    assert r.proposals(r.take()) == []
    r.core.decide("c", lead=True, now=0.2)
    entries = [p.entry for p in r.proposals(r.take())]
    assert entries == [Votes("r3", (("a", "r1"), ("b", "r2"))), Lead("c", "r3")]
    r.commit(Lead("d", "r1"), now=0.3)
    r.core.tick(0.8)  # nothing else to ride with: flushed after vote_flush_s
    assert [p.entry for p in r.proposals(r.take())] == [Vote("d", "r3", "r1")]


def test_a_restarted_replica_ends_a_cell_its_previous_process_won_and_never_finished() -> None:
    core = ElectionCore("r1", ElectionSettings(), raft=lambda: RaftView(True, "r2", VOTERS))
    core.configure(VOTERS)
    core.started(last_index=1, voters=VOTERS, now=0.0)  # its disk holds one entry, replayed next
    core.apply(1, Lead("m", "r1"), now=0.0)  # its previous process won m, then died
    core.tick(0.5)
    [lost] = [c.entry for c in core.take_commands() if isinstance(c, Propose) and isinstance(c.entry, Done)]
    assert lost.msg_id == "m" and lost.content["ename"] == "ExecutorLost"


def test_a_lead_that_wins_after_its_replica_answered_unavailable_gets_a_done_from_that_replica() -> None:
    """Seed 94089288 of election_torture: a partitioned candidate timed out on its LEAD and
    answered ReplicaUnavailable; the LEAD committed anyway, and with the standbys' watches gone
    (restarts; a later cell's DONE ends them) the won cell never got a DONE."""
    r = Replica("r1")
    request = r.core.decide("m", lead=True, now=0.0)
    commands = r.take()
    [lead] = r.proposals(commands)
    [bind] = [c for c in commands if isinstance(c, BindGpus)]
    r.core.bind_settled(bind.token, [0], now=0.001)
    r.core.proposal_settled(lead.token, TimeoutError("no quorum"), now=5.0)
    [answer] = r.answers(r.take(), request)
    assert isinstance(answer, Unavailable) and "could not commit the election" in answer.reason
    r.commit(Lead("m", "r1"), now=12.0)  # the partition heals: the LEAD had reached the leader
    [done] = [p.entry for p in r.proposals(r.take()) if isinstance(p.entry, Done)]
    assert done.msg_id == "m" and done.replica_id == "r1" and not done.state_follows
    assert done.content["ename"] == "ReplicaUnavailable"  # what the client was told; it never ran
    r.commit(done, now=12.1)
    assert r.core.book.done("m") == done


def test_a_lead_that_loses_after_its_replica_answered_unavailable_is_left_to_the_winner() -> None:
    r = Replica("r1")
    r.core.decide("m", lead=True, now=0.0)
    [lead] = r.proposals(r.take())
    r.core.proposal_settled(lead.token, TimeoutError("no quorum"), now=5.0)
    r.take()
    r.commit(Lead("m", "r2"), now=6.0)  # another candidate won: its DONE is its own business
    assert [p for p in r.proposals(r.take()) if isinstance(p.entry, Done)] == []


def test_a_retry_deciding_the_cell_when_the_given_up_lead_wins_runs_it_instead() -> None:
    r = Replica("r1")
    _, lead = r.lead_and_bind([0], now=0.0)
    r.core.proposal_settled(lead.token, TimeoutError("no quorum"), now=5.0)
    r.take()
    retry = r.core.decide("m", lead=True, now=6.0)  # the scheduler sends the cell again
    second = r.take()
    [again] = r.proposals(second)
    [bind] = [c for c in second if isinstance(c, BindGpus)]
    r.core.bind_settled(bind.token, [1], now=6.001)
    r.commit(Lead("m", "r1"), now=6.5)  # the first LEAD wins while the retry waits
    r.core.proposal_settled(again.token, 2, now=6.5)
    commands = r.take()
    assert [p for p in r.proposals(commands) if isinstance(p.entry, Done)] == []  # no "never ran" DONE
    [decision] = r.answers(commands, retry)
    assert isinstance(decision, Execute)


def _watch_silent_executor(r: Replica, *, vouch: bool, until: float) -> tuple[list[float], float | None, str]:
    """Ticks a standby watching r1 run "m" (LEAD committed at 0, no beat since); each time it asks
    after the executor the scheduler answers 50 ms later that r1's process runs (``vouch``), or
    never. When it asked, when it proposed ExecutorLost, and why."""
    r.commit(Lead("m", "r1"), now=0.0)
    asked: list[float] = []
    lost_at, reason = None, ""
    now = 0.0
    while now < until and lost_at is None:
        now = round(now + 0.05, 2)
        if vouch and asked and round(asked[-1] + 0.05, 2) == now:
            assert r.core.executor_busy("r1", now) == ["m"]
        r.core.tick(now)
        for command in r.take():
            if command == NotifyScheduler("executor_quiet", "m", executor="r1"):
                asked.append(now)
            elif isinstance(command, Propose) and isinstance(command.entry, Done):
                lost_at, reason = now, command.entry.content["evalue"]
    return asked, lost_at, reason


def test_a_silent_executor_nobody_vouches_for_is_asked_after_once_then_given_up() -> None:
    r = Replica("r2", ElectionSettings(executor_silence_s=1.0, propose_votes=False), leader="r1")
    asked, lost_at, reason = _watch_silent_executor(r, vouch=False, until=5.0)
    assert len(asked) == 1 and 0.5 < asked[0] <= 1.0
    assert lost_at is not None and 1.0 < lost_at <= 1.6
    assert "did not say that its process runs" in reason


def test_an_executor_whose_host_says_it_runs_is_waited_for_up_to_the_cap() -> None:
    """User code holding the GIL silences every thread of the executor: its host's word that the
    process runs counts as a beat, but only for ``executor_busy_max_s`` after the last real one."""
    settings = ElectionSettings(executor_silence_s=1.0, executor_busy_max_s=3.0, propose_votes=False)
    r = Replica("r2", settings, leader="r1")
    asked, lost_at, reason = _watch_silent_executor(r, vouch=True, until=10.0)
    assert len(asked) >= 3
    assert lost_at is not None and 3.0 < lost_at <= 4.6
    assert "although its host said its process ran" in reason


def test_a_beat_after_a_vouch_starts_a_new_silence() -> None:
    r = Replica("r2", ElectionSettings(executor_silence_s=1.0, propose_votes=False), leader="r1")
    r.commit(Lead("m", "r1"), now=0.0)
    r.core.tick(0.6)
    assert NotifyScheduler("executor_quiet", "m", executor="r1") in r.take()
    r.core.executor_busy("r1", 0.65)
    r.commit(Progress("m", "r1"), now=0.9)  # the C call returned: the executor beats again
    for now in (1.1, 1.3):
        r.core.tick(now)
    assert not [c for c in r.take() if isinstance(c, NotifyScheduler | Propose)]
    r.core.tick(1.6)  # silent 0.7 s since the beat: asked again
    assert NotifyScheduler("executor_quiet", "m", executor="r1") in r.take()


def test_a_lead_of_its_own_that_this_process_never_proposed_gets_executor_lost_at_once() -> None:
    """Its previous process proposed it and is gone (restarted in place): nothing here runs the
    cell, and its host would vouch for this process, so the standbys would wait for ever."""
    r = Replica("r1", ElectionSettings(propose_votes=False))
    r.commit(Lead("m", "r1"), now=0.0)
    r.core.tick(0.5)
    [lost] = [p.entry for p in r.proposals(r.take()) if isinstance(p.entry, Done)]
    assert lost.msg_id == "m" and lost.content["ename"] == "ExecutorLost"
