"""The ``tandem`` kernelspec: what makes "Tandem (replicated)" appear in every Jupyter client.

The spec names the ``tandem-provisioner`` and carries the default resource request in its
provisioner config (the provisioner reads it; TANDEM_* variables override it per session).
``interrupt_mode: message`` because there is no local process to signal: interrupts travel as
``interrupt_request`` on control to the replica that is executing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager

KERNEL_NAME = "tandem"
DISPLAY_NAME = "Tandem (replicated)"
DEFAULT_RESOURCES: dict[str, Any] = {"gpus": 1, "millicpus": 1000, "memory_mb": 2048, "vram_gb": 8}


def kernel_json(python: str | None = None) -> dict[str, Any]:
    return {
        # Only run by a client that ignores provisioners; the module explains and exits.
        "argv": [python or sys.executable, "-m", "services.provisioner", "{connection_file}"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "interrupt_mode": "message",
        "metadata": {
            "debugger": True,  # JupyterLab offers its debugger only to a kernelspec saying so
            "kernel_provisioner": {
                "provisioner_name": "tandem-provisioner",
                "config": dict(DEFAULT_RESOURCES),
            },
        },
    }


def install(*, user: bool = False, prefix: str | None = None) -> str:
    """Install the spec (``user`` or ``prefix``; neither: system-wide) and return where it went."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = Path(tmp) / KERNEL_NAME
        spec_dir.mkdir()
        (spec_dir / "kernel.json").write_text(json.dumps(kernel_json(), indent=2) + "\n")
        return KernelSpecManager().install_kernel_spec(
            str(spec_dir), kernel_name=KERNEL_NAME, user=user, prefix=prefix, replace=True
        )


def install_private(prefix: Path) -> str:
    """Install the spec under ``prefix`` and put that prefix first on this process's
    ``JUPYTER_PATH``: benchmarks and tests reach ``tandem`` without touching the user's specs.
    Returns the ``JUPYTER_PATH`` it replaced ('' when none)."""
    install(prefix=str(prefix))
    old = os.environ.get("JUPYTER_PATH", "")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(prefix / "share" / "jupyter"), old]))
    return old
