"""IPython's output history (``_``, ``__``, ``___``, ``_5``, ``Out[5]``) across executors.

A cell whose last expression has a value shows it as ``Out[5]``, and the shell keeps it: ``_`` is
the last output, ``Out[5]`` / ``_5`` that one. Those names are private (``_``-prefixed) and never
travel with the namespace, so after an executor change ``_`` was whatever the new executor last
showed itself, an older value, silently (``_ * 2`` on a number another replica just printed).

The executor records each output in its STATE (``CellOutput``): as the name of a notebook
variable holding that very object (``df`` shown at a cell's end: no copy, and ``_ is df`` as on
one process), else pickled when small (``df.head()``, a number), else as why it is not there
(too large, unpicklable). A replica enters the outputs in log order just before it next runs a
cell, as IPython's display hook does: the name's value, the unpickled copy, or an ``Unreplicated``
marker whose repr says what is missing and where it lives. The log's record of the outputs
(``ReplicatedOutputs``) is part of the Raft snapshot and of a hibernated kernel's image, so a
replica rebuilt from either (a restart, a new member, a resumed kernel) has the history too: it
was empty, and ``_ * 2`` after a resume gave ``''``, silently.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Names a cell reads the output history by.
OUTPUT_NAME = re.compile(r"_{1,3}|_\d+|Out|_oh")


@dataclass(frozen=True, slots=True)
class CellOutput:
    """Cell ``count``'s output: the notebook variable that holds it (``alias``), or its pickle
    (``value``), or why neither (``missing``). Exactly one is set."""

    count: int
    alias: str | None = None
    value: bytes | None = None
    missing: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.alias, self.value, self.missing)) != 1:
            raise ValueError("a cell output is an alias, a value or a reason, exactly one")

    def to_wire(self) -> list[Any]:
        return [self.count, self.alias, self.value, self.missing]

    @classmethod
    def from_wire(cls, raw: Any) -> CellOutput:
        """ValueError naming what is malformed (it comes from the log)."""
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError("a cell output must be [count, alias, value, missing]")
        count, alias, value, missing = raw
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError("a cell output's count must be an int >= 0")
        if not (
            (alias is None or isinstance(alias, str))
            and (value is None or isinstance(value, bytes))
            and (missing is None or isinstance(missing, str))
        ):
            raise ValueError("a cell output's alias, value and missing must be str, bytes and str")
        return cls(count, alias, value, missing)


#: Outputs the replicated record keeps (IPython's own cache keeps 1000), and the bytes of the
#: copies among them (older copies become markers past it; a snapshot must stay small).
KEPT_OUTPUTS = 1000
KEPT_COPY_BYTES = 4 * 2**20


class ReplicatedOutputs:
    """The notebook's output history as the log holds it: (output, executor) per cell, oldest
    first. An output held by a variable is kept by name; once a later STATE rebinds or deletes
    that name, a replica rebuilt from a snapshot cannot get the object the cell showed, so the
    entry says so instead of standing for the variable's later value."""

    def __init__(self, entries: Iterable[tuple[CellOutput, str]] = ()) -> None:
        self._entries: dict[int, tuple[CellOutput, str]] = {}
        self._aliased: dict[str, set[int]] = {}  # variable -> counts of the outputs it holds
        self._copy_bytes = 0
        for output, executor in entries:
            self.add(output, executor)

    def rebound(self, names: Iterable[str]) -> None:
        """A STATE changed, rebound or deleted ``names`` (applied before its own output)."""
        for name in names:
            for count in self._aliased.pop(name, ()):
                entry = self._entries.get(count)
                if entry is not None:
                    why = f"the variable {name!r} that held it was changed or rebound by a later cell"
                    self._entries[count] = (CellOutput(count, missing=why), entry[1])

    def add(self, output: CellOutput, executor: str) -> None:
        self._drop(output.count)
        self._entries[output.count] = (output, executor)
        if output.alias is not None:
            self._aliased.setdefault(output.alias, set()).add(output.count)
        self._copy_bytes += len(output.value or b"")
        while len(self._entries) > KEPT_OUTPUTS:
            self._drop(next(iter(self._entries)))
        if self._copy_bytes <= KEPT_COPY_BYTES:
            return
        for count, (old, executor) in list(self._entries.items()):
            if self._copy_bytes <= KEPT_COPY_BYTES:
                break
            if old.value is not None:
                self._copy_bytes -= len(old.value)
                why = f"its copy was dropped from the replicated history (over {KEPT_COPY_BYTES:,} bytes of copies)"
                self._entries[count] = (CellOutput(count, missing=why), executor)

    def _drop(self, count: int) -> None:
        entry = self._entries.pop(count, None)
        if entry is None:
            return
        output = entry[0]
        self._copy_bytes -= len(output.value or b"")
        if output.alias is not None:
            counts = self._aliased.get(output.alias)
            if counts is not None:
                counts.discard(count)
                if not counts:
                    del self._aliased[output.alias]

    def entries(self) -> list[tuple[CellOutput, str]]:
        return list(self._entries.values())

    def to_wire(self) -> list[list[Any]]:
        return [[output.to_wire(), executor] for output, executor in self._entries.values()]

    @classmethod
    def from_wire(cls, raw: Any) -> ReplicatedOutputs:
        """ValueError naming what is malformed (it comes from a snapshot)."""
        if not isinstance(raw, list) or not all(
            isinstance(item, list) and len(item) == 2 and isinstance(item[1], str) for item in raw
        ):
            raise ValueError("an output history must be a list of [output, executor]")
        return cls((CellOutput.from_wire(output), executor) for output, executor in raw)


class Unreplicated:
    """Stands for an output this replica could not get: its repr says which, and why.
    ``awaiting``: the variable whose load will replace it (``output_loaded``)."""

    def __init__(self, count: int, why: str, awaiting: str | None = None) -> None:
        self.count, self.why, self.awaiting = count, why, awaiting

    def __repr__(self) -> str:
        return f"<Out[{self.count}] is not on this replica: {self.why}>"


def capture_output(
    namespace: Mapping[str, Any], count: int, names: Callable[[], Iterable[str]], *, max_bytes: int
) -> CellOutput | None:
    """Cell ``count``'s output as the executor holds it (None: the cell showed none). ``names``:
    the notebook's replicated variables (listed only for a cell that showed an output), looked
    through for one holding the very object."""
    history = namespace.get("_oh")
    if not isinstance(history, dict) or count not in history:
        return None
    shown = history[count]
    for name in names():
        if namespace.get(name) is shown:
            return CellOutput(count, alias=name)
    try:
        value = _pickled(shown, max_bytes)
    except _TooLarge:
        return CellOutput(count, missing=f"its {type(shown).__name__} is over {max_bytes:,} bytes pickled")
    except Exception as exc:
        return CellOutput(
            count, missing=f"its {type(shown).__name__} cannot be pickled ({exc.__class__.__name__})"
        )
    if len(value) > max_bytes:
        return CellOutput(
            count, missing=f"its {type(shown).__name__} is {len(value):,} bytes pickled, over {max_bytes:,}"
        )
    return CellOutput(count, value=value)


class _TooLarge(Exception):
    pass


def _pickled(value: Any, max_bytes: int) -> bytes:
    """``value`` pickled, given up as soon as its buffers (arrays', tensors', frames' data, which
    protocol 5 hands over first) pass ``max_bytes``: a 10 GB array shown at a cell's end is not
    copied to find out."""
    if (
        isinstance(value, str | bytes | bytearray | list | tuple | dict | set | frozenset)
        and len(value) > max_bytes
    ):
        raise _TooLarge  # a byte at least per item pickled: no need to build it to know
    seen = 0

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        nonlocal seen
        seen += memoryview(buffer).nbytes
        if seen > max_bytes:
            raise _TooLarge
        return True  # serialised in the pickle itself

    return pickle.dumps(value, protocol=5, buffer_callback=in_band)


def reads_outputs(mentioned: Collection[str]) -> bool:
    """Whether code mentioning these identifiers may read the output history."""
    return any(OUTPUT_NAME.fullmatch(name) for name in mentioned)


def resolve_output(
    namespace: Mapping[str, Any], output: CellOutput, executor: str, loading: Collection[str] = ()
) -> Any:
    """The object ``output`` stands for, taken when the replica has applied that cell's STATE (a
    variable is read as it was then, not as a later cell rebinds it): the variable's value, the
    unpickled copy, or an ``Unreplicated`` marker (``executor``: the replica that showed it). One
    held by a variable still ``loading`` is a marker that ``output_loaded`` replaces."""
    if output.alias is not None and output.alias in loading:
        return Unreplicated(output.count, f"{output.alias!r}, which holds it, is still loading", output.alias)
    if output.alias is not None and output.alias in namespace:
        return namespace[output.alias]
    if output.value is not None:
        try:
            return pickle.loads(output.value)
        except Exception as exc:
            return Unreplicated(
                output.count, f"it could not be unpickled here ({exc.__class__.__name__}: {exc})"
            )
    why = output.missing or f"the variable {output.alias!r} that held it is not here"
    return Unreplicated(output.count, f"{why}; it is on replica {executor}")


def enter_outputs(shell: Any, outputs: Iterable[tuple[int, Any]]) -> None:
    """Put (count, object) outputs other replicas showed into this shell's history, in order,
    through IPython's own display hook (``DisplayHook.update_user_ns``: ``_``, ``__``, ``___``
    unless the notebook assigned one itself, ``_<n>``, ``Out[n]``, the cache culled when full),
    with the shell's counter set to each output's cell for the call."""
    hook, counter = shell.displayhook, shell.execution_count
    ahead = counter - hook.prompt_count  # IPython 9 counts the cell before its output is shown
    try:
        for count, value in outputs:
            shell.execution_count = count + ahead
            hook.update_user_ns(value)
    finally:
        shell.execution_count = counter


def output_loaded(shell: Any, marker: Unreplicated, value: Any) -> None:
    """The variable an output was entered as ``marker`` for is loaded: every place of the
    history still holding the marker holds the value now."""
    hook, namespace = shell.displayhook, shell.user_ns
    for name in ("_", "__", "___"):
        if getattr(hook, name, None) is marker:
            setattr(hook, name, value)
        if namespace.get(name) is marker:
            namespace[name] = value
    if namespace.get(f"_{marker.count}") is marker:
        namespace[f"_{marker.count}"] = value
    if namespace["_oh"].get(marker.count) is marker:
        namespace["_oh"][marker.count] = value
