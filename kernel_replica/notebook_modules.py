"""Globals the notebook changes in its own modules, replicated with the executor.

A notebook imports modules of its own (``import config``, ``from src import data``, a file it wrote
with ``%%writefile``) and changes their globals: ``config.BATCH = 64``, a counter a helper bumps,
a cache a helper fills, a flag. The next executor replays the import and so has each module as its
file makes it: the notebook's changes were gone, and cells computed with other values, silently.

A module is the notebook's when its file is Python source found through ``sys.path`` (the
working directory, a directory the notebook added), outside the standard library, the installed
packages and Tandem itself: not, say, the modules a compiler writes to a temporary directory and
loads from there (``torch.compile``'s). Its *data globals* are everything in it but dunders,
modules, and the functions and classes its file defines (the replayed import makes those).
They travel as a library setting (``library_settings``) named ``module:<name>``: each global
pickled on its own (one that cannot be pickled does not stop the others), with the names of
all of them, so that a global the notebook deleted is deleted on the next executor too. A
module's setting is read again only when one of its globals changed: atoms are compared by
value, what pickles by reference (functions, classes) by identity, anything else by its pickle.

A global that cannot be pickled, or pickles to more than ``MAX_GLOBAL_BYTES``, stays this
replica's (an array, a tensor, a model or a data frame known to be larger is not pickled to find
out, and any other pickle stops at the limit: a helper module that loads a model at import costs
no copy of it), and the user is told once (``take_warnings``): the next executor has what its import
makes (a lock, a connection, a table read from disk: often what the notebook wants, but not
always, and only the notebook knows). Whether the import made the value or the notebook did
cannot be told apart here: a module is first seen after the cell that imported it, which may
have changed it already. A global that holds the very object a notebook variable holds
(``helpers.items = items``) travels as a copy of its own, so the two are two objects on the next
executor: the user is told that too (``holder``: the kernel's codec knows which objects the
namespace's names reach).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import site
import sys
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any

from kernel_replica.lazy_modules import is_ndarray, is_tensor, loaded_class

PREFIX = "module:"
MAX_GLOBAL_BYTES = 256 * 1024
_ATOMS = (int, float, complex, bool, str, bytes, type(None))
_BY_REFERENCE = (FunctionType, BuiltinFunctionType, type)


def setting_name(module: str) -> str:
    return PREFIX + module


def library_roots() -> tuple[str, ...]:
    """Directories whose modules are not the notebook's: the standard library, the installed
    packages (system, virtual environment, user), and Tandem's own packages."""
    roots = {sysconfig.get_paths().get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    roots.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    here = Path(__file__).resolve().parent
    roots.update(str(here.parent / package) for package in ("kernel_replica", "shared", "services"))
    return tuple(sorted(os.path.join(os.path.realpath(r), "") for r in roots if r))


def search_dirs() -> tuple[str, ...]:
    """The directories ``sys.path`` names (the empty entry: the working directory), resolved."""
    dirs = set()
    for entry in sys.path:
        if isinstance(entry, str):
            with contextlib.suppress(OSError):
                dirs.add(os.path.join(os.path.realpath(entry or os.getcwd()), ""))
    return tuple(sorted(dirs))


def is_notebook_module(module: Any, roots: tuple[str, ...], dirs: tuple[str, ...] | None = None) -> bool:
    """Whether ``module`` is the notebook's: its source is under a ``sys.path`` directory
    (``dirs``, by default ``search_dirs()``) and not under a library root (``library_roots``)."""
    path = getattr(module, "__file__", None)
    if not isinstance(module, ModuleType) or not isinstance(path, str) or not path.endswith((".py", ".pyc")):
        return False
    if getattr(module, "__name__", "__main__") == "__main__":
        return False
    if path.startswith(roots):  # most library modules, without resolving links (~15 us each)
        return False
    real = os.path.realpath(path)
    return not real.startswith(roots) and real.startswith(search_dirs() if dirs is None else dirs)


def data_globals(module: ModuleType) -> dict[str, Any]:
    """The module's globals a notebook may change (see the module docstring)."""
    name = module.__name__
    out = {}
    for key, value in vars(module).items():
        if key.startswith("__") and key.endswith("__"):
            continue
        if isinstance(value, ModuleType):
            continue
        if isinstance(value, FunctionType | type) and getattr(value, "__module__", None) == name:
            continue
        out[key] = value
    return out


class _TooLarge(Exception):
    pass


class _LimitedBuffer(io.BytesIO):
    """A pickle's output that refuses to grow past ``MAX_GLOBAL_BYTES`` (the pickle stops there)."""

    def write(self, data: Any) -> int:
        if self.tell() + memoryview(data).nbytes > MAX_GLOBAL_BYTES:
            raise _TooLarge
        return super().write(data)


def known_size(value: Any) -> int:
    """A lower bound of what ``value`` pickles to, where its type says so at once (its element
    bytes), else 0: what is surely over the limit is never pickled."""
    if isinstance(value, bytes | bytearray | memoryview):
        return memoryview(value).nbytes
    if is_ndarray(value):
        return int(value.nbytes)
    if is_tensor(value):
        return int(value.untyped_storage().nbytes())
    module_class = loaded_class("torch.nn", "Module")
    if module_class is not None and isinstance(value, module_class):
        tensors = [*value.parameters(), *value.buffers()]
        return sum(int(t.untyped_storage().nbytes()) for t in tensors)
    frame_class = loaded_class("pandas", "DataFrame")
    if frame_class is not None and isinstance(value, frame_class):
        return int(value.memory_usage(index=False, deep=False).sum())
    return 0


def _pickled(value: Any) -> bytes:
    """``value``'s pickle, or ``_TooLarge`` without making (or finishing) a larger one."""
    if known_size(value) > MAX_GLOBAL_BYTES:
        raise _TooLarge
    out = _LimitedBuffer()
    pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def _memo(value: Any, pickled: bytes | None) -> Any:
    """What tells later whether a global changed (see the module docstring)."""
    if type(value) in _ATOMS:
        return (type(value), value)
    if isinstance(value, _BY_REFERENCE) or pickled is None:
        return id(value)
    return pickled


class NotebookModules:
    """This process's notebook modules and their data globals as last read or written here."""

    def __init__(self, roots: tuple[str, ...] | None = None) -> None:
        self._roots = roots if roots is not None else library_roots()
        self._verdicts: dict[str, tuple[int, bool]] = {}  # module name -> (id(module), its own?)
        self._count = -1
        self._mine: list[str] = []
        self._memos: dict[str, dict[str, Any]] = {}  # module -> global -> _memo
        self._values: dict[str, bytes] = {}  # setting name -> its value, as last read or written
        # "module.global" -> (why, what another executor has), found since the last take_warnings
        self._warnings: dict[str, str] = {}  # "module.global" -> what the user is told (new ones)
        self._warned: set[str] = set()
        # a notebook variable reaching the very object given, if one does (set by the kernel)
        self.holder: Callable[[Any], str | None] | None = None
        self.namespace: dict[str, Any] | None = None  # the notebook's (set by the kernel)

    def modules(self) -> list[str]:
        """The notebook's modules now imported (classified once per module object)."""
        modules = sys.modules
        if len(modules) != self._count:
            self._count = len(modules)
            mine = []
            dirs = search_dirs()
            for name, module in list(modules.items()):
                known = self._verdicts.get(name)
                if known is None or known[0] != id(module):
                    known = self._verdicts[name] = (id(module), is_notebook_module(module, self._roots, dirs))
                if known[1]:
                    mine.append(name)
            self._mine = mine
        return self._mine

    def is_mine(self, name: str) -> bool:
        """Whether the module ``name`` is one of the notebook's (its globals travel here)."""
        return name in self.modules()

    def capture(self) -> dict[str, bytes]:
        """Setting name -> value for every notebook module (re-read only where a global changed)."""
        current = {}
        for name in self.modules():
            module = sys.modules.get(name)
            if module is None:
                continue
            setting = setting_name(name)
            values = data_globals(module)
            memos = self._memos.get(name)
            if memos is None or not self._same(values, memos):
                self._read(name, module, values)
            current[setting] = self._values[setting]
        for setting in [s for s in self._values if s not in current]:
            del self._values[setting]  # a module the notebook removed from sys.modules
        return current

    @staticmethod
    def _same(values: Mapping[str, Any], memos: Mapping[str, Any]) -> bool:
        if values.keys() != memos.keys():
            return False
        for key, value in values.items():
            memo = memos[key]
            if isinstance(memo, bytes):
                try:
                    if _pickled(value) != memo:
                        return False
                except Exception:
                    return False
            elif isinstance(memo, int):  # by reference, or not replicated: the same object?
                if id(value) != memo:
                    return False
            elif memo != (type(value), value):
                return False
        return True

    def _read(self, name: str, module: ModuleType, values: Mapping[str, Any]) -> None:
        pickled: dict[str, bytes] = {}
        memos: dict[str, Any] = {}
        for key, value in values.items():
            raw: bytes | None
            try:
                raw, why = _pickled(value), ""
            except _TooLarge:
                raw, why = None, f"over {MAX_GLOBAL_BYTES // 1024} KB pickled"
            except Exception as exc:
                raw, why = None, f"{exc.__class__.__name__}: {exc}"
            if why:
                raw = None
                self._warn(
                    f"{name}.{key}",
                    f"module global '{name}.{key}' is not replicated to this kernel's other replicas"
                    f" ({why}); another executor has the value its import makes",
                )
            else:
                pickled[key] = raw  # type: ignore[assignment]
                if self.holder is not None and not isinstance(value, _ATOMS + _BY_REFERENCE):
                    variable = self.holder(value)
                    if variable is not None:
                        self._warn(
                            f"{name}.{key}",
                            f"module global '{name}.{key}' holds the object the variable {variable!r}"
                            " holds, and travels to this kernel's other replicas as a copy of its own:"
                            " after an executor change they are two objects",
                        )
            memos[key] = _memo(value, raw)
        self._memos[name] = memos
        self._values[setting_name(name)] = pickle.dumps(
            {"globals": pickled, "names": sorted(values)}, protocol=pickle.HIGHEST_PROTOCOL
        )

    def _warn(self, name: str, notice: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            self._warnings[name] = notice

    def take_warnings(self) -> dict[str, str]:
        """Globals found not replicated as they are since the last call, each once:
        "module.global" -> what to tell the user."""
        taken, self._warnings = self._warnings, {}
        return taken

    def apply(self, values: Mapping[str, bytes]) -> list[str]:
        """Give this process's notebook modules the executor's data globals (importing a module
        it has not imported, as the notebook's imports would); what failed."""
        failed = []
        replaced: dict[int, Any] = {}  # id of a global's object before -> its object now
        for setting, value in values.items():
            if not setting.startswith(PREFIX) or value == self._values.get(setting):
                continue
            name = setting.removeprefix(PREFIX)
            try:
                module = sys.modules.get(name) or importlib.import_module(name)
                state = pickle.loads(value)
                names = set(state["names"])
                for key in [k for k in data_globals(module) if k not in names]:
                    delattr(module, key)  # deleted on the executor
                for key, raw in state["globals"].items():
                    before, now = vars(module).get(key), pickle.loads(raw)
                    setattr(module, key, now)
                    if before is not None and not isinstance(before, _ATOMS + _BY_REFERENCE):
                        replaced[id(before)] = now
            except Exception as exc:
                failed.append(f"{name}'s globals ({exc.__class__.__name__}: {exc})")
                continue
            now_globals = data_globals(module)
            self._memos[name] = {key: _memo(v, state["globals"].get(key)) for key, v in now_globals.items()}
            self._values[setting] = value
        if replaced and self.namespace is not None:
            # ``from config import settings`` was replayed here and took the import's object: the
            # name holds the module's object, as on the executor
            for variable, held in list(self.namespace.items()):
                if id(held) in replaced:
                    self.namespace[variable] = replaced[id(held)]
        return failed
