"""``python -m services.gateway --scheduler ADDR [--bind ADDR] [--address-file PATH] ...``.

``--address-file`` receives the API address actually bound (useful with port 0), written only once
the gateway answers requests, so a launcher can wait on the file instead of guessing ports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import structlog
import zmq.asyncio

from services.gateway.service import Gateway
from shared.private_files import write_private
from shared.runner import run_service
from shared.service_cli import add_common_arguments, setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--scheduler", help="global scheduler ROUTER address (gateway.scheduler_address)")
    parser.add_argument("--bind", help="API ROUTER address, port 0 for a free one (gateway.api_address)")
    parser.add_argument("--address-file", help="write the bound API address here once ready")
    add_common_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = setup(
        args,
        "gateway",
        {"gateway.scheduler_address": args.scheduler, "gateway.api_address": args.bind},
    )
    scheduler = cfg.get("gateway.scheduler_address")
    if not scheduler:
        print("gateway: no scheduler address (--scheduler or gateway.scheduler_address)", file=sys.stderr)
        return 2

    async def serve(stop: asyncio.Event) -> None:
        ctx = zmq.asyncio.Context()
        gateway = Gateway(ctx, cfg, scheduler_address=scheduler)
        try:
            address = await gateway.start(cfg.get("gateway.api_address"))
            if args.address_file:
                tmp = Path(args.address_file + ".tmp")
                write_private(tmp, address)
                os.replace(tmp, args.address_file)
            await stop.wait()
        finally:
            await gateway.close()
            ctx.destroy(linger=0)  # never blocks on a socket left open or a send pending to a dead peer
            structlog.get_logger("gateway").info("gateway_stopped")

    return run_service(serve, name="gateway")


if __name__ == "__main__":
    sys.exit(main())
