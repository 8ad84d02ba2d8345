"""A seeded generator of interactive deep-learning-training (IDLT) notebook sessions.

Fitted to what NotebookOS (ASPLOS '26) publishes about AdobeTrace; the raw trace is not public.

**Task durations** (§2.3.1): an empirical quantile function, piecewise log-linear through the
published points p50 120 s, p75 5 min, p90 17 min, p95 36 min, p99 182 min. Log-linear
interpolation makes each segment log-uniform: exact at every published point, no parametric shape
imposed between them, and heavy-tailed the way the trace is. The ends are assumptions: p0 = 15 s
(the trace's sample granularity, nothing shorter is observable) and p100 = 150,000 s (~42 h), set
so that the summer's published mean concurrency (67.63 trainings, Appendix E.1) over 92 days comes
to ~545k tasks, the trace's published event count: the top 1% of tasks carry much of the GPU time.

**Per-session inter-arrival times** (§2.3.2, §5.4): the same construction through p0 = 240 s (the
published minimum), p50 300 s, p75 480 s. Above p75 the paper is silent; we assume p90 30 min,
p95 1 h, p99 1 day (overnight) and p100 1.75 days, the last tuned so that the summer's mean active
trainings come out at the published 67.63 (Appendix E.1) given the session counts below.

**Coupling**: a user does not submit a cell while the previous one runs, so the gap after a task
depends on its length. The quantile of each IAT is drawn through a Gaussian copula with the
quantile of the task before it (``rho`` = 0.98), then clamped up to ``previous duration +
min_think_s``. The IAT quantile function dominates the duration one (Q_iat(u) > Q_dur(u) + 15 s
for every u), so the clamp touches ~3% of gaps; it only lengthens gaps, lifting p75 by ~5%, so the
drawn p75 knot is 457 s and the generated p75 lands on 480 s. Weaker coupling clamps more (rho 0.9:
9% of gaps, p75 +23%), which is why the coupling is this strong.

**Idle sessions**: ``idle_fraction`` = 25% of sessions never train. §2.3.3 reports more idleness
(~70% of GPUs idle for a whole session), but that cannot hold together with Figure 20: 67.63
trainings per ~244 sessions would need the other 30% busy 93% of their lives, while the published
IATs (p50 300 s against a 120 s median task) keep a session idle well over 15% of its life. Here a
training session is busy ~37% of its life; 25% idle sessions give Figure 20's ratio and the
excerpt's mean/max trainings ~17/33 (published 19.5/34).

**Sessions**: Poisson arrivals with a piecewise-constant rate; lifetimes from a mixture of
exponentials. Defaults are a least-squares fit (scipy) to Appendix E.1 / Figure 20: 0 sessions on
June 1, 206 / 312 / 397 at the ends of June / July / August, monthly means 115 / 233 / 379
(fit: 12.3 arrivals/day; 72.5% of sessions live ~11.4 days, the rest outlive the summer). The
17.5-hour excerpt (§5.3, Figure 7) is a different regime; we read it as sessions counted from their
first appearance in the excerpt, rising 0 -> ~87 with bursts of arrivals at the start, around
hour 2 and before hour 12 (the subscription-ratio spikes of Figure 10).

**GPUs per session** (1-8): not published. We assume a distribution skewed to one GPU with mass at
powers of two, as requests are usually sized to a whole model-parallel degree: 1: 55%, 2: 20%,
3: 2%, 4: 14%, 6: 2%, 8: 7% (mean 2.25). Every task of a session uses all its GPUs, as in NotebookOS.

Deterministic for a seed: one ``numpy.random.Generator`` (PCG64) drawn in a fixed order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import pairwise

import numpy as np
import numpy.typing as npt
from scipy.special import ndtr

from shared.workload.model import Session, Trace, default_resources

HOUR = 3600.0
DAY = 86400.0

# Published points (AdobeTrace, NotebookOS §2.3 and §5.4): probability -> seconds.
PUBLISHED_DURATION_QUANTILES: dict[float, float] = {
    0.50: 120.0,
    0.75: 300.0,
    0.90: 1020.0,
    0.95: 2160.0,
    0.99: 10920.0,
}
PUBLISHED_IAT_QUANTILES: dict[float, float] = {0.50: 300.0, 0.75: 480.0}
PUBLISHED_MIN_IAT_S = 240.0

Knots = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class QuantileFunction:
    """An empirical quantile function: log-linear between (probability, value) knots.

    Exact at the knots; each segment is log-uniform. Knots must start at p=0, end at p=1, and be
    strictly increasing in both coordinates with positive values.
    """

    knots: Knots

    def __post_init__(self) -> None:
        ps = [p for p, _ in self.knots]
        vs = [v for _, v in self.knots]
        if len(self.knots) < 2 or ps[0] != 0.0 or ps[-1] != 1.0:
            raise ValueError(f"quantile knots must run from p=0 to p=1, got {self.knots}")
        if any(b <= a for a, b in pairwise(ps)) or any(b <= a for a, b in pairwise(vs)):
            raise ValueError(f"quantile knots must be strictly increasing, got {self.knots}")
        if vs[0] <= 0:
            raise ValueError(f"quantile values must be > 0 (log-linear), got {vs[0]}")

    @cached_property
    def _p(self) -> npt.NDArray[np.float64]:
        return np.array([p for p, _ in self.knots])

    @cached_property
    def _logv(self) -> npt.NDArray[np.float64]:
        return np.log([v for _, v in self.knots])

    def __call__(self, u: npt.ArrayLike) -> npt.NDArray[np.float64]:
        return np.exp(np.interp(u, self._p, self._logv))

    def cdf(self, x: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The inverse: P(X <= x)."""
        return np.interp(np.log(np.maximum(np.asarray(x, dtype=np.float64), 1e-300)), self._logv, self._p)

    @cached_property
    def _mean(self) -> float:
        total = 0.0
        for (p0, a), (p1, b) in pairwise(self.knots):
            total += (p1 - p0) * (b - a) / math.log(b / a)
        return total

    def mean(self) -> float:
        """Exact mean: each log-uniform segment [a, b] with mass m contributes m (b - a) / ln(b / a)."""
        return self._mean


@dataclass(frozen=True)
class IdltParams:
    """Every knob of the generator, defaults fitted as the module docstring explains."""

    duration: QuantileFunction = field(
        default_factory=lambda: QuantileFunction(
            ((0.0, 15.0), *PUBLISHED_DURATION_QUANTILES.items(), (1.0, 150_000.0))
        )
    )
    iat: QuantileFunction = field(
        default_factory=lambda: QuantileFunction(
            (
                (0.0, PUBLISHED_MIN_IAT_S),
                (0.50, PUBLISHED_IAT_QUANTILES[0.50]),
                # The no-overlap clamp only lengthens gaps, lifting the generated p75 ~5% above the
                # drawn one; drawing p75 at 457 s puts the generated p75 on the published 480 s.
                (0.75, 457.0),
                (0.90, 30 * 60.0),
                (0.95, HOUR),
                (0.99, DAY),
                (1.0, 1.75 * DAY),
            )
        )
    )
    # Share of sessions that never train (§2.3.3: many reserved GPUs stay idle for a whole session).
    idle_fraction: float = 0.25
    rho: float = 0.98  # Gaussian-copula correlation of a task's duration quantile and the next IAT's
    min_think_s: float = 15.0  # least gap between a task's end and the next submit (trace granularity)
    # (start hour, sessions per hour) steps; the last step holds to the end.
    session_rate: tuple[tuple[float, float], ...] = ((0.0, 12.27 / 24),)
    # (weight, mean lifetime in days) of an exponential mixture.
    lifetime_mix: tuple[tuple[float, float], ...] = ((0.725, 11.4), (0.275, 5000.0))
    gpu_weights: tuple[tuple[int, float], ...] = (
        (1, 0.55),
        (2, 0.20),
        (3, 0.02),
        (4, 0.14),
        (6, 0.02),
        (8, 0.07),
    )
    # End sessions still open at the horizon there, as a finite trace observes them (one that is
    # training then closes when that task ends, so no task is cut short).
    clip_to_horizon: bool = True

    def __post_init__(self) -> None:
        if not -1.0 < self.rho < 1.0:
            raise ValueError(f"rho must be in (-1, 1), got {self.rho}")
        if not 0.0 <= self.idle_fraction < 1.0:
            raise ValueError(f"idle_fraction must be in [0, 1), got {self.idle_fraction}")
        if self.min_think_s < 0:
            raise ValueError(f"min_think_s must be >= 0, got {self.min_think_s}")
        if not self.session_rate or self.session_rate[0][0] != 0.0:
            raise ValueError("session_rate must start at hour 0")
        if any(b[0] <= a[0] for a, b in pairwise(self.session_rate)):
            raise ValueError(f"session_rate start hours must increase, got {self.session_rate}")
        if any(r < 0 for _, r in self.session_rate):
            raise ValueError("session rates must be >= 0")
        if not self.lifetime_mix or any(w < 0 or m <= 0 for w, m in self.lifetime_mix):
            raise ValueError(f"lifetime_mix needs weights >= 0 and means > 0, got {self.lifetime_mix}")
        if sum(w for w, _ in self.lifetime_mix) <= 0:
            raise ValueError("lifetime_mix weights sum to 0")
        if not self.gpu_weights or any(not 1 <= g <= 8 or w < 0 for g, w in self.gpu_weights):
            raise ValueError(f"gpu_weights need GPU counts 1..8 and weights >= 0, got {self.gpu_weights}")
        if sum(w for _, w in self.gpu_weights) <= 0:
            raise ValueError("gpu_weights sum to 0")


# The 17.5-hour excerpt's arrival schedule (sessions/hour), shaped after Figures 7 and 10: a burst
# of kernel creations at the start, another around hour 2, another before hour 12; ~89 in all.
EXCERPT_SESSION_RATE: tuple[tuple[float, float], ...] = (
    (0.0, 15.0),
    (1.0, 5.0),
    (2.0, 12.0),
    (3.0, 3.0),
    (11.0, 10.0),
    (12.0, 4.0),
)
EXCERPT_HOURS = 17.5


def _arrivals(
    rng: np.random.Generator, steps: tuple[tuple[float, float], ...], horizon_s: float
) -> list[float]:
    """Poisson arrivals with a piecewise-constant rate, in [0, horizon_s)."""
    out: list[float] = []
    bounds = [h * HOUR for h, _ in steps] + [math.inf]
    for (start_h, rate), stop in zip(steps, bounds[1:], strict=True):
        lo, hi = start_h * HOUR, min(stop, horizon_s)
        if hi <= lo:
            continue
        n = rng.poisson(rate * (hi - lo) / HOUR)
        out.extend(np.sort(rng.uniform(lo, hi, size=n)).tolist())
    return out


def _session_tasks(
    rng: np.random.Generator, params: IdltParams, start: float, end: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], float, int]:
    """Submit times and durations of one session's tasks; returns the session's (possibly later) end.

    Tasks are submitted while the session is open; the session closes after its last task ends.
    Drawn in chunks sized to the expected count so a long session costs a few numpy calls.
    """
    mean_iat = params.iat.mean()
    s_rho = math.sqrt(1.0 - params.rho**2)
    submits: list[npt.NDArray[np.float64]] = []
    durs: list[npt.NDArray[np.float64]] = []
    # The first task comes one think-time after the session opens (an IAT draw, no coupling).
    t = start + float(params.iat(rng.random()))
    z_prev = rng.standard_normal()
    clamped = 0
    while t < end:
        n = int((end - t) / mean_iat * 1.3) + 8
        z_d = np.concatenate(([z_prev], rng.standard_normal(n)))
        eps = rng.standard_normal(n)
        d = params.duration(ndtr(z_d))
        z_i = params.rho * z_d[:-1] + s_rho * eps
        gaps = params.iat(ndtr(z_i))
        floor = d[:-1] + params.min_think_s
        hit = gaps < floor
        gaps = np.maximum(gaps, floor)
        sub = t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        k = int(np.count_nonzero(sub < end))  # sub is increasing, so the kept tasks are a prefix
        clamped += int(np.count_nonzero(hit[: k if k == n else max(k - 1, 0)]))
        submits.append(sub[:k])
        durs.append(d[:k])
        if k < n:
            break
        t = float(sub[-1] + gaps[-1])
        z_prev = z_d[-1]
    if not submits:
        return np.empty(0), np.empty(0), end, clamped
    sub_all = np.concatenate(submits)
    dur_all = np.concatenate(durs)
    last_end = float(sub_all[-1] + dur_all[-1]) if len(sub_all) else end
    return sub_all, dur_all, max(end, last_end), clamped


@dataclass(frozen=True)
class GenerationStats:
    """Side facts about one generation, for reports: how often the no-overlap clamp acted."""

    gaps_clamped: int
    gaps_total: int


def generate_with_stats(
    days: float, seed: int, params: IdltParams | None = None
) -> tuple[Trace, GenerationStats]:
    """:func:`generate`, plus how many IATs the no-overlap clamp changed."""
    if not days > 0:
        raise ValueError(f"days must be > 0, got {days}")
    params = params or IdltParams()
    rng = np.random.Generator(np.random.PCG64(seed))
    horizon = days * DAY
    starts = _arrivals(rng, params.session_rate, horizon)
    n = len(starts)
    weights = np.array([w for w, _ in params.lifetime_mix], dtype=np.float64)
    comp = rng.choice(len(weights), size=n, p=weights / weights.sum())
    means = np.array([m for _, m in params.lifetime_mix]) * DAY
    lifetimes = rng.exponential(means[comp]) if n else np.empty(0)
    gw = np.array([w for _, w in params.gpu_weights], dtype=np.float64)
    gpu_choices = np.array([g for g, _ in params.gpu_weights])
    gpus = gpu_choices[rng.choice(len(gw), size=n, p=gw / gw.sum())] if n else np.empty(0, dtype=np.int64)
    idle = rng.random(n) < params.idle_fraction

    sessions: list[Session] = []
    cols_idx: list[npt.NDArray[np.int64]] = []
    cols_sub: list[npt.NDArray[np.float64]] = []
    cols_dur: list[npt.NDArray[np.float64]] = []
    clamped = 0
    for i in range(n):
        start = starts[i]
        end = start + float(lifetimes[i])
        if params.clip_to_horizon:
            end = min(end, horizon)
        if idle[i]:
            sub, dur, c = np.empty(0), np.empty(0), 0
        else:
            sub, dur, end, c = _session_tasks(rng, params, start, end)
        clamped += c
        g = int(gpus[i])
        sessions.append(Session(f"s{i:06d}", start, end, g, default_resources(g)))
        cols_idx.append(np.full(len(sub), i, dtype=np.int64))
        cols_sub.append(sub)
        cols_dur.append(dur)
    idx = np.concatenate(cols_idx) if cols_idx else np.empty(0, dtype=np.int64)
    trace = Trace(
        tuple(sessions),
        idx,
        np.concatenate(cols_sub) if cols_sub else np.empty(0),
        np.concatenate(cols_dur) if cols_dur else np.empty(0),
        gpus[idx] if n else np.empty(0, dtype=np.int64),
    )
    return trace, GenerationStats(clamped, len(trace.iats_s()))


def generate(days: float, seed: int, params: IdltParams | None = None) -> Trace:
    """A synthetic IDLT trace of ``days`` days, from an empty cluster, deterministic for ``seed``."""
    return generate_with_stats(days, seed, params)[0]


def excerpt_params(params: IdltParams | None = None) -> IdltParams:
    """``params`` with the 17.5-hour excerpt's session arrivals (Figure 7) in place of the summer's."""
    return replace(params or IdltParams(), session_rate=EXCERPT_SESSION_RATE)


def excerpt_17_5h(seed: int, params: IdltParams | None = None) -> Trace:
    """A stand-in for the paper's 17.5-hour prototype excerpt: ~87-90 sessions by the end."""
    return generate(EXCERPT_HOURS / 24.0, seed, excerpt_params(params))
