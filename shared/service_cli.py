"""Command-line plumbing shared by the services: config layering and logging flags.

Configuration layers, later wins: built-in defaults, ``--config PATH`` (TOML), ``--config-json``
(what ``tandem up`` hands its children), then each ``--set section.key=value``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any, Protocol

from shared.config import Config, ConfigError, config_from_json, load_config, parse_overrides
from shared.logs import configure_logging
from shared.runner import run_service


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", help="TOML configuration file")
    parser.add_argument("--config-json", metavar="JSON", help="merged configuration from a parent process")
    parser.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one configuration key",
    )
    parser.add_argument("--log-format", choices=("console", "json"), help="overrides log.format")
    parser.add_argument("--log-level", help="overrides log.level")


def load_service_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    """``extra`` holds a service's own flags already mapped to keys (they win over ``--set``)."""
    overrides: dict[str, Any] = {}
    if args.config_json:
        try:
            inherited = config_from_json(args.config_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config-json is not JSON: {exc}") from exc
        except AttributeError as exc:
            raise ConfigError("--config-json must be a JSON object of [section] maps") from exc
        overrides.update(inherited.as_overrides())
    overrides.update(parse_overrides(args.set))
    if args.log_format:
        overrides["log.format"] = args.log_format
    if args.log_level:
        overrides["log.level"] = args.log_level
    overrides.update({k: v for k, v in (extra or {}).items() if v is not None})
    return load_config(args.config, overrides)


def setup(args: argparse.Namespace, service: str, extra: dict[str, Any] | None = None) -> Config:
    """Load the configuration and configure logging; exit 2 with the reason on a bad config."""
    try:
        cfg = load_service_config(args, extra)
        configure_logging(cfg.get("log.format"), cfg.get("log.level"), service=service)
    except (ConfigError, ValueError) as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    return cfg


def announce(service: str, **fields: Any) -> None:
    """One JSON line on stdout saying where the service listens (parents parse it)."""
    print(json.dumps({"service": service, "event": "listening", **fields}), flush=True)


class BoundService(Protocol):
    """A service that binds its ROUTER, then runs until ``stop``."""

    def bind(self, address: str) -> str: ...
    async def run(self, stop: asyncio.Event) -> None: ...


def bound_service_main(
    argv: list[str] | None,
    *,
    module: str,
    name: str,
    build: Callable[[Config], BoundService],
    doc: str | None,
) -> int:
    """``python -m <module> --bind ADDR [--bind-local ipc://PATH] [--config-json JSON] ...`` for
    a service with one ROUTER: parse, configure, build it (``build`` imports the service lazily),
    bind, announce where it listens (``tandem up`` reads that line), run until SIGTERM."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    parser.add_argument(
        "--bind", default=None, help="ROUTER address (default tcp://<cluster.ip>:0, a free port)"
    )
    parser.add_argument(
        "--bind-local",
        default=None,
        metavar="ipc://PATH",
        help="also an ipc endpoint, for clients on this machine (PLAIN: shared/security/curve.py)",
    )
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.bind_local and not args.bind_local.startswith("ipc://"):
        parser.error(f"--bind-local takes an ipc:// address, not {args.bind_local!r}")
    cfg = setup(args, name)

    async def service(stop: asyncio.Event) -> None:
        instance = build(cfg)
        address = instance.bind(args.bind or f"tcp://{cfg.get('cluster.ip')}:0")
        if args.bind_local:
            announce(name, address=address, local_address=instance.bind(args.bind_local))
        else:
            announce(name, address=address)
        await instance.run(stop)

    return run_service(service, name=name)
