"""The hibernated kernels on disk (``<state_dir>/scheduler/hibernated.json``, 0600).

A hibernated kernel has no replica, so no host reports it after a scheduler restart the way
running kernels are adopted (``_reconcile_host``); this file is how a restarted scheduler still
knows it: its key, resources, launch environment and namespace image, enough to resume it on its
next request. Rewritten whole (small: one entry per hibernated kernel) after each change, through
a temporary file and a rename, so a crash leaves the old or the new table, never half of one.
A new cluster (``tandem up``) starts without it, as without the gateway's kernel table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from shared.private_files import private_dir, write_private

log = structlog.get_logger("global_scheduler.hibernated")

FIELDS = ("kernel_id", "key", "signature_scheme", "resources", "launch", "image", "image_bytes",
          "hibernated_at", "generation", "resumes")  # fmt: skip


class HibernatedFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, entries: Iterable[dict[str, Any]]) -> None:
        """Write ``entries`` (each with ``FIELDS``); an OSError is logged: the kernels stay
        hibernated in memory, only a scheduler restart would forget them."""
        try:
            private_dir(self.path.parent)
            tmp = self.path.with_suffix(".tmp")
            write_private(tmp, json.dumps({"kernels": list(entries)}))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("hibernated_kernels_not_saved", path=str(self.path), reason=str(exc))

    def load(self) -> list[dict[str, Any]]:
        """The saved entries that carry every field; none if the file is absent or unreadable."""
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.error("hibernated_kernels_unreadable", path=str(self.path), reason=str(exc))
            return []
        kernels = raw.get("kernels") if isinstance(raw, dict) else None
        return [k for k in kernels or [] if isinstance(k, dict) and all(f in k for f in FIELDS)]


def forget_hibernated(state_dir: Path) -> None:
    """A new cluster starts with no kernel: the previous scheduler's hibernated ones are not its."""
    (state_dir / "scheduler" / "hibernated.json").unlink(missing_ok=True)
