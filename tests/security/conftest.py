"""Attacks on a running cluster, each a test that failed before its fix. The integration helpers
(``_kernels``) live beside the integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
