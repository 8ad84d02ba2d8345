"""``python -m services.serving_controller --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

import argparse
import asyncio

from shared.runner import run_service
from shared.service_cli import add_common_arguments, announce, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.serving_controller", description=__doc__)
    parser.add_argument(
        "--bind", default=None, help="ROUTER address (default tcp://<cluster.ip>:0, a free port)"
    )
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    cfg = setup(args, "serving_controller")

    async def service(stop: asyncio.Event) -> None:
        from services.serving_controller.service import ServingController

        controller = ServingController(cfg)
        address = controller.bind(args.bind or f"tcp://{cfg.get('cluster.ip')}:0")
        announce("serving_controller", address=address)
        await controller.run(stop)

    return run_service(service, name="serving_controller")


if __name__ == "__main__":
    raise SystemExit(main())
