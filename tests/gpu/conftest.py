"""The GPU tests drive kernels with the integration tests' helpers (``tests/integration/_kernels.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
