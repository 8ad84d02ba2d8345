"""``python -m services.serving_controller --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

from shared.config import Config
from shared.service_cli import BoundService, bound_service_main


def build(cfg: Config) -> BoundService:
    from services.serving_controller.service import ServingController  # heavy: only once parsed

    return ServingController(cfg)


def main(argv: list[str] | None = None) -> int:
    return bound_service_main(
        argv, module="services.serving_controller", name="serving_controller", build=build, doc=__doc__
    )


if __name__ == "__main__":
    raise SystemExit(main())
