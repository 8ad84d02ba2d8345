"""Packing two best-effort (BE) jobs per GPU, and Gimbal's coordination search over a packing set.

Gimbal (Yang, Cui et al., "Taming Flexible Job Packing in Deep Learning Training Clusters";
../shared/papers/gimbal-flexible-job-packing.txt). Three pure parts, one interface for the live
local scheduler and the simulator (``shared.simulator.packing_sim``):

- **Constraints** (§5.1): at most two workers per GPU; a smaller job shares GPUs only with the
  largest job of its packing set (J_max), so every set is a star around J_max; never a GPU a cell
  holds (a cell squeezes both BE workers to zero through the preemption path instead).
- **Objectives** (§5.2, Eq. 1-6): JCT, deadline, makespan, each a local objective (lower is better)
  and a job priority (higher = more important, swelled first). The paper's Eq. 4 and 6 print the
  priorities with the opposite sign to the text that explains them ("jobs closer to their deadlines
  have higher priority", "shorter jobs are squeezed to speed up longer jobs"); we follow the text.
  Eq. 3 prints headroom where the text means lateness; we use lateness ``max(0, finish - deadline)``.
- **Search** (Algorithm 1) as a state machine: ``propose()`` returns the next trial configuration,
  the caller applies it and hands back what the runtime monitor measured (``observe``), ``best()``
  is the best configuration seen. No clock, no I/O: a trial is whatever the caller measured.
  ``ExhaustiveSearch`` walks the whole space the algorithm moves in, for comparison (§7.4).

A configuration is one cap per job in percent of the device (10% steps, LGRR: an MPS thread
percentage on a GPU, a duty cycle on the CPU) and, for J_max, the fraction of the global batch each
of its workers takes (LISS). Caps are per job, not per worker: every worker of a smaller job sits
on a GPU of J_max, so "squeeze the workers co-located with J_max's slow workers" (line 19-20)
squeezes the jobs owning those workers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

STEP = 10  # LGRR granularity, percent (§7.4: 10% balances search length against optimality)
MIN_CAP = STEP  # 0% would stop the job; a cap of 0 is a preemption, not a packing
FULL = 100
MAX_WORKERS_PER_GPU = 2
EARLY_EXIT_TRIALS = 3  # Algorithm 1 line 9
FIRST_WINDOW = 1 / 3  # of a trial, measured first by live shells (``CoordinationSearch.interim``)
STRAGGLER_TOLERANCE = 0.05  # a worker 5% slower (per step) than the fastest one is a straggler


# ---------------------------------------------------------------------------------------------
# Constraints (§5.1)


@dataclass(frozen=True, slots=True)
class Placement:
    """Which BE jobs hold which GPUs (a GPU id is any hashable string, e.g. ``"node3/gpu1"``)."""

    jobs: Mapping[str, tuple[str, ...]]  # job id -> GPUs its workers hold, one worker per GPU

    def occupants(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for job_id, gpus in self.jobs.items():
            for gpu in gpus:
                out.setdefault(gpu, []).append(job_id)
        return out

    def world_size(self, job_id: str) -> int:
        return len(self.jobs[job_id])


def violations(placement: Placement, cell_gpus: Iterable[str] = ()) -> list[str]:
    """Every §5.1 rule the placement breaks (empty when it is a legal packing)."""
    found: list[str] = []
    occupants = placement.occupants()
    cells = set(cell_gpus)
    for gpu, jobs in sorted(occupants.items()):
        if gpu in cells:
            found.append(f"{gpu}: a cell holds it, BE workers {sorted(jobs)} must not run there")
        if len(jobs) > MAX_WORKERS_PER_GPU:
            found.append(f"{gpu}: {len(jobs)} workers, at most {MAX_WORKERS_PER_GPU}")
        if len(set(jobs)) != len(jobs):
            found.append(f"{gpu}: a job holds it twice")
    partners = _partners(occupants)
    for a, others in sorted(partners.items()):
        for b in sorted(others):
            if _rank(placement, b) > _rank(placement, a):
                continue  # look at each pair from its larger side
            if partners[b] != {a}:
                found.append(
                    f"{b} shares with {sorted(partners[b])}: a smaller job shares only with its J_max {a}"
                )
            if placement.world_size(a) == placement.world_size(b) and set(placement.jobs[a]) != set(
                placement.jobs[b]
            ):
                found.append(f"{a} and {b} have one world size: they may only share all their GPUs")
    return sorted(set(found))


def _rank(placement: Placement, job_id: str) -> tuple[int, str]:
    return (placement.world_size(job_id), job_id)


def _partners(occupants: Mapping[str, Sequence[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for jobs in occupants.values():
        for a in jobs:
            out.setdefault(a, set()).update(b for b in jobs if b != a)
    return out


def packing_sets(placement: Placement) -> list[tuple[str, tuple[str, ...]]]:
    """The packing sets of a legal placement: (J_max, the smaller jobs packed with it)."""
    partners = _partners(placement.occupants())
    sets: list[tuple[str, tuple[str, ...]]] = []
    seen: set[str] = set()
    for job_id in sorted(placement.jobs, key=lambda j: (-placement.world_size(j), j)):
        if job_id in seen or not partners.get(job_id):
            continue
        members = tuple(sorted(partners[job_id] - seen))
        seen.add(job_id)
        seen.update(members)
        sets.append((job_id, members))
    return sets


def packable_gpus(
    world_size: int,
    placement: Placement,
    cell_gpus: Iterable[str] = (),
    *,
    free_gpus: Iterable[str] = (),
) -> list[tuple[str | None, tuple[str, ...]]]:
    """Where a new job of ``world_size`` workers may go: free GPUs first (partner None), then each
    running job that can be J_max of a set including it (partner = that job, on GPUs it holds
    alone). GPUs a cell holds are never offered, whatever the caller lists as free."""
    cells = set(cell_gpus)
    occupants = placement.occupants()
    partners = _partners(occupants)
    options: list[tuple[str | None, tuple[str, ...]]] = []
    free = sorted(g for g in free_gpus if g not in cells and g not in occupants)
    if len(free) >= world_size:
        options.append((None, tuple(free[:world_size])))
    for job_id, gpus in sorted(placement.jobs.items()):
        if len(gpus) < world_size:
            continue  # a smaller job shares only with a job at least its size
        if any(placement.world_size(p) >= len(gpus) for p in partners.get(job_id, ())):
            continue  # job_id is the smaller side of a set (or a balanced pair): it takes no one
        alone = sorted(g for g in gpus if len(occupants[g]) == 1 and g not in cells)
        if world_size == len(gpus) and partners.get(job_id):
            continue  # equal sizes share only all their GPUs, and some are taken
        if len(alone) >= world_size:
            options.append((job_id, tuple(alone[:world_size])))
    return options


# ---------------------------------------------------------------------------------------------
# Objectives (§5.2)


@dataclass(frozen=True, slots=True)
class JobInfo:
    """What the search knows of a job of the set before it starts."""

    job_id: str
    gpus: tuple[str, ...]
    remaining_steps: float
    deadline_s: float | None = None  # seconds from now; only the deadline objective reads it
    solo_throughput: float | None = None  # steps/s alone (profiled); only ``jct_sequenced`` reads it


@dataclass(frozen=True, slots=True)
class JobMeasurement:
    """What the runtime monitor measured for a job during one trial."""

    throughput: float  # steps per second
    utilization: float = 1.0  # device busy fraction of the job, 0..1
    worker_step_s: Mapping[str, float] = field(default_factory=dict)  # per GPU: forward time/sample


Measurement = Mapping[str, JobMeasurement]


def _eta(job: JobInfo, m: JobMeasurement) -> float:
    return job.remaining_steps / m.throughput if m.throughput > 0 else float("inf")


class Objective(Protocol):
    name: str

    def value(self, jobs: Sequence[JobInfo], measured: Measurement) -> float: ...

    def priority(self, job: JobInfo, measured: JobMeasurement) -> float: ...


class JctObjective:
    """Eq. 1-2: mean remaining time; low-utilization jobs first (squeezing a big job costs it less
    than the same share gives a small one)."""

    name = "jct"

    def value(self, jobs: Sequence[JobInfo], measured: Measurement) -> float:
        return sum(_eta(j, measured[j.job_id]) for j in jobs) / len(jobs)

    def priority(self, job: JobInfo, measured: JobMeasurement) -> float:
        return -measured.utilization


class DeadlineObjective:
    """Eq. 3-4 (signs as the text explains them): the worst lateness; least headroom first."""

    name = "deadline"

    def value(self, jobs: Sequence[JobInfo], measured: Measurement) -> float:
        late = [
            max(0.0, _eta(j, measured[j.job_id]) - j.deadline_s) for j in jobs if j.deadline_s is not None
        ]
        # Ties at zero lateness are broken by the mean ETA so a search still sees gains.
        return max(late, default=0.0) + 1e-6 * JctObjective().value(jobs, measured)

    def priority(self, job: JobInfo, measured: JobMeasurement) -> float:
        if job.deadline_s is None:
            return float("-inf")
        return -(job.deadline_s - _eta(job, measured))


class MakespanObjective:
    """Eq. 5-6 (signs as the text explains them): the longest remaining time; longest job first."""

    name = "makespan"

    def value(self, jobs: Sequence[JobInfo], measured: Measurement) -> float:
        return max(_eta(j, measured[j.job_id]) for j in jobs)

    def priority(self, job: JobInfo, measured: JobMeasurement) -> float:
        return _eta(job, measured)


class SequencedJctObjective(JctObjective):
    """Not in the paper: Eq. 1 prices every job at its current throughput to the end, so it never
    sees that a squeezed job speeds up to its solo throughput once its partner finishes; squeezing
    one side hard (close to running the pair one after the other) then always looks bad. This
    variant plays the set out: jobs finish in ETA order; when one job is left it runs at
    ``solo_throughput`` (others keep their measured throughput). Mean completion time.

    Its priority is least remaining *device* work first: remaining time alone x the device share
    the job uses (SRPT with the device as the resource). Between two jobs that keep the device
    busy, whose utilizations tie, it is shortest remaining time first (Eq. 2's utilization picked
    the side to squeeze by noise: the live compute-bound pair squeezed its short job, 1.35x free
    competition); a job that waits for its input most of the time needs little device work even
    when it runs longer, and is swelled, as Eq. 2 would (plain SRPT squeezed such a job, the longer
    one at low load: 1.30x free competition)."""

    name = "jct_sequenced"

    def priority(self, job: JobInfo, measured: JobMeasurement) -> float:
        speed = job.solo_throughput or measured.throughput
        if speed <= 0:
            return float("-inf")
        return -job.remaining_steps / speed * max(measured.utilization, 0.01)

    def value(self, jobs: Sequence[JobInfo], measured: Measurement) -> float:
        left = {j.job_id: j.remaining_steps for j in jobs}
        speed = {j.job_id: measured[j.job_id].throughput for j in jobs}
        solo = {j.job_id: j.solo_throughput or measured[j.job_id].throughput for j in jobs}
        now, total = 0.0, 0.0
        while left:
            if len(left) == 1:
                (jid,) = left
                speed[jid] = solo[jid]
            jid = min(left, key=lambda k: left[k] / speed[k] if speed[k] > 0 else float("inf"))
            if speed[jid] <= 0:
                return float("inf")
            dt = left[jid] / speed[jid]
            now += dt
            total += now
            del left[jid]
            for k in left:
                left[k] -= speed[k] * dt
        return total / len(jobs)


OBJECTIVES: dict[str, Callable[[], Objective]] = {
    "jct": JctObjective,
    "jct_sequenced": SequencedJctObjective,
    "deadline": DeadlineObjective,
    "makespan": MakespanObjective,
}


# ---------------------------------------------------------------------------------------------
# Search (Algorithm 1)


@dataclass(frozen=True, slots=True)
class PackingConfig:
    """One trial: a cap per job (percent) and J_max's LISS split (fraction of the global batch per
    GPU of J_max; empty = equal split)."""

    caps: Mapping[str, int]
    fractions: Mapping[str, float] = field(default_factory=dict)

    def key(self) -> tuple:
        return (
            tuple(sorted(self.caps.items())),
            tuple(sorted((g, round(f, 4)) for g, f in self.fractions.items())),
        )


@dataclass(frozen=True, slots=True)
class Trial:
    config: PackingConfig
    objective: float


class Search(Protocol):
    def propose(self) -> PackingConfig | None: ...

    def observe(self, measured: Measurement) -> None: ...

    def best(self) -> PackingConfig: ...

    @property
    def trials(self) -> Sequence[Trial]: ...


def _jmax(jobs: Sequence[JobInfo]) -> JobInfo:
    return max(jobs, key=lambda j: (len(j.gpus), j.job_id))


def stragglers(m: JobMeasurement, tolerance: float = STRAGGLER_TOLERANCE) -> tuple[list[str], list[str]]:
    """(slow, fast) workers of a job from their measured per-step times."""
    times = m.worker_step_s
    if len(times) < 2:
        return [], list(times)
    fastest = min(times.values())
    slow = sorted(g for g, t in times.items() if t > fastest * (1 + tolerance))
    return slow, sorted(g for g in times if g not in slow)


def balanced_fractions(m: JobMeasurement, fractions: Mapping[str, float]) -> dict[str, float]:
    """LISS (LB-BSP): each worker's share of the global batch proportional to its measured speed
    (samples it did per second), so all finish a step together. Swells slow workers (they give up
    samples) and squeezes fast ones (they take them) in one move."""
    gpus = sorted(m.worker_step_s)
    current = {g: fractions.get(g, 1.0 / len(gpus)) for g in gpus}
    speed = {g: current[g] / m.worker_step_s[g] for g in gpus}
    total = sum(speed.values())
    return {g: speed[g] / total for g in gpus}


class _TrialLog:
    """The bookkeeping both searches share: the pending trial, every measured trial, the best."""

    def __init__(self, jobs: Sequence[JobInfo], objective: Objective, min_gain: float = 0.0) -> None:
        self._jobs = list(jobs)
        self._objective = objective
        self._min_gain = min_gain
        self._pending: PackingConfig | None = None
        self._trials: list[Trial] = []
        self._best: Trial | None = None

    @property
    def trials(self) -> Sequence[Trial]:
        return self._trials

    def best(self) -> PackingConfig:
        if self._best is None:
            raise RuntimeError("no trial observed yet")
        return self._best.config

    def _record(self, measured: Measurement) -> tuple[PackingConfig, bool]:
        """Log the pending trial's outcome; True when it beat every earlier trial (by ``min_gain``,
        a fraction: live trials are noisy, and a squeeze kept for a gain that was only noise costs
        the rest of the run)."""
        if self._pending is None:
            raise RuntimeError("observe() without a proposed trial")
        config, self._pending = self._pending, None
        trial = Trial(config, self._objective.value(self._jobs, measured))
        self._trials.append(trial)
        improved = self._best is None or trial.objective < self._best.objective * (
            1 - max(self._min_gain, 1e-9)
        )
        if improved:
            self._best = trial
        return config, improved


# Why a search ended (``CoordinationSearch.ended``)
EXIT_NO_GAIN = "no_gain"  # line 9: three trials in a row without gain
EXIT_EXHAUSTED = "exhausted"  # every low-priority job at the floor
EXIT_NOTHING_TO_GAIN = "nothing_to_gain"  # not in the paper: no further trial can gain (``reachable``)


class CoordinationSearch(_TrialLog):
    """Algorithm 1 over one packing set. ``propose()`` returns None once the search is over.

    The first trial is the set as packed (every cap 100%: free competition) and measures the
    priorities; line 5 then swells the high-priority side (it is already at 100% unless a caller
    restarts the search from a previous best, ``start``).

    Not in the paper (``futile_exit``, on by default; False is the literal algorithm): after each
    trial the search bounds what any further trial could measure (``reachable``) and ends at once
    when even that bound would not beat the best trial by ``min_gain``. Algorithm 1 would run its
    three losing trials there and keep the same best; live, each of them squeezes a job for a whole
    trial for nothing (the bench's underusing pair: the swelled job already ran at ~its solo speed
    under free competition, and three squeezes of its partner cost ~0.5 s of a ~17 s mean JCT).
    Also not in the paper, and only where the caller measures a trial in windows: ``interim`` cuts
    short a trial whose first window is already clearly worse than the best."""

    def __init__(
        self,
        jobs: Sequence[JobInfo],
        objective: Objective,
        *,
        start: PackingConfig | None = None,
        early_exit: int | None = EARLY_EXIT_TRIALS,
        skip_slack: bool = True,
        min_gain: float = 0.0,
        futile_exit: bool = True,
    ) -> None:
        if len(jobs) < 2:
            raise ValueError("a packing set has at least two jobs")
        super().__init__(jobs, objective, min_gain)
        self._jmax = _jmax(jobs)
        self._early_exit = early_exit
        self._futile_exit = futile_exit
        self.ended: str | None = None  # why the search is over (``EXIT_*``); None while it runs
        self.cut_short = 0  # trials ended after their first window (``interim``)
        self._first_window: float | None = None  # the pending trial's first-window objective
        self._window_noise: list[float] = []  # |first window / whole trial - 1| of whole trials
        self._skip_slack = skip_slack  # False: the paper's literal 10% steps from 100%
        self._next: PackingConfig | None = start or PackingConfig({j.job_id: FULL for j in jobs})
        self._misses = 0
        self._low: set[str] | None = None  # subset1: the low-priority side, squeezed
        self._last: Measurement | None = None
        self._seen: set[tuple] = set()

    @property
    def low_priority(self) -> frozenset[str]:
        return frozenset(self._low or ())

    def propose(self) -> PackingConfig | None:
        if self._pending is None:
            self._pending, self._next = self._next, None
        return self._pending

    def interim(self, measured: Measurement) -> bool:
        """The pending trial measured over its first window (optional, live shells): True when it is
        already clearly worse than the best trial, and the caller then observes this measurement as
        the trial's (a shorter trial: a squeeze that loses costs the squeezed job less).

        Not in the paper. "Clearly": worse by more than ``min_gain`` plus twice the monitor's noise,
        the largest gap seen so far between a whole trial and its own first window; so never in the
        second trial before a whole one measured the noise, nor without a best to compare."""
        if self._pending is None:
            raise RuntimeError("interim() without a proposed trial")
        value = self._objective.value(self._jobs, measured)
        self._first_window = value
        if self._best is None or not self._window_noise:
            return False
        margin = self._min_gain + 2 * max(self._window_noise)
        if value > self._best.objective * (1 + margin):
            self._first_window = None  # cut short: its first window is the whole trial
            self.cut_short += 1
            return True
        return False

    def observe(self, measured: Measurement) -> None:
        config, improved = self._record(measured)
        whole, first = self._trials[-1].objective, self._first_window
        self._first_window = None
        if first is not None and 0 < whole < math.inf and first < math.inf:
            self._window_noise.append(abs(first / whole - 1))
        self._seen.add(config.key())
        self._misses = 0 if improved else self._misses + 1
        self._last = measured
        if self._low is None:
            self._split(measured)
            self._next = self._swell_high(config)
            if self._next.key() in self._seen:
                self._next = self._generate(config, measured)
            self.ended = EXIT_EXHAUSTED if self._next is None else None
        elif self._early_exit is not None and self._misses >= self._early_exit:
            self._next, self.ended = None, EXIT_NO_GAIN
        else:
            self._next = self._generate(config, measured)
            self.ended = EXIT_EXHAUSTED if self._next is None else None
        if self._next is not None and self._futile_exit and self._futile(measured):
            self._next, self.ended = None, EXIT_NOTHING_TO_GAIN

    def reachable(self, measured: Measurement) -> float | None:
        """A lower bound on the objective of any trial after the one ``measured`` (None: no bound).

        Every later trial squeezes the low-priority side further (caps only go down from the last
        trial's) and keeps the high-priority side swelled, so, on a device where a squeezed job
        never speeds up and no job runs faster than alone: low-priority jobs at most at their
        measured speeds, high-priority jobs at most at their solo speeds (``solo_throughput``, or
        faster if so measured). The objectives only improve with speed. No bound when a
        high-priority job's solo speed is unknown, or when J_max is on the low side and straggles
        (LISS could speed it up without a squeeze)."""
        if self._low is None:
            return None
        jmax = self._jmax.job_id
        if jmax in self._low and stragglers(measured[jmax])[0]:
            return None
        optimistic = dict(measured)
        for job in self._jobs:
            if job.job_id in self._low:
                continue
            if job.solo_throughput is None:
                return None
            m = measured[job.job_id]
            optimistic[job.job_id] = JobMeasurement(
                max(m.throughput, job.solo_throughput), m.utilization, m.worker_step_s
            )
        return self._objective.value(self._jobs, optimistic)

    def _futile(self, measured: Measurement) -> bool:
        """True when no further trial can count as a gain: even ``reachable`` would not beat the
        best by ``min_gain`` (what ``_record`` asks of a gain)."""
        bound = self.reachable(measured)
        assert self._best is not None
        return bound is not None and not bound < self._best.objective * (1 - max(self._min_gain, 1e-9))

    # Lines 1-5
    def _split(self, measured: Measurement) -> None:
        jmax = {self._jmax.job_id}
        rest = {j.job_id for j in self._jobs} - jmax

        def prio(ids: set[str]) -> float:
            ps = [self._objective.priority(j, measured[j.job_id]) for j in self._jobs if j.job_id in ids]
            return sum(ps) / len(ps)

        subset1, subset2 = jmax, rest
        if prio(subset2) < prio(subset1):
            subset1, subset2 = subset2, subset1
        self._low = subset1

    def _swell_high(self, config: PackingConfig) -> PackingConfig:
        caps = {j: (c if j in (self._low or ()) else FULL) for j, c in config.caps.items()}
        return PackingConfig(caps, config.fractions)

    # Lines 11-20
    def _generate(self, config: PackingConfig, measured: Measurement) -> PackingConfig | None:
        assert self._low is not None
        jmax = self._jmax.job_id
        slow, _fast = stragglers(measured[jmax])
        if slow and jmax in self._low:
            nxt = PackingConfig(config.caps, balanced_fractions(measured[jmax], config.fractions))
            if nxt.key() not in self._seen:
                return nxt
        if slow and jmax not in self._low:
            owners = {j.job_id for j in self._jobs if j.job_id != jmax and set(j.gpus) & set(slow)}
            nxt = _squeeze(config, owners, measured if self._skip_slack else None)
            if nxt is not None and nxt.key() not in self._seen:
                return nxt
        nxt = _squeeze(config, self._low, measured if self._skip_slack else None)
        if nxt is None or nxt.key() in self._seen:
            return None  # every low-priority job is at the floor: the space is exhausted
        return nxt


def _squeeze(
    config: PackingConfig, jobs: Iterable[str], measured: Measurement | None = None
) -> PackingConfig | None:
    """One 10% step down for each job; with ``measured``, a job whose cap lies above what it uses
    first drops to its use (rounded up to a step): a cap above the use changes nothing, and three
    such no-op trials would end the search before a cap ever bit (the early exit counts them)."""
    caps = dict(config.caps)
    moved = False
    for j in jobs:
        target = caps[j] - STEP
        if measured is not None and j in measured:
            used = STEP * math.ceil(round(measured[j].utilization * FULL, 6) / STEP)
            target = min(target, used)
        target = max(MIN_CAP, target)
        if target < caps[j]:
            caps[j] = target
            moved = True
    return PackingConfig(caps, config.fractions) if moved else None


class ExhaustiveSearch(_TrialLog):
    """Every cap vector Algorithm 1 can reach (each low-priority job in 10..100%, the high side at
    100%), each measured, and where J_max then straggles a second trial with its LISS split
    balanced. The low-priority side is taken from the first trial, as in Algorithm 1."""

    def __init__(self, jobs: Sequence[JobInfo], objective: Objective) -> None:
        super().__init__(jobs, objective)
        self._inner = CoordinationSearch(jobs, objective, early_exit=None)
        self._queue: Iterator[PackingConfig] | None = None
        self._balance_next: PackingConfig | None = None

    def propose(self) -> PackingConfig | None:
        if self._pending is not None:
            return self._pending
        if not self._trials:
            self._pending = self._inner.propose()
        elif self._balance_next is not None:
            self._pending, self._balance_next = self._balance_next, None
        else:
            assert self._queue is not None
            self._pending = next(self._queue, None)
        return self._pending

    def observe(self, measured: Measurement) -> None:
        config, _improved = self._record(measured)
        if self._queue is None:
            self._inner.observe(measured)
            low = sorted(self._inner.low_priority)
            levels = range(FULL, MIN_CAP - 1, -STEP)
            grid = (
                PackingConfig({**{j.job_id: FULL for j in self._jobs}, **dict(zip(low, combo, strict=True))})
                for combo in itertools.product(levels, repeat=len(low))
            )
            self._queue = (c for c in grid if c.key() != config.key())
        jmax = _jmax(self._jobs).job_id
        if not config.fractions and stragglers(measured[jmax])[0]:
            self._balance_next = PackingConfig(config.caps, balanced_fractions(measured[jmax], {}))


def run_search(
    search: Search, measure: Callable[[PackingConfig], Measurement], limit: int = 100_000
) -> PackingConfig:
    """Drive a search to its end against a measurement function (simulator, tests)."""
    for _ in range(limit):
        config = search.propose()
        if config is None:
            return search.best()
        search.observe(measure(config))
    raise RuntimeError("search did not end")
