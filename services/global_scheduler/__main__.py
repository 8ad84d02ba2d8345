"""``python -m services.global_scheduler --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

from shared.config import Config
from shared.service_cli import BoundService, bound_service_main


def build(cfg: Config) -> BoundService:
    from services.global_scheduler.service import GlobalScheduler

    return GlobalScheduler(cfg)


def main(argv: list[str] | None = None) -> int:
    return bound_service_main(
        argv, module="services.global_scheduler", name="global_scheduler", build=build, doc=__doc__
    )


if __name__ == "__main__":
    raise SystemExit(main())
