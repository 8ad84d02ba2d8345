"""For the Jupyter server of a remote front end (``jupyter lab --gateway-url``): kernel WebSockets
that Chrome and Chromium accept.

JupyterLab 4 opens a kernel's WebSocket offering the ``v1.kernel.websocket.jupyter.org``
subprotocol. jupyter_server in gateway mode relays the gateway's frames as they are, so it answers
with no subprotocol (the legacy JSON one, jupyter_server#1311); Chromium fails a handshake that
offered a subprotocol and got none ("Sent non-empty 'Sec-WebSocket-Protocol' header but no
response was received"), and Lab reconnects forever: no kernel in Chrome, whatever the gateway.

This connection negotiates the same subprotocol on both legs instead: the browser's choice is
asked of the gateway too (Tandem's API, being jupyter_server's kernel handlers, speaks v1), and
binary frames are relayed as binary. A client that offers no subprotocol still gets the legacy
one on both legs. Use it with::

    jupyter lab --gateway-url=... \\
        --ServerApp.kernel_websocket_connection_class=services.http_gateway.front_end.V1GatewayWebSocketConnection
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, cast

import tornado.websocket as tornado_websocket
from jupyter_server.gateway.connections import GatewayWebSocketConnection
from jupyter_server.gateway.gateway_client import GatewayClient
from jupyter_server.utils import url_path_join
from tornado.concurrent import Future
from tornado.escape import url_escape
from tornado.httpclient import HTTPRequest
from tornado.ioloop import IOLoop
from traitlets import Unicode


class V1GatewayWebSocketConnection(GatewayWebSocketConnection):  # type: ignore[misc]
    """``GatewayWebSocketConnection`` with the browser's subprotocol carried to the gateway."""

    # None: jupyter_server's default choice, v1 when the client offers it
    kernel_ws_protocol = Unicode(None, allow_none=True, config=True)

    @property
    def chosen_subprotocol(self) -> str | None:
        return cast("str | None", self.websocket_handler.selected_subprotocol)

    async def connect(self) -> None:
        """As upstream, asking the gateway for the subprotocol the browser got."""
        self.ws = None
        ws_url = url_path_join(
            GatewayClient.instance().ws_url or "",
            GatewayClient.instance().kernels_endpoint,
            url_escape(self.kernel_id),
            "channels",
        )
        if self.session_id:
            ws_url += f"?session_id={url_escape(self.session_id)}"
        self.log.info(f"Connecting to {ws_url} ({self.chosen_subprotocol or 'legacy'} protocol)")
        request = HTTPRequest(ws_url, **GatewayClient.instance().load_connection_args())
        chosen = self.chosen_subprotocol
        self.ws_future = cast(
            "Future[Any]",
            tornado_websocket.websocket_connect(request, subprotocols=[chosen] if chosen else None),
        )
        self.ws_future.add_done_callback(self._connection_done)
        IOLoop.current().add_future(self.ws_future, lambda future: self._read_messages())

    async def _read_messages(self) -> None:
        """As upstream, with binary (v1) frames kept binary rather than decoded as text."""
        while self.ws is not None and not self.disconnected:
            try:
                message = await self.ws.read_message()
            except Exception as e:
                self.log.error(f"Exception reading message from websocket: {e}")
                message = None
            if message is None:
                if not self.disconnected:
                    self.log.warning(f"Lost connection to Gateway: {self.kernel_id}")
                break
            self.handle_outgoing_message(message)
        if not self.disconnected and self.retry < GatewayClient.instance().gateway_retry_max:
            client = GatewayClient.instance()
            interval = min(client.gateway_retry_interval * (2**self.retry), client.gateway_retry_interval_max)
            self.retry += 1
            await asyncio.sleep(interval + random.randint(10, 100) * 0.01)  # jitter, as upstream
            IOLoop.current().spawn_callback(self.connect)

    def handle_outgoing_message(self, incoming_msg: str | bytes, *args: Any) -> None:
        """To the browser: as the gateway framed it."""
        try:
            self.websocket_handler.write_message(incoming_msg, binary=isinstance(incoming_msg, bytes))
        except tornado_websocket.WebSocketClosedError:
            self.log.debug("Notebook client closed websocket connection - message dropped")

    def _write_message(self, message: str | bytes) -> None:
        """To the gateway: as the browser framed it."""
        try:
            if not self.disconnected and self.ws is not None:
                self.ws.write_message(message, binary=isinstance(message, bytes))
        except Exception as e:
            self.log.error(f"Exception writing message to websocket: {e}")
