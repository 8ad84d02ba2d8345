"""TOML configuration layered over built-in defaults.

Layers, later wins: the defaults below (which serve the embedded single-machine cluster), a TOML
file that names only the keys it changes, then ``section.key=value`` overrides from CLI flags.
Unknown keys and wrongly typed values are rejected with the key's name, because a silently
ignored typo in a deployment config is worse than a refusal to start.
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, dict[str, Any]] = {
    "cluster": {
        "hosts": 4,
        "max_hosts": 4,
        "ip": "127.0.0.1",
        "state_dir": "~/.tandem",
        "replicas_per_kernel": 3,
    },
    "host": {
        # Resources a local scheduler declares. GPUs come from NVML when present, else these.
        "gpus": 8,
        "millicpus": 64_000,
        "memory_mb": 262_144,
        "vram_gb_per_gpu": 40,
        "use_nvml": True,
    },
    "kernel": {
        # The default resource request of a kernel (the kernelspec and TANDEM_* variables override).
        "gpus": 1,
        "millicpus": 1000,
        "memory_mb": 2048,
        "vram_gb": 8,
        "python": "",  # interpreter for replica processes; empty: the one running Tandem
    },
    "scheduler": {
        "heartbeat_interval_s": 1.0,
        "heartbeat_timeout_s": 5.0,
        "replica_start_timeout_s": 60.0,
        "request_timeout_s": 10.0,
        "subscription_ratio_watermark": 3.0,
    },
    "raft": {
        "tick_ms": 20,
        "election_ticks": 10,
        "snapshot_every": 1000,
    },
    "gateway": {
        # The Jupyter-facing edge. Port 0 picks a free port (the embedded cluster); a node
        # deployment pins it so the provisioner's cluster.json stays valid across restarts.
        "api_address": "tcp://127.0.0.1:0",
        "kernel_ip": "127.0.0.1",  # where each kernel's five Jupyter sockets are bound
        "kernel_start_timeout_s": 90.0,
        "status_poll_interval_s": 2.0,  # how often the liveness seen by heartbeats is refreshed
        "scheduler_address": "",  # empty: the one written in cluster.json / passed by `tandem up`
    },
    "embedded": {
        "virtual_gpus": True,  # hosts of `tandem up` declare host.gpus virtual GPUs, not NVML's
        "ready_timeout_s": 60.0,  # until every host has registered
        "log_dir": "",  # empty: <state_dir>/logs
    },
    "datastore": {
        # Where replicas keep large objects (shared/datastore); the Raft log carries only pointers.
        "backend": "local",  # local | s3 | redis
        "path": "",  # local: a directory; empty: <state_dir>/datastore
        "bucket": "tandem",  # s3 (credentials from the standard AWS variables)
        "endpoint_url": "",  # s3: empty for AWS itself, else e.g. http://127.0.0.1:9000
        "url": "redis://127.0.0.1:6379/0",  # redis
        "large_object_bytes": 1_048_576,  # objects above this go to the store, smaller ones to Raft
        "cache_bytes": 268_435_456,  # per-process LRU read cache
        "chunk_bytes": 8_388_608,  # stream unit: file write, S3 part (>= 5 MiB), Redis value
    },
    "log": {
        "format": "console",  # "console" for development, "json" for production
        "level": "info",
    },
}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the source."""


class Config:
    """Read-only view of the merged configuration: ``cfg["cluster"]["hosts"]`` or ``cfg.get("cluster.hosts")``."""

    def __init__(self, data: dict[str, dict[str, Any]]) -> None:
        self._data = data

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self._data[section]

    def get(self, dotted: str) -> Any:
        section, key = _split(dotted, "lookup")
        return self._data[section][key]

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return copy.deepcopy(self._data)

    def as_overrides(self) -> dict[str, Any]:
        """Every key as ``section.key``: the form a child layers its own flags over."""
        return {
            f"{section}.{key}": value for section, keys in self._data.items() for key, value in keys.items()
        }

    def to_json(self) -> str:
        return json.dumps(self._data)

    def state_dir(self) -> Path:
        return Path(os.path.expanduser(os.environ.get("TANDEM_STATE_DIR") or self.get("cluster.state_dir")))


def _split(dotted: str, source: str) -> tuple[str, str]:
    section, sep, key = dotted.partition(".")
    if not sep or section not in DEFAULTS or key not in DEFAULTS[section]:
        raise ConfigError(f"unknown configuration key {dotted!r} ({source})")
    return section, key


def _coerce(dotted: str, value: Any, source: str) -> Any:
    section, key = _split(dotted, source)
    default = DEFAULTS[section][key]
    if isinstance(value, str) and not isinstance(default, str):
        try:
            value = json.loads(value.lower() if isinstance(default, bool) else value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{dotted}: cannot parse {value!r} ({source})") from exc
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(
            f"{dotted} must be {type(default).__name__}, got {type(value).__name__} {value!r} ({source})"
        )
    return value


def _layer(data: dict[str, dict[str, Any]], updates: Mapping[str, Any], source: str) -> None:
    for dotted, value in updates.items():
        section, key = _split(dotted, source)
        data[section][key] = _coerce(dotted, value, source)


def _flatten(tree: Mapping[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, keys in tree.items():
        if not isinstance(keys, Mapping):
            raise ConfigError(f"top-level key {section!r} must be a [section] ({source})")
        for key, value in keys.items():
            flat[f"{section}.{key}"] = value
    return flat


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    """``["cluster.hosts=2", ...]`` -> ``{"cluster.hosts": "2"}`` (values coerced later)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"override {pair!r} must look like section.key=value")
        out[key.strip()] = value.strip()
    return out


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    data = copy.deepcopy(DEFAULTS)
    if path is not None:
        file = Path(path)
        try:
            tree = tomllib.loads(file.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"configuration file {file} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from exc
        _layer(data, _flatten(tree, str(file)), str(file))
    if overrides:
        _layer(data, {k: v for k, v in overrides.items() if v is not None}, "command line")
    return Config(data)


def config_from_json(text: str) -> Config:
    """Children of ``tandem up`` receive the parent's merged configuration this way."""
    data = copy.deepcopy(DEFAULTS)
    _layer(data, _flatten(json.loads(text), "inherited configuration"), "inherited configuration")
    return Config(data)
