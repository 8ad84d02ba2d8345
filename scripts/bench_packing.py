#!/usr/bin/env python
"""Packing benchmark (issue #18): Gimbal's squeeze/swell, LISS-aware coordination search and
packing, live on this machine and in the simulator. Prints ONE JSON line.

Live (one core is the "GPU": both jobs of a pair are pinned to it): for each pair (``PAIRS``:
``underusing``, a job that waits for its input every step beside a compute-bound job, the headline;
``compute_bound``, two jobs that keep the device busy), the two small CPU training jobs
(``shared.packing.cpu_job``, one torch thread each, real processes) run one after the other
(shortest first, from their measured solo times), then together under free competition, then
together under Gimbal: Algorithm 1 (``shared.policies.packing``; objective ``--objective``, default
``jct_sequenced`` with each job's solo speed profiled once) proposes caps, the duty-cycle governor
in each job applies them at its next step, and this script is the runtime monitor (throughput and
CPU utilization from each job's progress file over a trial window). Process and torch start-up
happen before the start line and are not counted. Keys: ``jct_sequential_s``,
``jct_free_competition_s``, ``jct_gimbal_s`` (the underusing pair; ``compute_bound_jct_*`` the
other; mean JCT of the two jobs, median of ``--repeats`` interleaved repeats; every figure and each
search's trials under ``pairs``), ``search_trials`` and ``search_ended`` (the headline pair's
searches: trials each ran, and why each ended: ``nothing_to_gain`` is our exit, not the paper's;
``--compare-literal`` adds ``jct_gimbal_literal_s``: Algorithm 1's exit only, trials whole),
``share_error_max`` (one job alone at shares 30..100%: max |throughput / throughput at 100% -
share|, medians of repeats), the per-share errors.

Simulated (``shared.simulator.packing_sim``, Philly-like 150-job trace on 32 GPUs, pair slowdowns
MODELLED): ``jct_ratio_vs_no_packing``, ``jct_ratio_vs_naive``, ``deadlines_met_<policy>``,
``makespan_ratio`` (Gimbal / no packing), ``search_trials_ratio`` and ``search_objective_ratio``
(Algorithm 1 / exhaustive on every packing set the run formed); medians over ``--seeds`` traces.

Targets: live jct_gimbal_s <= 0.85 x sequential and <= free competition; share_error_max <= 0.15;
simulated JCT <= 0.85 x no packing; search within 1% of exhaustive in <= 55% of its trials.
The machine is shared with other work: live numbers are noisy, hence medians.

Usage: ``python scripts/bench_packing.py [--quick] [--repeats 3] [--seeds 3] [--no-live | --no-sim]
[--pairs underusing,compute_bound] [--objective jct_sequenced] [--compare-literal]``
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.packing.governor import write_share
from shared.policies.packing import FIRST_WINDOW, OBJECTIVES, CoordinationSearch, JobInfo, JobMeasurement
from shared.simulator.packing_sim import SLOWDOWN_SOURCE, TraceParams, model_pairs_gaining, run_all

ROOT = Path(__file__).resolve().parents[1]
# the "GPU": one core, both jobs of a pair pinned to it (a device they time-share, as two jobs
# share a GPU; the other cores play the host's CPUs, where the rest of the machine's load runs)
DEVICE_CPU = max(os.sched_getaffinity(0))
CORES = 1
MIN_GAIN = 0.03  # as the job runner's default ([packing] min_gain)
PROFILE_S = 1.5  # each job's solo profile, once per pair


@dataclass(frozen=True)
class JobSpec:
    name: str
    steps: int
    width: int
    load_ms: float = 0.0  # input wait before each step: the device idles (see cpu_job)


class LiveJob:
    """One job process, started and waiting at the start line."""

    def __init__(self, spec: JobSpec, workdir: Path, go: Path) -> None:
        self.spec = spec
        self.share_file = workdir / f"{go.name}-{spec.name}.share"
        self.progress_file = workdir / f"{go.name}-{spec.name}.progress"
        write_share(self.share_file, 100)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shared.packing.cpu_job",
                "--steps",
                str(spec.steps),
                "--width",
                str(spec.width),
                "--share-file",
                str(self.share_file),
                "--progress-file",
                str(self.progress_file),
                "--go-file",
                str(go),
                "--load-ms",
                str(spec.load_ms),
                "--cpu",
                str(DEVICE_CPU),
            ],
            env=env,
            cwd=ROOT,
        )

    def progress(self) -> tuple[int, float, float]:
        for _ in range(100):
            try:
                steps, t, cpu = self.progress_file.read_text().split()[:3]
                return int(steps), float(t), float(cpu)
            except (FileNotFoundError, ValueError):
                time.sleep(0.01)
        raise RuntimeError(f"{self.spec.name}: no progress")

    def ready(self) -> bool:
        return self.progress_file.exists()

    def done(self) -> bool:
        return self.progress()[0] >= self.spec.steps

    def finish_time(self) -> float:
        self.proc.wait(timeout=600)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.spec.name} exited {self.proc.returncode}")
        return self.progress()[1]


def _start(specs: Sequence[JobSpec], workdir: Path, go: Path) -> list[LiveJob]:
    jobs = [LiveJob(s, workdir, go) for s in specs]
    while not all(j.ready() for j in jobs):
        time.sleep(0.02)
    return jobs


def _go(go: Path) -> float:
    t = time.monotonic()
    go.touch()
    return t


def run_sequential(specs: Sequence[JobSpec], workdir: Path, tag: str) -> tuple[float, dict[str, float]]:
    """One after the other, shortest first: each job runs alone (its process and torch started
    before its start line), and the mean JCT is that of the shortest-first order of the measured
    solo times (the second job's completion is the sum of both). Ordering by the measured times is
    an oracle no scheduler has: it favours the baseline. Also returns the solo times."""
    solo: dict[str, float] = {}
    for i, spec in enumerate(specs):
        go = workdir / f"go-{tag}-{i}"
        (job,) = _start([spec], workdir, go)
        t0 = _go(go)
        solo[spec.name] = job.finish_time() - t0
    finishes = list(itertools.accumulate(sorted(solo.values())))
    return statistics.fmean(finishes), solo


def profile_solo(spec: JobSpec, workdir: Path, seconds: float) -> float:
    """Steps per second of the job alone over ``seconds`` (after its first steps): the profile a
    packing scheduler has of a job before it packs it (Lucid profiles each job; the job runner
    has J_max's own speed from before its guest came)."""
    go = workdir / f"go-profile-{spec.name}-{time.monotonic_ns()}"
    (job,) = _start([dataclasses.replace(spec, steps=10**7)], workdir, go)
    _go(go)
    time.sleep(0.3)  # first steps (allocation, caches) are not the job's speed
    s0, t0, _ = job.progress()
    time.sleep(seconds)
    s1, t1, _ = job.progress()
    job.proc.kill()
    job.proc.wait()
    return (s1 - s0) / max(t1 - t0, 1e-6)


def run_together(
    specs: Sequence[JobSpec],
    workdir: Path,
    tag: str,
    gimbal: bool,
    trial_s: float,
    solo: dict[str, float] | None = None,
    objective: str = "jct_sequenced",
    literal: bool = False,
) -> tuple[float, dict]:
    go = workdir / f"go-{tag}"
    jobs = _start(specs, workdir, go)
    t0 = _go(go)
    info: dict = {}
    if gimbal:
        info = _coordinate(jobs, trial_s, solo or {}, objective, literal)
    return statistics.fmean(j.finish_time() - t0 for j in jobs), info


def _coordinate(
    jobs: Sequence[LiveJob], trial_s: float, solo: dict[str, float], objective: str, literal: bool
) -> dict:
    """The runtime monitor and coordinator: Algorithm 1 against live measurements; the search ends
    once no later trial can gain, and a trial clearly worse after its first window ends there
    (``literal``: neither, Algorithm 1's own exit only and every trial whole)."""
    by_name = {j.spec.name: j for j in jobs}
    start = {j.spec.name: j.progress() for j in jobs}
    infos = [
        JobInfo(
            j.spec.name,
            (f"cpu/{j.spec.name}",),
            j.spec.steps - start[j.spec.name][0],
            solo_throughput=solo.get(j.spec.name),
        )
        for j in jobs
    ]
    # The duty cycle caps a share of the job's own full speed: every cap below 100% binds, there is
    # no slack above a use to skip (that is a GPU notion), so the literal 10% steps apply.
    # min_gain: a trial must beat the best by more than the noise of a window on a shared machine
    search = CoordinationSearch(
        infos, OBJECTIVES[objective](), skip_slack=False, min_gain=MIN_GAIN, futile_exit=not literal
    )
    trials: list[dict] = []
    while (config := search.propose()) is not None:
        if any(j.done() for j in jobs):
            break  # a job finished during the search: the set dissolved
        for name, cap in config.caps.items():
            write_share(by_name[name].share_file, cap)
        before = {n: j.progress() for n, j in by_name.items()}
        time.sleep(trial_s * FIRST_WINDOW)
        measured = _measure(before, {n: j.progress() for n, j in by_name.items()})
        cut_short = not literal and search.interim(measured)  # clearly worse: the window is the trial
        if not cut_short:
            time.sleep(trial_s * (1 - FIRST_WINDOW))
            measured = _measure(before, {n: j.progress() for n, j in by_name.items()})
        search.observe(measured)
        trials.append(
            {
                "caps": dict(config.caps),
                "cut_short": cut_short,
                "throughput": {n: round(m.throughput, 2) for n, m in measured.items()},
                "utilization": {n: round(m.utilization, 3) for n, m in measured.items()},
                "objective": round(search.trials[-1].objective, 3),
                "reachable": _rounded(search.reachable(measured)),
            }
        )
    best = search.best() if search.trials else None
    if best is not None and not any(j.done() for j in jobs):
        for name, cap in best.caps.items():
            write_share(by_name[name].share_file, cap)
    # the set dissolves when a job ends: the other runs alone, at 100% (as the job runner does;
    # leaving it squeezed cost the earlier Gimbal runs their lead)
    while not any(j.done() for j in jobs):
        time.sleep(0.02)
    for job in jobs:
        write_share(job.share_file, 100)
    return {
        "trials": trials,
        "best_caps": dict(best.caps) if best else None,
        "ended": search.ended,
        "cut_short": search.cut_short,
    }


def _measure(
    before: dict[str, tuple[int, float, float]], after: dict[str, tuple[int, float, float]]
) -> dict[str, JobMeasurement]:
    """Each job's speed over its own report clock and its device use (CPU seconds over them)."""
    measured = {}
    for n in before:
        (s0, t0, c0), (s1, t1, c1) = before[n], after[n]
        dt = max(t1 - t0, 1e-6)
        measured[n] = JobMeasurement(throughput=max((s1 - s0) / dt, 1e-9), utilization=(c1 - c0) / dt / CORES)
    return measured


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def measure_shares(spec: JobSpec, workdir: Path, window_s: float, cycles: int = 4) -> dict[int, float]:
    """Throughput of one job alone at each share relative to 100%: ``cycles`` short windows at the
    share interleaved with as many at 100%, steps and seconds summed over each kind. The machine's
    load drifts (other work shares its two cores); one long window at each share bracketed by two at
    100% measured that drift as much as the governor (rerun at a load average of 1.6: 40% read as
    0.217 and 30% as 0.248, not monotone). Interleaving cancels all but the drift within a window."""
    go = workdir / f"go-share-{time.monotonic_ns()}"
    (job,) = _start([spec], workdir, go)
    _go(go)

    def window(share: int) -> tuple[int, float]:
        write_share(job.share_file, share)
        time.sleep(0.05)  # the share applies at the next step boundary
        s0, t0, _ = job.progress()
        time.sleep(window_s)
        s1, t1, _ = job.progress()
        return s1 - s0, max(t1 - t0, 1e-6)

    window(100)  # the governor's full-speed reference
    relative: dict[int, float] = {}
    for share in range(30, 100, 10):
        steps = {share: 0, 100: 0}
        seconds = {share: 0.0, 100: 0.0}
        for i in range(2 * cycles):
            kind = (share, 100)[(i + share // 10) % 2]  # alternate which comes first
            n, dt = window(kind)
            steps[kind] += n
            seconds[kind] += dt
        relative[share] = (steps[share] / seconds[share]) / (steps[100] / seconds[100])
    job.proc.kill()
    job.proc.wait()
    return relative


# The pairs, each one job per process on the one "GPU" core. ``underusing`` is the kind Gimbal
# packs (§2, Fig. 2: jobs that leave the device idle part of each step): a training job that
# waits for its input every step (the device idles ~3/4 of the time) beside a compute-bound job.
# ``compute_bound``: two jobs that keep the device busy all the time; packing cannot beat
# running them one after the other (the device has no idle time to harvest), it is kept to show
# what the coordinator does when there is nothing to gain.
# Jobs of ~20-30 s alone: the search's trials (1.5 s each, the last three of them lost) are then a
# small part of a job's run, as the paper's 60 s trials are of jobs that run for hours.
PAIRS: dict[str, tuple[JobSpec, JobSpec]] = {
    "underusing": (JobSpec("loader", 900, 256, load_ms=24.0), JobSpec("compute", 3000, 384)),
    "compute_bound": (JobSpec("large", 1500, 384), JobSpec("small", 2000, 128)),
}
PRIMARY = "underusing"  # its figures are the bench's headline keys


def live_pair(
    specs: Sequence[JobSpec],
    workdir: Path,
    repeats: int,
    trial_s: float,
    tag: str,
    objective: str,
    compare_literal: bool = False,
) -> dict:
    """Sequential, free competition and Gimbal for one pair, ``repeats`` interleaved repeats; the
    jobs' solo speeds profiled once first (``PROFILE_S`` each, not counted in any JCT).
    ``compare_literal``: also Gimbal with Algorithm 1's exit only, every trial whole
    (``gimbal_literal``: the search before the "nothing to gain" exit and cut-short trials)."""
    profile = {spec.name: profile_solo(spec, workdir, PROFILE_S) for spec in specs}
    seq, free, gim, searches, solos = [], [], [], [], []
    literal: list[float] = []
    literal_searches: list[dict] = []
    variants = ("seq", "free", "gimbal") + (("gimbal_literal",) if compare_literal else ())
    for r in range(repeats):
        # the variants in a rotating order: load that drifts over a repeat does not always favour
        # the same one
        k = r % len(variants)
        for variant in variants[k:] + variants[:k]:
            if variant == "seq":
                jct, solo = run_sequential(specs, workdir, f"{tag}-seq-{r}")
                seq.append(jct)
                solos.append(solo)
            elif variant == "free":
                free.append(run_together(specs, workdir, f"{tag}-free-{r}", False, trial_s)[0])
            else:
                is_literal = variant == "gimbal_literal"
                jct, info = run_together(
                    specs, workdir, f"{tag}-{variant}-{r}", True, trial_s, profile, objective, is_literal
                )
                (literal if is_literal else gim).append(jct)
                (literal_searches if is_literal else searches).append(info)
    extra: dict = {}
    if compare_literal:
        extra = {
            "jct_gimbal_literal_s": statistics.median(literal),
            "jct_gimbal_literal_runs_s": literal,
            "gimbal_literal_vs_free": statistics.median(literal) / statistics.median(free),
            "search_trials_literal": [len(s["trials"]) for s in literal_searches],
            "searches_literal": literal_searches,
        }
    return {
        **extra,
        "jct_sequential_s": statistics.median(seq),
        "jct_free_competition_s": statistics.median(free),
        "jct_gimbal_s": statistics.median(gim),
        "jct_sequential_runs_s": seq,
        "jct_free_competition_runs_s": free,
        "jct_gimbal_runs_s": gim,
        "solo_s": {n: statistics.median(s[n] for s in solos) for n in solos[0]},
        "profiled_steps_per_s": {n: round(v, 2) for n, v in profile.items()},
        "objective": objective,
        "gimbal_vs_sequential": statistics.median(gim) / statistics.median(seq),
        "gimbal_vs_free": statistics.median(gim) / statistics.median(free),
        "free_vs_sequential": statistics.median(free) / statistics.median(seq),
        "search_trials": [len(s["trials"]) for s in searches],
        "search_best_caps": [s["best_caps"] for s in searches],
        "search_ended": [s["ended"] for s in searches],
        "searches": searches,
    }


def live(repeats: int, quick: bool, pairs: Sequence[str], objective: str, compare_literal: bool) -> dict:
    scale = 0.5 if quick else 1.0
    # about 50-150 steps of these jobs (the paper: up to 60 s or 5 steps); 0.5 s windows let
    # the machine's load swing a trial by more than a 10% squeeze changes it
    trial_s = 1.0 if quick else 1.5
    out: dict = {"device": f"core {DEVICE_CPU} of {os.cpu_count()}", "pairs": {}}
    errors: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        workdir = Path(d)
        for name in pairs:
            specs = [dataclasses.replace(s, steps=int(s.steps * scale)) for s in PAIRS[name]]
            result = live_pair(specs, workdir, repeats, trial_s, name, objective, compare_literal)
            result["jobs"] = [dataclasses.asdict(s) for s in specs]
            out["pairs"][name] = result
        for _ in range(repeats):
            for share, rel in measure_shares(JobSpec("probe", 10**7, 256), workdir, 0.4).items():
                errors.setdefault(share, []).append(abs(rel - share / 100))
    share_err = {s: statistics.median(v) for s, v in sorted(errors.items())}
    headline = out["pairs"].get(PRIMARY) or next(iter(out["pairs"].values()))
    keys = ("jct_sequential_s", "jct_free_competition_s", "jct_gimbal_s")
    keys += ("jct_gimbal_literal_s",) if compare_literal else ()
    out.update({k: headline[k] for k in keys})
    out["search_trials"] = headline["search_trials"]  # trials each Gimbal search ran (4: Algorithm 1's)
    out["search_ended"] = headline["search_ended"]
    out["live_gimbal_vs_sequential"] = headline["gimbal_vs_sequential"]
    out["live_gimbal_vs_free"] = headline["gimbal_vs_free"]
    for name, result in out["pairs"].items():
        if result is not headline:
            out.update({f"{name}_{k}": result[k] for k in keys})
    out["share_error_max"] = max(share_err.values())
    out.update({f"share_error_{s}": round(e, 4) for s, e in share_err.items()})
    out["load_avg_1m"] = os.getloadavg()[0]
    return out


def simulated(seeds: int) -> dict:
    runs = [run_all(TraceParams(), seed=s) for s in range(seeds)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["sim_seeds"] = seeds
    out["pair_slowdowns"] = SLOWDOWN_SOURCE
    out.update(model_pairs_gaining())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half-length jobs, one repeat, one trace")
    parser.add_argument("--repeats", type=int, default=None, help="live repeats (default 3; quick 1)")
    parser.add_argument("--seeds", type=int, default=None, help="simulated traces (default 3; quick 1)")
    parser.add_argument("--no-live", action="store_true", help="simulation only")
    parser.add_argument("--no-sim", action="store_true", help="live part only")
    parser.add_argument(
        "--objective",
        default="jct_sequenced",
        choices=sorted(OBJECTIVES),
        help="the live coordinator's objective (jct: the paper's Eq. 1)",
    )
    parser.add_argument(
        "--compare-literal",
        action="store_true",
        help="also run Gimbal with Algorithm 1's exit only and every trial whole",
    )
    parser.add_argument(
        "--pairs", default=",".join(PAIRS), help=f"live pairs, comma-separated (of {', '.join(PAIRS)})"
    )
    args = parser.parse_args()
    t0 = time.monotonic()
    out: dict = {}
    if not args.no_live:
        out.update(
            live(
                args.repeats or (1 if args.quick else 3),
                args.quick,
                args.pairs.split(","),
                args.objective,
                args.compare_literal,
            )
        )
    if not args.no_sim:
        out.update(simulated(args.seeds or (1 if args.quick else 3)))
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
