"""The process state a notebook changes besides its namespace, replicated with each cell's STATE.

Notebooks move their working directory (``%cd data``, ``os.chdir``), set environment variables
(``%env``, ``os.environ["API_KEY"] = ...``) and extend ``sys.path`` before importing their own
modules (``sys.path.insert(0, "../src")``). None of it is in the namespace, so a replica that
executes next would otherwise run the notebook's next cell in another directory, without those
variables, and fail to import (or, worse, read another file of the same name).

Libraries' process-wide settings (the random generators' states, torch's default dtype, numpy's
and pandas' options, warnings filters, logger levels, rcParams, ...: ``library_settings.SETTINGS``)
travel here too, only those that changed.

IPython's own configuration is per process too: ``%load_ext autoreload`` and ``%autoreload 2``
(without them the next executor silently stops reloading the notebook's modules), ``%config
InlineBackend.figure_formats = ...``, ``%matplotlib``, ``%xmode``. Those line magics are recorded
as they run and replayed, in order, where the context is applied.

What travels is the executor's context relative to its own start: its working directory, the
environment variables that differ from those it started with (a removed one as None),
``sys.path`` and the configuration magics run so far. A replica applies it relative to *its* start, so what Tandem sets per replica
(``TANDEM_*``) stays its own. Sans-I/O except ``capture``/``apply``, which read and change this
process.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kernel_replica.library_patches import PREFIX as PATCH_PREFIX
from kernel_replica.library_patches import LibraryPatches
from kernel_replica.library_settings import SETTING_NAMES, SettingsTracker
from kernel_replica.notebook_modules import PREFIX as MODULE_PREFIX
from kernel_replica.notebook_modules import NotebookModules

# Variables each replica has of its own (its ids, the GPUs bound for a cell): never replicated.
OWN_PREFIX = "TANDEM_"
# Line magics that configure the shell rather than compute: replayed on the next executor.
CONFIG_MAGICS = frozenset(
    {
        "load_ext",
        "reload_ext",
        "unload_ext",
        "autoreload",
        "aimport",
        "config",
        "matplotlib",
        "precision",
        "xmode",
        "alias",  # %alias ll ls -l: a shell alias the notebook's later cells call as %ll
        "unalias",
        "colors",
    }
)
MAX_MAGICS = 200  # a notebook reconfiguring in a loop keeps its first ones (order matters)


@dataclass(frozen=True, slots=True)
class ProcessContext:
    cwd: str
    env: dict[str, str | None] = field(default_factory=dict)  # changed since start; None: removed
    path: tuple[str, ...] = ()
    magics: tuple[tuple[str, str], ...] = ()  # (name, line) of the CONFIG_MAGICS run, in order
    # library settings (``library_settings``): name -> pickled value. In a STATE only those that
    # changed since the log's last context; the namespace's context holds them all
    settings: dict[str, bytes] = field(default_factory=dict)

    def changed_since(self, logged: ProcessContext | None) -> ProcessContext:
        """This context as a STATE carries it: the settings the log has already left out."""
        if logged is None or not logged.settings:
            return self
        return replace(self, settings={k: v for k, v in self.settings.items() if logged.settings.get(k) != v})

    def merged_onto(self, logged: ProcessContext | None) -> ProcessContext:
        """The log's context once this one (from a STATE) is applied: its settings added."""
        if logged is None or not logged.settings:
            return self
        return replace(self, settings={**logged.settings, **self.settings})

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"cwd": self.cwd, "env": dict(self.env), "path": list(self.path)}
        if self.magics:
            wire["magics"] = [list(m) for m in self.magics]
        if self.settings:
            wire["settings"] = dict(self.settings)
        return wire

    @classmethod
    def from_wire(cls, raw: Any) -> ProcessContext:
        """ValueError naming what is malformed (it comes from the log)."""
        if not isinstance(raw, dict):
            raise ValueError("process context must be a map")
        cwd, env, path = raw.get("cwd"), raw.get("env"), raw.get("path")
        if not isinstance(cwd, str) or not cwd:
            raise ValueError("process context 'cwd' must be a non-empty string")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in env.items()
        ):
            raise ValueError("process context 'env' must map names to strings or None")
        if not isinstance(path, list) or not all(isinstance(p, str) for p in path):
            raise ValueError("process context 'path' must be a list of strings")
        magics = raw.get("magics", [])
        if not isinstance(magics, list) or not all(
            isinstance(m, list) and len(m) == 2 and m[0] in CONFIG_MAGICS and isinstance(m[1], str)
            for m in magics
        ):
            raise ValueError("process context 'magics' must be a list of [configuration magic, line]")
        settings = raw.get("settings", {})
        if not isinstance(settings, dict) or not all(
            isinstance(k, str) and isinstance(v, bytes) for k, v in settings.items()
        ):
            raise ValueError("process context 'settings' must map setting names to bytes")
        # a setting only a newer replica knows stays its own
        known = {
            k: v
            for k, v in settings.items()
            if k in SETTING_NAMES or k.startswith((MODULE_PREFIX, PATCH_PREFIX))
        }
        return cls(cwd, env, tuple(path), tuple((name, line) for name, line in magics), known)


def env_changes(now: Mapping[str, str], start: Mapping[str, str]) -> dict[str, str | None]:
    """The variables ``now`` differs in from ``start`` (removed ones as None), Tandem's own left out."""
    changes: dict[str, str | None] = {
        k: v for k, v in now.items() if start.get(k) != v and not k.startswith(OWN_PREFIX)
    }
    changes.update({k: None for k in start if k not in now and not k.startswith(OWN_PREFIX)})
    return changes


def env_to_apply(
    changes: Mapping[str, str | None], applied: Mapping[str, str | None], start: Mapping[str, str]
) -> dict[str, str | None]:
    """What to set (None: unset) so that the environment is ``start`` plus ``changes``, given the
    ``applied`` changes of the context before: a variable changed then but not now is put back."""
    targets: dict[str, str | None] = {k: start.get(k) for k in applied if k not in changes}
    targets.update(changes)
    return {k: v for k, v in targets.items() if not k.startswith(OWN_PREFIX)}


class ProcessState:
    """This process's side: its start (what changes are relative to), the context last applied
    here, and the capture and application themselves."""

    def __init__(self) -> None:
        self.start_env = dict(os.environ)
        self.applied: ProcessContext | None = None
        # os.environ's own bytes as last read, and what they differed in from the start: a cell
        # rarely changes them, and comparing the raw map costs ~1 us where decoding it costs ~25
        self._raw_env: dict[bytes, bytes] = {}
        self._env: dict[str, str | None] = {}
        self._magics: list[tuple[str, str]] = []  # run here or replayed here, in order
        self.notebook_modules = NotebookModules()
        self.library_patches = LibraryPatches(skip_module=self.notebook_modules.is_mine)
        self._settings = SettingsTracker(modules=self.notebook_modules, patches=self.library_patches)

    def record_magic(self, name: str, line: str) -> None:
        """A configuration magic ran here (``CONFIG_MAGICS``); the same one again adds nothing."""
        magic = (name, line)
        if name in CONFIG_MAGICS and magic not in self._magics and len(self._magics) < MAX_MAGICS:
            self._magics.append(magic)

    def capture(self) -> ProcessContext:
        """This process's context now, which is what this replica has applied from then on."""
        try:
            cwd = os.getcwd()
        except FileNotFoundError:  # the directory was removed under the kernel
            cwd = self.applied.cwd if self.applied is not None else "/"
        raw = getattr(os.environ, "_data", None)  # CPython's POSIX os.environ keeps bytes there
        if raw is None or raw != self._raw_env:
            self._raw_env = dict(raw) if raw is not None else {}
            self._env = env_changes(os.environ, self.start_env)
        path, magics, settings = tuple(sys.path), tuple(self._magics), self._settings.capture()
        applied = self.applied
        if applied is None or (applied.cwd, applied.env, applied.path, applied.magics, applied.settings) != (
            cwd, self._env, path, magics, settings,
        ):  # fmt: skip
            self.applied = ProcessContext(cwd, dict(self._env), path, magics, settings)
        return self.applied  # type: ignore[return-value]

    def apply_settings(self, settings: Mapping[str, bytes]) -> str | None:
        """Library settings from the log (``ProcessContext.settings``), set in the context the cells
        run in; what failed, for the user, or None."""
        return self._settings.apply(settings)

    def apply(
        self, context: ProcessContext, run_magic: Callable[[str, str], object] | None = None
    ) -> str | None:
        """Make this process's context ``context`` (``run_magic`` replays the configuration
        magics this process has not run yet); what could not be applied (a working directory
        missing on this host, a magic that failed here), for the user, or None."""
        entered = self._enter(context)  # first: an extension may be the notebook's own module
        problems = [p for p in (entered, self._replay(context.magics, run_magic)) if p]
        return "; ".join(problems) or None

    def _replay(
        self, magics: tuple[tuple[str, str], ...], run_magic: Callable[[str, str], object] | None
    ) -> str | None:
        done = len(self._magics) if tuple(self._magics) == magics[: len(self._magics)] else 0
        failed = []
        for name, line in magics[done:] if run_magic is not None else ():
            try:
                run_magic(name, line)
            except Exception as exc:  # an extension missing on this host, say
                failed.append(f"%{name} {line} ({exc.__class__.__name__}: {exc})")
        self._magics = list(magics)
        return f"replaying {', '.join(failed)} failed on this host" if failed else None

    def _enter(self, context: ProcessContext) -> str | None:
        previous = self.applied.env if self.applied is not None else {}
        changes = env_to_apply(context.env, previous, self.start_env)
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if "TZ" in changes:  # the C library reads TZ again only when told (time.localtime, strftime)
            time.tzset()
        if list(sys.path) != list(context.path):
            sys.path[:] = context.path
            importlib.invalidate_caches()  # a module the cell just wrote is found by the replay
        self.applied = context
        try:
            os.chdir(context.cwd)
        except OSError as exc:
            return (
                f"the working directory {context.cwd}, set by an earlier cell, cannot be entered on "
                f"this host ({exc.strerror}): this replica stays in the directory it was in"
            )
        return None
