"""A kernel's launch environment: the working directory and variables its replicas start with.

A stock ipykernel is a child of its client and inherits what the client gives ``Popen``: ``cwd``
(nbclient's and papermill's ``cwd``, JupyterLab's notebook folder) and ``env`` (the kernelspec's
``env``, Enterprise Gateway's ``KERNEL_*`` variables). A Tandem kernel runs as replicas on other
hosts, started again on migration and restart, so this travels as data with ``kernel.start``,
every ``replica.start``/``replica.restart`` and a host's report of what it runs (``launch``).

Two kinds of working directory: one the client asked for (``required``: a host without it fails
the start, as ``Popen(cwd=...)`` does), and one only inherited or mirrored from a remote front end
(``KERNEL_WORKING_DIR`` through the HTTP API, the client's own directory): used where it exists,
else the replica starts in the host's default directory, as jupyter_server's ``cwd_for_path``
walks up when documents and kernels are not on one file system.

Pure: no I/O but ``os.path.isdir`` in ``directory_on_this_host``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Ours, or fixed when the interpreter starts (a pre-warmed runtime has already started: setting
# them later would work in a cold start and not in a warm one), or the replica's own imports.
RESERVED_PREFIXES = ("TANDEM_", "JPY_")
RESERVED_NAMES = frozenset(
    {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH"}
)
WORKING_DIR_VAR = "KERNEL_WORKING_DIR"  # Enterprise Gateway's name; jupyter_server's GatewayClient sends it
MAX_ENV_BYTES = 64 * 1024  # a kernel start is one message; a bigger environment is a mistake


class LaunchError(ValueError):
    """A launch environment that cannot be used; the message names the field."""


def reserved(name: str) -> bool:
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES)


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    cwd: str = ""  # absolute; "": the host's default directory
    cwd_required: bool = False
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, raw: Any) -> KernelLaunch:
        """From a message's ``launch`` field (absent: the default); LaunchError says what is wrong."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise LaunchError("launch must be a map")
        cwd = raw.get("cwd", "")
        if not isinstance(cwd, str) or (cwd and not os.path.isabs(cwd)) or "\0" in cwd:
            raise LaunchError(f"launch.cwd must be an absolute path, not {cwd!r}")
        required = raw.get("cwd_required", False)
        if not isinstance(required, bool):
            raise LaunchError("launch.cwd_required must be true or false")
        env = raw.get("env") or {}
        if not isinstance(env, dict):
            raise LaunchError("launch.env must be a map of names to strings")
        size = 0
        for name, value in env.items():
            if not isinstance(name, str) or ENV_NAME.fullmatch(name) is None:
                raise LaunchError(f"launch.env: {name!r} is not a variable name")
            if reserved(name):
                raise LaunchError(f"launch.env: {name} is reserved (Tandem sets it, or it is fixed at start)")
            if not isinstance(value, str) or "\0" in value:
                raise LaunchError(f"launch.env: the value of {name} must be a string")
            size += len(name) + len(value)
        if size > MAX_ENV_BYTES:
            raise LaunchError(f"launch.env holds {size} bytes; at most {MAX_ENV_BYTES}")
        return cls(cwd, required and bool(cwd), dict(env))

    def to_wire(self) -> dict[str, Any]:
        return {"cwd": self.cwd, "cwd_required": self.cwd_required, "env": dict(self.env)}

    def directory_on_this_host(self) -> tuple[str | None, str | None]:
        """(the directory to start in, or None for the default; a warning, or None). A required
        directory that is missing raises LaunchError."""
        if not self.cwd or os.path.isdir(self.cwd):
            return (self.cwd or None), None
        if self.cwd_required:
            raise LaunchError(f"the kernel's working directory {self.cwd} does not exist on this host")
        return None, f"working directory {self.cwd} does not exist here; starting in the default one"


def from_client(
    env: Mapping[str, str] | None, cwd: str | None, client_environ: Mapping[str, str], client_cwd: str
) -> KernelLaunch:
    """What a Jupyter client's ``start_kernel(env=..., cwd=...)`` asks of a Tandem kernel.

    Forwarded: every ``KERNEL_*`` variable and every variable the client set on top of its own
    environment (the kernelspec's ``env``, an explicit ``env=``), not the client's whole
    environment (its secrets and paths belong to its machine, not the cluster's hosts). The
    working directory is ``cwd`` (required), else ``KERNEL_WORKING_DIR``, else the client's own
    directory (both used where they exist)."""
    env = env or {}
    chosen = {
        name: value
        for name, value in env.items()
        if ENV_NAME.fullmatch(name)
        and not reserved(name)
        and (name.startswith("KERNEL_") or client_environ.get(name) != value)
    }
    if cwd:
        return KernelLaunch(os.path.abspath(os.path.join(client_cwd, cwd)), True, chosen)
    mirrored = env.get(WORKING_DIR_VAR, "")
    if mirrored and os.path.isabs(mirrored):
        return KernelLaunch(mirrored, False, chosen)
    return KernelLaunch(client_cwd, False, chosen)
