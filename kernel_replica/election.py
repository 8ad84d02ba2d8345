"""The executor election of NotebookOS §3.2.2 as a pure book: committed entries in, decisions out.

Every replica feeds the same committed log entries in the same order, so every replica reaches the
same decisions without talking about them: for each cell (msg_id) the first committed LEAD from a
current voter wins; if every current voter has YIELDed before any LEAD, the election failed; later
LEAD/YIELD entries for a decided msg_id change nothing. DONE records the reply every replica sends
(the first DONE per msg_id counts, which is what makes a retried msg_id run at most once); a DONE
that carries its executor's LEAD (a cell that ended before its LEAD was proposed) is that LEAD
followed by that DONE, and nothing at all if the LEAD does not win. STATE is
accepted only for the latest DONE, so a namespace update that arrives too late can never overwrite
a newer cell's state (the replica that executed meanwhile gave up waiting for it).

No I/O, no clock, no threads: the Raft thread owns one instance and serialises access to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from kernel_replica.log_entries import Done, Lead, LogEntry, Progress, State, Vote, Votes, Yield


@dataclass(frozen=True, slots=True)
class ElectionDecided:
    msg_id: str
    winner: str


@dataclass(frozen=True, slots=True)
class ElectionFailed:
    msg_id: str


@dataclass(frozen=True, slots=True)
class ExecutorLost:
    """The winner of msg_id left the voters before its DONE committed: it will never finish."""

    msg_id: str
    executor: str


@dataclass(frozen=True, slots=True)
class CellDone:
    done: Done


@dataclass(frozen=True, slots=True)
class StateAccepted:
    state: State


@dataclass(frozen=True, slots=True)
class EntryIgnored:
    """An entry that changes nothing; ``reason`` is for the log (late LEAD, duplicate DONE, ...)."""

    entry: LogEntry
    reason: str


BookEvent = ElectionDecided | ElectionFailed | ExecutorLost | CellDone | StateAccepted | EntryIgnored


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished election: ``winner`` is None exactly when it failed."""

    winner: str | None

    @property
    def failed(self) -> bool:
        return self.winner is None


@dataclass(slots=True)
class _Election:
    leads: list[str] = field(default_factory=list)  # LEADs seen (first one from a voter wins)
    yielded: set[str] = field(default_factory=set)
    votes: dict[str, str] = field(default_factory=dict)
    outcome: Outcome | None = None


# Elections and DONEs remembered: the oldest beyond this are forgotten (in log order, so every
# replica forgets the same ones). Only a request retried after this many newer cells could run
# twice; without a bound the book, and every snapshot of it, grew with each cell ever run.
DECIDED_KEPT = 4096


class ElectionBook:
    """Decisions for the latest msg_ids seen in the log (``DECIDED_KEPT``), plus the voters they
    are counted against."""

    def __init__(self, voters: Iterable[str] = (), *, keep: int = DECIDED_KEPT) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._keep = keep
        self._voters: frozenset[str] = frozenset(voters)
        self._elections: dict[str, _Election] = {}
        self._done: dict[str, Done] = {}
        self._awaiting_state: str | None = None
        # msg_id -> winner of cells decided with a winner and no DONE yet, in decision order. A DONE
        # also drops every cell decided before it (a later cell finished: the earlier ones are moot).
        self._running: dict[str, str] = {}

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def voters(self) -> frozenset[str]:
        return self._voters

    def outcome(self, msg_id: str) -> Outcome | None:
        """The decided outcome, or None while the election is open (or never started)."""
        election = self._elections.get(msg_id)
        return election.outcome if election is not None else None

    def done(self, msg_id: str) -> Done | None:
        return self._done.get(msg_id)

    def last_done(self) -> Done | None:
        """The most recent DONE in log order (its execution count is the kernel's)."""
        return next(reversed(self._done.values()), None)

    def awaiting_state(self) -> str | None:
        """msg_id of the latest DONE whose STATE has not committed yet (None: state is current)."""
        return self._awaiting_state

    def unfinished_before(self, msg_id: str) -> list[str]:
        """Cells decided before ``msg_id`` whose executor (still a voter) has not committed DONE:
        the executor of ``msg_id`` must not run before their DONE and STATE are applied (the
        executor of the previous cell replies before its DONE commits)."""
        out: list[str] = []
        for other, winner in self._running.items():
            if other == msg_id:
                break
            if winner in self._voters:
                out.append(other)
        return out

    def running(self) -> dict[str, str]:
        """msg_id -> winner of every cell decided with a winner and no DONE yet, in log order."""
        return dict(self._running)

    def running_on(self, replica_id: str) -> list[str]:
        """Cells ``replica_id`` won whose DONE has not committed (what dies with its process)."""
        return [msg_id for msg_id, winner in self._running.items() if winner == replica_id]

    def silent_voters(self, msg_id: str) -> frozenset[str]:
        """Voters that have neither LEADed nor YIELDed for msg_id (who an open election waits on)."""
        election = self._elections.get(msg_id)
        if election is None:
            return self._voters
        return self._voters - election.yielded - set(election.leads)

    # ---- updates ---------------------------------------------------------------------------------
    def set_voters(self, voters: Iterable[str]) -> list[BookEvent]:
        """A membership change committed: open elections may now have failed (a voter left), and
        a running cell whose executor was removed will never see its DONE."""
        self._voters = frozenset(voters)
        events: list[BookEvent] = []
        for msg_id, election in self._elections.items():
            if election.outcome is None and self._all_yielded(election):
                election.outcome = Outcome(None)
                events.append(ElectionFailed(msg_id))
            elif (
                election.outcome is not None
                and election.outcome.winner is not None
                and election.outcome.winner not in self._voters
                and msg_id not in self._done
            ):
                events.append(ExecutorLost(msg_id, election.outcome.winner))
        return events

    def apply(self, entry: LogEntry) -> list[BookEvent]:
        """Feed one committed entry (in log order); returns what it decided."""
        match entry:
            case Lead():
                return self._on_lead(entry)
            case Yield():
                return self._on_yield(entry)
            case Vote():
                election = self._election(entry.msg_id)
                election.votes[entry.replica_id] = entry.winner
                if election.outcome is not None and election.outcome.winner != entry.winner:
                    return [
                        EntryIgnored(entry, f"vote disagrees with decided winner {election.outcome.winner}")
                    ]
                return []
            case Votes():
                return [event for vote in entry.each() for event in self.apply(vote)]
            case Done():
                return self._on_done(entry)
            case Progress():
                return []  # liveness only; the replica's shell times it, the book has no clock
            case State(repair=True):
                # a value stored after its cell (durability.py): belongs to no cell's election,
                # and the namespace takes only the names its executor still holds unprotected
                return [StateAccepted(entry)]
            case State():
                if entry.msg_id != self._awaiting_state:
                    return [EntryIgnored(entry, f"stale state (awaiting {self._awaiting_state!r})")]
                self._awaiting_state = None
                return [StateAccepted(entry)]
        raise TypeError(f"not a log entry: {type(entry).__name__}")

    def _on_lead(self, entry: Lead) -> list[BookEvent]:
        election = self._election(entry.msg_id)
        election.leads.append(entry.replica_id)
        if election.outcome is not None:
            return [EntryIgnored(entry, "election already decided")]
        if entry.replica_id not in self._voters:
            return [EntryIgnored(entry, "LEAD from a non-voter")]
        election.outcome = Outcome(entry.replica_id)
        if entry.msg_id not in self._done:
            self._running[entry.msg_id] = entry.replica_id
        return [ElectionDecided(entry.msg_id, entry.replica_id)]

    def _on_yield(self, entry: Yield) -> list[BookEvent]:
        election = self._election(entry.msg_id)
        if election.outcome is not None:
            return [EntryIgnored(entry, "election already decided")]
        election.yielded.add(entry.replica_id)
        if self._all_yielded(election):
            election.outcome = Outcome(None)
            return [ElectionFailed(entry.msg_id)]
        return []

    def _on_done(self, entry: Done) -> list[BookEvent]:
        if entry.msg_id in self._done:
            return [EntryIgnored(entry, "duplicate DONE")]
        decided: list[BookEvent] = []
        if entry.claims_lead:  # its LEAD first, as if committed just before it
            decided = self._on_lead(Lead(entry.msg_id, entry.replica_id))
            outcome = self._elections[entry.msg_id].outcome
            if outcome is None:
                return [EntryIgnored(entry, "DONE carrying a LEAD from a non-voter")]
            if outcome.winner != entry.replica_id:
                lost = "had failed" if outcome.failed else f"was won by {outcome.winner}"
                return [EntryIgnored(entry, f"DONE carrying a LEAD for an election that {lost}")]
            decided = [e for e in decided if isinstance(e, ElectionDecided)]
            entry = replace(entry, claims_lead=False)  # the LEAD is spent (snapshots drop the flag)
        # Only the winner proposes DONE; whoever proposed the first one, it counts, so the cell is
        # never run again. The winner's DONE is also its VOTE (it appends no VOTE of its own).
        self._done[entry.msg_id] = entry
        _forget_oldest(self._done, self._keep)
        election = self._elections.get(entry.msg_id)
        if (
            election is not None
            and election.outcome is not None
            and election.outcome.winner == entry.replica_id
        ):
            election.votes.setdefault(entry.replica_id, entry.replica_id)
        self._awaiting_state = entry.msg_id if entry.state_follows else None
        if entry.msg_id in self._running:
            for msg_id in list(self._running):
                del self._running[msg_id]
                if msg_id == entry.msg_id:
                    break
        return [*decided, CellDone(entry)]

    def _election(self, msg_id: str) -> _Election:
        """msg_id's election, opened if new (then the oldest beyond ``keep`` is forgotten)."""
        election = self._elections.get(msg_id)
        if election is None:
            election = self._elections[msg_id] = _Election()
            _forget_oldest(self._elections, self._keep)
        return election

    def _all_yielded(self, election: _Election) -> bool:
        return bool(self._voters) and self._voters <= election.yielded

    # ---- snapshots -------------------------------------------------------------------------------
    def to_snapshot(self) -> dict[str, Any]:
        """Plain data (msgpack-able) that ``from_snapshot`` turns back into an equal book."""
        return {
            "voters": sorted(self._voters),
            "elections": {
                msg_id: {
                    "leads": list(e.leads),
                    "yielded": sorted(e.yielded),
                    "votes": dict(e.votes),
                    "decided": e.outcome is not None,
                    "winner": e.outcome.winner if e.outcome is not None else None,
                }
                for msg_id, e in self._elections.items()
            },
            "done": {
                msg_id: [d.replica_id, d.content, d.execution_count, d.state_follows]
                for msg_id, d in self._done.items()
            },
            "awaiting_state": self._awaiting_state,
            "running": [[m, w] for m, w in self._running.items()],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any], *, keep: int = DECIDED_KEPT) -> ElectionBook:
        """The book ``to_snapshot`` described; ValueError naming the problem for anything else
        (a snapshot comes from a peer: a malformed one must be refused, not half-restored)."""
        problem = _snapshot_problem(data)
        if problem is not None:
            raise ValueError(f"election book snapshot: {problem}")
        book = cls(data["voters"], keep=keep)
        for msg_id, raw in data["elections"].items():
            book._elections[msg_id] = _Election(
                leads=list(raw["leads"]),
                yielded=set(raw["yielded"]),
                votes=dict(raw["votes"]),
                outcome=Outcome(raw["winner"]) if raw["decided"] else None,
            )
        for msg_id, (replica_id, content, count, follows) in data["done"].items():
            book._done[msg_id] = Done(msg_id, replica_id, content, count, follows)
        _forget_oldest(book._elections, keep)  # a snapshot from a book that kept more
        _forget_oldest(book._done, keep)
        book._awaiting_state = data["awaiting_state"]
        book._running = {str(m): str(w) for m, w in data.get("running") or ()}
        return book


def _str_list(value: Any) -> bool:
    return type(value) is list and all(type(v) is str for v in value)


def _snapshot_problem(data: Any) -> str | None:
    """What makes ``data`` not an ``ElectionBook.to_snapshot()``, or None."""
    if type(data) is not dict:
        return "not a map"
    if not _str_list(data.get("voters")):
        return "voters must be a list of ids"
    elections, done = data.get("elections"), data.get("done")
    if type(elections) is not dict or type(done) is not dict:
        return "elections and done must be maps"
    for msg_id, raw in elections.items():
        if (
            type(msg_id) is not str
            or type(raw) is not dict
            or not _str_list(raw.get("leads"))
            or not _str_list(raw.get("yielded"))
            or type(raw.get("votes")) is not dict
            or not all(type(k) is str and type(v) is str for k, v in raw["votes"].items())
            or type(raw.get("decided")) is not bool
            or not (raw.get("winner") is None or type(raw.get("winner")) is str)
        ):
            return f"election {str(msg_id)[:80]!r} is malformed"
    for msg_id, raw in done.items():
        if (
            type(msg_id) is not str
            or type(raw) is not list
            or len(raw) != 4
            or type(raw[0]) is not str
            or type(raw[1]) is not dict
            or type(raw[2]) is not int
            or type(raw[3]) is not bool
        ):
            return f"done {str(msg_id)[:80]!r} is malformed"
    if "awaiting_state" not in data or not (
        data["awaiting_state"] is None or type(data["awaiting_state"]) is str
    ):
        return "awaiting_state must be a msg_id or nil"
    running = data.get("running")
    if running is not None and not (
        type(running) is list and all(_str_list(r) and len(r) == 2 for r in running)
    ):
        return "running must be a list of [msg_id, executor]"
    return None


def _forget_oldest(table: dict[str, Any], keep: int) -> None:
    """Drop ``table``'s oldest entries (insertion order is log order) beyond ``keep``."""
    for msg_id in list(islice(table, max(0, len(table) - keep))):
        del table[msg_id]
