"""``python -m services.checkpoint_service --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

import argparse
import asyncio

from shared.runner import run_service
from shared.service_cli import add_common_arguments, announce, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.checkpoint_service", description=__doc__)
    parser.add_argument(
        "--bind", default=None, help="ROUTER address (default tcp://<cluster.ip>:0, a free port)"
    )
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    cfg = setup(args, "checkpoint")

    async def service(stop: asyncio.Event) -> None:
        from services.checkpoint_service.service import CheckpointService

        checkpoints = CheckpointService(cfg)
        address = checkpoints.bind(args.bind or f"tcp://{cfg.get('cluster.ip')}:0")
        announce("checkpoint", address=address)
        await checkpoints.run(stop)

    return run_service(service, name="checkpoint")


if __name__ == "__main__":
    raise SystemExit(main())
