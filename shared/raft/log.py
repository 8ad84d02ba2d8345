"""The Raft core's in-memory log: the entries after the last snapshot, plus the Ready cursors.

The core does no I/O, so the driver's storage holds the durable copy; this log is what the core
reasons about. Two pairs of cursors tie it to the Ready cycle::

    persisted <= handed_out <= last_index   entries handed to the driver to persist / known durable
    applied   <= applying   <= committed    entries handed to the application / known applied

``handed_out`` and ``applying`` move when a ``Ready`` is built; ``persisted`` and ``applied`` move
when it is advanced. A truncation pulls ``handed_out`` and ``persisted`` back so the replacement
entries go out in the next ``Ready``.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.raft.types import Entry, Snapshot

# Per-entry overhead counted towards ``max_bytes_per_append`` besides data and proposal id.
ENTRY_OVERHEAD_BYTES = 24


class RaftInvariantError(ValueError):
    """Input that would break a Raft safety invariant, e.g. an append overwriting committed entries.

    Only a bug, a corrupted peer or a member that lost its disk can send it. It is raised before
    anything changes, so the message is rejected and the node keeps its state; a ``ValueError``
    because, to a correct node, such a message is structurally impossible.
    """


class RaftLog:
    """Entries ``snapshot_index + 1 .. last_index`` and the cursors described in the module doc."""

    __slots__ = (
        "applied",
        "applying",
        "committed",
        "entries",
        "handed_out",
        "pending_snapshot",
        "persisted",
        "snapshot_index",
        "snapshot_term",
    )

    def __init__(
        self, snapshot_index: int, snapshot_term: int, entries: Sequence[Entry], committed: int
    ) -> None:
        for offset, e in enumerate(entries):
            if e.index != snapshot_index + 1 + offset:
                raise ValueError(
                    f"restored entries must be contiguous from {snapshot_index + 1}; "
                    f"entry {offset} has index {e.index}"
                )
        last = snapshot_index + len(entries)
        if committed > last:
            raise ValueError(f"commit index {committed} is beyond the last log index {last}")
        self.snapshot_index = snapshot_index
        self.snapshot_term = snapshot_term
        self.entries: list[Entry] = list(entries)
        self.committed = max(committed, snapshot_index)
        self.applied = snapshot_index
        self.applying = snapshot_index
        self.handed_out = last
        self.persisted = last
        # A snapshot this node must hand to the driver (installed from the leader, or bootstrap).
        self.pending_snapshot: Snapshot | None = None

    # ------------------------------------------------------------------ reading

    def first_index(self) -> int:
        return self.snapshot_index + 1

    def last_index(self) -> int:
        return self.snapshot_index + len(self.entries)

    def last_term(self) -> int:
        return self.entries[-1].term if self.entries else self.snapshot_term

    def term(self, index: int) -> int | None:
        """Term of the entry at ``index``; the snapshot's term at its index; None if not held."""
        offset = index - self.snapshot_index
        if offset == 0:
            return self.snapshot_term
        if 0 < offset <= len(self.entries):
            return self.entries[offset - 1].term
        return None

    def entry(self, index: int) -> Entry:
        """The entry at ``index``, which must be held (``first_index <= index <= last_index``)."""
        offset = index - self.snapshot_index
        if not 0 < offset <= len(self.entries):
            raise IndexError(f"entry {index} is not in the log ({self.first_index()}..{self.last_index()})")
        return self.entries[offset - 1]

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Whether a candidate's log is at least as up to date as ours (Raft §5.4.1)."""
        our_term = self.last_term()
        return last_term > our_term or (last_term == our_term and last_index >= self.last_index())

    def find_conflict_by_term(self, index: int, term: int) -> tuple[int, int]:
        """The largest index ``<= index`` whose entry term is ``<= term``, with that term.

        Used on both sides of a rejected append to skip a whole run of mismatching entries at
        once instead of one index per round trip. Returns ``(index, 0)`` when the answer lies
        below what this log holds (compacted), so the caller falls back to probing from there.
        """
        last = self.last_index()
        if index > last:
            return index, 0
        snapshot_index = self.snapshot_index
        entries = self.entries
        while index > snapshot_index:
            entry_term = entries[index - snapshot_index - 1].term
            if entry_term <= term:
                return index, entry_term
            index -= 1
        if index == snapshot_index and self.snapshot_term <= term:
            return index, self.snapshot_term
        return index, 0

    def slice(self, low: int, max_count: int, max_bytes: int) -> list[Entry]:
        """Entries from ``low`` on, at most ``max_count`` of them and about ``max_bytes``.

        Always returns at least one entry when ``low <= last_index`` so a single oversized
        entry still makes progress.
        """
        start = low - self.snapshot_index - 1
        if start < 0:
            raise IndexError(f"entry {low} is compacted (log starts at {self.first_index()})")
        batch = self.entries[start : start + max_count]
        if len(batch) <= 1:
            return batch
        size = 0
        for i, e in enumerate(batch):
            size += len(e.data) + len(e.proposal_id) + ENTRY_OVERHEAD_BYTES
            if size > max_bytes and i > 0:
                return batch[:i]
        return batch

    def committed_to_apply(self) -> list[Entry]:
        """Committed entries not yet handed to the application."""
        base = self.snapshot_index
        return self.entries[self.applying - base : self.committed - base]

    def unstable(self) -> list[Entry]:
        """Entries not yet handed to the driver for persisting."""
        return self.entries[self.handed_out - self.snapshot_index :]

    # ------------------------------------------------------------------ writing

    def append(self, entry: Entry) -> None:
        """Append one entry built by the leader (its index must be ``last_index + 1``)."""
        self.entries.append(entry)

    def maybe_append(
        self, prev_index: int, prev_term: int, leader_commit: int, entries: Sequence[Entry]
    ) -> tuple[int, int, list[Entry]] | None:
        """Follower side of AppendEntries.

        Returns None if the log does not hold ``(prev_index, prev_term)``. Otherwise returns
        ``(last_new_index, first_written_index, removed_entries)``: ``first_written_index`` is 0 when
        every entry was already present; ``removed_entries`` is the conflicting suffix dropped.
        """
        if self.term(prev_index) != prev_term:
            return None
        last_new = prev_index + len(entries)
        removed: list[Entry] = []
        first_written = 0
        if entries:
            first_written = self._find_conflict(entries)
            if first_written:
                if first_written <= self.committed:
                    raise RaftInvariantError(
                        f"entry {first_written} conflicts with the committed prefix (commit {self.committed})"
                    )
                if first_written <= self.last_index():
                    removed = self.truncate_from(first_written)
                self.entries.extend(entries[first_written - prev_index - 1 :])
        self.commit_to(min(leader_commit, last_new))
        return last_new, first_written, removed

    def _find_conflict(self, entries: Sequence[Entry]) -> int:
        """Index of the first entry that is new or differs in term from ours; 0 if none."""
        snapshot_index = self.snapshot_index
        held = self.entries
        count = len(held)
        for e in entries:
            offset = e.index - snapshot_index
            if offset > count:
                return e.index
            if offset > 0 and held[offset - 1].term != e.term:
                return e.index
            # offset <= 0: at or below the snapshot, committed, so it matches by Log Matching.
        return 0

    def truncate_from(self, index: int) -> list[Entry]:
        """Drop entries ``>= index`` and return them; they go back to the next Ready if rewritten."""
        offset = index - self.snapshot_index - 1
        removed = self.entries[offset:]
        del self.entries[offset:]
        if self.handed_out >= index:
            self.handed_out = index - 1
        if self.persisted >= index:
            self.persisted = index - 1
        return removed

    def commit_to(self, index: int) -> bool:
        """Raise the commit index (never lowers it). Returns whether it moved."""
        if index <= self.committed:
            return False
        if index > self.last_index():
            raise RaftInvariantError(f"commit {index} is beyond the last log index {self.last_index()}")
        self.committed = index
        return True

    def stable_to(self, index: int, term: int) -> None:
        """The driver persisted entries up to ``(index, term)``, unless they were replaced since."""
        if index > self.persisted and self.term(index) == term:
            self.persisted = index

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the whole log by a snapshot from the leader (newer than our commit index)."""
        meta = snapshot.meta
        self.snapshot_index = meta.index
        self.snapshot_term = meta.term
        self.entries = []
        self.committed = meta.index
        self.applying = meta.index
        self.handed_out = meta.index
        self.persisted = meta.index
        self.pending_snapshot = snapshot

    def compact_to(self, index: int, term: int) -> None:
        """Forget entries ``<= index``; an application snapshot now covers them."""
        del self.entries[: index - self.snapshot_index]
        self.snapshot_index = index
        self.snapshot_term = term
        if self.handed_out < index:
            self.handed_out = index
        if self.persisted < index:
            self.persisted = index
