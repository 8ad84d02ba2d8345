"""``python -m services.checkpoint_service --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

from shared.config import Config
from shared.service_cli import BoundService, bound_service_main


def build(cfg: Config) -> BoundService:
    from services.checkpoint_service.service import CheckpointService

    return CheckpointService(cfg)


def main(argv: list[str] | None = None) -> int:
    return bound_service_main(
        argv, module="services.checkpoint_service", name="checkpoint", build=build, doc=__doc__
    )


if __name__ == "__main__":
    raise SystemExit(main())
