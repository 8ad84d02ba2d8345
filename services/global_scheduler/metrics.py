"""What the global scheduler measures, from messages it handles anyway (no extra traffic per cell).

Per cell (an ``execute_request``), in the scheduler's own view of the paper's definitions (§5.1):

* interactivity delay: the request's arrival here to its executor's election (the local scheduler
  binds the GPUs and reports ``elected`` just before the cell's code starts);
* task completion time: arrival to the moment the merged reply completed the request;
* whether GPUs were committed immediately: a replica's host had the GPUs free when the cell
  arrived (a designated executor) and the election did not fail (no migration needed);
* which replica executed, and the times of the scheduler-visible steps: ``route_ms`` (arrival to
  the request sent on), ``held_ms`` (waiting for a migration, then sent on again), ``elect_ms``
  (sent on to elected), ``run_ms`` (elected to completion);
* the executor's own step times (``replica_steps_ms``: decide, elect, state wait, bind, apply
  wait, run, confirm, replied, and the state replication steps after the reply), which the
  replica pushes as ``replica.event cell_timings`` after its reply (off the critical path).

Cluster-wide: subscription ratio, provisioned and committed GPUs, migrations, scale events, warm
pools, replica start times (cold vs warm). ``status()`` feeds ``cluster.status``;
``PrometheusExporter`` serves the same numbers on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from services.global_scheduler.cluster_state import RUNNING, STARTING
from shared.policies.placement import cluster_subscription_ratio
from shared.snapshot_metrics import SnapshotExporter

if TYPE_CHECKING:
    from services.global_scheduler.autoscaling import ClusterAutoscaler
    from services.global_scheduler.cluster_state import ClusterState

log = structlog.get_logger("metrics")

OPEN_CELLS_MAX = 10_000  # cells never completed (a lost reply) are dropped oldest first past this
DELAY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# replica steps are often well under a millisecond (a bind ahead, an empty state wait)
STEP_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, *DELAY_BUCKETS_S)
# What a replica's ``cell_timings`` event may carry (kernel_replica/kernel.py ``timing``, in this
# order in reports): the execute path's steps, then the state replication after the reply (ms).
REPLICA_STEPS = (
    "decide_ms",
    "elect_ms",
    "state_wait_ms",
    "bind_ms",
    "apply_wait_ms",
    "load_wait_ms",  # the large objects the cell may touch, still loading on a new executor
    "run_ms",
    "confirm_ms",
    "replied_ms",
    "analysis_ms",
    "fingerprint_ms",
    "serialize_ms",
    "store_ms",
    "replicate_ms",  # DONE and STATE handed to Raft -> committed (the executor's idle waits for it)
    "to_gpu_ms",  # GPU residency (kernel_replica/device_residency.py): notebook tensors moved
    "to_host_ms",
)
# sizes, not times: the cell's STATE entry, the tensors moved to the GPU and back
REPLICA_SIZES = ("state_bytes", "to_gpu_bytes", "to_host_bytes")
MAX_STEP_MS = 7 * 24 * 3600 * 1000.0  # a week: anything longer is a broken clock, not a step


def parse_cell_timings(detail: Any) -> tuple[dict[str, float], list[str]]:
    """A replica's ``cell_timings`` detail as ``({step or size: value}, unknown keys left out)``;
    ``ValueError`` naming the problem unless it is a mapping whose known keys hold finite,
    non-negative numbers (the event crosses processes). Unknown keys are left out, not fatal, so
    a replica that reports a new step does not lose the others."""
    if not isinstance(detail, dict) or not detail:
        raise ValueError(f"cell_timings detail must be a non-empty mapping, got {type(detail).__name__}")
    timings: dict[str, float] = {}
    unknown: list[str] = []
    for key, value in detail.items():
        if key not in REPLICA_STEPS and key not in REPLICA_SIZES:
            unknown.append(str(key)[:64])
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"cell_timings {key!r} must be a number, got {type(value).__name__}")
        limit = float("inf") if key in REPLICA_SIZES else MAX_STEP_MS
        if not math.isfinite(value) or not 0 <= value <= limit:
            raise ValueError(f"cell_timings {key!r} is out of range: {value!r}")
        timings[key] = float(value)
    if not timings:
        raise ValueError(f"cell_timings has no known step (got {sorted(unknown)[:8]})")
    return timings, sorted(unknown)


@dataclass(slots=True)
class CellRecord:
    kernel_id: str
    msg_id: str
    submitted_at: float  # wall clock, for reports
    arrived: float  # scheduler clock
    routed: float = 0.0
    designated: str | None = None
    immediate: bool = True
    elected: float | None = None
    executor: str | None = None
    host: str | None = None
    completed: float | None = None
    steps_ms: dict[str, float] = field(default_factory=dict)
    replica_steps_ms: dict[str, float] = field(default_factory=dict)  # the executor's own (ms)
    replica_bytes: dict[str, int] = field(default_factory=dict)  # state_bytes, to_gpu_bytes, ...

    @property
    def interactivity_delay_ms(self) -> float | None:
        return None if self.elected is None else (self.elected - self.arrived) * 1000

    @property
    def task_completion_ms(self) -> float | None:
        return None if self.completed is None else (self.completed - self.arrived) * 1000

    def report(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("arrived", "routed", "elected", "completed"):
            out.pop(key)
        out["interactivity_delay_ms"] = _r(self.interactivity_delay_ms)
        out["task_completion_ms"] = _r(self.task_completion_ms)
        out["steps_ms"] = {k: round(v, 3) for k, v in self.steps_ms.items()}
        out["replica_steps_ms"] = {k: round(v, 3) for k, v in self.replica_steps_ms.items()}
        return out


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def percentiles(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {}
    return {
        "count": len(data),
        "p50": round(data[len(data) // 2], 3),
        "p90": round(data[min(int(len(data) * 0.9), len(data) - 1)], 3),
        "p99": round(data[min(int(len(data) * 0.99), len(data) - 1)], 3),
        "mean": round(statistics.fmean(data), 3),
    }


class SchedulerMetrics:
    def __init__(self, *, cells_kept: int = 1000, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: OrderedDict[tuple[str, str], CellRecord] = OrderedDict()
        self.cells: deque[CellRecord] = deque(maxlen=max(cells_kept, 1))
        # completed cells by key, for the executor's timings that arrive after the reply
        self._completed: OrderedDict[tuple[str, str], CellRecord] = OrderedDict()
        self.cells_total = 0
        self.cells_immediate = 0
        self.migrations = 0
        self.replica_starts: dict[str, deque[float]] = {"cold": deque(maxlen=500), "warm": deque(maxlen=500)}
        self.warm_pools: dict[str, dict[str, int]] = {}  # host -> {warm, starting} from heartbeats
        self.on_cell_completed: Callable[[CellRecord], None] | None = None  # the exporter's histograms
        self.on_replica_timings: Callable[[dict[str, float]], None] | None = None  # likewise
        self.timings_dropped = 0  # cell_timings events refused (malformed, unknown cell, not the executor)

    # ---- cells (called from the scheduler's message handlers) -------------------------------

    def cell_submitted(
        self, kernel_id: str, msg_id: str, arrived: float, designated: str | None, needs_gpus: bool
    ) -> None:
        now = self._clock()
        earlier = self._open.get((kernel_id, msg_id))
        if earlier is not None:  # sent on again after a migration: it keeps its arrival and verdict
            earlier.designated = designated
            earlier.steps_ms["held_ms"] = earlier.steps_ms.get("held_ms", 0.0) + (now - earlier.routed) * 1000
            earlier.routed = now
            return
        record = CellRecord(
            kernel_id,
            msg_id,
            time.time(),
            arrived,
            now,
            designated,
            immediate=designated is not None or not needs_gpus,
        )
        record.steps_ms["route_ms"] = (now - arrived) * 1000
        self._open[(kernel_id, msg_id)] = record
        if len(self._open) > OPEN_CELLS_MAX:
            self._open.popitem(last=False)

    def cell_elected(self, kernel_id: str, msg_id: str, replica_id: str, host_id: str) -> None:
        record = self._open.get((kernel_id, msg_id))
        if record is None:  # the reply came first (it travels another socket): who ran it, still
            done = self._completed.get((kernel_id, msg_id))
            if done is not None and done.executor is None:
                done.executor, done.host = replica_id, host_id
            return
        if record.elected is not None:
            return
        record.elected = self._clock()
        record.executor, record.host = replica_id, host_id
        record.steps_ms["elect_ms"] = (record.elected - record.routed) * 1000
        if record.designated is not None and record.designated != replica_id:
            record.immediate = False  # another replica had to take over (its host had the GPUs later)

    def cell_not_committed(self, kernel_id: str, msg_id: str) -> None:
        """Every replica yielded (no host could bind the GPUs): not committed immediately."""
        record = self._open.get((kernel_id, msg_id))
        if record is not None:
            record.immediate = False

    def requests_finished(self, kernel_id: str, msg_ids: Iterable[str]) -> None:
        for msg_id in msg_ids:
            record = self._open.pop((kernel_id, msg_id), None)
            if record is None:
                continue  # not an execute_request
            record.completed = self._clock()
            if record.elected is not None:
                record.steps_ms["run_ms"] = (record.completed - record.elected) * 1000
            self.cells.append(record)
            self._completed[(kernel_id, msg_id)] = record
            while len(self._completed) > (self.cells.maxlen or 1):
                self._completed.popitem(last=False)
            self.cells_total += 1
            self.cells_immediate += record.immediate
            if self.on_cell_completed is not None:
                self.on_cell_completed(record)

    def cell_timings(self, kernel_id: str, msg_id: str, replica_id: str, detail: Any) -> bool:
        """The executor's step times for a cell (``replica.event cell_timings``, sent after its
        reply, so usually after the cell completed here). False, logged, when refused: malformed,
        an unknown (or long forgotten) cell, or a replica other than the cell's executor."""
        clog = log.bind(kernel=kernel_id, replica=replica_id, msg_id=msg_id)
        try:
            timings, unknown = parse_cell_timings(detail)
        except ValueError as exc:
            self.timings_dropped += 1
            clog.warning("cell_timings_dropped", reason=str(exc))
            return False
        if unknown:
            clog.warning("cell_timings_unknown_steps_left_out", steps=unknown[:8])
        key = (kernel_id, msg_id)
        record = self._open.get(key) or self._completed.get(key)
        if record is None or (record.executor is not None and record.executor != replica_id):
            self.timings_dropped += 1
            reason = "unknown cell" if record is None else f"not its executor ({record.executor})"
            clog.info("cell_timings_dropped", reason=reason)
            return False
        record.replica_steps_ms = {k: v for k, v in timings.items() if k in REPLICA_STEPS}
        record.replica_bytes = {k: int(v) for k, v in timings.items() if k in REPLICA_SIZES}
        if self.on_replica_timings is not None:
            self.on_replica_timings(timings)
        return True

    # ---- cluster events ---------------------------------------------------------------------

    def record_migration(self) -> None:
        """Part of the migration path: one replica moved (counted in status and /metrics)."""
        self.migrations += 1

    def record_replica_start(self, warm: bool, seconds: float) -> None:
        self.replica_starts["warm" if warm else "cold"].append(seconds * 1000)

    def record_pool(self, host_id: str, pool: Any) -> None:
        if isinstance(pool, dict):
            self.warm_pools[host_id] = {k: int(v) for k, v in pool.items() if isinstance(v, int)}

    # ---- reports ----------------------------------------------------------------------------

    def cell_summary(self) -> dict[str, Any]:
        recent = list(self.cells)
        return {
            "cells_total": self.cells_total,
            "cells_committed_immediately": self.cells_immediate,
            "immediate_commit_ratio": round(self.cells_immediate / self.cells_total, 4)
            if self.cells_total
            else None,
            "interactivity_delay_ms": percentiles(
                d for c in recent if (d := c.interactivity_delay_ms) is not None
            ),
            "task_completion_ms": percentiles(t for c in recent if (t := c.task_completion_ms) is not None),
            "steps_ms": {
                step: percentiles(c.steps_ms[step] for c in recent if step in c.steps_ms)
                for step in ("route_ms", "held_ms", "elect_ms", "run_ms")
            },
            "replica_steps_ms": {
                step: percentiles(c.replica_steps_ms[step] for c in recent if step in c.replica_steps_ms)
                for step in REPLICA_STEPS
            },
            "replica_bytes": {
                size: percentiles(c.replica_bytes[size] for c in recent if size in c.replica_bytes)
                for size in REPLICA_SIZES
            },
            "cell_timings_dropped": self.timings_dropped,
            "replica_start_ms": {kind: percentiles(v) for kind, v in self.replica_starts.items()},
        }

    def recent_cells(self, limit: int) -> list[dict[str, Any]]:
        return [c.report() for c in list(self.cells)[-limit:]] if limit > 0 else []


class PrometheusExporter(SnapshotExporter):
    """``/metrics`` over HTTP (prometheus_client's server thread). Gauges are read from a snapshot
    taken on the scheduler's event loop at scrape time; per-cell histograms are observed as cells
    complete (prometheus_client's metrics are thread-safe)."""

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        loop: asyncio.AbstractEventLoop,
        metrics: SchedulerMetrics,
    ) -> None:
        from prometheus_client import Counter, Histogram, Summary

        super().__init__(snapshot, loop, _cluster_families)
        self._delay = Histogram(
            "tandem_cell_interactivity_delay_seconds",
            "Arrival of an execute_request at the scheduler to its executor's election",
            buckets=DELAY_BUCKETS_S,
            registry=self.registry,
        )
        self._completion = Histogram(
            "tandem_cell_task_completion_seconds",
            "Arrival of an execute_request at the scheduler to its completed reply",
            buckets=DELAY_BUCKETS_S,
            registry=self.registry,
        )
        self._steps = Histogram(
            "tandem_cell_step_seconds",
            "Scheduler-visible steps of the execute path (route, held, elect, run)",
            ["step"],
            buckets=DELAY_BUCKETS_S,
            registry=self.registry,
        )
        self._replica_steps = Histogram(
            "tandem_cell_replica_step_seconds",
            "The executor's own steps of the execute path and of the state replication after the reply",
            ["step"],
            buckets=STEP_BUCKETS_S,
            registry=self.registry,
        )
        self._replica_bytes = Summary(
            "tandem_cell_replica_bytes",
            "Per cell on its executor: the STATE entry's size (state), tensors moved to the GPU and back",
            ["kind"],
            registry=self.registry,
        )
        self._cells = Counter(
            "tandem_cells", "Completed cells", ["committed_immediately"], registry=self.registry
        )
        metrics.on_cell_completed = self.observe
        metrics.on_replica_timings = self.observe_replica_timings

    def observe(self, record: CellRecord) -> None:
        if (delay := record.interactivity_delay_ms) is not None:
            self._delay.observe(delay / 1000)
        if (completion := record.task_completion_ms) is not None:
            self._completion.observe(completion / 1000)
        for step, ms in record.steps_ms.items():
            self._steps.labels(step=step.removesuffix("_ms")).observe(ms / 1000)
        self._cells.labels(committed_immediately=str(record.immediate).lower()).inc()

    def observe_replica_timings(self, timings: dict[str, float]) -> None:
        for step, value in timings.items():
            if step in REPLICA_SIZES:
                self._replica_bytes.labels(kind=step.removesuffix("_bytes")).observe(value)
            else:
                self._replica_steps.labels(step=step.removesuffix("_ms")).observe(value / 1000)


def _cluster_families(snap: dict[str, Any]) -> Iterable[Any]:
    """Cluster gauges and counters from one scheduler snapshot."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    cluster = snap["cluster"]
    for name, help_text in (
        ("hosts", "Live hosts"),
        ("provisioned_gpus", "GPUs of the live hosts"),
        ("committed_gpus", "GPUs bound to executing replicas (or reserved for one)"),
        ("subscribed_gpus", "GPUs requested by the replicas placed on live hosts"),
        ("subscription_ratio", "Cluster subscription ratio sum(S) / (sum(G) * R)"),
        ("kernels", "Kernels starting or running"),
        ("pending_hosts", "Hosts asked of the provider, not registered yet"),
        ("warm_runtimes", "Pre-warmed replica processes ready on all hosts"),
    ):
        yield GaugeMetricFamily(f"tandem_{name}", help_text, value=float(cluster[name]))
    for name, help_text in (
        ("migrations", "Replica migrations"),
        ("scale_out_hosts", "Hosts added by the autoscaler"),
        ("scale_in_hosts", "Hosts released by the autoscaler"),
    ):
        yield CounterMetricFamily(f"tandem_{name}", help_text, value=float(cluster[name]))
    per_host = GaugeMetricFamily("tandem_host_committed_gpus", "GPUs committed per host", labels=["host"])
    ratio = GaugeMetricFamily("tandem_host_subscription_ratio", "S / (G * R) per host", labels=["host"])
    for host in snap["hosts"]:
        per_host.add_metric([host["id"]], float(host["committed"]))
        ratio.add_metric([host["id"]], float(host["subscription_ratio"]))
    yield per_host
    yield ratio


def cluster_report(
    state: ClusterState, autoscaling: ClusterAutoscaler, metrics: SchedulerMetrics, metrics_url: str | None
) -> dict[str, Any]:
    """``cluster.status``: the cluster state's report (``hosts[]``, ``kernels[]``) plus the
    autoscaler's state and scale events, each host's warm pool, and the metrics."""
    report = state.cluster_status()
    live = [h for h in state.host_views() if h.alive]
    for host in report["hosts"]:
        host["provisioned_by_autoscaler"] = autoscaling.provider.owns(host["id"])
        host["warm_pool"] = metrics.warm_pools.get(host["id"], {})
    r = state.replicas_per_kernel
    report["cluster"] = {
        "hosts": len(live),
        "provisioned_gpus": sum(h.gpus for h in live),
        "committed_gpus": sum(h.committed_gpus for h in live),
        "subscribed_gpus": sum(h.subscribed_gpus for h in live),
        "subscription_ratio": round(cluster_subscription_ratio(live), 4) if live else 0.0,
        "kernels": sum(1 for k in state.kernels.values() if k.state in (STARTING, RUNNING)),
        "pending_hosts": autoscaling.policy.pending_hosts,
        "warm_runtimes": sum(metrics.warm_pools.get(h.host_id, {}).get("warm", 0) for h in live),
        "migrations": metrics.migrations,
        "scale_out_hosts": autoscaling.scale_outs,
        "scale_in_hosts": autoscaling.scale_ins,
        "scale_events": len(autoscaling.events),
        "replicas_per_kernel": r,
    }
    report["autoscale"] = autoscaling.status()
    report["scale_events"] = list(autoscaling.events)
    report["metrics"] = {**metrics.cell_summary(), "prometheus_url": metrics_url}
    report["cells"] = metrics.recent_cells(50)
    return report
