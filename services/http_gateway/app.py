"""The Jupyter Kernel Gateway API of a Tandem cluster, served by ``jupyter_kernel_gateway``.

``jupyter lab --gateway-url``, jupyter_server's ``GatewayClient``, JupyterHub and VS Code reach
remote kernels through this API: ``/api/kernelspecs``, ``/api/kernels`` (list, start with ``env``,
interrupt, restart, delete) and ``/api/kernels/{id}/channels``, a WebSocket carrying the Jupyter
protocol. Rather than re-implement it, this runs the reference server of that API, Jupyter Kernel
Gateway (jupyter-server's project, built on jupyter_server's own kernel handlers and WebSocket
bridge, so the wire format is exactly what ``GatewayClient`` was written against), with a
MultiKernelManager whose kernels are Tandem kernels: the ``tandem`` kernelspec names
``TandemProvisioner``, which starts three replicas through the Tandem gateway and hands back the
gateway's five ZMQ ports that the WebSocket bridge then connects to.

What Tandem adds: the token comes from a 0600 file (never argv), only the ``tandem`` kernelspec is
offered, a start's ``KERNEL_*`` variables and ``KERNEL_WORKING_DIR`` become the kernel's launch
environment (``TandemProvisioner`` forwards them to every replica), an unauthenticated request gets
a 401 that says how to authenticate, and the server's logs go through structlog. The kernels it
starts are recorded (``<state>/http/sessions``, 0600: their keys); restarted after a crash, it
re-attaches to those the cluster still runs before it serves (``adopt_kernels``), so they are
listed and usable through the API again and a front end reconnects to the same kernel.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from jupyter_server.log import log_request
from kernel_gateway import mixins
from kernel_gateway.gatewayapp import KernelGatewayApp
from tornado import httpserver, netutil
from traitlets.config import Config as TraitletsConfig

from services.http_gateway.dashboard import add_dashboard
from services.kernelspec import KERNEL_NAME, kernel_json
from services.provisioner import forget_session, read_session, recorded_kernels
from shared.config import Config
from shared.private_files import private_dir, write_private

log = structlog.get_logger("http_gateway")

TOKEN_BYTES = 32
# A request body is read whole before any handler (the token check included) sees the request:
# tornado's default, 100 MB, let anyone who can connect make the server hold 100 MB per
# connection. The API's bodies are a kernel start (its environment is at most 64 KiB,
# shared/kernel_launch.py) and small models; a kernel's messages go over the WebSocket, whose
# frames have their own limit (10 MiB).
MAX_BODY_BYTES = 1 << 20
UNAUTHORIZED = (
    "this Tandem API needs its token: send 'Authorization: token <token>' (or ?token=<token>); "
    "the token is in the file named by http.token_file (default <keys_dir>/http.token)"
)


def load_or_create_token(path: Path) -> str:
    """The API token in ``path``, made (random, 0600) when the file does not exist yet: a token
    that survives restarts, so a remote Lab configured with it keeps working."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        private_dir(path.parent, tighten=False)
        token = secrets.token_urlsafe(TOKEN_BYTES)
        write_private(path, token + "\n", exclusive=True)
        log.info("http_token_created", path=str(path))
        return token
    if not token:
        raise ValueError(f"{path} is empty: put a token in it, or delete it to have one made")
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} is readable by others (chmod 600 it): it is the API's password")
    return token


def install_kernelspec(directory: Path) -> Path:
    """The ``tandem`` kernelspec in ``<directory>/kernels``, where this server alone looks
    (``JUPYTER_PATH``), so the API serves it whether or not ``make setup`` installed one."""
    spec_dir = private_dir(directory / "kernels" / KERNEL_NAME, tighten=False)
    write_private(spec_dir / "kernel.json", json.dumps(kernel_json(), indent=2) + "\n")
    return directory


def _require_token(self: Any) -> Any:
    """Kernel Gateway's token check (``TokenAuthorizationMixin.prepare``, on every REST and
    WebSocket handler), with a constant-time comparison and a 401 that says what to send."""
    expected = self.settings.get("kg_auth_token")
    if expected and self.request.method != "OPTIONS":
        given = self.get_argument("token", None)
        if given is None:
            header = self.request.headers.get("Authorization", "")
            given = header[len("token ") :] if header.startswith("token ") else ""
        if not secrets.compare_digest(given.encode(), expected.encode()):
            # answered here, not raised: tornado would log the raised error with the request's
            # URI, and a ?token= in it
            self.set_status(401, reason="Unauthorized")
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"reason": "Unauthorized", "message": UNAUTHORIZED}))
            return None
    return super(mixins.TokenAuthorizationMixin, self).prepare()


class _ToStructlog(logging.Handler):
    """The Jupyter and tornado loggers' records, as structlog events of this service."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record must not take the server down
            message = str(record.msg)
        method = {
            logging.DEBUG: log.debug,
            logging.INFO: log.info,
            logging.WARNING: log.warning,
        }.get(record.levelno, log.error)
        method(message, logger=record.name)


def route_logs_to_structlog(app_log: logging.Logger, level: str) -> None:
    """The app's logger (the provisioner logs through it too) and tornado's, into structlog."""
    handler = _ToStructlog()
    loggers = [
        app_log,
        *(logging.getLogger(n) for n in ("tornado.access", "tornado.application", "tornado.general")),
    ]
    for logger in loggers:
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(level.upper())


class TandemKernelGatewayApp(KernelGatewayApp):  # type: ignore[misc]
    """Kernel Gateway bound to a port the OS may choose (port 0), told to the launcher."""

    name = "tandem-http"
    sessions_dir = ""  # where TandemProvisioner records this server's kernels ("": not recorded)
    idle_timeout_s = 60.0  # http.idle_timeout_s

    def start_app(self) -> None:
        """Take back the kernels a crashed predecessor started, before serving."""
        if self.sessions_dir:
            self.io_loop.run_sync(lambda: adopt_kernels(self.kernel_manager, self.sessions_dir))
        super().start_app()

    def init_http_server(self) -> None:
        ssl_options = self._build_ssl_options()
        self.http_server = httpserver.HTTPServer(
            self.web_app,
            xheaders=self.trust_xheaders,
            ssl_options=ssl_options,
            max_body_size=MAX_BODY_BYTES,
            idle_connection_timeout=self.idle_timeout_s,
            body_timeout=self.idle_timeout_s,
        )
        sockets = netutil.bind_sockets(self.port, self.ip)
        self.port = sockets[0].getsockname()[1]
        self.http_server.add_sockets(sockets)

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http{'s' if self.certfile else ''}://{host}:{self.port}"


async def adopt_kernels(manager: Any, sessions_dir: str) -> list[str]:
    """Start every kernel recorded in ``sessions_dir`` again by its id: ``TandemProvisioner``
    re-attaches to it when the cluster still runs it (same ports, same key), and drops the record
    otherwise. A clean shutdown of the API stops its kernels and drops their records, so what is
    recorded here at start-up is what a crash left running. Returns the ids re-attached."""
    adopted: list[str] = []
    for kernel_id in recorded_kernels(sessions_dir):
        record = read_session(sessions_dir, kernel_id)
        if record is None:
            forget_session(sessions_dir, kernel_id)
            continue
        try:
            await manager.start_kernel(
                kernel_id=kernel_id, kernel_name=record.get("kernel_name") or KERNEL_NAME
            )
        except Exception as exc:
            log.warning("kernel_not_readopted", kernel=kernel_id, reason=f"{exc.__class__.__name__}: {exc}")
            forget_session(sessions_dir, kernel_id)
            continue
        adopted.append(kernel_id)
        log.info("kernel_readopted", kernel=kernel_id)
    return adopted


def traitlets_config(cfg: Config, token: str) -> TraitletsConfig:
    """The Kernel Gateway settings a Tandem configuration means."""
    c = TraitletsConfig()
    c.KernelGatewayApp.ip = str(cfg.get("http.ip"))
    c.KernelGatewayApp.port = int(cfg.get("http.port"))
    c.KernelGatewayApp.auth_token = token
    c.KernelGatewayApp.default_kernel_name = KERNEL_NAME
    c.KernelGatewayApp.force_kernel_name = KERNEL_NAME  # a remote client's "python3" is a Tandem kernel too
    c.KernelGatewayApp.allow_origin = str(cfg.get("http.allow_origin"))
    c.KernelGatewayApp.certfile = str(cfg.get("http.certfile"))
    c.KernelGatewayApp.keyfile = str(cfg.get("http.keyfile"))
    c.KernelGatewayApp.client_ca = str(cfg.get("http.client_ca"))
    if int(cfg.get("http.max_kernels")) > 0:
        c.KernelGatewayApp.max_kernels = int(cfg.get("http.max_kernels"))
    # unused (token auth, no login page): kept in memory rather than written to ~/.local
    c.KernelGatewayApp.cookie_secret = secrets.token_bytes(32)
    c.JupyterWebsocketPersonality.list_kernels = True
    c.KernelSpecManager.allowed_kernelspecs = {KERNEL_NAME}
    # a kernel's start and stop are requests to the Tandem gateway; the KernelManager's
    # defaults suit a local process (5 s to stop, then kill)
    c.KernelManager.shutdown_wait_time = 15.0
    return c


def build_app(cfg: Config, token: str, spec_root: Path) -> TandemKernelGatewayApp:
    """Initialized (bound, not yet serving)."""
    if bool(cfg.get("http.certfile")) != bool(cfg.get("http.keyfile")):
        raise ValueError("http.certfile and http.keyfile go together: set both for TLS, or neither")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        filter(None, [str(install_kernelspec(spec_root)), os.environ.get("JUPYTER_PATH")])
    )
    mixins.TokenAuthorizationMixin.prepare = _require_token  # type: ignore[method-assign]
    config = traitlets_config(cfg, token)
    config.TandemProvisioner.sessions_dir = str(spec_root / "sessions")
    app = TandemKernelGatewayApp(config=config)
    app.sessions_dir = str(spec_root / "sessions")
    app.idle_timeout_s = float(cfg.get("http.idle_timeout_s"))
    app.initialize(argv=[])
    # jupyter_server's access log, which scrubs ?token= from the URIs it logs (tornado's does not)
    app.web_app.settings["log_function"] = partial(log_request, record_prometheus_metrics=False)
    route_logs_to_structlog(app.log, str(cfg.get("log.level")))
    add_dashboard(app.web_app)
    return app
