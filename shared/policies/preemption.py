"""Which best-effort (BE) jobs a cell preempts, and on which replica host the cell then runs.

FitGpp (Yabuuchi, Taniwaki, Omura, "Low-latency job scheduling with preemption for the development
of deep learning", §3.2; ../shared/papers/fitgpp-preemptive-te-be-scheduling.txt) and the paper's
baselines (non-preemptive FIFO, LRTP, RAND), behind one interface so the live scheduler and the
simulator (``shared.simulator.preemption_sim``) step the same objects.

In Tandem the trial-and-error (TE) work is a notebook cell and the candidate nodes are the
kernel's replica hosts: a cell can only run where a replica lives. So electing the executor and
choosing the victims are ONE decision: ``decide(demand, hosts)`` returns the host the cell runs on
and the BE jobs to preempt there (none when a replica host has room now).

The grace period (GP) of a job is not a user's guess but its *measured* time to release its GPUs
(pause at the next step boundary, or rewind to the last checkpoint); the caller measures it and
hands it in as data. Pure: no clock, no I/O; RAND draws from its own seeded ``random.Random``.
Also here: ``RevocableLease``, the lease rules a cell applies when it takes a leased GPU.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.resources import Resources

RESOURCE_AXES = ("millicpus", "memory_mb", "gpus")  # FitGpp's C, R, G (Eq. 1)


@dataclass(frozen=True, slots=True)
class BEJob:
    """A running (not already releasing) BE job as the policy sees it."""

    job_id: str
    demand: Resources
    grace_period_s: float  # measured time to release (GP): step boundary or rewind to checkpoint
    preemptions: int = 0  # PreemptionCount_j
    remaining_s: float | None = None  # remaining execution time; only LRTP reads it (perfect oracle)


@dataclass(frozen=True, slots=True)
class CandidateHost:
    """A replica host of the kernel: its capacity, its unallocated resources N, its BE jobs.

    ``free`` may be negative on an axis where resources are already promised (a cell waiting for
    an earlier victim's grace period): such a host has no room until that victim is gone."""

    host_id: str
    capacity: Resources
    free: Resources
    jobs: tuple[BEJob, ...] = ()


@dataclass(frozen=True, slots=True)
class Victim:
    host_id: str
    job_id: str


@dataclass(frozen=True, slots=True)
class PreemptionDecision:
    """Where the cell runs and whom it preempts.

    ``host_id`` None: no candidate host can host the cell even after preempting every BE job on
    it (the hosts are full of cells or too small): the cell waits. ``victims`` empty with a host:
    it runs without preemption. LRTP and RAND may name victims on other hosts than ``host_id``
    (they preempt until *some* host has room, as the paper simulates them); FitGpp never does."""

    host_id: str | None
    victims: tuple[Victim, ...]
    reason: str
    over_budget: bool = False  # some victim had already been preempted P times (never-blocked rule)

    @property
    def blocked(self) -> bool:
        return self.host_id is None


class PreemptionPolicy(Protocol):
    name: str
    preemptive: bool  # False: cells queue with jobs, FIFO (the paper's vanilla baseline)

    def decide(self, demand: Resources, hosts: Sequence[CandidateHost]) -> PreemptionDecision: ...


def size(demand: Resources, capacity: Resources) -> float:
    """FitGpp Eq. 1: the Euclidean norm of CPU, RAM and GPU demand, each over the node's capacity
    of it, so the measure is unit-free (4 CPUs vs 64 GB compare fairly). Axes the node lacks are
    left out."""
    total = 0.0
    for axis in RESOURCE_AXES:
        cap = getattr(capacity, axis)
        if cap > 0:
            total += (getattr(demand, axis) / cap) ** 2
    return math.sqrt(total)


def fits(demand: Resources, room: Resources) -> bool:
    """Element-wise ``demand <= room`` over CPU, RAM and GPU (FitGpp Eq. 2's inequality)."""
    return all(getattr(demand, a) <= getattr(room, a) for a in RESOURCE_AXES)


def host_with_room(demand: Resources, hosts: Sequence[CandidateHost]) -> CandidateHost | None:
    """The first host (in the caller's order of preference) whose unallocated resources fit."""
    return next((h for h in hosts if fits(demand, h.free)), None)


def _run_here(host: CandidateHost) -> PreemptionDecision:
    return PreemptionDecision(host.host_id, (), f"room on {host.host_id}: runs without preemption")


def _blocked(demand: Resources) -> PreemptionDecision:
    return PreemptionDecision(None, (), f"no replica host can free {demand} even by preempting every BE job")


class NoPreemption:
    """Vanilla FIFO (the paper's baseline): a cell runs where there is room, or waits."""

    name = "fifo"
    preemptive = False

    def decide(self, demand: Resources, hosts: Sequence[CandidateHost]) -> PreemptionDecision:
        host = host_with_room(demand, hosts)
        if host is not None:
            return _run_here(host)
        return PreemptionDecision(None, (), "no room on any replica host; FIFO does not preempt")


class FitGpp:
    """FitGpp §3.2: preempt the one BE job with the lowest

        Score(j) = Size(D_j) / max Size + s * GP_j / max GP          (Eq. 3)

    among the jobs j that free enough room on their own, D_TE <= D_j + N on j's node (Eq. 2), and
    have been preempted fewer than P times (Eq. 4). The maxima run over every BE job handed in
    (the simulator hands in the whole cluster, the paper's set J; live, the replica hosts' jobs).
    Small jobs are re-placed quickly (no head-of-line blocking); short GPs let the cell start soon.

    Where the paper "preempts a random BE job" when no job qualifies (never seen in its runs),
    Tandem keeps the score and degrades in this order, so **a cell is never blocked while BE jobs
    hold its replica hosts**:
      1. one in-budget job that frees enough on its own (the paper's rule);
      2. several in-budget jobs on one host, lowest scores first, fewest victims winning;
      3. the same two steps again counting jobs already preempted P times (over budget: the
         decision says so), by the same score.
    Only when even preempting every BE job on a host cannot fit the cell anywhere is it blocked.
    """

    name = "fitgpp"
    preemptive = True

    def __init__(self, s: float = 4.0, max_preemptions: int = 1) -> None:
        if s < 0 or max_preemptions < 0:
            raise ValueError("FitGpp needs s >= 0 and P >= 0")
        self.s = s
        self.max_preemptions = max_preemptions

    def scores(self, hosts: Sequence[CandidateHost]) -> dict[tuple[str, str], float]:
        """Eq. 3 for every job handed in, keyed by (host_id, job_id)."""
        sizes = {(h.host_id, j.job_id): size(j.demand, h.capacity) for h in hosts for j in h.jobs}
        gps = {(h.host_id, j.job_id): j.grace_period_s for h in hosts for j in h.jobs}
        max_size = max(sizes.values(), default=0.0)
        max_gp = max(gps.values(), default=0.0)
        return {
            key: (sizes[key] / max_size if max_size > 0 else 0.0)
            + self.s * (gps[key] / max_gp if max_gp > 0 else 0.0)
            for key in sizes
        }

    def decide(self, demand: Resources, hosts: Sequence[CandidateHost]) -> PreemptionDecision:
        host = host_with_room(demand, hosts)
        if host is not None:
            return _run_here(host)
        score = self.scores(hosts)
        order = {h.host_id: i for i, h in enumerate(hosts)}

        def rank(h: CandidateHost, j: BEJob) -> tuple[float, int, str]:
            return (score[(h.host_id, j.job_id)], order[h.host_id], j.job_id)

        for over_budget in (False, True):
            allowed = [
                (h, j) for h in hosts for j in h.jobs if over_budget or j.preemptions < self.max_preemptions
            ]
            single = [(h, j) for h, j in allowed if fits(demand, j.demand + h.free)]
            if single:
                h, j = min(single, key=lambda hj: rank(*hj))
                return PreemptionDecision(
                    h.host_id,
                    (Victim(h.host_id, j.job_id),),
                    f"argmin score {score[(h.host_id, j.job_id)]:.3f} among {len(single)} eligible"
                    + (" (all eligible jobs over budget P)" if over_budget else ""),
                    over_budget=over_budget and j.preemptions >= self.max_preemptions,
                )
            best: tuple[tuple[int, float, int], CandidateHost, list[BEJob]] | None = None
            for h in hosts:
                jobs = sorted((j for hh, j in allowed if hh is h), key=lambda j: rank(h, j))
                chosen = _cover(demand, h.free, jobs)
                if chosen is not None:
                    key = (len(chosen), sum(score[(h.host_id, j.job_id)] for j in chosen), order[h.host_id])
                    if best is None or key < best[0]:
                        best = (key, h, chosen)
            if best is not None:
                _, h, chosen = best
                return PreemptionDecision(
                    h.host_id,
                    tuple(Victim(h.host_id, j.job_id) for j in chosen),
                    f"no single job frees enough: {len(chosen)} lowest-score jobs on {h.host_id}",
                    over_budget=any(j.preemptions >= self.max_preemptions for j in chosen),
                )
        return _blocked(demand)


def _cover(demand: Resources, free: Resources, jobs: Iterable[BEJob]) -> list[BEJob] | None:
    """The shortest prefix of ``jobs`` whose release (with ``free``) fits ``demand``, or None."""
    room = free
    chosen: list[BEJob] = []
    for j in jobs:
        room = room + j.demand
        chosen.append(j)
        if fits(demand, room):
            return chosen
    return None


class _UntilRoom:
    """LRTP and RAND as the paper simulates them: preempt jobs one at a time, in the policy's
    order, anywhere among the candidate hosts, until some host has room for the cell ("continue
    the preemption process until they can prepare enough resource"). The P budget and the
    never-blocked rule are applied as for FitGpp: in-budget jobs first, then the rest."""

    name = ""
    preemptive = True

    def __init__(self, max_preemptions: int = 1) -> None:
        self.max_preemptions = max_preemptions

    def order(self, jobs: list[tuple[CandidateHost, BEJob]]) -> list[tuple[CandidateHost, BEJob]]:
        raise NotImplementedError

    def decide(self, demand: Resources, hosts: Sequence[CandidateHost]) -> PreemptionDecision:
        host = host_with_room(demand, hosts)
        if host is not None:
            return _run_here(host)
        pairs = [(h, j) for h in hosts for j in h.jobs]
        in_budget = self.order([(h, j) for h, j in pairs if j.preemptions < self.max_preemptions])
        over = self.order([(h, j) for h, j in pairs if j.preemptions >= self.max_preemptions])
        room = {h.host_id: h.free for h in hosts}
        chosen: list[tuple[CandidateHost, BEJob]] = []
        for h, j in in_budget + over:
            chosen.append((h, j))
            room[h.host_id] = room[h.host_id] + j.demand
            if fits(demand, room[h.host_id]):
                return PreemptionDecision(
                    h.host_id,
                    tuple(Victim(vh.host_id, vj.job_id) for vh, vj in chosen),
                    f"{self.name}: {len(chosen)} preempted until {h.host_id} had room",
                    over_budget=any(vj.preemptions >= self.max_preemptions for _, vj in chosen),
                )
        return _blocked(demand)


class Lrtp(_UntilRoom):
    """Longest Remaining Time Preemption (Big-C; the paper's LRTP): preempt the job with the longest
    remaining execution time first, assuming that time is known exactly (``BEJob.remaining_s``)."""

    name = "lrtp"

    def order(self, jobs: list[tuple[CandidateHost, BEJob]]) -> list[tuple[CandidateHost, BEJob]]:
        for _, j in jobs:
            if j.remaining_s is None:
                raise ValueError(f"LRTP needs the remaining time of job {j.job_id}")
        return sorted(jobs, key=lambda hj: (-(hj[1].remaining_s or 0.0), hj[1].job_id))


class RandomPreemption(_UntilRoom):
    """RAND: preempt running BE jobs in a random order (from this object's own seeded generator)."""

    name = "rand"

    def __init__(self, max_preemptions: int = 1, seed: int = 0) -> None:
        super().__init__(max_preemptions)
        self.rng = random.Random(seed)

    def order(self, jobs: list[tuple[CandidateHost, BEJob]]) -> list[tuple[CandidateHost, BEJob]]:
        shuffled = list(jobs)
        self.rng.shuffle(shuffled)
        return shuffled


def make_policy(name: str, *, s: float = 4.0, max_preemptions: int = 1, seed: int = 0) -> PreemptionPolicy:
    if name == "fifo":
        return NoPreemption()
    if name == "fitgpp":
        return FitGpp(s=s, max_preemptions=max_preemptions)
    if name == "lrtp":
        return Lrtp(max_preemptions=max_preemptions)
    if name == "rand":
        return RandomPreemption(max_preemptions=max_preemptions, seed=seed)
    raise ValueError(f"unknown preemption policy {name!r} (fifo, lrtp, rand, fitgpp)")


POLICY_NAMES = ("fifo", "lrtp", "rand", "fitgpp")


class LeaseError(ValueError):
    pass


class RevocableLease:
    """A BE job's lease on GPUs that cells may revoke for a while.

    A cell that takes a leased GPU *suspends* the lease; while any cell holds it the lease clock
    stops, so the job is not charged for time it could not use. When the last such cell ends the
    GPUs return to the same app if the lease has not expired, expiry being measured in
    unsuspended time only (``term_s`` of it). Times are the caller's (monotonic seconds)."""

    def __init__(self, lease_id: str, app_id: str, term_s: float, granted_at: float) -> None:
        if term_s <= 0:
            raise LeaseError("a lease needs a positive term")
        self.lease_id = lease_id
        self.app_id = app_id
        self.term_s = term_s
        self._used_s = 0.0  # unsuspended time before ``_since``
        self._since = granted_at  # start of the current unsuspended stretch (when not suspended)
        self._last = granted_at
        self._cells: set[str] = set()

    @property
    def suspended(self) -> bool:
        return bool(self._cells)

    def _tick(self, now: float) -> None:
        if now < self._last:
            raise LeaseError(f"time went backwards: {now} < {self._last}")
        self._last = now

    def used_s(self, now: float) -> float:
        """Unsuspended time elapsed since the grant."""
        self._tick(now)
        return self._used_s if self.suspended else self._used_s + (now - self._since)

    def remaining_s(self, now: float) -> float:
        return max(0.0, self.term_s - self.used_s(now))

    def expired(self, now: float) -> bool:
        return self.used_s(now) >= self.term_s

    def suspend(self, cell_id: str, now: float) -> None:
        """A cell takes the lease's GPUs: the clock stops (from the first suspending cell)."""
        if self.expired(now):
            raise LeaseError(f"lease {self.lease_id} expired; nothing to suspend")
        if cell_id in self._cells:
            raise LeaseError(f"cell {cell_id} already suspends lease {self.lease_id}")
        if not self._cells:
            self._used_s += now - self._since
        self._cells.add(cell_id)

    def resume(self, cell_id: str, now: float) -> bool:
        """The cell ended. True when the GPUs go back to ``app_id`` (the last suspending cell ended
        and the lease is not expired); False while other cells still hold it, or when expired."""
        self._tick(now)
        if cell_id not in self._cells:
            raise LeaseError(f"cell {cell_id} does not suspend lease {self.lease_id}")
        self._cells.discard(cell_id)
        if self._cells:
            return False
        self._since = now
        return not self.expired(now)


DEFAULT_GRACE_PERIOD_S = 1.0  # a job's GP before it reports its first step (one step of a typical job)
PAUSE, REWIND = "pause", "rewind"


@dataclass(frozen=True, slots=True)
class ReleaseFacts:
    """What has been measured about how fast a job gives its GPUs back to a cell."""

    paused_s: float | None = None  # host-measured: pause asked -> paused at a step boundary (last one)
    step_s: float | None = None  # the job's own report: seconds per iteration (a pause waits < one step)
    killed_s: float | None = None  # host-measured: SIGKILL -> process gone (its last rewind)
    image_step: int | None = None  # the step of its latest image the checkpoint service holds


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    """How a cell takes the job's GPUs, and the time that takes (FitGpp's GP; None: unmeasured)."""

    mode: str  # PAUSE (step boundary, else SIGSTOP at the grace) or REWIND (killed, resumes from its image)
    grace_period_s: float | None


def release_plan(facts: ReleaseFacts, *, pause_grace_s: float) -> ReleasePlan:
    """A job pauses at its next step boundary, or is frozen by SIGSTOP at ``pause_grace_s``: either
    way its GPUs are the cell's within min(time to a boundary, grace). A job whose pause would run
    past the grace (its steps are longer) would be frozen *with its GPU memory*; if the checkpoint
    service holds an image of it, it is rewound instead: killed now (memory freed), restarted later
    from that image, losing the steps since. The time to a boundary is the measured pause, or until
    one is measured the job's reported step time."""
    pause_s = facts.paused_s if facts.paused_s is not None else facts.step_s
    capped = None if pause_s is None else min(pause_s, pause_grace_s)
    if facts.image_step is not None and pause_s is not None and pause_s > pause_grace_s:
        return ReleasePlan(REWIND, facts.killed_s if facts.killed_s is not None else capped)
    return ReleasePlan(PAUSE, capped)


@dataclass(frozen=True, slots=True)
class LeasedJob:
    """What a host reports of a job on leased GPUs (``host.heartbeat``'s ``leased``): enough for
    the global mirror to mark its devices leased and for FitGpp to score it (GPU axis only)."""

    job_id: str
    device_ids: tuple[int, ...]
    grace_period_s: float | None = None  # ``release_plan``'s, from measurements; None: nothing measured yet
    preemptions: int = 0

    @property
    def gpus(self) -> int:
        return len(self.device_ids)

    def to_wire(self) -> list[Any]:
        return [self.job_id, list(self.device_ids), self.grace_period_s, self.preemptions]

    @classmethod
    def from_wire(cls, raw: Sequence[Any]) -> LeasedJob:
        """Raises (ValueError, TypeError, IndexError) on a malformed entry."""
        gp = raw[2] if len(raw) > 2 else None
        return cls(
            str(raw[0]),
            tuple(int(d) for d in raw[1]),
            None if gp is None else float(gp),
            int(raw[3]) if len(raw) > 3 else 0,
        )


def gpu_candidate(host_id: str, total_gpus: int, idle_gpus: int, jobs: Iterable[LeasedJob]) -> CandidateHost:
    """A replica host as FitGpp sees it when cells ask for GPUs only (their CPU and memory are
    the replica's, already subscribed): capacity and room in GPUs, one BEJob per leased job, GP
    the job's measured time to release (``release_plan``) or ``DEFAULT_GRACE_PERIOD_S`` until the
    job has reported a step."""
    return CandidateHost(
        host_id,
        Resources(gpus=total_gpus),
        Resources(gpus=idle_gpus),
        tuple(
            BEJob(
                j.job_id,
                Resources(gpus=j.gpus),
                DEFAULT_GRACE_PERIOD_S if j.grace_period_s is None else j.grace_period_s,
                j.preemptions,
            )
            for j in jobs
            if j.gpus > 0
        ),
    )
