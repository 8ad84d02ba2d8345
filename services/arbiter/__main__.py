"""``python -m services.arbiter --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

from shared.config import Config
from shared.service_cli import BoundService, bound_service_main


def build(cfg: Config) -> BoundService:
    from services.arbiter.service import ArbiterService

    return ArbiterService(cfg)


def main(argv: list[str] | None = None) -> int:
    return bound_service_main(argv, module="services.arbiter", name="arbiter", build=build, doc=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
