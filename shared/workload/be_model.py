"""Best-effort training workloads: apps of jobs, each job a model with a per-iteration time and a
placement sensitivity (Themis §6.1, Table 4). Built by ``themis_workload`` or ``be_trace_csv``,
replayed by ``shared.simulator.be``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from shared.arbiter.halving import jobs_per_phase
from shared.arbiter.reports import APP_JOBS, APP_SUCCESSIVE_HALVING, APP_TYPES


@dataclass(frozen=True)
class ModelProfile:
    """Per-model throughput (serial seconds per iteration on one GPU) and the slowdown S >= 1 of a
    job placed across hosts."""

    name: str
    category: str
    seconds_per_iteration: float
    placement_sensitivity: float


#: Themis Table 4's models. Sensitivities: VGG16 1.29 and Inception-v3 1.0 are Themis Table 1's
#: measurements (103.6 vs 80.4 and 242 vs 243 images/s, 4 GPUs on one vs two servers); the others
#: are our estimates from each model's parameter count (gradient bytes per iteration), ranked as
#: Gandiva and Themis rank them: large dense layers (AlexNet, VGG, GNMT, LangModel) sensitive,
#: convolution-heavy or small models (Inception, ResNet, WaveNet) not. Iteration times are
#: K80-class figures, only their ratios matter (work is given in GPU-seconds).
MODELS: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("inception-v3", "cv", 0.9, 1.0),
        ModelProfile("alexnet", "cv", 0.3, 1.4),
        ModelProfile("resnet50", "cv", 0.6, 1.1),
        ModelProfile("vgg16", "cv", 0.8, 1.29),
        ModelProfile("vgg19", "cv", 0.9, 1.3),
        ModelProfile("bi-att-flow", "nlp", 0.5, 1.1),
        ModelProfile("langmodel", "nlp", 0.2, 1.25),
        ModelProfile("gnmt", "nlp", 0.6, 1.3),
        ModelProfile("transformer", "nlp", 0.4, 1.2),
        ModelProfile("wavenet", "speech", 0.7, 1.05),
        ModelProfile("deepspeech", "speech", 0.8, 1.2),
    )
}
#: A job whose model is not in ``MODELS`` (imported traces): insensitive, 1 s per iteration.
UNKNOWN_MODEL = ModelProfile("unknown", "unknown", 1.0, 1.0)


@dataclass(frozen=True)
class BeJob:
    """One training job: ``iterations`` to run (for successive halving: its full run if it were
    never killed), at most ``max_gpus`` GPUs, and ``final_loss`` (lower is better: which half a
    successive-halving app keeps)."""

    job_id: str
    model: ModelProfile
    iterations: int
    max_gpus: int
    final_loss: float = 0.0

    @property
    def work_gpu_s(self) -> float:
        return self.iterations * self.model.seconds_per_iteration


@dataclass(frozen=True)
class BeApp:
    """An app: jobs submitted together at ``submitted_at``. Successive-halving apps also carry
    their per-phase iterations (``shared.arbiter.halving.plan_iterations``)."""

    app_id: str
    submitted_at: float
    jobs: tuple[BeJob, ...]
    app_type: str = APP_JOBS
    phase_iterations: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.app_type not in APP_TYPES:
            raise ValueError(f"app {self.app_id}: unknown app_type {self.app_type!r}")
        if not self.jobs:
            raise ValueError(f"app {self.app_id} has no jobs")
        if self.app_type == APP_SUCCESSIVE_HALVING and not self.phase_iterations:
            raise ValueError(f"app {self.app_id}: successive halving needs phase_iterations")

    @cached_property
    def budget_gpu_s(self) -> float:
        """Themis's B: the app's total serial work (for successive halving, its planned budget)."""
        if self.app_type == APP_SUCCESSIVE_HALVING:
            spi = sorted(j.model.seconds_per_iteration for j in self.jobs)[len(self.jobs) // 2]
            counts = jobs_per_phase(len(self.jobs))
            return sum(n * it * spi for n, it in zip(counts, self.phase_iterations, strict=True))
        return sum(j.work_gpu_s for j in self.jobs)

    @cached_property
    def demand_max_gpus(self) -> int:
        return sum(j.max_gpus for j in self.jobs)


@dataclass(frozen=True)
class BeWorkload:
    """A BE workload: its apps (sorted by submit time) and where it came from."""

    apps: tuple[BeApp, ...]
    source: str

    @property
    def n_jobs(self) -> int:
        return sum(len(a.jobs) for a in self.apps)

    @property
    def work_gpu_hours(self) -> float:
        return sum(a.budget_gpu_s for a in self.apps) / 3600.0
