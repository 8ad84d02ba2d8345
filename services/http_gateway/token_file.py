"""Where the HTTP API's token lives: apart from ``app.py`` so that ``tandem up``, which only
names the file, does not import Jupyter Server and Kernel Gateway (seconds at start and again
at interpreter exit, on every cluster start)."""

from __future__ import annotations

import os
from pathlib import Path

from shared.config import Config


def token_path(cfg: Config, keys_dir: Path | None = None) -> Path:
    """``http.token_file``, else ``http.token`` in the cluster's keys directory."""
    explicit = str(cfg.get("http.token_file"))
    if explicit:
        return Path(os.path.expanduser(explicit))
    return (keys_dir or cfg.keys_dir()) / "http.token"
