"""No ``ok`` without durability: which names' latest values are not in the Raft log, and who says so.

A cell's changed names reach the other replicas through its STATE entry: inline, or as pointers
to objects written to the data store. When a write fails (store error, full disk, read-only
store) or a value is too large for the Raft log with no store, the name is *unstored*: its value
exists only in the executor's memory. An unpicklable name is *skipped*, with the same effect.
Nothing of this may be silent:

* the executor prints a warning on the cell's stderr naming the unstored names and why, and
  keeps the cell's ``ok``: the cell did run, its outputs and its values are right on this
  replica, and an error reply would tell the user the opposite and invite a rerun (which, for a
  cell that appends, trains or writes files, is wrong twice). The warning says exactly what is
  at risk. It is repeated after every cell while anything is unstored, and stops once a write
  succeeds;
* the executor retries (``ExecutorRecord.retry_names``), with a capped exponential backoff
  after failed attempts (``Backoff``): in the background between cells (a *repair* STATE,
  ``apply_repair``, carries what it stored), and with every later cell, which encodes the
  unstored names again; while the store fails, a cell writes it before its reply, so that the
  attempt's outcome is on that cell's output. Once stored, the next cell says so, once;
* the STATE entry lists the unstored and skipped names with the reason (``State.unstored``,
  ``State.skipped``), so the committed log knows (``apply_markers``); a replica that executes
  after another one tells its user, on the first cell it runs, which names it lacks or holds an
  older value of (``missing_here``, ``missing_notice``). Its own STATE then clears those marks:
  from there on the log's values are the notebook's.

Everything here is pure: the kernel (``kernel_replica.kernel``) feeds it STATE entries and the
clock, and prints what it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Container, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kernel_replica.log_entries import State

DEFAULT_RETRY_INITIAL_S = 1.0
DEFAULT_RETRY_MAX_S = 60.0


class Marker(NamedTuple):
    """A name whose latest value is not in the log: why, the cell that changed it, and the
    replica holding that value in memory (the executor of that cell)."""

    reason: str
    msg_id: str
    replica_id: str


def apply_markers(markers: Mapping[str, Marker], state: State) -> dict[str, Marker]:
    """The marks after ``state`` commits. A STATE from another replica than the one holding a
    marked value means the kernel changed executor and that replica told its user what it lacks
    (``missing_notice``): the mark is dropped, the log's value is the notebook's from there on.
    A name the STATE carries or deletes is protected again; the names it lists as unstored or
    skipped are marked with its cell and executor."""
    kept = {name: marker for name, marker in markers.items() if marker.replica_id == state.replica_id}
    for group in state.groups:
        for name in group.get("names", ()):
            kept.pop(name, None)
    for alias, _statement in state.imports:
        kept.pop(alias, None)
    for name in state.deleted:
        kept.pop(name, None)
    for name, reason in (*state.skipped.items(), *state.unstored.items()):
        kept[name] = Marker(reason, state.msg_id, state.replica_id)
    return kept


def apply_repair(markers: Mapping[str, Marker], state: State) -> tuple[dict[str, Marker], State]:
    """A repair STATE (``State.repair``: values stored after their cell, by a background retry)
    commits: it protects only the names still marked as held by its executor. Any other name in
    it is stale (a later cell changed or stored it, or another executor took over): left out of
    the returned STATE, which is what every replica applies. A name whose attempt failed again
    stays marked, with the cell that changed it."""
    held = {name for name, marker in markers.items() if marker.replica_id == state.replica_id}
    groups = []
    for group in state.groups:
        names = [name for name in group.get("names", ()) if name in held]
        if names:
            groups.append({**group, "names": names})
    taken = {name for group in groups for name in group["names"]}
    kept = {name: marker for name, marker in markers.items() if name not in taken}
    unstored = {name: reason for name, reason in state.unstored.items() if name in held and name not in taken}
    for name, reason in unstored.items():
        kept[name] = markers[name]._replace(reason=reason)
    effective = dataclasses.replace(
        state,
        digests={name: fp for name, fp in state.digests.items() if name in taken},
        deleted=(),
        skipped={},
        groups=tuple(groups),
        imports=(),
        unstored=unstored,
    )
    return kept, effective


@dataclass(slots=True)
class Backoff:
    """Capped exponential backoff between attempts to store what a failed write left unstored.
    The first attempt after a failure is not delayed: a write behind the reply may be found to
    have failed only when the next cell settles it, and a passing fault may be gone already."""

    initial_s: float = DEFAULT_RETRY_INITIAL_S
    max_s: float = DEFAULT_RETRY_MAX_S
    failures: int = 0
    next_at: float = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def failed(self, now: float) -> None:
        self.failures += 1
        delay = 0.0 if self.failures == 1 else min(self.max_s, self.initial_s * 2 ** (self.failures - 2))
        self.next_at = now + delay

    def succeeded(self) -> None:
        self.failures, self.next_at = 0, 0.0

    @property
    def failing(self) -> bool:
        """The last store write failed (and none succeeded since)."""
        return self.failures > 0


class Own(NamedTuple):
    """A name whose value this executor holds but the log does not."""

    reason: str
    msg_id: str
    retry: bool  # unstored: writing it again may succeed (skipped, unpicklable: it would not)


@dataclass(slots=True)
class ExecutorRecord:
    """The executor's own record of what it holds unprotected, settled from its STATE entries in
    cell order (a write behind the reply settles when it ends: ``settle`` must be called in the
    order the cells ran, never for a later cell before an earlier one)."""

    backoff: Backoff = field(default_factory=Backoff)
    names: dict[str, Own] = field(default_factory=dict)
    recovered: set[str] = field(default_factory=set)  # stored after a failed attempt, not yet said

    def settle(self, state: State, retried: Collection[str], now: float) -> None:
        """``state``: the STATE proposed for a cell, as it ended (write-behind done); ``retried``:
        the names that cell encoded again because an earlier cell could not store them."""
        carried = {name for group in state.groups for name in group.get("names", ())}
        carried.update(alias for alias, _statement in state.imports)
        for name in carried:
            own = self.names.pop(name, None)
            if own is not None and own.retry:
                self.recovered.add(name)
        for name in state.deleted:
            self.names.pop(name, None)
            self.recovered.discard(name)
        for name, reason in state.skipped.items():
            self.names[name] = Own(reason, state.msg_id, False)
        for name, reason in state.unstored.items():
            self.names[name] = Own(reason, state.msg_id, True)
            self.recovered.discard(name)
        if state.unstored:
            self.backoff.failed(now)
        elif any(group.get("pointer") for group in state.groups) or carried.intersection(retried):
            self.backoff.succeeded()

    def retry_names(self, now: float) -> list[str]:
        """The unstored names the next cell encodes again (none while backing off)."""
        if not self.backoff.due(now):
            return []
        return sorted(name for name, own in self.names.items() if own.retry)

    def take_recovered(self) -> list[str]:
        """The names stored since they were last reported unstored (each said once)."""
        names, self.recovered = sorted(self.recovered), set()
        return names

    def unstored(self) -> dict[str, str]:
        return {name: own.reason for name, own in self.names.items() if own.retry}

    def drop_all(self) -> list[str]:
        """Another replica executed after this one: its marks are cleared, its values rule."""
        names = sorted(self.names)
        self.names.clear()
        self.recovered.clear()
        self.backoff.succeeded()
        return names


def missing_here(
    markers: Mapping[str, Marker], own: Container[str], told: Container[tuple[str, str]]
) -> dict[str, Marker]:
    """The marked names a replica about to execute lacks the latest value of: every mark but
    those for values it holds itself (``own``), and those it already told (``(name, msg_id)``)."""
    return {
        name: marker
        for name, marker in sorted(markers.items())
        if name not in own and (name, marker.msg_id) not in told
    }


def _names(names: Collection[str]) -> str:
    quoted = [repr(name) for name in sorted(names)]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def unprotected_warning(unstored: Mapping[str, str], retry_in_s: float) -> str:
    """The executor's stderr lines after a cell that leaves ``unstored`` names; the next attempt
    to store them is made by the first cell run ``retry_in_s`` from now or later."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in sorted(unstored.items()):
        by_reason.setdefault(reason, []).append(name)
    lines = []
    for reason, names in by_reason.items():
        noun = "variable" if len(names) == 1 else "variables"
        lines.append(f"Tandem: WARNING: {noun} {_names(names)} NOT protected ({reason}).")
    when = "now" if retry_in_s <= 0.5 else f"in {retry_in_s:.0f} s"
    lines.append(
        "The latest values exist only in this replica's memory and will be missing if the kernel "
        f"moves to another replica. Tandem tries to store them again {when}, in the background "
        "and with later cells, until it succeeds."
    )
    return "\n".join(lines)


def protected_again(names: Collection[str]) -> str:
    """The executor's stderr line once names reported unstored have been stored."""
    noun = "variable" if len(names) == 1 else "variables"
    return f"Tandem: {noun} {_names(names)} now protected (stored after an earlier attempt failed)."


def missing_notice(
    missing: Mapping[str, Marker], not_loaded: Mapping[str, str], present: Container[str], replica_id: str
) -> str:
    """What the executor ``replica_id`` tells its user before the cell runs: each name whose
    latest value never reached the log (``missing``: which replica held it, and why), and each
    name the log has but this replica could not load (``not_loaded``: why), saying whether it
    is missing here or holds an older value (``present``)."""
    lines = [
        f"Tandem: WARNING: this cell runs on replica {replica_id}, which does not have these "
        "variables as the previous cell left them:"
    ]
    for name, marker in missing.items():
        what = "has an older value here" if name in present else "is missing"
        lines.append(
            f"  {name!r} {what}: its value stayed on replica {marker.replica_id}, never stored ({marker.reason})"
        )
    for name, reason in sorted(not_loaded.items()):
        if name not in missing:
            what = "has an older value here" if name in present else "is missing"
            lines.append(f"  {name!r} {what}: {reason}")
    return "\n".join(lines)
