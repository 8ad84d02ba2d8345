"""A deterministic discrete-event simulator that steps the cluster core the live scheduler steps.

``Simulator(trace, "notebookos", params, seed=...).run()`` -> ``SimResult``; ``results.summarize``
turns it into the paper's figures; ``tandem sim`` (``cli.py``) runs several policies and plots.
"""

from shared.simulator.engine import POLICY_NAMES, SimResult, Simulator, build_core
from shared.simulator.params import SimParams

__all__ = ["POLICY_NAMES", "SimParams", "SimResult", "Simulator", "build_core"]
