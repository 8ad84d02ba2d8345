"""The per-app AGENT (Themis §4.2.2): reports rho in the visibility phase, answers an offer with a
bid table, and in the allocation phase splits what its app won between the app's jobs.

Pure: built from an ``AppReport`` each round; the arbiter supplies time, the BE-usable capacity
and the app's average contention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.arbiter.config import ArbiterConfig
from shared.arbiter.estimate import FinishTimeModel, Work, job_shares
from shared.arbiter.reports import AppReport, JobReport
from shared.arbiter.slots import GpuSlot

#: rho_old of a starving app: T_sh is unbounded, and this stands for it in the PF objective's
#: log(rho_old / rho_new) (any finite grant gains ~14 nats over it).
STARVING_RHO = 1e6


@dataclass(frozen=True)
class Contention:
    """How many apps an app has shared the cluster with: ``area`` (integral of the active-app
    count) over the ``seen_s`` seconds since it arrived, and ``now`` apps active at present."""

    area: float
    seen_s: float
    now: int

    def lifetime_average(self, remaining_s: float) -> float:
        """N_avg over the app's life if today's count holds for its ``remaining_s`` seconds."""
        span = self.seen_s + remaining_s
        if span <= 0 or math.isinf(remaining_s):
            return max(1.0, float(self.now))
        return max(1.0, (self.area + self.now * remaining_s) / span)


@dataclass(frozen=True, order=True)
class Bundle:
    """A GPU subset of an offer, up to what the valuation depends on: ``gpus`` GPUs either all on
    host ``host``, or anywhere (``host`` None, valued as if every multi-GPU job share spanned
    hosts, so a placement-sensitive app prefers a packed bundle)."""

    gpus: int
    host: str | None = None


@dataclass(frozen=True)
class Bid:
    """An app's bid table (Themis Table 2/3): ``rho_old`` for receiving nothing, and the new rho
    for each bundle. Only bundles that improve on ``rho_old`` are listed."""

    app_id: str
    rho_old: float
    table: tuple[tuple[Bundle, float], ...]


def offer_sizes(limit: int, cap: int) -> list[int]:
    """Bundle sizes an agent bids on: powers of two up to ``limit`` plus ``limit`` itself (Themis
    bids on 1/2/4/8/16), at most ``cap`` of them (the largest kept)."""
    if limit <= 0:
        return []
    sizes = sorted({1 << k for k in range(limit.bit_length()) if (1 << k) <= limit} | {limit})
    return sizes[-cap:] if len(sizes) > cap else sizes


class AppAgent:
    """One app's agent for one round."""

    def __init__(
        self,
        report: AppReport,
        config: ArbiterConfig,
        *,
        now: float,
        capacity_gpus: float,
        n_avg: float,
        model: FinishTimeModel | None = None,
        contention: Contention | None = None,
    ) -> None:
        self.report = report
        self.config = config
        self.now = now
        self.model = model or FinishTimeModel(report, config)
        self.capacity_gpus = capacity_gpus
        self.n_avg = n_avg
        self.contention = contention
        self.t_id = self.model.t_id(capacity_gpus, n_avg)
        self.held = report.gpus_held
        self.releasing = report.gpus_releasing

    @property
    def app_id(self) -> str:
        return self.report.app_id

    @property
    def wants(self) -> int:
        """GPUs beyond those held that the app could use now."""
        current = self.model.phases[0] if self.model.phases else []
        usable = sum(w.max_gpus for w in current if w.seconds > 0)
        return max(0, usable - self.held)

    @property
    def placement_sensitive(self) -> bool:
        return any(w.sensitivity > 1.0 for p in self.model.phases for w in p)

    def t_sh(self, gpus: int, layout: Mapping[str, int] | None = None) -> float:
        return self.model.t_sh(self.now, gpus, layout)

    def rho(self, gpus: int, layout: Mapping[str, int] | None = None) -> float:
        """rho = T_sh / T_id if the app held ``gpus`` GPUs (laid out as ``layout``) to the end.

        N_avg in T_id is the contention over the app's whole life (Themis §4.3.1). With
        ``contention`` known, the life so far is measured and the rest, the remaining time on
        ``gpus``, is taken at today's count, as Eq. 1 takes the allocation as binding till the end;
        without it, N_avg is the average so far (which, while apps keep arriving, undervalues an
        early app's T_id and overvalues its rho against a later arrival's)."""
        if math.isinf(self.t_id):
            return 1.0
        if self.contention is None:
            return self.t_sh(gpus, layout) / self.t_id
        remaining = self.model.remaining(gpus, layout)
        t_sh = max(0.0, self.now - self.report.submitted_at) + remaining
        return t_sh / self.model.t_id(self.capacity_gpus, self.contention.lifetime_average(remaining))

    @property
    def starving(self) -> bool:
        """Holds no GPU but has work: its T_sh, hence its rho, is unbounded (Themis §3.3.2). An app
        whose leases all ended this round is renewing, not starving: counted starving, it bid first
        every time its leases ended together and kept winning them (live: one app of two got
        ~25% more GPU time over a minute of 2.5 s leases)."""
        return self.held == 0 and self.releasing == 0 and self.wants > 0

    @property
    def rho_current(self) -> float:
        """The visibility phase's report: rho with what the app holds now. A starving app's rho is
        unbounded; it reports, finitely, the rho it would reach if it got its fair share
        (BE capacity / N_avg GPUs) from now on: its waiting so far over T_id, plus its remaining
        work at a fair rate. That ranks starving apps by how long they have waited for their work,
        not by how bad one GPU would be for them (which would push sweeps with little work left
        to the back of the queue forever). An app renewing its ended leases reports the rho of
        holding them still."""
        if self.held == 0 and self.releasing > 0:
            return self.rho(self.releasing)
        if self.held > 0 or not self.starving:
            return self.rho(self.held)
        if math.isinf(self.t_id):
            return 1.0
        fair = max(1, min(self.wants, math.floor(self.capacity_gpus / max(1.0, self.n_avg))))
        return self.rho(fair)

    @property
    def rho_old(self) -> float:
        """The bid's valuation of getting nothing: the current rho, unbounded (``STARVING_RHO``)
        for a starving app, so that a proportional-fair allocation serves every starving bidder
        it can before it enlarges anyone's share ("any non-zero GPU allocation to that app will
        lead to a huge improvement in the app's valuation", §3.3.2)."""
        return STARVING_RHO if self.starving else self.rho_current

    def bid(self, free_by_host: Mapping[str, int]) -> Bid:
        """The bid table for an offer of ``free_by_host`` GPUs (the visibility phase, step 3)."""
        rho_old = self.rho_old
        total = sum(free_by_host.values())
        table: list[tuple[Bundle, float]] = []
        sizes = offer_sizes(min(total, self.wants), self.config.max_bundle_sizes)
        for k in (k for k in sizes if k >= self.smallest_start):
            anywhere = self.rho(self.held + k)
            if anywhere < rho_old:
                table.append((Bundle(k), anywhere))
            if not self.placement_sensitive or k < 2:
                continue
            packed = self.rho(self.held + k, None if self.held else {"one host": k})
            if packed >= min(anywhere, rho_old):
                continue
            fits = sorted((free, host) for host, free in free_by_host.items() if free >= k)
            table += [(Bundle(k, host), packed) for _, host in fits[: self.config.packed_hosts_per_size]]
        return Bid(self.app_id, rho_old, tuple(table))

    def assign(self, slots: Sequence[GpuSlot]) -> dict[str, tuple[GpuSlot, ...]]:
        """Allocation phase, step 5: split won GPUs between the app's unfinished jobs (shares by
        water-filling, each job's share from as few hosts as possible)."""
        jobs = list(self.report.jobs)
        current = self.model.phases[0] if self.model.phases else []
        works = [
            Work(w.seconds, max(0, w.max_gpus - j.gpus), w.sensitivity)
            for w, j in zip(current, jobs, strict=True)
        ]
        if not self.config.single_host_jobs and all(j.min_gpus == 1 or j.gpus > 0 for j in jobs):
            shares = job_shares(works, len(slots))
            return pack(dict((j.job_id, s) for j, s in zip(jobs, shares, strict=True) if s > 0), slots)
        return place_jobs(jobs, works, slots, single_host=self.config.single_host_jobs)

    @property
    def smallest_start(self) -> int:
        """The fewest GPUs that let one more job run or grow: 1 if some job already runs, else
        the smallest ``min_gpus`` of its waiting jobs (a bid below it could not be used)."""
        current = self.model.phases[0] if self.model.phases else []
        open_jobs = [
            j for j, w in zip(self.report.jobs, current, strict=True) if w.seconds > 0 and j.gpus < j.max_gpus
        ]
        if any(j.gpus > 0 for j in open_jobs):
            return 1
        return min((j.min_gpus for j in open_jobs), default=1)


def place_jobs(
    jobs: Sequence[JobReport], works: Sequence[Work], slots: Sequence[GpuSlot], *, single_host: bool
) -> dict[str, tuple[GpuSlot, ...]]:
    """Split ``slots`` between jobs honouring each job's lower bound (a waiting job gets at least
    ``min_gpus`` or nothing) and, with ``single_host``, one host per job (a running job grows only
    on its own host). Most work first: each job first gets its minimum on the host that fits it
    most tightly, then jobs grow one GPU at a time up to ``works[i].max_gpus`` (their room). GPUs
    no job can use are left out (the caller keeps them free)."""
    by_host: dict[str, list[GpuSlot]] = {}
    for s in sorted(slots):
        by_host.setdefault(s.host_id, []).append(s)
    order = sorted(
        (i for i, w in enumerate(works) if w.seconds > 0 and w.max_gpus > 0), key=lambda i: -works[i].seconds
    )
    got: dict[int, list[GpuSlot]] = {}

    def take(i: int, n: int, hosts: list[str]) -> bool:
        if single_host:
            fits = [h for h in hosts if len(by_host.get(h, ())) >= n]
            if not fits:
                return False
            h = got[i][0].host_id if got.get(i) else min(fits, key=lambda h: (len(by_host[h]), h))
            picked, by_host[h] = by_host[h][:n], by_host[h][n:]
        else:
            if sum(len(by_host[h]) for h in hosts) < n:
                return False
            picked = []
            for h in sorted(hosts, key=lambda h: (-len(by_host[h]), h)):
                k = min(n - len(picked), len(by_host[h]))
                picked, by_host[h] = picked + by_host[h][:k], by_host[h][k:]
        got.setdefault(i, []).extend(picked)
        return True

    def hosts_of(i: int) -> list[str]:
        job = jobs[i]
        if single_host and got.get(i):
            return [got[i][0].host_id]
        if single_host and job.gpus > 0 and job.host is not None:
            return [job.host] if job.host in by_host else []
        return list(by_host)

    for i in order:
        take(i, 1 if jobs[i].gpus > 0 else jobs[i].min_gpus, hosts_of(i))
    growing = True
    while growing:
        growing = False
        for i in order:
            if i in got and len(got[i]) < works[i].max_gpus and take(i, 1, hosts_of(i)):
                growing = True
    return {jobs[i].job_id: tuple(g) for i, g in got.items()}


def pack(shares: Mapping[str, int], slots: Sequence[GpuSlot]) -> dict[str, tuple[GpuSlot, ...]]:
    """Give each key ``shares[key]`` of ``slots``, largest share first, each from the host that
    fits it most tightly (else from the fullest hosts), so few shares span hosts."""
    by_host: dict[str, list[GpuSlot]] = {}
    for s in sorted(slots):
        by_host.setdefault(s.host_id, []).append(s)
    out: dict[str, tuple[GpuSlot, ...]] = {}
    for key, n in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])):
        fits = [h for h, free in by_host.items() if len(free) >= n]
        chosen: list[GpuSlot] = []
        if fits:
            h = min(fits, key=lambda h: (len(by_host[h]), h))
            chosen, by_host[h] = by_host[h][:n], by_host[h][n:]
        else:
            for h in sorted(by_host, key=lambda h: (-len(by_host[h]), h)):
                take = min(n - len(chosen), len(by_host[h]))
                chosen += by_host[h][:take]
                by_host[h] = by_host[h][take:]
                if len(chosen) == n:
                    break
        out[key] = tuple(chosen)
    return out
