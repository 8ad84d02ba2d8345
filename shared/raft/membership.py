"""Single-server membership changes and the configuration in force at each log index.

A configuration takes effect when its CONF_CHANGE entry is *appended* to a log, not when it
commits (Raft dissertation §4.1). Why this rather than etcd's apply-time semantics:

* the single-server argument (any two adjacent configurations share a majority) is stated for
  append-time changes, and the leader needs no second, "applied" view of membership;
* the configuration of a node is a pure function of its log (snapshot conf + CONF_CHANGE entries
  after it), so it survives a restart with no extra persisted state, and a truncated conf change
  simply rolls back;
* a new learner starts receiving the log the moment it is added, which is what replica migration
  waits for.

The rules that keep it safe: at most one uncommitted conf change in the log, and a leader proposes
one only after committing an entry of its own term (the fix in the dissertation's errata).
"""

from __future__ import annotations

from shared.raft.types import ConfChange, ConfChangeType, ConfState


def conf_change_refusal(conf: ConfState, change: ConfChange) -> str | None:
    """Why ``change`` cannot be applied to ``conf``, or None if it can."""
    node = change.node_id
    if not node:
        return "conf change names no node"
    if change.type == ConfChangeType.ADD_LEARNER:
        if node in conf.voters or node in conf.learners:
            return f"{node} is already a member"
    elif change.type == ConfChangeType.PROMOTE:
        if node not in conf.learners:
            return f"{node} is not a learner"
    elif change.type == ConfChangeType.REMOVE:
        if node not in conf.voters and node not in conf.learners:
            return f"{node} is not a member"
        if conf.voters == (node,):
            return "cannot remove the last voter"
    else:  # pragma: no cover - ConfChangeType is closed
        return f"unknown conf change type {change.type!r}"
    return None


def apply_conf_change(conf: ConfState, change: ConfChange) -> ConfState:
    """The configuration after ``change``; an inapplicable change leaves ``conf`` unchanged.

    Order is kept (append on add, remove in place) so every replica and the driver, which
    applies the same rules to committed entries, derive identical tuples.
    """
    if conf_change_refusal(conf, change) is not None:
        return conf
    node = change.node_id
    if change.type == ConfChangeType.ADD_LEARNER:
        return ConfState(conf.voters, (*conf.learners, node))
    if change.type == ConfChangeType.PROMOTE:
        return ConfState((*conf.voters, node), tuple(n for n in conf.learners if n != node))
    return ConfState(tuple(n for n in conf.voters if n != node), tuple(n for n in conf.learners if n != node))


def same_conf(a: ConfState, b: ConfState) -> bool:
    """Equal as sets: the order of members carries no meaning."""
    return set(a.voters) == set(b.voters) and set(a.learners) == set(b.learners)


class ConfHistory:
    """The configuration at every index of the log: a base (the snapshot's) plus one per change."""

    __slots__ = ("_base", "_base_index", "_changes", "current")

    def __init__(self, base_index: int, base: ConfState) -> None:
        self._base_index = base_index
        self._base = base
        self._changes: list[tuple[int, ConfState]] = []  # ascending by index
        self.current = base

    @property
    def last_change_index(self) -> int:
        """Index of the newest CONF_CHANGE entry in the log, 0 if none after the snapshot."""
        return self._changes[-1][0] if self._changes else 0

    def at(self, index: int) -> ConfState:
        """The configuration in force once the log has been appended up to ``index``."""
        for change_index, conf in reversed(self._changes):
            if change_index <= index:
                return conf
        return self._base

    def record(self, index: int, conf: ConfState) -> None:
        """A CONF_CHANGE entry at ``index`` (after every recorded one) produced ``conf``."""
        self._changes.append((index, conf))
        self.current = conf

    def truncate_from(self, index: int) -> None:
        """Entries ``>= index`` left the log: their changes no longer apply."""
        changes = self._changes
        while changes and changes[-1][0] >= index:
            changes.pop()
        self.current = changes[-1][1] if changes else self._base

    def compact_to(self, index: int) -> None:
        """A snapshot at ``index`` now carries the configuration of the prefix."""
        self._base = self.at(index)
        self._base_index = index
        self._changes = [(i, c) for i, c in self._changes if i > index]

    def reset(self, index: int, conf: ConfState) -> None:
        """The log was replaced by a snapshot at ``index`` carrying ``conf``."""
        self._base_index = index
        self._base = conf
        self._changes = []
        self.current = conf
