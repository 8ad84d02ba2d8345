#!/usr/bin/env python
"""Compare the IDLT generator with the published AdobeTrace statistics (NotebookOS §2.3, §5.3, App. E.1).

Prints ONE JSON line: for each published task-duration and IAT quantile the published and the
generated value and the error in percent; the summer's session and training concurrency against
Figure 20's numbers (averaged over ``--seeds`` seeds); the 17.5-hour excerpt's against Figure 7's (averaged over ``--excerpt-seeds``
seeds, since one excerpt has only ~90 sessions); generation time and the share of gaps the
no-overlap clamp touched.

With ``--plot DIR`` also writes, in the style of the paper's figures: ``task_duration_cdf.png`` and
``task_iat_cdf.png`` (Figure 2(a)/(b): CDF on a log-x axis, published points marked),
``summer_concurrency.png`` (Figure 20) and ``excerpt_concurrency.png`` (Figure 7).

Usage: ``python scripts/workload_report.py [--days 92] [--seed 1] [--plot DIR]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.workload.idlt import (
    DAY,
    EXCERPT_HOURS,
    PUBLISHED_DURATION_QUANTILES,
    PUBLISHED_IAT_QUANTILES,
    PUBLISHED_MIN_IAT_S,
    excerpt_17_5h,
    generate_with_stats,
)
from shared.workload.metrics import cdf_points, level_on_grid
from shared.workload.model import Trace

# Appendix E.1 / Figure 20 (summer) and §5.3 / Figure 7 (17.5-hour excerpt).
PUBLISHED_SUMMER = {
    "sessions_end_june": 206,
    "sessions_end_july": 312,
    "sessions_end_august": 397,
    "sessions_mean_june": 115,
    "sessions_mean_july": 233,
    "sessions_mean_august": 379,
    "sessions_max": 433,
    "trainings_mean": 67.63,
    "trainings_median": 68,
    "trainings_mean_june": 31,
    "trainings_mean_july": 65,
    "trainings_mean_august": 105,
    "trainings_max": 141,
}
PUBLISHED_EXCERPT = {
    "sessions_end": 87,
    "sessions_max": 90,
    "trainings_mean": 19.5,
    "trainings_median": 19,
    "trainings_end": 26,
    "trainings_max": 34,
}
MONTHS = (("june", 0, 30), ("july", 30, 61), ("august", 61, 92))


def _active(trace: Trace, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sessions = level_on_grid([(s.start_s, s.end_s, 1.0) for s in trace.sessions], grid)
    trainings = level_on_grid(np.c_[trace.task_submit_s, trace.task_end_s, np.ones(trace.n_tasks)], grid)
    return sessions, trainings


def _compare(published: dict[str, float], generated: dict[str, float]) -> dict[str, dict[str, float]]:
    out = {}
    for key, pub in published.items():
        if key in generated:
            gen = float(generated[key])
            out[key] = {
                "published": pub,
                "generated": round(gen, 2),
                "err_pct": round(100 * (gen / pub - 1), 2),
            }
    return out


def _quantiles(values: np.ndarray, published: dict[float, float]) -> dict[str, dict[str, float]]:
    gen = {f"p{round(p * 100)}": float(np.quantile(values, p)) for p in published}
    return _compare({f"p{round(p * 100)}": v for p, v in published.items()}, gen)


def summer_concurrency(
    trace: Trace, days: float
) -> tuple[dict[str, float], np.ndarray, np.ndarray, np.ndarray]:
    grid = np.arange(0.0, days * DAY, 900.0)
    sessions, trainings = _active(trace, grid)
    gen: dict[str, float] = {
        "sessions_max": sessions.max(),
        "trainings_mean": trainings.mean(),
        "trainings_median": float(np.median(trainings)),
        "trainings_max": trainings.max(),
    }
    for name, a, b in MONTHS:
        m = (grid >= a * DAY) & (grid < b * DAY)
        if b <= days and m.any():
            gen[f"sessions_end_{name}"] = sessions[m][-1]
            gen[f"sessions_mean_{name}"] = sessions[m].mean()
            gen[f"trainings_mean_{name}"] = trainings[m].mean()
    return gen, grid, sessions, trainings


def excerpt_concurrency(seeds: range) -> dict[str, float]:
    grid = np.arange(0.0, EXCERPT_HOURS * 3600, 60.0)
    rows = []
    for seed in seeds:
        s, t = _active(excerpt_17_5h(seed), grid)
        rows.append((s[-1], s.max(), t.mean(), np.median(t), t[-1], t.max()))
    keys = (
        "sessions_end",
        "sessions_max",
        "trainings_mean",
        "trainings_median",
        "trainings_end",
        "trainings_max",
    )
    return dict(zip(keys, np.mean(rows, axis=0).tolist(), strict=True))


def plot(
    out_dir: Path, trace: Trace, grid: np.ndarray, sessions: np.ndarray, trainings: np.ndarray
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, values, published, label in (
        (
            "task_duration_cdf.png",
            trace.task_duration_s,
            PUBLISHED_DURATION_QUANTILES,
            "Task duration (seconds)",
        ),
        ("task_iat_cdf.png", trace.iats_s(), PUBLISHED_IAT_QUANTILES, "Task inter-arrival time (seconds)"),
    ):
        x, y = cdf_points(values, max_points=2000)
        fig, ax = plt.subplots(figsize=(4.2, 3.0))
        ax.plot(x, y, color="tab:blue", lw=2, label="generated")
        ax.scatter(
            list(published.values()), list(published.keys()), color="tab:red", zorder=3, label="AdobeTrace"
        )
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", ls=":", lw=0.5)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=150)
        plt.close(fig)
        written.append(name)

    def timeline(name: str, t_h: np.ndarray, s: np.ndarray, tr: np.ndarray, xlabel: str) -> None:
        fig, ax = plt.subplots(figsize=(6.0, 3.0))
        ax.plot(t_h, tr, color="tab:blue", lw=1, label="active trainings")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Active trainings")
        ax2 = ax.twinx()
        ax2.plot(t_h, s, color="tab:orange", lw=1.5, ls="--", label="active sessions")
        ax2.set_ylabel("Active sessions")
        fig.legend(loc="upper left", fontsize=8, bbox_to_anchor=(0.1, 0.9))
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=150)
        plt.close(fig)
        written.append(name)

    timeline("summer_concurrency.png", grid / DAY, sessions, trainings, "Time (days since June 1)")
    eg = np.arange(0.0, EXCERPT_HOURS * 3600, 60.0)
    s, t = _active(excerpt_17_5h(0), eg)
    timeline("excerpt_concurrency.png", eg / 3600, s, t, "Time (hours)")
    return written


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", type=float, default=92.0, help="length of the generated trace (summer: 92)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--seeds", type=int, default=4, help="summer seeds (seed, seed+1, ...) to average concurrency over"
    )
    ap.add_argument("--excerpt-seeds", type=int, default=20, help="excerpt seeds to average over")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write CDF/timeline PNGs here")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    trace, stats = generate_with_stats(args.days, args.seed)
    gen_s = time.perf_counter() - t0
    iats = trace.iats_s()
    summer, grid, sessions, trainings = summer_concurrency(trace, args.days)
    # One summer is dominated by a few hundred long-lived sessions: average the concurrency over seeds.
    extra = [
        summer_concurrency(generate_with_stats(args.days, s)[0], args.days)[0]
        for s in range(args.seed + 1, args.seed + args.seeds)
    ]
    summer = {k: float(np.mean([summer[k], *(e[k] for e in extra)])) for k in summer}
    report: dict[str, Any] = {
        "bench": "workload_report",
        "days": args.days,
        "seed": args.seed,
        "sessions": len(trace.sessions),
        "tasks": trace.n_tasks,
        "generate_s": round(gen_s, 3),
        "gaps_clamped_pct": round(100 * stats.gaps_clamped / max(stats.gaps_total, 1), 2),
        "task_duration_s": _quantiles(trace.task_duration_s, PUBLISHED_DURATION_QUANTILES),
        "task_iat_s": {
            **_quantiles(iats, PUBLISHED_IAT_QUANTILES),
            "min": {"published": PUBLISHED_MIN_IAT_S, "generated": round(float(iats.min()), 2)},
        },
        "summer": _compare(PUBLISHED_SUMMER, summer),
        "excerpt_17_5h": _compare(PUBLISHED_EXCERPT, excerpt_concurrency(range(args.excerpt_seeds))),
        "summer_seeds": args.seeds,
        "excerpt_seeds": args.excerpt_seeds,
    }
    if args.plot is not None:
        report["plots"] = [str(args.plot / n) for n in plot(args.plot, trace, grid, sessions, trainings)]
    print(json.dumps(report, separators=(",", ":")))
    return report


if __name__ == "__main__":
    main()
