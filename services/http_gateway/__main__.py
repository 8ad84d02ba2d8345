"""``python -m services.http_gateway [--config PATH] [--config-json JSON] ...``: the Kernel Gateway API.

Binds ``http.ip``/``http.port`` (port 0: a free one) and prints one JSON line
``{"event": "listening", "address": "http://..."}`` once it serves; ``tandem up`` waits for that
line and publishes the URL in ``cluster.json`` as ``http``. Its kernels are Tandem kernels: the
provisioner finds the cluster through ``$TANDEM_STATE_DIR/cluster.json``. SIGTERM shuts the
kernels it started down, then the server.
"""

from __future__ import annotations

import argparse
import gc
import sys

import structlog

from services.http_gateway.app import build_app, load_or_create_token
from services.http_gateway.token_file import token_path
from shared.service_cli import add_common_arguments, announce, setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.http_gateway", description=__doc__)
    parser.add_argument("--port", type=int, help="http.port (0: a free one)")
    parser.add_argument("--ip", help="http.ip")
    add_common_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = setup(args, "http_gateway", {"http.port": args.port, "http.ip": args.ip})
    log = structlog.get_logger("http_gateway")
    try:
        token = load_or_create_token(token_path(cfg))
        app = build_app(cfg, token, cfg.state_dir() / "http")
    except (OSError, ValueError) as exc:
        print(f"http_gateway: {exc}", file=sys.stderr)
        return 2
    announce("http_gateway", address=app.url)
    log.info("http_api_ready", url=app.url, tls=bool(app.certfile), token_file=str(token_path(cfg)))
    app.start()  # until SIGTERM: Kernel Gateway stops its kernels, then its loop
    log.info("http_api_stopped")
    # Everything is stopped: the interpreter's final collections need not walk Jupyter Server's
    # heap (seconds of pure GC on a busy machine, and `tandem up` waits for this exit)
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
