"""The arbiter's ``/metrics``: per-app rho and GPU time, the cluster's GPUs split into cells / BE /
idle, and the jobs by state, from one ``arbiter.status`` snapshot per scrape (taken on the
service's event loop, like the global scheduler's exporter)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import structlog

log = structlog.get_logger("arbiter.metrics")


class ArbiterExporter:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], loop: asyncio.AbstractEventLoop) -> None:
        from prometheus_client import CollectorRegistry

        self._snapshot = snapshot
        self._loop = loop
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self._take))
        self._server: Any = None
        self.url: str | None = None

    def _take(self) -> dict[str, Any]:
        async def take() -> dict[str, Any]:
            return self._snapshot()

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=5.0)

    def start(self, address: str, port: int) -> None:
        """Serve on ``port`` (0: a free port the OS picks)."""
        from prometheus_client import start_http_server

        self._server, _thread = start_http_server(port, addr=address, registry=self.registry)
        self.url = f"http://{address}:{self._server.server_port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Collector:
    def __init__(self, take: Callable[[], dict[str, Any]]) -> None:
        self._take = take

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        try:
            snap = self._take()
        except Exception as exc:  # the loop is stopping: serve nothing rather than fail the scrape
            log.warning("metrics_snapshot_failed", reason=repr(exc))
            return
        rho = GaugeMetricFamily(
            "tandem_be_app_rho", "Finish-time fairness rho = T_sh / T_id per app", labels=["app"]
        )
        gpu_s = CounterMetricFamily(
            "tandem_be_app_gpu_seconds", "GPU-seconds leased to each app's jobs", labels=["app"]
        )
        held = GaugeMetricFamily("tandem_be_app_gpus", "GPUs each app's jobs hold now", labels=["app"])
        jobs = GaugeMetricFamily("tandem_be_jobs", "Best-effort jobs by state", labels=["state"])
        by_state: dict[str, int] = {}
        for app_id, app in snap["apps"].items():
            if app.get("rho") is not None:
                rho.add_metric([app_id], float(app["rho"]))
            gpu_s.add_metric([app_id], float(app["gpu_seconds"]))
            held.add_metric([app_id], float(app["gpus_now"]))
            for state, count in app["jobs"].items():
                by_state[state] = by_state.get(state, 0) + count
        for state, count in sorted(by_state.items()):
            jobs.add_metric([state], float(count))
        usage = snap["usage"]
        now = GaugeMetricFamily("tandem_gpus_by_use", "Provisioned GPUs by use now", labels=["use"])
        total = CounterMetricFamily(
            "tandem_gpu_seconds_by_use", "Provisioned GPU-seconds by use", labels=["use"]
        )
        for use in ("cells", "be", "idle"):
            now.add_metric([use], float(usage["gpus_now"][use]))
            total.add_metric([use], float(usage["gpu_seconds"][use]))
        yield from (rho, gpu_s, held, jobs, now, total)
        yield GaugeMetricFamily(
            "tandem_be_capacity_gpus",
            "Time-averaged GPUs BE jobs could use (T_id's R)",
            value=usage["be_capacity_gpus"],
        )
        yield CounterMetricFamily("tandem_arbiter_rounds", "Auction rounds run", value=float(snap["rounds"]))
