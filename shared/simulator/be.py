"""The best-effort (BE) training simulator: apps of training jobs on leased GPUs, one allocation
policy (Themis's arbiter or a baseline, all with ``auction(now, apps, available, capacity)``),
simulated time. Pure and deterministic for (workload, policy, params, timeline).

Rounds. Time advances from event to event (an arrival, a lease expiry, a job or phase end, a
change in the BE-usable GPUs), rounded up to the next multiple of ``round_s``, so completions that
fall within a round are batched into one auction. At each round: apps that arrived join; leases
that expired, or whose GPUs are no longer BE-usable (a cell took them, in a mixed run), end; the
GPUs that are BE-usable and unleased are offered to the policy, whose leases start now. Between
rounds every job with GPUs progresses at g / (t_iter * S) iterations per second, g = min(GPUs,
max_gpus), S its placement sensitivity when its GPUs span hosts, else 1. A job that ends hands its
GPUs (until its lease's expiry) to sibling jobs of its app that can use them (Themis's app
scheduler divides an app's allocation); what no sibling can use goes back to the pool. A
successive-halving app advances a phase once all its live jobs reach the phase's target, killing
the worse half by loss.

BE-usable GPUs come from a ``GpuTimeline`` (``at(now)``, ``next_change(now)``): the whole cluster
for a BE-only run, or the GPUs no notebook cell holds for a mixed run. T_id's capacity is the
time average of that count (``shared.arbiter.estimate``).

Fairness per app is Themis's: rho = (finish - submit) / T_id, T_id = B * N_avg / min(R, demand),
N_avg the time-averaged number of active apps and R the time-averaged BE-usable GPUs over the
app's life, the same formula for every policy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shared.arbiter import AppReport, ArbiterConfig, AuctionOutcome, GpuSlot, JobReport, Lease
from shared.arbiter.baselines import BASELINES
from shared.arbiter.baselines import make_policy as make_baseline_policy
from shared.arbiter.capacity import CapacityMeter
from shared.arbiter.estimate import FinishTimeModel
from shared.arbiter.halving import SuccessiveHalving
from shared.arbiter.reports import APP_SUCCESSIVE_HALVING
from shared.arbiter.slots import spans_hosts
from shared.result_stdout import result_stdout
from shared.workload.be_model import BeApp, BeJob, BeWorkload

POLICIES = ("themis", *BASELINES)


class AllocationPolicy(Protocol):
    def auction(
        self, now: float, apps: Sequence[AppReport], available: Sequence[GpuSlot], be_capacity_gpus: float
    ) -> AuctionOutcome: ...


class GpuTimeline(Protocol):
    """Which GPUs BE jobs may use over time."""

    def at(self, now: float) -> frozenset[GpuSlot]: ...

    def next_change(self, now: float) -> float: ...


@dataclass(frozen=True)
class StaticCluster:
    """All GPUs BE-usable all the time (a BE-only cluster)."""

    slots: frozenset[GpuSlot]

    def at(self, now: float) -> frozenset[GpuSlot]:
        return self.slots

    def next_change(self, now: float) -> float:
        return math.inf


@dataclass(frozen=True)
class StepTimeline:
    """BE-usable GPUs as steps: ``steps[i] = (t_i, slots)`` hold from t_i until t_{i+1} (sorted);
    before the first step, the first step's set."""

    steps: tuple[tuple[float, frozenset[GpuSlot]], ...]

    def at(self, now: float) -> frozenset[GpuSlot]:
        current = self.steps[0][1]
        for t, slots in self.steps:
            if t > now:
                break
            current = slots
        return current

    def next_change(self, now: float) -> float:
        return next((t for t, _ in self.steps if t > now), math.inf)


def cluster(host_gpus: Sequence[int]) -> frozenset[GpuSlot]:
    """GPUs of hosts h000, h001, ... with ``host_gpus[i]`` GPUs each."""
    return frozenset(GpuSlot(f"h{h:03d}", d) for h, n in enumerate(host_gpus) for d in range(n))


#: Themis §6.1's simulated cluster is heterogeneous; ours has the paper's 256 GPUs with the same
#: mix of big, medium and single-GPU machines: 24 x 8 + 12 x 4 + 16 x 1.
THEMIS_256 = (8,) * 24 + (4,) * 12 + (1,) * 16
#: Themis's 64-GPU testbed: 8 machines with 2 GPUs and 12 with 4.
THEMIS_64 = (2,) * 8 + (4,) * 12


def make_policy(name: str, config: ArbiterConfig, time_scale: float = 1.0) -> AllocationPolicy:
    """Themis's arbiter or a baseline (``shared.arbiter.baselines.make_policy``)."""
    return make_baseline_policy(name, config, time_scale)


@dataclass(frozen=True)
class BeSimParams:
    round_s: float = 60.0
    lease_s: float = 600.0
    fairness_knob: float = 0.8
    rho_sample_s: float = 3600.0
    max_time_s: float = math.inf
    seed: int = 0
    lifetime_contention: bool = True
    starving_priority: str = "at_risk"
    #: the trace's time scale (the bench runs tasks at 5% of their length): baselines with time
    #: constants in their definition (Tiresias's queue thresholds) scale them by it
    time_scale: float = 1.0

    def arbiter_config(self) -> ArbiterConfig:
        return ArbiterConfig(
            fairness_knob=self.fairness_knob,
            lease_s=self.lease_s,
            seed=self.seed,
            lifetime_contention=self.lifetime_contention,
            starving_priority=self.starving_priority,
        )


@dataclass(frozen=True)
class AppResult:
    app_id: str
    submitted_at: float
    first_gpu_at: float | None
    finished_at: float | None
    t_id: float
    rho: float
    gpu_seconds: float
    n_avg: float
    alone_s: float = 0.0

    @property
    def rho_floor(self) -> float:
        """The rho this app would have had alone on min(R, demand) GPUs, perfectly placed: T_id
        assumes its work parallelises perfectly, but its longest job (per phase) bounds how soon
        it can finish, so no policy can bring its rho below this."""
        return self.alone_s / self.t_id

    @property
    def queueing_s(self) -> float | None:
        return None if self.first_gpu_at is None else self.first_gpu_at - self.submitted_at


@dataclass
class BeRunResult:
    policy: str
    apps: list[AppResult]
    rho_series: dict[str, list[tuple[float, float]]]
    auction_ms: list[float]
    rounds: int
    makespan_s: float
    gpu_seconds_allocated: float
    usable_gpu_seconds: float
    wall_s: float
    lost_gpu_seconds: float = 0.0  # progress lost when a cell took a leased GPU (since the last step)
    cuts: int = 0  # leases a cell ended at once
    #: CPU time of each round's policy call (this process, all its threads): what the auction
    #: costs, which its wall time (``auction_ms``) shows only on a machine nothing else loads
    auction_cpu_ms: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(a.finished_at is not None for a in self.apps)

    @property
    def max_rho(self) -> float:
        return max(a.rho for a in self.apps)

    @property
    def max_rho_floor(self) -> float:
        return max(a.rho_floor for a in self.apps)

    @property
    def median_rho(self) -> float:
        return statistics.median(a.rho for a in self.apps)

    @property
    def utilization(self) -> float:
        return self.gpu_seconds_allocated / self.usable_gpu_seconds if self.usable_gpu_seconds else 0.0

    def auction_percentile_ms(self, q: float, *, cpu: bool = False) -> float:
        times = self.auction_cpu_ms if cpu else self.auction_ms
        if not times:
            return 0.0
        ordered = sorted(times)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def summary(self) -> dict[str, float | str | int | bool]:
        return {
            "policy": self.policy,
            "max_rho": self.max_rho,
            "median_rho": self.median_rho,
            "max_rho_floor": self.max_rho_floor,
            "gpu_hours": self.gpu_seconds_allocated / 3600.0,
            "utilization": self.utilization,
            "makespan_h": self.makespan_s / 3600.0,
            "rounds": self.rounds,
            "auction_p50_ms": self.auction_percentile_ms(0.5),
            "auction_p95_ms": self.auction_percentile_ms(0.95),
            "auction_cpu_p50_ms": self.auction_percentile_ms(0.5, cpu=True),
            "finished": self.finished,
            "wall_s": self.wall_s,
        }


@dataclass
class _Job:
    spec: BeJob
    app_id: str
    target: float
    done: float = 0.0
    leases: list[Lease] = field(default_factory=list)
    ended: bool = False
    gpus: int = 0
    rate: float = 0.0
    advanced_to: float = -math.inf  # progress already counted up to here within the round
    _report: JobReport | None = None
    _report_key: tuple[int, int, int] = (0, 0, 0)

    def report(self) -> JobReport:
        """The job's progress report, the same object while nothing in it changed (queued jobs)."""
        key = (self.gpus, math.floor(self.done), math.ceil(self.target))
        if self._report is None or self._report_key != key:
            self._report_key = key
            self._report = JobReport(
                self.spec.job_id,
                self.app_id,
                self.gpus,
                self.spec.max_gpus,
                key[1],
                key[2],
                self.spec.model.seconds_per_iteration,
                self.spec.model.placement_sensitivity,
            )
        return self._report

    def set_leases(self, leases: list[Lease]) -> None:
        """Replace the job's leases and recompute its GPU count and its iterations per second."""
        self.leases = leases
        slots = [s for lease in leases for s in lease.slots]
        self.gpus = len(slots)
        g = min(self.gpus, self.spec.max_gpus)
        slow = self.spec.model.placement_sensitivity if spans_hosts(slots) else 1.0
        self.rate = g / (self.spec.model.seconds_per_iteration * slow) if g else 0.0


@dataclass
class _App:
    spec: BeApp
    jobs: dict[str, _Job]
    halving: SuccessiveHalving | None
    first_gpu_at: float | None = None
    finished_at: float | None = None
    gpu_seconds: float = 0.0
    contention_area: float = 0.0
    capacity_area: float = 0.0
    last_job_end: float = 0.0
    live: list[_Job] = field(default_factory=list)
    reached_target: bool = False

    def __post_init__(self) -> None:
        self.live = list(self.jobs.values())

    def report(self, releasing: int = 0) -> AppReport:
        """``releasing``: GPUs of leases that ended this round (see ``AppReport.gpus_releasing``)."""
        return AppReport(
            self.spec.app_id,
            self.spec.submitted_at,
            [j.report() for j in self.live],
            self.spec.app_type,
            phase_iterations=self.spec.phase_iterations,
            phase=self.halving.phase if self.halving else 0,
            budget_gpu_s=self.spec.budget_gpu_s,
            demand_max_gpus=self.spec.demand_max_gpus,
            gpu_seconds_used=self.gpu_seconds,
            gpus_releasing=releasing,
        )


def _start(spec: BeApp) -> _App:
    halving = None
    if spec.app_type == APP_SUCCESSIVE_HALVING:
        halving = SuccessiveHalving([j.job_id for j in spec.jobs], spec.phase_iterations)
    target = (lambda j: float(halving.target)) if halving else (lambda j: float(j.iterations))
    jobs = {j.job_id: _Job(j, spec.app_id, target(j)) for j in spec.jobs}
    return _App(spec, jobs, halving)


def _hand_down(app: _App, leases: list[Lease], now: float) -> None:
    """GPUs of an ended job go to siblings that can use more (same expiry), most work left first."""
    for lease in leases:
        slots = list(lease.slots)
        for sib in sorted(
            (j for j in app.live if not j.ended), key=lambda j: (j.done - j.target, j.spec.job_id)
        ):
            room = sib.spec.max_gpus - sib.gpus
            if room <= 0 or not slots:
                continue
            give, slots = slots[:room], slots[room:]
            sib.set_leases(
                [*sib.leases, Lease(app.spec.app_id, sib.spec.job_id, tuple(give), now, lease.expires_at)]
            )


def _end_jobs(app: _App, now: float) -> None:
    """Job ends at ``now``: plain jobs at their totals, a halving phase once all its jobs are done."""
    if app.halving is None:
        for job in app.live:
            if job.done >= job.target:
                job.ended = True
                freed = job.leases
                job.set_leases([])
                _hand_down(app, freed, now)
    else:
        h = app.halving
        if h.phase_done({j.spec.job_id: math.floor(j.done + 1e-9) for j in app.live}):
            killed = h.advance({j.spec.job_id: j.spec.final_loss for j in app.jobs.values()})
            ended = killed if not h.finished else [j.spec.job_id for j in app.live]
            freed: list[Lease] = []
            for job_id in ended:
                job = app.jobs[job_id]
                job.ended = True
                freed += job.leases
                job.set_leases([])
            for job in app.live:
                job.target = float(h.target)
            _hand_down(app, freed, now)
    app.live = [j for j in app.live if not j.ended]
    app.reached_target = False
    if not app.live:
        app.finished_at = app.last_job_end


def run_be(
    workload: BeWorkload,
    policy_name: str,
    hosts: Sequence[int] | None = None,
    params: BeSimParams | None = None,
    timeline: GpuTimeline | None = None,
    policy: AllocationPolicy | None = None,
    observer: Callable[[float, frozenset[GpuSlot]], None] | None = None,
) -> BeRunResult:
    """Replay ``workload`` under one policy on ``hosts`` (or a ``timeline`` of BE-usable GPUs).

    Within a round, a change of the timeline that removes leased GPUs (a cell took them) ends
    those leases at that instant, not at the next round: cells always win. The job loses its
    progress since its last completed step (the partial iteration in flight; no checkpoint
    model yet) and goes on with the GPUs it still holds. ``observer(t, leased)`` sees the set of
    leased GPUs each time it changes (for invariant checks)."""
    wall = time.perf_counter()
    p = params or BeSimParams()
    tl: GpuTimeline = timeline or StaticCluster(cluster(hosts or THEMIS_256))
    pol = policy or make_policy(policy_name, p.arbiter_config(), p.time_scale)
    pending = deque(sorted(workload.apps, key=lambda a: (a.submitted_at, a.app_id)))
    active: dict[str, _App] = {}
    done: list[_App] = []
    series: dict[str, list[tuple[float, float]]] = {}
    auction_ms: list[float] = []
    auction_cpu_ms: list[float] = []
    rounds = 0
    now = pending[0].submitted_at if pending else 0.0
    start = now
    allocated = 0.0
    lost = 0.0
    cuts = 0
    meter = CapacityMeter()

    def advance(app: _App, job: _Job, until: float) -> None:
        """Progress ``job`` from where it was counted (this round's start or a cut) to ``until``."""
        nonlocal allocated
        since = max(now, job.advanced_to)
        job.advanced_to = until
        r = job.rate
        if r <= 0 or until <= since:
            return
        run = min(until - since, (job.target - job.done) / r)
        job.done = min(job.target, job.done + r * run)
        app.gpu_seconds += job.gpus * run
        allocated += job.gpus * run
        if job.done >= job.target:
            app.last_job_end = max(app.last_job_end, since + run)
            app.reached_target = True

    while pending or active:
        while pending and pending[0].submitted_at <= now:
            spec = pending.popleft()
            active[spec.app_id] = _start(spec)
        usable = tl.at(now)
        leased: set[GpuSlot] = set()
        releasing: dict[str, int] = {}
        for app in active.values():
            for job in app.live:
                if not job.leases:
                    continue
                kept = []
                for lease in job.leases:
                    if lease.expired(now):
                        releasing[lease.app_id] = releasing.get(lease.app_id, 0) + len(lease.slots)
                        continue
                    slots = tuple(s for s in lease.slots if s in usable)
                    if slots:
                        kept.append(
                            Lease(lease.app_id, lease.job_id, slots, lease.granted_at, lease.expires_at)
                        )
                if len(kept) != len(job.leases) or any(
                    k is not o for k, o in zip(kept, job.leases, strict=False)
                ):
                    job.set_leases(kept)
                leased.update(s for lease in kept for s in lease.slots)
        free = sorted(usable - leased)
        capacity = meter.observe(now, len(usable))
        wanting = any(j.gpus < j.spec.max_gpus for a in active.values() for j in a.live)
        if free and wanting:
            reports = [a.report(releasing.get(i, 0)) for i, a in active.items()]
            cpu = time.process_time()
            outcome = pol.auction(now, reports, free, capacity)
            auction_cpu_ms.append((time.process_time() - cpu) * 1e3)
            rounds += 1
            auction_ms.append(outcome.auction_ms)
            for lease in outcome.leases:
                app = active[lease.app_id]
                job = app.jobs[lease.job_id]
                job.set_leases([*job.leases, lease])
                if app.first_gpu_at is None:
                    app.first_gpu_at = now
            for app_id, r in outcome.rho_by_app.items():
                s = series.setdefault(app_id, [])
                if not s or now - s[-1][0] >= p.rho_sample_s:
                    s.append((now, r))
        if observer is not None:
            observer(now, _leased(active))
        running = [j for a in active.values() for j in a.live if j.leases]
        nxt = min(
            pending[0].submitted_at if pending else math.inf,
            tl.next_change(now),
            p.max_time_s,
            *(lease.expires_at for j in running for lease in j.leases),
            *(now + (j.target - j.done) / j.rate for j in running if j.rate > 0),
        )
        if math.isinf(nxt):
            break  # nothing can ever run again (no usable GPU)
        nxt = max(now + p.round_s, math.ceil((nxt - start) / p.round_s - 1e-9) * p.round_s + start)
        dt = nxt - now
        n_active = len(active)
        c_lost, c_cuts = _cut_within_round(tl, now, nxt, usable, active, advance, observer)
        lost += c_lost
        cuts += c_cuts
        for app in active.values():
            app.contention_area += dt * n_active
            app.capacity_area += dt * len(usable)
            for job in app.live:
                advance(app, job, nxt)
                job.advanced_to = -math.inf
        now = nxt
        for app_id in list(active):
            app = active[app_id]
            if app.reached_target:
                _end_jobs(app, now)
            if app.finished_at is not None:
                done.append(active.pop(app_id))
        if now >= p.max_time_s:
            break
    results = [_result(a, now) for a in done + list(active.values())]
    return BeRunResult(
        policy_name,
        sorted(results, key=lambda r: r.app_id),
        series,
        auction_ms,
        rounds,
        now - start,
        allocated,
        meter.area + meter.count * max(0.0, now - meter.last),
        time.perf_counter() - wall,
        lost,
        cuts,
        auction_cpu_ms,
    )


def _leased(active: dict[str, _App]) -> frozenset[GpuSlot]:
    return frozenset(s for a in active.values() for j in a.live for lease in j.leases for s in lease.slots)


def _cut_within_round(
    tl: GpuTimeline,
    start: float,
    end: float,
    usable: frozenset[GpuSlot],
    active: dict[str, _App],
    advance: Callable[[_App, _Job, float], None],
    observer: Callable[[float, frozenset[GpuSlot]], None] | None,
) -> tuple[float, int]:
    """End, at the instant a cell takes them, the leases on GPUs the timeline removes in
    (start, end); GPUs it adds wait for the next round. Returns (GPU-seconds of progress lost,
    leases cut)."""
    lost, cuts = 0.0, 0
    t = tl.next_change(start)
    while t < end:
        now_usable = tl.at(t)
        gone = usable - now_usable
        usable = now_usable
        if gone:
            changed = False
            for app in active.values():
                for job in app.live:
                    if not any(s in gone for lease in job.leases for s in lease.slots):
                        continue
                    advance(app, job, t)
                    partial = job.done - math.floor(job.done + 1e-9)
                    if partial > 0 and job.done < job.target:
                        job.done -= partial
                        lost += partial * job.spec.model.seconds_per_iteration
                    kept = []
                    for lease in job.leases:
                        slots = tuple(s for s in lease.slots if s not in gone)
                        cuts += len(slots) != len(lease.slots)
                        if slots:
                            kept.append(
                                Lease(lease.app_id, lease.job_id, slots, lease.granted_at, lease.expires_at)
                            )
                    job.set_leases(kept)
                    changed = True
            if changed and observer is not None:
                observer(t, _leased(active))
        t = tl.next_change(t)
    return lost, cuts


def _result(app: _App, now: float) -> AppResult:
    end = app.finished_at if app.finished_at is not None else now
    life = max(end - app.spec.submitted_at, 1e-9)
    n_avg = max(1.0, app.contention_area / life)
    capacity = app.capacity_area / life
    r = min(capacity, float(app.spec.demand_max_gpus))
    t_id = app.spec.budget_gpu_s / r * n_avg if r > 0 else math.inf
    return AppResult(
        app.spec.app_id,
        app.spec.submitted_at,
        app.first_gpu_at,
        app.finished_at,
        t_id,
        (end - app.spec.submitted_at) / t_id,
        app.gpu_seconds,
        n_avg,
        FinishTimeModel(_start(app.spec).report(), ArbiterConfig()).remaining(int(r), {"alone": int(r)}),
    )


def run_all(
    workload: BeWorkload,
    policies: Sequence[str] = POLICIES,
    hosts: Sequence[int] | None = None,
    params: BeSimParams | None = None,
    timeline: GpuTimeline | None = None,
    progress: Callable[[BeRunResult], None] | None = None,
) -> dict[str, BeRunResult]:
    """One run per policy on the same workload and cluster."""
    out = {}
    for name in policies:
        out[name] = run_be(workload, name, hosts, params, timeline)
        if progress:
            progress(out[name])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shared.simulator.be``: BE apps under Themis and the baselines, one JSON line per
    policy (``--json``) or a table."""
    from shared.workload.be_trace_csv import read_be_trace_csv
    from shared.workload.themis_workload import ThemisWorkloadParams, generate_themis_workload

    ap = argparse.ArgumentParser(prog="python -m shared.simulator.be", description=main.__doc__)
    ap.add_argument("--trace", help="BE job trace CSV (shared/workload/be_trace_csv.py); default: Workload 1")
    ap.add_argument("--apps", type=int, default=85)
    ap.add_argument("--work-scale", type=float, default=1.0)
    ap.add_argument("--arrival-span-h", type=float, default=14 * 24.0)
    ap.add_argument("--halving-fraction", type=float, default=0.0)
    ap.add_argument("--hosts", default="themis256", help="themis256, themis64, or GPUs per host: 8,8,4,1")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--fairness-knob", type=float, default=0.8)
    ap.add_argument("--lease-s", type=float, default=600.0)
    ap.add_argument("--round-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.trace:
        workload = read_be_trace_csv(args.trace)
    else:
        workload = generate_themis_workload(
            ThemisWorkloadParams(
                n_apps=args.apps,
                work_scale=args.work_scale,
                arrival_span_s=args.arrival_span_h * 3600.0,
                halving_fraction=args.halving_fraction,
                seed=args.seed,
            )
        )
    hosts = {"themis256": THEMIS_256, "themis64": THEMIS_64}.get(args.hosts) or tuple(
        int(x) for x in args.hosts.split(",")
    )
    params = BeSimParams(
        round_s=args.round_s,
        lease_s=args.lease_s,
        fairness_knob=args.fairness_knob,
        seed=args.seed,
        time_scale=1.0 if args.trace else args.work_scale,
    )

    with result_stdout() as out:

        def show(r: BeRunResult) -> None:
            s = r.summary()
            line = (
                json.dumps(s)
                if args.json
                else "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items())
            )
            print(line, file=out, flush=True)

        run_all(
            workload, [p.strip() for p in args.policies.split(",") if p.strip()], hosts, params, progress=show
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
