"""Finish-time estimates for one app: Themis §4.3 equations (1) and (2).

T_id = T_cluster * N_avg with T_cluster = B / min(R, app_demand_max): the app alone on an
R-GPU cluster, linear speedup, no slowdown, stretched by the average contention N_avg. R is the
capacity best-effort jobs can actually use (GPUs not committed to notebook cells, time-averaged by
the caller), not the provisioned count: otherwise a busy notebook hour would inflate every app's
rho alike and the auction would chase a load it cannot change.

T_sh(G) = elapsed + the sum over the app's remaining phases of the time the phase takes on G GPUs.
A phase's time is the preemptive (moldable) makespan of its jobs with linear speedup up to each
job's ``max_gpus``: max(sum_j w_j S_j / min(G, sum_j c_j), max_j w_j S_j / min(c_j, G)), where w_j
is the job's remaining serial work and S_j its placement slowdown (1, or its sensitivity when its
share of G must span hosts). This is the "hyper-parameter optimizer can determine the optimal
allocation of GPUs within a phase" of §4.3.2, and it reproduces §4.3.3's Table 3 exactly
(4 / 2 / 1 / 0.5 / 0.34 for 1 / 2 / 4 / 8 / 16 GPUs), where a per-job max over fixed 1-GPU jobs
would give 1.06 / 0.53 / 0.36 for 4 / 8 / 16. Future phases of successive halving use the median
current job (iteration time, max_gpus, sensitivity), as §4.3.3 does.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.arbiter.config import ArbiterConfig
from shared.arbiter.reports import APP_SUCCESSIVE_HALVING, AppReport, JobReport


@dataclass(frozen=True)
class Work:
    """One job's remaining serial work (GPU-seconds at no slowdown), its GPU cap, sensitivity."""

    seconds: float
    max_gpus: int
    sensitivity: float


def job_shares(works: Sequence[Work], gpus: int) -> list[int]:
    """How an app scheduler splits ``gpus`` between its jobs: water-filling up to each cap, most
    work first. Shared by the estimate (which jobs must span hosts) and the simulator."""
    shares = [0] * len(works)
    order = sorted(range(len(works)), key=lambda i: -works[i].seconds)
    left = gpus
    while left > 0:
        progressed = False
        for i in order:
            if left == 0:
                break
            if shares[i] < works[i].max_gpus and works[i].seconds > 0:
                shares[i] += 1
                left -= 1
                progressed = True
        if not progressed:
            break
    return shares


def spanning(shares: Sequence[int], layout: Mapping[str, int] | None) -> list[bool]:
    """Which jobs' shares cross hosts. ``layout`` is GPUs per host of the allocation; ``None``
    means the layout is unknown, valued pessimistically (every multi-GPU share spans)."""
    if layout is None:
        return [s > 1 for s in shares]
    free = sorted(layout.values(), reverse=True)
    result = [False] * len(shares)
    for i in sorted(range(len(shares)), key=lambda i: -shares[i]):
        s = shares[i]
        if s == 0:
            continue
        fit = [k for k, f in enumerate(free) if f >= s]
        if fit:
            k = min(fit, key=lambda k: free[k])  # best fit keeps big hosts for big shares
            free[k] -= s
        else:
            result[i] = s > 1
            take = s
            for k in range(len(free)):
                t = min(take, free[k])
                free[k] -= t
                take -= t
    return result


def phase_time(works: Sequence[Work], gpus: int, layout: Mapping[str, int] | None = None) -> float:
    """Makespan of one phase's jobs on ``gpus`` GPUs (see the module docstring)."""
    works = [w for w in works if w.seconds > 0]
    if not works:
        return 0.0
    if gpus <= 0:
        return math.inf
    shares = job_shares(works, gpus)
    spans = spanning(shares, layout)
    slowed = [w.seconds * (w.sensitivity if s else 1.0) for w, s in zip(works, spans, strict=True)]
    usable = min(gpus, sum(w.max_gpus for w in works))
    longest = max(t / min(w.max_gpus, gpus) for t, w in zip(slowed, works, strict=True))
    return max(sum(slowed) / usable, longest)


class FinishTimeModel:
    """An app's remaining work as phases of jobs, built from its report (crude for jobs that do
    not report progress), plus its budget B and demand for T_id."""

    def __init__(self, report: AppReport, config: ArbiterConfig) -> None:
        self.report = report
        jobs = report.jobs
        self._spi_prior = config.unknown_seconds_per_iteration
        self._total_prior: float | None = None
        if any(j.seconds_per_iteration is None or j.iterations_total is None for j in jobs):
            # some job is unknown: it takes its app's medians (jobs of one sweep are alike)
            measured = [j.seconds_per_iteration for j in jobs if j.seconds_per_iteration is not None]
            totals = [j.iterations_total for j in jobs if j.iterations_total is not None]
            self._spi_prior = statistics.median(measured) if measured else self._spi_prior
            self._total_prior = statistics.median(totals) if totals else None
        self._spi = [j.seconds_per_iteration or self._spi_prior for j in jobs]
        if report.app_type == APP_SUCCESSIVE_HALVING:
            self.phases = self._halving_phases(report, self._spi)
        else:
            self.phases = [
                [
                    Work(self._remaining(j, spi, config) * spi, j.max_gpus, j.placement_sensitivity)
                    for j, spi in zip(jobs, self._spi, strict=True)
                ]
            ]
        self.budget_gpu_s = report.budget_gpu_s if report.budget_gpu_s is not None else self._budget(config)
        self.demand_max_gpus = max(
            report.demand_max_gpus or 0, max((sum(w.max_gpus for w in p) for p in self.phases), default=0)
        )

    def _total(self, job: JobReport, spi: float, config: ArbiterConfig) -> float:
        """The job's total iterations: its own, else its app's median known total, else the prior
        ``unknown_job_gpu_s`` of work; a job already past that is ``unknown_remaining_fraction``
        from its end."""
        if job.iterations_total is not None:
            return float(job.iterations_total)
        guess = self._total_prior if self._total_prior is not None else config.unknown_job_gpu_s / spi
        if job.iterations_done < guess:
            return float(guess)
        f = config.unknown_remaining_fraction
        return job.iterations_done + max(1.0, job.iterations_done * f / (1.0 - f))

    def _remaining(self, job: JobReport, spi: float, config: ArbiterConfig) -> float:
        return max(0.0, self._total(job, spi, config) - job.iterations_done)

    @staticmethod
    def _halving_phases(report: AppReport, spi: Sequence[float]) -> list[list[Work]]:
        jobs = report.jobs
        target = sum(report.phase_iterations[: report.phase + 1])
        current = [
            Work(max(0, target - j.iterations_done) * s, j.max_gpus, j.placement_sensitivity)
            for j, s in zip(jobs, spi, strict=True)
        ]
        phases = [current]
        if not jobs:
            return phases
        med_spi = statistics.median(spi)
        med_cap = int(statistics.median(j.max_gpus for j in jobs))
        med_sens = statistics.median(j.placement_sensitivity for j in jobs)
        n = len(jobs)
        for i in range(report.phase + 1, len(report.phase_iterations)):
            n = max(1, n // 2)
            work = Work(report.phase_iterations[i] * med_spi, med_cap, med_sens)
            phases.append([work] * n)
        return phases

    def _budget(self, config: ArbiterConfig) -> float:
        if self.report.app_type == APP_SUCCESSIVE_HALVING:
            return sum(sum(w.seconds for w in p) for p in self.phases)
        return sum(
            self._total(j, spi, config) * spi for j, spi in zip(self.report.jobs, self._spi, strict=True)
        )

    def remaining(self, gpus: int, layout: Mapping[str, int] | None = None) -> float:
        """Time to finish on ``gpus`` GPUs held to completion (layout only known for this phase's
        allocation; later phases reuse it, the allocation being assumed binding)."""
        return sum(phase_time(p, gpus, layout) for p in self.phases)

    def t_id(self, capacity_gpus: float, n_avg: float) -> float:
        """Themis's T_id against ``capacity_gpus`` (BE-usable, time-averaged) and contention."""
        r = min(capacity_gpus, float(self.demand_max_gpus))
        if r <= 0:
            return math.inf
        return self.budget_gpu_s / r * max(1.0, n_avg)

    def t_sh(self, now: float, gpus: int, layout: Mapping[str, int] | None = None) -> float:
        return max(0.0, now - self.report.submitted_at) + self.remaining(gpus, layout)
