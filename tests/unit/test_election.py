"""The executor election book: first committed LEAD wins, all-YIELD fails, DONE at most once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_replica.election import (
    CellDone,
    ElectionBook,
    ElectionDecided,
    ElectionFailed,
    EntryIgnored,
    ExecutorLost,
    StateAccepted,
)
from kernel_replica.log_entries import Done, Lead, LogEntry, State, Vote, Votes, Yield

VOTERS = ("r1", "r2", "r3")


def feed(book: ElectionBook, entries: list[LogEntry]) -> list[object]:
    events: list[object] = []
    for entry in entries:
        events += book.apply(entry)
    return events


def test_first_committed_lead_wins_and_later_leads_are_ignored() -> None:
    book = ElectionBook(VOTERS)
    events = feed(book, [Yield("m", "r1", "r1"), Lead("m", "r2"), Lead("m", "r3")])
    assert events[0] == ElectionDecided("m", "r2")
    assert isinstance(events[1], EntryIgnored)
    outcome = book.outcome("m")
    assert outcome is not None and outcome.winner == "r2" and not outcome.failed


def test_batched_votes_count_like_single_ones_and_flag_a_disagreeing_vote() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m1", "r1"), Lead("m2", "r2")])
    events = book.apply(Votes("r3", (("m1", "r1"), ("m2", "r1"))))
    assert len(events) == 1 and isinstance(events[0], EntryIgnored)  # m2 was won by r2
    assert events[0].entry == Vote("m2", "r3", "r1")


def test_all_voters_yield_fails_the_election() -> None:
    book = ElectionBook(VOTERS)
    events = feed(book, [Yield("m", r, r) for r in VOTERS])
    assert events == [ElectionFailed("m")]
    assert book.outcome("m") is not None and book.outcome("m").failed  # type: ignore[union-attr]
    # a LEAD after the failure changes nothing: every replica already answered with an error
    assert isinstance(book.apply(Lead("m", "r1"))[0], EntryIgnored)


def test_proxy_yield_for_a_silent_voter_ends_the_election() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Yield("m", "r1", "r1"), Yield("m", "r2", "r2")])
    assert book.silent_voters("m") == {"r3"}
    assert book.apply(Yield("m", "r3", "r1")) == [ElectionFailed("m")]


def test_lead_from_non_voter_cannot_win() -> None:
    book = ElectionBook(VOTERS)
    assert isinstance(book.apply(Lead("m", "r9"))[0], EntryIgnored)
    assert book.outcome("m") is None
    assert book.apply(Lead("m", "r1")) == [ElectionDecided("m", "r1")]


def test_removing_a_silent_voter_fails_an_open_all_yield_election() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Yield("m", "r1", "r1"), Yield("m", "r2", "r2")])
    assert book.set_voters(["r1", "r2"]) == [ElectionFailed("m")]


def test_removing_the_executor_before_done_reports_it_lost() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r1"), Lead("n", "r1"), Done("n", "r1", {"status": "ok"}, 1)])
    assert book.set_voters(["r2", "r3"]) == [ExecutorLost("m", "r1")]


def test_done_is_recorded_once_and_state_must_match_latest_done() -> None:
    book = ElectionBook(VOTERS)
    first = Done("m", "r1", {"status": "ok", "execution_count": 1}, 2)
    events = feed(book, [Lead("m", "r1"), Vote("m", "r2", "r1"), first])
    assert events[-1] == CellDone(first)
    assert isinstance(book.apply(Done("m", "r2", {"status": "ok"}, 9))[0], EntryIgnored)
    assert book.done("m") == first
    assert book.awaiting_state() == "m"
    state = State("m", "r1", {"x": b"1"}, b"blob")
    assert book.apply(state) == [StateAccepted(state)]
    assert book.awaiting_state() is None
    # a STATE for an older cell after a newer DONE is stale and must not overwrite anything
    feed(book, [Lead("n", "r2"), Done("n", "r2", {"status": "ok"}, 3)])
    assert isinstance(book.apply(State("m", "r1", {"x": b"0"}, b"old"))[0], EntryIgnored)


def test_done_without_state_does_not_block_the_next_cell() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r1"), Done("m", "r1", {"status": "error"}, 1, state_follows=False)])
    assert book.awaiting_state() is None


def test_the_cells_a_replica_won_without_done_are_what_dies_with_it() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r1"), Done("m", "r1", {"status": "ok"}, 1), Lead("n", "r1"), Lead("o", "r2")])
    assert book.running_on("r1") == ["n"]
    assert book.running_on("r2") == ["o"]
    assert book.running_on("r3") == []


def test_a_lead_proposed_for_a_dead_executor_wins_so_its_cell_is_not_run_again() -> None:
    # a survivor proposes the dead replica's LEAD (it had started the cell) before its own
    book = ElectionBook(VOTERS)
    events = feed(book, [Lead("m", "r1"), Lead("m", "r2")])
    assert events[0] == ElectionDecided("m", "r1") and isinstance(events[1], EntryIgnored)
    assert book.running_on("r1") == ["m"]


def test_a_cell_decided_before_the_previous_done_waits_for_it() -> None:
    # the executor of "m" replies before its DONE commits, so "n"'s LEAD can commit first
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r1"), Lead("n", "r2")])
    assert book.unfinished_before("n") == ["m"]
    assert book.unfinished_before("m") == []
    feed(book, [Done("m", "r1", {"status": "ok"}, 1)])
    assert book.unfinished_before("n") == [] and book.awaiting_state() == "m"
    # a removed executor never finishes: nobody waits for it
    feed(book, [Lead("o", "r3"), Lead("p", "r1")])
    book.set_voters(["r1", "r2"])
    assert book.unfinished_before("p") == ["n"]
    # a later DONE settles every earlier cell, and the book survives a snapshot
    feed(book, [Done("o", "r3", {"status": "ok"}, 2)])
    restored = ElectionBook.from_snapshot(book.to_snapshot())
    assert restored.unfinished_before("p") == book.unfinished_before("p") == []


def test_a_done_carrying_its_lead_decides_the_election_and_finishes_the_cell() -> None:
    book = ElectionBook(VOTERS)
    events = book.apply(Done("m", "r1", {"status": "ok"}, 1, claims_lead=True))
    assert events[0] == ElectionDecided("m", "r1") and isinstance(events[1], CellDone)
    assert book.awaiting_state() == "m" and book.unfinished_before("n") == []
    assert book.apply(State("m", "r1")) == [StateAccepted(State("m", "r1"))]
    assert isinstance(book.apply(Lead("m", "r1"))[0], EntryIgnored)  # its own LEAD, proposed late


def test_a_done_carrying_a_lead_that_lost_is_ignored_with_its_state() -> None:
    # r1 ran the cell before proposing its LEAD, but r2 took the cell over and its LEAD came first
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r2")])
    ignored = book.apply(Done("m", "r1", {"status": "ok"}, 1, claims_lead=True))
    assert len(ignored) == 1 and isinstance(ignored[0], EntryIgnored) and "r2" in ignored[0].reason
    assert book.done("m") is None and book.unfinished_before("n") == ["m"]
    assert isinstance(book.apply(State("m", "r1"))[0], EntryIgnored)
    assert isinstance(book.apply(Done("m", "r2", {"status": "ok"}, 1))[0], CellDone)


def test_a_done_carrying_a_lead_from_a_non_voter_is_ignored() -> None:
    book = ElectionBook(VOTERS)
    assert isinstance(book.apply(Done("m", "r9", {"status": "ok"}, 1, claims_lead=True))[0], EntryIgnored)
    assert book.done("m") is None and book.outcome("m") is None


def test_a_done_carrying_a_lead_already_committed_counts_once() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r1")])
    assert book.apply(Done("m", "r1", {"status": "ok"}, 1, claims_lead=True)) == [
        CellDone(Done("m", "r1", {"status": "ok"}, 1))
    ]


def test_the_winners_done_is_its_vote_and_a_stand_ins_is_not() -> None:
    book = ElectionBook(VOTERS)
    feed(book, [Lead("m", "r1"), Vote("m", "r2", "r1"), Done("m", "r1", {"status": "ok"}, 1)])
    feed(book, [Lead("n", "r2"), Done("n", "r3", {"status": "error", "ename": "ExecutorLost"}, 1, False)])
    elections = book.to_snapshot()["elections"]
    assert elections["m"]["votes"] == {"r2": "r1", "r1": "r1"}
    assert elections["n"]["votes"] == {}


def test_the_book_forgets_the_oldest_cells_beyond_its_bound_and_snapshots_stay_small() -> None:
    book = ElectionBook(VOTERS, keep=8)
    for i in range(20):
        feed(book, [Lead(f"m{i}", "r1"), Done(f"m{i}", "r1", {"status": "ok"}, i + 1)])
    assert book.done("m11") is None and book.outcome("m11") is None  # forgotten
    assert book.done("m12") is not None and book.outcome("m19") is not None
    snapshot = book.to_snapshot()
    assert len(snapshot["elections"]) == len(snapshot["done"]) == 8
    assert book.last_done() == Done("m19", "r1", {"status": "ok"}, 20)
    # a book restored with a smaller bound keeps only the newest
    small = ElectionBook.from_snapshot(snapshot, keep=3)
    assert [m for m in ("m16", "m17", "m18", "m19") if small.done(m)] == ["m17", "m18", "m19"]


# ---- properties ----------------------------------------------------------------------------------

replica_ids = st.sampled_from(["r1", "r2", "r3", "r4"])
msg_ids = st.sampled_from(["a", "b", "c"])
entries = st.one_of(
    st.builds(Lead, msg_ids, replica_ids),
    st.builds(lambda m, r, p: Yield(m, r, p), msg_ids, replica_ids, replica_ids),
    st.builds(Vote, msg_ids, replica_ids, replica_ids),
    st.builds(
        lambda m, r, n, lead: Done(m, r, {"status": "ok", "execution_count": n}, n + 1, claims_lead=lead),
        msg_ids,
        replica_ids,
        st.integers(0, 9),
        st.booleans(),
    ),
    st.builds(lambda m, r: State(m, r, {"x": m.encode()}, m.encode()), msg_ids, replica_ids),
)


def decisions(book: ElectionBook) -> dict[str, object]:
    return {m: (book.outcome(m), book.done(m)) for m in ("a", "b", "c")} | {"state": book.awaiting_state()}


@settings(max_examples=300, deadline=None)
@given(st.lists(entries, max_size=40), st.integers(0, 40))
def test_every_replica_feeding_the_same_log_decides_the_same(log: list[LogEntry], cut: int) -> None:
    # Replica A applies the whole log; replica B restarts at `cut` from a snapshot (the way a
    # restarted or joining replica catches up) and applies the rest.
    a = ElectionBook(VOTERS, keep=2)  # small: forgetting must be the same everywhere too
    feed(a, log)
    b = ElectionBook(VOTERS, keep=2)
    feed(b, log[:cut])
    b = ElectionBook.from_snapshot(b.to_snapshot(), keep=2)
    feed(b, log[cut:])
    assert decisions(a) == decisions(b)
    assert a.last_done() == b.last_done()


@settings(max_examples=300, deadline=None)
@given(st.lists(entries, max_size=40))
def test_winner_is_the_first_voter_lead_before_all_voters_yield_and_a_losing_done_never_counts(
    log: list[LogEntry],
) -> None:
    book = ElectionBook(VOTERS)
    feed(book, log)
    for m in ("a", "b", "c"):
        yielded: set[str] = set()
        expected: str | None = None
        decided = done = False
        for entry in log:
            if entry.msg_id != m:
                continue
            if isinstance(entry, Done) and not done:
                # a DONE carrying its LEAD is that LEAD first, and counts only if that LEAD won
                if entry.claims_lead and not decided and entry.replica_id in VOTERS:
                    expected, decided = entry.replica_id, True
                done = not entry.claims_lead or (decided and expected == entry.replica_id)
            if decided:
                continue
            if isinstance(entry, Lead) and entry.replica_id in VOTERS:
                expected, decided = entry.replica_id, True
            elif isinstance(entry, Yield):
                yielded.add(entry.replica_id)
                decided = set(VOTERS) <= yielded
        outcome = book.outcome(m)
        if not decided:
            assert outcome is None
        else:
            assert outcome is not None and outcome.winner == expected
        assert (book.done(m) is not None) == done
