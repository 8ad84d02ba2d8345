"""Job-level baselines, as their own papers define them: Tiresias (discretized 2D-LAS) and
Gandiva-fair (per-user tickets, gang-aware stride scheduling). Same interface as the arbiter
(``auction(now, apps, available, be_capacity_gpus) -> AuctionOutcome``) and the same leases, so the
BE simulator and the live arbiter service can drive them.

Themis §6.1 describes its "Tiresias" as app-level least attained service ("all apps report their
service metric and we allocate the resource to apps that have the least GPU service"); that one is
``shared.arbiter.baselines.las_app``. Tiresias itself (Gu et al., NSDI'19, §3.2-3.3) schedules
*jobs*, not apps, on priority queues discretised by attained service, and is the one here. Themis
does not evaluate Gandiva-fair (Chaudhary et al., EuroSys'20); it is here as the fair-share
scheduler of its time that, unlike Themis, splits GPU time between users, not apps' finish times.

Both are stateful across rounds (attained service, stride passes), integrate what each job holds
between calls, and see no more of the cluster than the arbiter does: the GPUs free this round
(leased GPUs come back at lease expiry, which is when these policies preempt: a job whose lease
ended competes again at its current priority).
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.arbiter.agent import pack
from shared.arbiter.arbiter import Arbiter, AuctionOutcome
from shared.arbiter.config import ArbiterConfig
from shared.arbiter.lease import Lease
from shared.arbiter.reports import AppReport, JobReport
from shared.arbiter.slots import GpuSlot


def _runnable(job: JobReport) -> bool:
    return job.iterations_total is None or job.iterations_done < job.iterations_total


def _need(job: JobReport) -> int:
    """GPUs the job asks for beyond those it holds: its full request (gang scheduling)."""
    return max(0, job.max_gpus - job.gpus) if _runnable(job) else 0


class _JobPolicy:
    """Shared shell: per-app rho (the same visibility phase as Themis, for the rho series), the
    placement of one job's gang, and the leases."""

    name = "job-policy"

    def __init__(self, config: ArbiterConfig | None) -> None:
        self.config = config or ArbiterConfig()
        self._visibility = Arbiter(self.config)

    def _place(
        self, job: JobReport, n: int, left: list[GpuSlot], rng: random.Random, *, consolidate: bool
    ) -> tuple[GpuSlot, ...] | None:
        """``n`` of the free GPUs ``left`` for ``job``, or None if they cannot be had: a
        consolidated job (or any job with ``single_host_jobs``) on one host (the host it already
        runs on, if any), tightest fit first; else any ``n`` GPUs, in a seeded random order."""
        if len(left) < n:
            return None
        one_host = consolidate or self.config.single_host_jobs
        if not one_host:
            return tuple(rng.sample(left, n))
        by_host: dict[str, int] = {}
        for s in left:
            by_host[s.host_id] = by_host.get(s.host_id, 0) + 1
        hosts = [h for h, free in by_host.items() if free >= n and (job.host is None or h == job.host)]
        if not hosts:
            if self.config.single_host_jobs:
                return None
            return pack({job.job_id: n}, left)[job.job_id]  # spans hosts: as few as it can
        host = min(hosts, key=lambda h: (by_host[h], h))
        return tuple(s for s in left if s.host_id == host)[:n]

    def _outcome(
        self,
        now: float,
        apps: Sequence[AppReport],
        be_capacity_gpus: float,
        grants: list[tuple[JobReport, tuple[GpuSlot, ...]]],
        start: float,
    ) -> AuctionOutcome:
        rho = {a.app_id: a.rho_current for a in self._visibility.agents(now, apps, be_capacity_gpus)}
        won: dict[str, int] = {}
        leases = []
        for job, slots in grants:
            won[job.app_id] = won.get(job.app_id, 0) + len(slots)
            leases.append(Lease(job.app_id, job.job_id, slots, now, now + self.config.lease_s))
        return AuctionOutcome(leases, rho, won_by_app=won, auction_ms=(time.perf_counter() - start) * 1e3)


@dataclass
class _Attained:
    """Tiresias's per-job state: GPU-seconds attained, since when it is counted, GPUs it held."""

    service: float = 0.0
    base: float = 0.0  # service at the last starvation promotion (the queue counts from here)
    seen_at: float = 0.0
    gpus: int = 0
    ran_from: float | None = None  # start of the current (or last) run
    last_run_s: float = 0.0
    waiting_since: float | None = None


@dataclass(frozen=True)
class TiresiasParams:
    """Discretized 2D-LAS (Tiresias §3.2.2-3.2.3). ``thresholds_gpu_s``: attained service (GPUs x
    seconds run) at which a job drops to the next queue, K = len + 1 queues (Tiresias evaluates
    K = 2 as its default and finds few queues enough); 3,600 GPU-s (one GPU-hour) is our choice for
    Workload 1's median 3.75-GPU-hour task, scaled with the trace (``time_scale``).
    ``promote_knob``: a waiting job that has waited longer than ``promote_knob`` times its last
    run goes back to the highest queue (Tiresias's PROMOTEKNOB starvation guard). ``consolidate_at``:
    placement sensitivity from which a job is placed on one host (Tiresias §3.3 consolidates
    only models with large tensor skew, VGG- and AlexNet-like, and spreads the rest)."""

    thresholds_gpu_s: tuple[float, ...] = (3600.0,)
    promote_knob: float = 8.0
    consolidate_at: float = 1.25

    def scaled(self, time_scale: float) -> TiresiasParams:
        return TiresiasParams(
            tuple(t * time_scale for t in self.thresholds_gpu_s), self.promote_knob, self.consolidate_at
        )


class TiresiasPolicy(_JobPolicy):
    """Tiresias's Discretized 2D-LAS, information-agnostic (Gu et al., NSDI'19, §3.2): each *job*
    (not app) sits in the queue its attained service (GPU-seconds) reaches; queues in priority
    order, FIFO by arrival within a queue; jobs are gang-scheduled (a job starts only with all the
    GPUs it asks for, lower-priority jobs that fit go ahead of one that does not); a job starved
    for ``promote_knob`` times its last run is promoted to the first queue. Preemption happens at
    lease expiry (the job's GPUs come back to the pool and it competes again at its priority).
    Themis §6.1 compares against an app-level LAS and calls it Tiresias; see ``las_app``."""

    name = "tiresias"

    def __init__(self, config: ArbiterConfig | None = None, params: TiresiasParams | None = None) -> None:
        super().__init__(config)
        self.params = params or TiresiasParams()
        self._jobs: dict[str, _Attained] = {}

    def queue_of(self, job_id: str) -> int:
        """0 is the highest-priority queue."""
        state = self._jobs[job_id]
        return bisect.bisect_right(self.params.thresholds_gpu_s, state.service - state.base)

    def _observe(self, now: float, jobs: list[JobReport]) -> None:
        """Attained service since the last call (at the GPUs each job held then), runs, waits,
        starvation promotions."""
        live = set()
        for job in jobs:
            live.add(job.job_id)
            st = self._jobs.get(job.job_id)
            if st is None:
                st = self._jobs[job.job_id] = _Attained(seen_at=now, waiting_since=now)
            st.service += st.gpus * max(0.0, now - st.seen_at)
            st.seen_at = now
            self._set_gpus(st, job.gpus, now)
            if (
                st.gpus == 0
                and st.waiting_since is not None
                and st.last_run_s > 0
                and now - st.waiting_since >= self.params.promote_knob * st.last_run_s
            ):
                st.base = st.service  # promoted: back to the first queue
                st.waiting_since = now
        for gone in self._jobs.keys() - live:
            del self._jobs[gone]

    @staticmethod
    def _set_gpus(st: _Attained, gpus: int, now: float) -> None:
        if gpus > 0 and st.gpus == 0:
            st.ran_from, st.waiting_since = now, None
        elif gpus == 0 and st.gpus > 0:
            st.last_run_s = now - (st.ran_from if st.ran_from is not None else now)
            st.waiting_since = now
        st.gpus = gpus

    def auction(
        self, now: float, apps: Sequence[AppReport], available: Sequence[GpuSlot], be_capacity_gpus: float
    ) -> AuctionOutcome:
        start = time.perf_counter()
        arrival = {a.app_id: a.submitted_at for a in apps}
        jobs = [j for a in apps for j in a.jobs]
        self._observe(now, jobs)
        order = sorted(
            (j for j in jobs if _need(j) > 0),
            key=lambda j: (self.queue_of(j.job_id), arrival[j.app_id], j.app_id, j.job_id),
        )
        left = sorted(available)
        rng = random.Random(f"{self.config.seed}:{now!r}")
        grants: list[tuple[JobReport, tuple[GpuSlot, ...]]] = []
        for job in order:
            if not left:
                break
            consolidate = job.placement_sensitivity >= self.params.consolidate_at
            got = self._place(job, _need(job), left, rng, consolidate=consolidate)
            if got is None:
                continue
            taken = set(got)
            left = [s for s in left if s not in taken]
            grants.append((job, got))
            self._set_gpus(self._jobs[job.job_id], job.gpus + len(got), now)
        return self._outcome(now, apps, be_capacity_gpus, grants, start)


@dataclass
class _User:
    """Gandiva-fair's per-user stride state (a user is an app here)."""

    tickets: float
    passes: float
    job_pass: dict[str, float] = field(default_factory=dict)


class GandivaFairPolicy(_JobPolicy):
    """Gandiva-fair (Chaudhary et al., EuroSys'20, §3-4): every active user (here: every app)
    holds equal tickets and gets a ticket-proportional share of GPU time, scheduled by a gang-aware
    stride scheduler over time quanta (here: leases). Each quantum, the user with the lowest pass
    runs its job with the lowest pass that fits the free GPUs (the user's tickets are split evenly
    between its jobs), and both passes advance by the job's GPUs x the quantum over the tickets;
    a user who arrives (or comes back) starts at the lowest pass of the active users, so time spent
    away is not banked. Multi-GPU jobs go on as few hosts as possible (Gandiva-fair's central
    scheduler places a gang within a server).

    Not modelled: GPU trading between users across GPU generations (Gandiva-fair §5: users whose
    jobs gain most from fast GPUs buy their share of them with slow-GPU share): it needs a
    heterogeneous cluster, and ours (Themis's testbed, all K80s) has one generation, so there is
    nothing to trade; job migration for consolidation is not modelled either."""

    name = "gandiva_fair"

    def __init__(self, config: ArbiterConfig | None = None, tickets: float = 100.0) -> None:
        super().__init__(config)
        self.tickets = tickets
        self._users: dict[str, _User] = {}
        self._active: set[str] = set()  # users that held or wanted GPUs last round

    def auction(
        self, now: float, apps: Sequence[AppReport], available: Sequence[GpuSlot], be_capacity_gpus: float
    ) -> AuctionOutcome:
        start = time.perf_counter()
        present = {a.app_id for a in apps}
        for gone in self._users.keys() - present:
            del self._users[gone]
        wanting = {a.app_id: [j for j in a.jobs if _need(j) > 0] for a in apps}
        active = {a.app_id for a in apps if a.gpus_held > 0 or wanting[a.app_id]}
        staying = [self._users[u].passes for u in active & self._active if u in self._users]
        floor = min(staying, default=min((u.passes for u in self._users.values()), default=0.0))
        for a in apps:
            user = self._users.setdefault(a.app_id, _User(self.tickets, floor))
            user.job_pass = {j.job_id: user.job_pass.get(j.job_id, 0.0) for j in a.jobs}
            if a.app_id in active and a.app_id not in self._active:
                user.passes = max(user.passes, floor)  # back from idle: no banked time
        self._active = active
        quantum = self.config.lease_s
        left = sorted(available)
        rng = random.Random(f"{self.config.seed}:{now!r}")
        grants: list[tuple[JobReport, tuple[GpuSlot, ...]]] = []
        users = {u for u, js in wanting.items() if js}
        while left and users:
            uid = min(users, key=lambda u: (self._users[u].passes, u))
            user = self._users[uid]
            placed = None
            for job in sorted(wanting[uid], key=lambda j: (user.job_pass[j.job_id], j.job_id)):
                got = self._place(job, _need(job), left, rng, consolidate=True)
                if got is not None:
                    placed = (job, got)
                    break
            if placed is None:
                users.discard(uid)  # nothing of this user fits what is left this round
                continue
            job, got = placed
            taken = set(got)
            left = [s for s in left if s not in taken]
            grants.append((job, got))
            wanting[uid].remove(job)
            if not wanting[uid]:
                users.discard(uid)
            n_jobs = max(1, len(user.job_pass))
            user.passes += len(got) * quantum / user.tickets
            user.job_pass[job.job_id] += len(got) * quantum * n_jobs / user.tickets
        return self._outcome(now, apps, be_capacity_gpus, grants, start)
