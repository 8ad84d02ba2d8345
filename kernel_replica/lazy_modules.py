"""numpy and torch for the replica's codec and fingerprints, imported only when needed.

A replica must not import torch (about 200 MB of RSS) or numpy for a notebook that never does:
three replicas of a kernel would pay it for nothing. An object can only be an array or a tensor if
its library is already imported, so the type checks ask ``sys.modules`` (``loaded``) and never
import; code that builds arrays or tensors (decoding a pickle that holds them, hashing one) uses
``Deferred`` modules, imported at their first attribute access, which happens only when such an
object exists.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


class Deferred:
    """A module imported at the first attribute read (then read from directly)."""

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)


def loaded(name: str) -> ModuleType | None:
    """The module if some code (the notebook's, usually) has imported it, else None; never imports."""
    return sys.modules.get(name)


def loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if the module is imported (and far enough through its own import to have
    it: the notebook may be importing it on another thread), else None; never imports."""
    cls = getattr(loaded(module), name, None)
    return cls if isinstance(cls, type) else None


def is_ndarray(obj: object) -> bool:
    """``isinstance(obj, numpy.ndarray)`` without importing numpy."""
    cls = loaded_class("numpy", "ndarray")
    return cls is not None and isinstance(obj, cls)


def is_tensor(obj: object) -> bool:
    """``isinstance(obj, torch.Tensor)`` without importing torch."""
    cls = loaded_class("torch", "Tensor")
    return cls is not None and isinstance(obj, cls)
