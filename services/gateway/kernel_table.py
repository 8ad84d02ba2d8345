"""The gateway's kernel table on disk, so a restarted gateway serves every kernel on the same ports.

What a Jupyter client holds is a connection file: five ports and the kernel's HMAC key. Only the
gateway knows the ports (it bound them); the global scheduler never sees them, and after its own
restart it knows kernels only from the hosts' reports, which do not carry them either. So the
gateway keeps its own table in ``<state_dir>/gateway/kernels.json`` (0600: it holds the keys),
written atomically whenever a kernel is handed to a client or forgotten, and read back at start.
The scheduler stays the authority on whether a kernel lives: a restored kernel is reconciled
with its ``kernel.status`` (services/gateway/service.py), so a kernel that died or stopped while
the gateway was down is reported so, and one the scheduler never heard of is marked dead.

This table survives a gateway restart, a scheduler restart, and both at once, because neither
side's restart depends on the other's memory. A kernel whose start was still in progress when
the gateway died is not in it: its client never got a connection file.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("gateway.kernel_table")

TABLE_VERSION = 1
CHANNELS = ("shell", "iopub", "stdin", "control", "hb")


class KernelTableError(ValueError):
    """A kernel table that cannot be used; the message names the problem."""


@dataclass(frozen=True, slots=True)
class KernelEntry:
    """What a restarted gateway needs to serve one kernel where its clients expect it."""

    kernel_id: str
    key: str
    signature_scheme: str
    ip: str
    ports: dict[str, int] = field(hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "key": self.key,
            "signature_scheme": self.signature_scheme,
            "ip": self.ip,
            "ports": dict(self.ports),
        }

    @classmethod
    def from_dict(cls, raw: Any) -> KernelEntry:
        if not isinstance(raw, dict):
            raise KernelTableError(f"a kernel entry must be a map, not {type(raw).__name__}")
        for name in ("kernel_id", "key", "signature_scheme", "ip"):
            if not isinstance(raw.get(name), str) or not raw[name]:
                raise KernelTableError(
                    f"kernel entry {raw.get('kernel_id')!r}: {name} must be a non-empty string"
                )
        ports = raw.get("ports")
        if not isinstance(ports, dict) or set(ports) != set(CHANNELS):
            raise KernelTableError(
                f"kernel {raw['kernel_id']!r}: ports must name exactly {', '.join(CHANNELS)}"
            )
        for channel, port in ports.items():
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise KernelTableError(
                    f"kernel {raw['kernel_id']!r}: {channel} port {port!r} is not a TCP port"
                )
        return cls(raw["kernel_id"], raw["key"], raw["signature_scheme"], raw["ip"], dict(ports))


def encode_table(entries: list[KernelEntry]) -> bytes:
    body = {"version": TABLE_VERSION, "kernels": [e.to_dict() for e in entries]}
    return json.dumps(body, indent=1, sort_keys=True).encode()


def decode_table(data: bytes) -> tuple[list[KernelEntry], list[str]]:
    """The usable entries and, for each one left out, why. A file that is not a table at all
    raises ``KernelTableError``."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise KernelTableError(f"not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("version") != TABLE_VERSION:
        raise KernelTableError(f"not a version {TABLE_VERSION} kernel table")
    kernels = body.get("kernels")
    if not isinstance(kernels, list):
        raise KernelTableError("kernels must be a list")
    entries: list[KernelEntry] = []
    problems: list[str] = []
    seen: set[str] = set()
    for raw in kernels:
        try:
            entry = KernelEntry.from_dict(raw)
        except KernelTableError as exc:
            problems.append(str(exc))
            continue
        if entry.kernel_id in seen:
            problems.append(f"kernel {entry.kernel_id!r} listed twice")
            continue
        seen.add(entry.kernel_id)
        entries.append(entry)
    return entries, problems


class KernelTableFile:
    """``kernels.json`` in the gateway's state directory: atomic, fsync'd, private."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, entries: list[KernelEntry]) -> None:
        """Replace the table (blocking I/O: call it off the event loop)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a leftover tmp file of another mode
            data = encode_table(entries)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        with contextlib.suppress(OSError):
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def load(self) -> list[KernelEntry]:
        """The saved entries; an unreadable table is logged with its reason and moved aside
        (``kernels.json.bad``) so it is neither trusted nor silently overwritten."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.error("kernel_table_unreadable", path=str(self.path), reason=str(exc))
            return []
        try:
            entries, problems = decode_table(data)
        except KernelTableError as exc:
            aside = self.path.with_name(self.path.name + ".bad")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error("kernel_table_unreadable", path=str(self.path), reason=str(exc), moved_to=str(aside))
            return []
        for problem in problems:
            log.error("kernel_entry_ignored", path=str(self.path), reason=problem)
        return entries
