"""A blocking Jupyter kernel client over a Kernel Gateway ``/api/kernels/{id}/channels`` WebSocket.

``jupyter_client``'s ``BlockingKernelClient`` builds every request (execute, complete, inspect,
history, kernel_info...) and waits for replies through its channel objects; here those channels
are one WebSocket (JSON messages, each naming its channel) instead of five ZMQ sockets, so any
code written against a blocking client, ``jupyter_kernel_test`` included, can run through the
HTTP API unchanged.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any

import websocket
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.jsonutil import json_default

MESSAGE_KEYS = ("header", "parent_header", "metadata", "content", "buffers", "msg_id", "msg_type")


class _Hub:
    """The WebSocket and a reader thread that sorts incoming messages into one queue per channel."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.ws = websocket.create_connection(url, header=headers, timeout=60)
        self.queues: dict[str, queue.Queue[dict[str, Any]]] = {
            name: queue.Queue() for name in ("shell", "iopub", "stdin", "control", "hb")
        }  # "hb": never fed (the server checks the heartbeat itself); there for start/stop
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="ws-kernel-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                raw = self.ws.recv()
            except (websocket.WebSocketException, OSError):
                return
            if not raw:
                return
            msg = json.loads(raw)
            target = self.queues.get(msg.pop("channel", ""))
            if target is not None:
                target.put({key: msg[key] for key in MESSAGE_KEYS if key in msg})

    def send(self, channel: str, msg: dict[str, Any]) -> None:
        framed = {key: msg[key] for key in ("header", "parent_header", "metadata", "content")}
        with self._lock:
            self.ws.send(json.dumps({**framed, "channel": channel}, default=json_default))

    def close(self) -> None:
        self.ws.close()
        self._reader.join(timeout=5)


class _Channel:
    """One channel of the hub, with the methods a blocking client's channel has."""

    def __init__(self, hub: _Hub, name: str) -> None:
        self.hub = hub
        self.name = name
        self._alive = False

    def start(self) -> None:
        self._alive = True

    def stop(self) -> None:
        self._alive = False

    def is_alive(self) -> bool:
        return self._alive

    def send(self, msg: dict[str, Any]) -> None:
        self.hub.send(self.name, msg)

    def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        return self.hub.queues[self.name].get(timeout=timeout)  # queue.Empty, like a ZMQ channel

    def get_msgs(self) -> list[dict[str, Any]]:
        msgs = []
        while not self.hub.queues[self.name].empty():
            msgs.append(self.get_msg(timeout=0))
        return msgs

    def msg_ready(self) -> bool:
        return not self.hub.queues[self.name].empty()


class WebSocketKernelClient(BlockingKernelClient):  # type: ignore[misc]
    """``BlockingKernelClient`` whose channels are the kernel's ``/channels`` WebSocket."""

    def __init__(self, url: str, token: str, kernel_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        ws_url = url.replace("http", "ws", 1) + f"/api/kernels/{kernel_id}/channels"
        self._hub = _Hub(ws_url, {"Authorization": f"token {token}"})
        self._ws_channels = {name: _Channel(self._hub, name) for name in self._hub.queues}

    shell_channel = property(lambda self: self._ws_channels["shell"])
    iopub_channel = property(lambda self: self._ws_channels["iopub"])
    stdin_channel = property(lambda self: self._ws_channels["stdin"])
    control_channel = property(lambda self: self._ws_channels["control"])
    hb_channel = property(lambda self: self._ws_channels["hb"])

    def is_alive(self) -> bool:
        return self._hub._reader.is_alive()

    def stop_channels(self) -> None:
        for channel in self._ws_channels.values():
            channel.stop()
        self._hub.close()
