"""What an app reports to the arbiter each round (Themis §4.3, Figure 7's JobInfo).

The reports are the agents' inputs: the arbiter never guesses an app's work, it asks. A job that
does not use the job-side progress API reports ``None`` for its totals and gets crude estimates
(``ArbiterConfig.unknown_*``), exactly like a Themis app whose profiler has no samples yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The plain app type: all jobs run to their own totals, in parallel.
APP_JOBS = "jobs"
#: Successive halving (Themis §4.3.2): phases of n, n/2, ... 1 jobs; the worse half is killed at
#: the end of each phase. ``AppReport.phase_iterations`` holds the per-phase iteration budget.
APP_SUCCESSIVE_HALVING = "successive_halving"
APP_TYPES = (APP_JOBS, APP_SUCCESSIVE_HALVING)


@dataclass(frozen=True)
class JobReport:
    """One training job's progress, as its app scheduler sees it.

    ``seconds_per_iteration`` is the serial time of one iteration on one GPU with no placement
    penalty (Themis's iter_serial_time); ``placement_sensitivity`` is the multiplicative slowdown
    S >= 1 the job suffers when its GPUs span more than one host (1.0: insensitive, e.g.
    Inception-v3; VGG16 in Themis Table 1 is ~1.29). ``gpus`` is what it holds now (leases).
    ``min_gpus`` is the least it can start on (``tandem job submit --gpus N``: a lower bound, the
    arbiter never leases it fewer); ``host`` is where the GPUs it holds are, so that a
    single-host arbiter (``ArbiterConfig.single_host_jobs``) extends it only there.
    """

    job_id: str
    app_id: str
    gpus: int
    max_gpus: int
    iterations_done: int
    iterations_total: int | None
    seconds_per_iteration: float | None
    placement_sensitivity: float = 1.0
    min_gpus: int = 1
    host: str | None = None

    def __post_init__(self) -> None:
        if self.max_gpus < 1:
            raise ValueError(f"job {self.job_id}: max_gpus must be >= 1, got {self.max_gpus}")
        if not 1 <= self.min_gpus <= self.max_gpus:
            raise ValueError(f"job {self.job_id}: min_gpus must be in [1, max_gpus], got {self.min_gpus}")
        if self.gpus < 0 or self.iterations_done < 0:
            raise ValueError(f"job {self.job_id}: gpus and iterations_done must be >= 0")
        if self.placement_sensitivity < 1.0:
            raise ValueError(f"job {self.job_id}: placement_sensitivity is a slowdown, >= 1.0")
        if self.seconds_per_iteration is not None and self.seconds_per_iteration <= 0:
            raise ValueError(f"job {self.job_id}: seconds_per_iteration must be > 0")


@dataclass(frozen=True)
class AppReport:
    """An app (a group of jobs: a sweep, a single training run) as of one auction round.

        ``jobs`` lists the app's live jobs (for successive halving: the jobs of the current phase).
        Successive-halving apps also give ``phase_iterations`` (iterations each job of phase i runs
        in that phase), ``phase`` (0-based index of the current phase) and ``budget_gpu_s`` (Themis's
        B, the app's total GPU time budget, which sets its T_id). For plain apps B is the jobs' total
        work and ``budget_gpu_s`` may be left ``None``. ``demand_max_gpus`` (app_demand_max) defaults to
    the most GPUs the reported jobs can use at once; give it when jobs that finished are no longer
    reported, so T_id stays the app's, not its tail's. ``gpus_releasing`` counts GPUs whose lease
    ended this round and are in the offer again: an app renewing its leases is not starving.
    """

    app_id: str
    submitted_at: float
    jobs: list[JobReport]
    app_type: str = APP_JOBS
    phase_iterations: tuple[int, ...] = ()
    phase: int = 0
    budget_gpu_s: float | None = None
    demand_max_gpus: int | None = None
    gpus_releasing: int = 0
    gpu_seconds_used: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        if self.app_type not in APP_TYPES:
            raise ValueError(f"app {self.app_id}: unknown app_type {self.app_type!r}, one of {APP_TYPES}")
        if self.app_type == APP_SUCCESSIVE_HALVING and not self.phase_iterations:
            raise ValueError(f"app {self.app_id}: successive halving needs phase_iterations")
        for job in self.jobs:
            if job.app_id != self.app_id:
                raise ValueError(f"job {job.job_id} reports app {job.app_id}, not {self.app_id}")

    @property
    def gpus_held(self) -> int:
        return sum(j.gpus for j in self.jobs)

    @property
    def max_gpus(self) -> int:
        """app_demand_max: the most GPUs the app can use at once now."""
        return sum(j.max_gpus for j in self.jobs)
