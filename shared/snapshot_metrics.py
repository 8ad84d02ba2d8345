"""``/metrics`` over HTTP from one snapshot of a service's state per scrape.

prometheus_client serves scrapes on its own thread; the snapshot is taken on the service's event
loop (``run_coroutine_threadsafe``), where its state lives, so a scrape never reads it half
changed. The global scheduler and the arbiter each turn their snapshot into metric families.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import structlog

log = structlog.get_logger("metrics")

Snapshot = dict[str, Any]


class SnapshotExporter:
    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        loop: asyncio.AbstractEventLoop,
        families: Callable[[Snapshot], Iterable[Any]],
    ) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self._snapshot = snapshot
        self._loop = loop
        self._server: Any = None
        self.port = 0
        self.address = ""
        self.registry.register(_SnapshotCollector(self._take_snapshot, families))

    def _take_snapshot(self) -> Snapshot:
        async def take() -> Snapshot:
            return self._snapshot()

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=5.0)

    def start(self, address: str, port: int) -> int:
        """Serve on ``port`` (-1 or 0 here: a free port the OS picks); the port bound."""
        from prometheus_client import start_http_server

        self._server, _thread = start_http_server(max(port, 0), addr=address, registry=self.registry)
        self.port = int(self._server.server_port)
        self.address = address
        return self.port

    @property
    def url(self) -> str | None:
        return f"http://{self.address}:{self.port}/metrics" if self.port else None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _SnapshotCollector:
    def __init__(self, take: Callable[[], Snapshot], families: Callable[[Snapshot], Iterable[Any]]) -> None:
        self._take = take
        self._families = families

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterable[Any]:
        try:
            snap = self._take()
        except Exception as exc:  # the loop is stopping: serve nothing rather than fail the scrape
            log.warning("metrics_snapshot_failed", reason=repr(exc))
            return
        yield from self._families(snap)
