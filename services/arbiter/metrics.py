"""The arbiter's ``/metrics``: per-app rho and GPU time, the cluster's GPUs split into cells / BE /
idle, and the jobs by state, from one ``arbiter.status`` snapshot per scrape
(``shared.snapshot_metrics``, as the global scheduler's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from shared.snapshot_metrics import SnapshotExporter


def arbiter_exporter(
    snapshot: Callable[[], dict[str, Any]], loop: asyncio.AbstractEventLoop
) -> SnapshotExporter:
    return SnapshotExporter(snapshot, loop, _families)


def _families(snap: dict[str, Any]) -> Iterable[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
    total = CounterMetricFamily("tandem_gpu_seconds_by_use", "Provisioned GPU-seconds by use", labels=["use"])
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
