"""``python -m services.serving_controller --bind ADDR [--config-json JSON] ...``"""

from __future__ import annotations

from typing import Any

from shared.config import Config
from shared.service_cli import router_service_main


def _build(cfg: Config) -> Any:
    from services.serving_controller.service import (
        ServingController,
    )  # heavy: only once the arguments are parsed

    return ServingController(cfg)


def main(argv: list[str] | None = None) -> int:
    return router_service_main(argv, name="serving_controller", doc=__doc__, build=_build)


if __name__ == "__main__":
    raise SystemExit(main())
