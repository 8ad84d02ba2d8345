"""Attributes a notebook sets on libraries' modules and classes, replicated with the executor.

``pd.DataFrame.describe_all = describe_all``, ``sklearn.metrics.accuracy_score = my_score``,
``torch.nn.Module.__repr__ = short_repr``, ``nbhelpers.Config.rate = 0.1``: the object changed is
a module or a class that no variable holds a copy of (the import is replayed), so the next
executor had the library's own attribute, and computed with it, silently.

The cell analysis reports the dotted targets a cell assigns or deletes
(``CellEffects.attribute_targets``). Each one whose owner (all but its last part) resolves to a
module, or to a class defined outside the notebook's cells that its module gives back by name,
becomes a *patch*, kept from then on. (The notebook's own modules' globals are
``notebook_modules``' and a class the notebook defines travels with its own attributes.) A
patch's value is read from the owner's ``__dict__``, so a ``staticmethod`` stays one, and travels
as a library setting ``patch:<module>:<qualified name>``: pickled by the codec (a notebook
function by value, its globals the namespace it is decoded into), or as a deletion. A value that
cannot be pickled, or pickles to more than the notebook modules' limit (``MAX_GLOBAL_BYTES``:
one known to be larger, a model or an array, is not pickled to find out), stays the executor's,
and the user is told once.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

from kernel_replica.notebook_modules import MAX_GLOBAL_BYTES, known_size

PREFIX = "patch:"
_ABSENT = object()


def _owner_path(owner: Any) -> tuple[str, str] | None:
    """(module, qualified name within it: "" for the module) that gives ``owner`` back on any
    replica, or None for what is the notebook's own (``__main__``) or cannot be found by name."""
    if isinstance(owner, ModuleType):
        name = owner.__name__
        return None if name == "__main__" else (name, "")
    if not isinstance(owner, type):
        return None
    module, qualname = getattr(owner, "__module__", None), getattr(owner, "__qualname__", "")
    if not isinstance(module, str) or module == "__main__" or "<locals>" in qualname:
        return None
    try:
        found = resolve(module, qualname)
    except Exception:
        return None
    return (module, qualname) if found is owner else None


def resolve(module: str, qualname: str) -> Any:
    """The object ``qualname`` names in ``module`` (importing it)."""
    found: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        found = getattr(found, part)
    return found


def setting_name(module: str, qualname: str, attr: str) -> str:
    return f"{PREFIX}{module}:{qualname + '.' if qualname else ''}{attr}"


def _parse(setting: str) -> tuple[str, str, str]:
    module, _, path = setting.removeprefix(PREFIX).partition(":")
    qualname, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"malformed patch setting {setting!r}")
    return module, qualname, attr


class LibraryPatches:
    """This process's patches: which, and their values as last read or written here."""

    def __init__(self, skip_module: Callable[[str], bool] = lambda name: False) -> None:
        self._skip_module = skip_module  # the notebook's own modules (``notebook_modules``)
        self._patches: dict[str, tuple[Any, str]] = {}  # setting name -> (owner, attribute)
        self._memos: dict[str, Any] = {}  # setting name -> id of the value read (or _ABSENT's)
        self._values: dict[str, bytes] = {}
        self._warnings: dict[str, str] = {}
        self._warned: set[str] = set()
        # the notebook's namespace (the kernel sets it): a function's globals when it is decoded
        self.namespace: dict[str, Any] | None = None

    def note(self, targets: Iterable[tuple[str, ...]], namespace: Mapping[str, Any]) -> None:
        """Register the patches among the dotted targets a cell assigned or deleted."""
        for target in targets:
            if len(target) < 2 or target[0] not in namespace:
                continue
            try:
                owner = namespace[target[0]]
                for part in target[1:-1]:
                    owner = getattr(owner, part)
            except Exception:
                continue
            path = _owner_path(owner)
            if path is None or (not path[1] and self._skip_module(path[0])):
                continue
            self._patches.setdefault(setting_name(*path, target[-1]), (owner, target[-1]))

    def capture(self) -> dict[str, bytes]:
        """Setting name -> value of every patch (pickled again only when its value changed)."""
        for setting, (owner, attr) in self._patches.items():
            value = vars(owner).get(attr, _ABSENT)
            if setting in self._memos and self._memos[setting] == id(value):
                continue
            self._memos[setting] = id(value)
            encoded = self._encode(setting, value)
            if encoded is None:
                self._values.pop(setting, None)
            else:
                self._values[setting] = encoded
        return dict(self._values)

    def _encode(self, setting: str, value: Any) -> bytes | None:
        if value is _ABSENT:
            return pickle.dumps(("del",))
        from kernel_replica.object_codec import dumps_inline  # not before a notebook patches

        try:
            if known_size(value) > MAX_GLOBAL_BYTES:
                data, why = b"", f"over {MAX_GLOBAL_BYTES // 1024} KB"
            else:
                data = dumps_inline(value, self.namespace)
                why = (
                    f"{len(data)} bytes pickled, over {MAX_GLOBAL_BYTES}"
                    if len(data) > MAX_GLOBAL_BYTES
                    else ""
                )
        except Exception as exc:
            data, why = b"", f"{exc.__class__.__name__}: {exc}"
        if why:
            if setting not in self._warned:
                self._warned.add(setting)
                target = setting.removeprefix(PREFIX).replace(":", ".", 1)
                self._warnings[setting] = (
                    f"the notebook's change of {target} is not replicated to this kernel's other"
                    f" replicas ({why}); another executor has the library's own"
                )
            return None
        return pickle.dumps(("set", data))

    def take_warnings(self) -> dict[str, str]:
        """Patches found unreplicable since the last call, each once: setting -> notice."""
        taken, self._warnings = self._warnings, {}
        return taken

    def apply(self, values: Mapping[str, bytes]) -> list[str]:
        """Make this process's patches ``values`` (importing their modules); what failed."""
        failed = []
        for setting, value in values.items():
            if not setting.startswith(PREFIX) or value == self._values.get(setting):
                continue
            try:
                module, qualname, attr = _parse(setting)
                owner = resolve(module, qualname)
                kind, *rest = pickle.loads(value)
                if kind == "del":
                    if attr in vars(owner):
                        delattr(owner, attr)
                else:
                    from kernel_replica.object_codec import loads

                    setattr(owner, attr, loads(rest[0], namespace=self.namespace))
            except Exception as exc:
                failed.append(f"{setting.removeprefix(PREFIX)} ({exc.__class__.__name__}: {exc})")
                continue
            self._patches[setting] = (owner, attr)
            self._memos[setting] = id(vars(owner).get(attr, _ABSENT))
            self._values[setting] = value
        return failed
