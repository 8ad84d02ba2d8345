"""Themis's finish-time fairness against nine baselines on a Workload-1-like BE trace.

Replays one seeded workload drawn from Themis Workload 1's statistics
(``shared.workload.themis_workload``) on a simulated cluster, once per policy
(``shared.simulator.be``), and prints one JSON line:

* ``max_rho_themis`` and ``max_rho_<b>`` for every baseline b of ``shared.arbiter.baselines``:
  tiresias (job-level discretized 2D-LAS, Tiresias's own), gandiva_fair (ticket stride between
  apps), las_app (Themis §6.1's "Tiresias": app-level least attained service), gandiva, slaq,
  optimus, srtf, srsf, fifo (Themis §6.2's headline metric: the worst app's rho = T_sh / T_id),
  ``median_rho_<p>``,
  ``utilization_<p>`` (allocated over BE-usable GPU-seconds until the last app ends);
* ``best_baseline`` (the baseline with the lowest max rho), ``ratio_best_over_themis`` (its max
  rho over Themis's; the issue's target is >= 2.2, Themis reports 2.2-3.25x), ``target_met``, and
  ``baselines`` (the baselines run);
* ``max_rho_floor_<p>``: the largest rho any app would have had alone on the cluster, perfectly
  placed, with the N_avg it saw under policy p (its longest jobs bound its finish; T_id assumes
  its work parallelises perfectly): p cannot bring max rho below this;
* ``max_rho_fluid_ps`` / ``median_rho_fluid_ps``: the same trace under ideal egalitarian processor
  sharing (fluid, ``shared.simulator.be_reference``): every app R / N(t) GPUs, no slowdown, no
  leases. It keeps each app at rho <= 1 unless the app's own stragglers bind, so it is the
  reference a fair policy approaches; no baseline close to it leaves room for a 2.2x gain;
* ``auction_p50_ms`` / ``auction_p95_ms``: one Themis round (visibility phase for every app,
  bids, the PF MILP and each winner's c_i solve on HiGHS, leases), over all rounds of the run;
  Themis reports 354 / 1398 ms with Gurobi. ``auction_max_ms`` too, and ``auction_cpu_p50_ms`` /
  ``auction_cpu_p95_ms``, the same rounds' CPU time (wall time on a loaded machine counts the
  time the process waits for a core; CPU time is what the round costs);
* the scale used: ``cluster_gpus``, ``cluster_hosts``, ``apps``, ``jobs``, ``work_gpu_hours``,
  ``work_scale``, ``arrival_span_h``, ``fairness_knob``, ``lease_s``, ``round_s``, the measured
  workload statistics, and ``wall_s`` (the whole script).

``--seeds 0,1,2``: one workload per seed, every policy on each (all in this run); each
``max_rho_<p>``, ``median_rho_<p>``, ``utilization_<p>``, ``max_rho_floor_<p>`` and the auction
percentiles are then the median over seeds, ``ratio_best_over_themis`` is the median of the per-seed
ratios (best baseline of that seed over Themis), and ``<key>_by_seed`` lists the per-seed values;
``best_baseline_of_medians`` / ``ratio_of_medians`` compare the medians instead (the baseline
with the lowest median max rho, over Themis's median max rho).

Default: all 85 apps on Themis's 64-GPU testbed cluster (Figure 9 is Workload 1 on that
testbed), every task at 2.5% of its length (``TESTBED_WORK_SCALE``, fitted to Figure 11's GPU time)
and arrivals uniform over a span that makes the trace's average demand ~50 GPUs (§2.2,
``TRACE_DEMAND_GPUS``). ``--quick``: 30 apps, same scale and demand. ``--full``: unscaled, over two
weeks, on the 256-GPU simulated cluster (an hour or more). ``--contention 1,2,4``: also on the
cluster halved and quartered (§6.2.2), keys ``max_rho_<p>_contention_<k>x``,
``ratio_best_over_themis_contention_<k>x``. ``best_paper_baseline`` /
``ratio_paper_best_over_themis``: the same ratio over Themis §6.1's six baselines only
(``PAPER_BASELINES``); ``target_met`` stays over every baseline run.

Usage: ``python scripts/bench_arbiter.py [--quick | --full] [--seed N | --seeds 0,1,2] [--policies a,b]
[--contention 1,2,4] [--work-scale X] [--demand-gpus G]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.arbiter.baselines import BASELINES, PAPER_BASELINES
from shared.arbiter.config import STARVING_PRIORITIES
from shared.result_stdout import result_stdout
from shared.simulator.be import (
    POLICIES,
    THEMIS_64,
    THEMIS_256,
    BeRunResult,
    BeSimParams,
    run_all,
)
from shared.simulator.be_reference import fluid_ps_rho
from shared.workload.be_model import BeWorkload
from shared.workload.themis_workload import (
    ThemisWorkloadParams,
    generate_themis_workload,
    workload_stats,
)

TWO_WEEKS_H = 14 * 24.0
#: Themis §2.2 (Figure 1): the 85 apps' "average GPU demand is ~50 GPUs" (bursty). The bench
#: replays the drawn trace so that its work spread over the arrival span averages this many GPUs:
#: the paper's load, on its 64-GPU testbed ~0.8 on average (more in bursts; §6.2.2's 2x and 4x by
#: shrinking the cluster). Before 2026-11-26 the span was two weeks x the work scale, which with
#: our generator's work (121 GPUs of average demand unscaled, 182 with the old 1/2/4/8 GPU mix)
#: loaded the 64 GPUs 1.9-2.9x, i.e. the paper's "4X" case, not its base case.
TRACE_DEMAND_GPUS = 50.0
#: Task lengths on the testbed replay, as a fraction of Workload 1's: fitted to Themis Figure 11
#: (Workload 1 on the 64-GPU testbed: every scheme's total GPU time on an axis up to 1,200 GPU-hours,
#: "similar efficiency across Themis and the baselines"), so the trace's work is ~1,000 GPU-hours
#: (median over seeds 0-4 at 2.5%: 1,017), and to Table 5's two testbed apps (83 and 580 GPU-minutes;
#: our median app at 2.5% is ~460 GPU-minutes). The value before 2026-11-26 was 5% (2,000-3,000
#: GPU-hours, over the figure's axis).
TESTBED_WORK_SCALE = 0.025


def shrink(hosts: Sequence[int], k: int) -> tuple[int, ...]:
    """Every k-th host: the cluster at 1/k of its size with the same mix of host sizes (Themis
    §6.2.2 halves and quarters its 64-GPU testbed to raise contention 2x and 4x)."""
    if k < 1:
        raise ValueError(f"a shrink factor is >= 1, got {k}")
    return tuple(hosts[::k])


def _workload(
    args: argparse.Namespace, n_apps: int, work_scale: float, seed: int
) -> tuple[BeWorkload, float]:
    """The seeded trace and its arrival span in hours (see ``TRACE_DEMAND_GPUS``). The generator
    draws arrivals as span x uniform, so the span does not change any other draw."""

    def draw(span_h: float) -> BeWorkload:
        return generate_themis_workload(
            ThemisWorkloadParams(
                n_apps=n_apps, work_scale=work_scale, arrival_span_s=span_h * 3600.0, seed=seed
            )
        )

    if args.full:
        span_h = TWO_WEEKS_H
    elif args.demand_gpus > 0:
        span_h = draw(1.0).work_gpu_hours / args.demand_gpus
    else:
        span_h = 12.0 if args.quick else TWO_WEEKS_H * work_scale
    return draw(span_h), span_h


def _contention_keys(part: dict[str, object], k: int) -> dict[str, object]:
    """The fairness keys of a run on the cluster shrunk k times, suffixed ``_contention_<k>x``."""
    keep = ("max_rho_", "median_rho_", "best_", "ratio_", "cluster_gpus")
    return {f"{key}_contention_{k}x": v for key, v in part.items() if key.startswith(keep)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scale = ap.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true", help="30 apps over 12 h (about a minute)")
    scale.add_argument("--full", action="store_true", help="unscaled Workload 1 on 256 GPUs (slow)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", help="comma-separated seeds: medians over them (overrides --seed)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--fairness-knob", type=float, default=0.8)
    ap.add_argument("--lease-s", type=float, default=600.0)
    ap.add_argument("--round-s", type=float, default=60.0)
    ap.add_argument(
        "--past-contention",
        action="store_true",
        help="Themis's rho estimates use N_avg so far, not over the app's life (the pre-fix estimate)",
    )
    ap.add_argument(
        "--starving-priority",
        choices=STARVING_PRIORITIES,
        default="at_risk",
        help="which starving apps Themis's filter ranks before every holder (ArbiterConfig)",
    )
    ap.add_argument(
        "--work-scale",
        type=float,
        help=f"task lengths as a fraction of Workload 1's (default {TESTBED_WORK_SCALE}, --full 1)",
    )
    ap.add_argument(
        "--demand-gpus",
        type=float,
        default=TRACE_DEMAND_GPUS,
        help="arrival span = the trace's work / this many GPUs (Themis §2.2: ~50); 0: the span "
        "before 2026-11-26 (two weeks x work scale, --quick 12 h)",
    )
    ap.add_argument(
        "--contention",
        default="1",
        help="comma-separated cluster shrink factors (Themis §6.2.2: 2 = half, 4 = a quarter of the "
        "hosts); each factor k > 1 adds max_rho_<p>_contention_<k>x keys",
    )
    args = ap.parse_args()
    start = time.perf_counter()
    if args.full:
        n_apps, work_scale, hosts = 85, 1.0, THEMIS_256
    else:
        n_apps, work_scale, hosts = (30 if args.quick else 85), TESTBED_WORK_SCALE, THEMIS_64
    if args.work_scale is not None:
        work_scale = args.work_scale
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [args.seed]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    factors = [int(x) for x in args.contention.split(",") if x.strip()]
    reports = []
    with result_stdout():
        for seed in seeds:
            workload, span_h = _workload(args, n_apps, work_scale, seed)
            params = BeSimParams(
                round_s=args.round_s,
                lease_s=args.lease_s,
                fairness_knob=args.fairness_knob,
                seed=seed,
                lifetime_contention=not args.past_contention,
                starving_priority=args.starving_priority,
                time_scale=work_scale,
            )
            report: dict[str, object] = {}
            for k in factors:
                shrunk = shrink(hosts, k)
                results = run_all(workload, policies, shrunk, params)
                part = _report(args, seed, workload, shrunk, work_scale, span_h, results, start)
                if k == 1:
                    report.update(part)
                else:
                    report.update(_contention_keys(part, k))
            reports.append(report)
        out = reports[0] if len(reports) == 1 else _medians(reports)
        out["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(out), flush=True)
    return 0


def _medians(reports: list[dict[str, object]]) -> dict[str, object]:
    """A key the seeds agree on once; else numbers as their median (with ``<key>_by_seed``), flags
    as all-true (with ``<key>_by_seed``), anything else as the per-seed list."""
    out: dict[str, object] = {}
    for key, first in reports[0].items():
        values = [r.get(key) for r in reports]
        if key == "seed":
            out["seeds"] = values
        elif all(v == first for v in values):
            out[key] = first
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            nums = [float(v) for v in values if isinstance(v, (int, float))]
            out[key] = round(statistics.median(nums), 4)
            out[f"{key}_by_seed"] = values
        elif isinstance(first, bool):
            out[key] = all(bool(v) for v in values)
            out[f"{key}_by_seed"] = values
        else:
            out[key] = values
    medians = {
        k.removeprefix("max_rho_"): float(v)  # type: ignore[arg-type]
        for k, v in out.items()
        if k.startswith("max_rho_") and k.removeprefix("max_rho_") in BASELINES
    }
    if medians and "max_rho_themis" in out:
        best = min(medians, key=medians.__getitem__)
        out["best_baseline_of_medians"] = best
        out["ratio_of_medians"] = round(medians[best] / float(out["max_rho_themis"]), 3)  # type: ignore[arg-type]
    paper = {k: v for k, v in medians.items() if k in PAPER_BASELINES}
    if paper and "max_rho_themis" in out:
        best = min(paper, key=paper.__getitem__)
        out["best_paper_baseline_of_medians"] = best
        out["ratio_paper_of_medians"] = round(paper[best] / float(out["max_rho_themis"]), 3)  # type: ignore[arg-type]
    if "ratio_best_over_themis" in out:
        out["target_met"] = (
            float(out["ratio_best_over_themis"]) >= 2.2 and float(out["auction_p50_ms"]) <= 100
        )  # type: ignore[arg-type]
    return out


def _report(
    args: argparse.Namespace,
    seed: int,
    workload: BeWorkload,
    hosts: Sequence[int],
    work_scale: float,
    span_h: float,
    results: dict[str, BeRunResult],
    start: float,
) -> dict[str, object]:
    """The JSON line's keys (see the module docstring)."""
    out: dict[str, object] = {}
    for name, r in results.items():
        out[f"max_rho_{name}"] = round(r.max_rho, 4)
    for name, r in results.items():
        out[f"median_rho_{name}"] = round(r.median_rho, 4)
        out[f"utilization_{name}"] = round(r.utilization, 4)
        out[f"finished_{name}"] = r.finished
        out[f"max_rho_floor_{name}"] = round(r.max_rho_floor, 4)
    ps = fluid_ps_rho(workload, sum(hosts))
    out["max_rho_fluid_ps"] = round(max(ps.values()), 4)
    out["median_rho_fluid_ps"] = round(statistics.median(ps.values()), 4)
    baselines = {n: r.max_rho for n, r in results.items() if n in BASELINES}
    if "themis" in results:
        themis = results["themis"]
        out["auction_p50_ms"] = round(themis.auction_percentile_ms(0.5), 2)
        out["auction_p95_ms"] = round(themis.auction_percentile_ms(0.95), 2)
        out["auction_max_ms"] = round(max(themis.auction_ms, default=0.0), 2)
        out["auction_cpu_p50_ms"] = round(themis.auction_percentile_ms(0.5, cpu=True), 2)
        out["auction_cpu_p95_ms"] = round(themis.auction_percentile_ms(0.95, cpu=True), 2)
        out["auction_rounds"] = themis.rounds
        if baselines:
            best = min(baselines, key=baselines.__getitem__)
            out["best_baseline"] = best
            out["baselines"] = sorted(baselines)
            out["ratio_best_over_themis"] = round(baselines[best] / themis.max_rho, 3)
            out["target_met"] = baselines[best] / themis.max_rho >= 2.2 and out["auction_p50_ms"] <= 100
            paper = {n: v for n, v in baselines.items() if n in PAPER_BASELINES}
            if paper:
                best_paper = min(paper, key=paper.__getitem__)
                out["best_paper_baseline"] = best_paper
                out["ratio_paper_best_over_themis"] = round(paper[best_paper] / themis.max_rho, 3)
    stats = workload_stats(workload)
    out.update(
        cluster_gpus=sum(hosts),
        cluster_hosts=len(hosts),
        apps=len(workload.apps),
        jobs=workload.n_jobs,
        work_gpu_hours=round(workload.work_gpu_hours, 1),
        work_scale=work_scale,
        arrival_span_h=round(span_h, 3),
        demand_gpus=round(workload.work_gpu_hours / span_h, 1),
        load=round(workload.work_gpu_hours / span_h / sum(hosts), 3),
        fairness_knob=args.fairness_knob,
        lifetime_contention=not args.past_contention,
        lease_s=args.lease_s,
        round_s=args.round_s,
        seed=seed,
        median_jobs_per_app=stats["median_jobs_per_app"],
        median_task_gpu_hours_unscaled=round(stats["median_task_gpu_hours"] / work_scale, 3),
        mode="full" if args.full else "quick" if args.quick else "default",
        wall_s=round(time.perf_counter() - start, 1),
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
