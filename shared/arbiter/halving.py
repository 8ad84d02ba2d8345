"""Successive halving (Themis §4.3.2), the built-in hyper-parameter-sweep app type.

n configurations start as n jobs; after each phase the better half (lowest loss) survives, until
one job is left: log2(n) + 1 phases. The budget B is split evenly across phases, so phase i with
J_i jobs runs each for B / phases / (J_i * t_iter) iterations. Pure: the live job scheduler and the
BE simulator both drive it with progress and losses, and kill the jobs it names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def jobs_per_phase(n_jobs: int) -> list[int]:
    """n, n/2, ..., 1 (floor division, as Themis's 4 -> 2 -> 1)."""
    if n_jobs < 1:
        raise ValueError(f"successive halving needs at least one job, got {n_jobs}")
    counts = [n_jobs]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


def plan_iterations(n_jobs: int, budget_gpu_s: float, seconds_per_iteration: float) -> tuple[int, ...]:
    """Iterations each job of each phase runs in that phase: the budget split evenly by phase."""
    counts = jobs_per_phase(n_jobs)
    per_phase = budget_gpu_s / len(counts)
    return tuple(max(1, math.floor(per_phase / (j * seconds_per_iteration))) for j in counts)


@dataclass
class SuccessiveHalving:
    """One sweep's progress through its phases. ``phase_iterations[i]`` is what each job of phase i
    runs in that phase; a job's target is cumulative (survivors keep training)."""

    job_ids: Sequence[str]
    phase_iterations: tuple[int, ...]
    phase: int = 0
    live: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.phase_iterations) != len(jobs_per_phase(len(self.job_ids))):
            raise ValueError(
                f"{len(self.job_ids)} jobs make {len(jobs_per_phase(len(self.job_ids)))} phases, "
                f"got {len(self.phase_iterations)} phase budgets"
            )
        if not self.live:
            self.live = list(self.job_ids)

    @property
    def target(self) -> int:
        """Cumulative iterations a live job must reach to finish the current phase."""
        return sum(self.phase_iterations[: self.phase + 1])

    @property
    def finished(self) -> bool:
        return self.phase >= len(self.phase_iterations)

    def phase_done(self, iterations: Mapping[str, int]) -> bool:
        return not self.finished and all(iterations.get(j, 0) >= self.target for j in self.live)

    def advance(self, losses: Mapping[str, float]) -> list[str]:
        """End the current phase: keep the better half by loss (ties by id), return the killed."""
        if self.finished:
            raise ValueError("successive halving already finished")
        self.phase += 1
        if self.finished:
            return []
        keep = jobs_per_phase(len(self.job_ids))[self.phase]
        ranked = sorted(self.live, key=lambda j: (losses[j], j))
        dropped = ranked[keep:]
        self.live = ranked[:keep]
        self.killed += dropped
        return dropped
