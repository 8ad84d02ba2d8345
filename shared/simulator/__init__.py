"""A deterministic discrete-event simulator that steps the cluster core the live scheduler steps.

``Simulator(trace, "notebookos", params, seed=...).run()`` -> ``SimResult``; ``results.summarize``
turns it into the paper's figures; ``tandem sim`` (``cli.py``) runs several policies and plots.

The names below are imported on first use: ``services.cli`` registers ``tandem sim`` through
``shared.simulator.cli``, and every other ``tandem`` command (``tandem status`` is polled by
scripts and tests) must not pay for the engine's numpy and scipy imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.simulator.engine import POLICY_NAMES, SimResult, Simulator, build_core
    from shared.simulator.params import SimParams

__all__ = ["POLICY_NAMES", "SimParams", "SimResult", "Simulator", "build_core"]
_HOMES = {"SimParams": "shared.simulator.params"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES.get(name, "shared.simulator.engine")), name)
