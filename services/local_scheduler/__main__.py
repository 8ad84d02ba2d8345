"""``python -m services.local_scheduler --host-id H --scheduler ADDR [--config-json JSON] ...``"""

from __future__ import annotations

import argparse
import asyncio

from shared.runner import run_service
from shared.service_cli import add_common_arguments, announce, setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.local_scheduler", description=__doc__)
    parser.add_argument("--host-id", required=True, help="this host's id (also its DEALER identity)")
    parser.add_argument("--scheduler", required=True, help="the global scheduler's ROUTER address")
    parser.add_argument(
        "--bind",
        default=None,
        help="replica ROUTER address: ipc://PATH (peers admitted by pid) or tcp://IP:PORT (CURVE); "
        "default an ipc socket in the host's state dir where the OS reports peer pids (Linux), "
        "else tcp://<cluster.ip>:0",
    )
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    cfg = setup(args, "local_scheduler")

    async def service(stop: asyncio.Event) -> None:
        from services.local_scheduler.service import LocalScheduler

        scheduler = LocalScheduler(cfg, host_id=args.host_id, scheduler_address=args.scheduler)
        address = scheduler.bind(args.bind)
        announce("local_scheduler", host_id=args.host_id, address=address)
        await scheduler.run(stop)

    return run_service(service, name="local_scheduler")


if __name__ == "__main__":
    raise SystemExit(main())
