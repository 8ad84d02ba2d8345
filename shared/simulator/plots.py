"""PNG figures in the style of NotebookOS §5: CDFs (Fig. 9), GPU timelines (Fig. 8), subscription
ratio with scale-out and migration events (Fig. 10), cost and revenue (Fig. 12), re-execution GPU
hours saved by idle-reclamation interval (Fig. 13). Matplotlib's Agg backend: no display needed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from shared.simulator.engine import SimResult
from shared.simulator.results import (
    Summary,
    cumulative_billing,
    gpu_timelines,
    reexecution_events,
    timeline_grid,
)
from shared.workload.metrics import cdf_points

COLORS = {"reservation": "tab:red", "batch": "tab:green", "lcp": "tab:purple", "notebookos": "tab:blue"}
LABELS = {
    "reservation": "Reservation",
    "batch": "Batch",
    "lcp": "NotebookOS (LCP)",
    "notebookos": "NotebookOS",
}


def _time_axis(grid: np.ndarray) -> tuple[np.ndarray, str]:
    if grid[-1] > 4 * 86_400:
        return grid / 86_400, "Time (days)"
    return grid / 3600, "Time (hours)"


def write_plots(
    out: Path,
    results: Mapping[str, SimResult],
    summaries: Mapping[str, Summary],
    window_end_s: float | None = None,
) -> list[Path]:
    """Write every figure into ``out``; timelines span [0, ``window_end_s``] (default: the whole run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: object, name: str) -> None:
        path = out / name
        fig.tight_layout()  # type: ignore[attr-defined]
        fig.savefig(path, dpi=130)  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        written.append(path)

    for key, xlabel, name in (
        ("delays_s", "Interactivity delay (seconds)", "fig9a_interactivity_delay_cdf.png"),
        ("tct_s", "Task completion time (seconds)", "fig9b_tct_cdf.png"),
    ):
        fig, ax = plt.subplots(figsize=(4.6, 3.2))
        for policy, summary in summaries.items():
            values = getattr(summary, key)
            if values.size == 0:
                continue
            x, y = cdf_points(np.maximum(values, 1e-3), max_points=4000)
            ax.plot(x, y, lw=2, color=COLORS.get(policy), label=LABELS.get(policy, policy))
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", ls=":", lw=0.5)
        ax.legend(fontsize=8, loc="lower right")
        save(fig, name)

    res = list(results.values())
    grid = timeline_grid(res, window_end_s)
    t, tlabel = _time_axis(grid)
    reservation = results.get("reservation")
    res_curve = gpu_timelines(reservation, grid)["provisioned"] if reservation is not None else None
    for policy, r in results.items():
        curves = gpu_timelines(r, grid)
        fig, ax = plt.subplots(figsize=(6.0, 3.2))
        if res_curve is not None and policy != "reservation":
            ax.plot(t, res_curve, color="tab:red", lw=1, label="Reservation")
            ax.fill_between(t, curves["provisioned"], res_curve, where=res_curve > curves["provisioned"],
                            color="tab:green", alpha=0.25, step="post", label="saved vs Reservation")  # fmt: skip
        ax.fill_between(t, curves["oracle"], curves["provisioned"], where=curves["provisioned"] > curves["oracle"],
                        color="tab:orange", alpha=0.3, step="post", label="over-provisioned")  # fmt: skip
        ax.step(
            t, curves["provisioned"], where="post", color=COLORS.get(policy, "k"), lw=1.2, label="provisioned"
        )
        ax.step(t, curves["allocated"], where="post", color="0.4", lw=0.6, label="allocated")
        ax.step(t, curves["oracle"], where="post", color="k", lw=0.8, ls="--", label="oracle")
        ax.set_xlabel(tlabel)
        ax.set_ylabel("GPUs")
        ax.set_title(LABELS.get(policy, policy), fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
        save(fig, f"fig8_gpus_{policy}.png")

    nbos = results.get("notebookos")
    if nbos is not None and nbos.subscription.size:
        fig, ax = plt.subplots(figsize=(6.0, 3.2))
        scale = 86_400 if grid[-1] > 4 * 86_400 else 3600
        sr = nbos.subscription[nbos.subscription[:, 0] <= grid[-1]]
        ax.plot(sr[:, 0] / scale, sr[:, 1], color="tab:blue", lw=1, label="subscription ratio")
        ax.set_xlabel(tlabel)
        ax.set_ylabel("Cluster subscription ratio")
        ax2 = ax.twinx()
        for times, color, label in (
            (nbos.scale_out_s, "tab:green", "scale-out"),
            (nbos.migration_s, "tab:red", "migration"),
        ):
            if times:
                hist, edges = np.histogram(np.asarray(times) / scale, bins=min(200, max(len(grid) // 10, 10)),
                                           range=(0, grid[-1] / scale))  # fmt: skip
                ax2.step(edges[:-1], hist, where="post", color=color, lw=0.8, label=label)
        ax2.set_ylabel("Events per bin")
        fig.legend(fontsize=7, loc="lower center", ncol=3)
        save(fig, "fig10_subscription_ratio.png")

    fig, (ax_cost, ax_margin) = plt.subplots(1, 2, figsize=(8.4, 3.2))
    for policy, r in results.items():
        cost, revenue = cumulative_billing(r, grid)
        ax_cost.plot(t, cost, color=COLORS.get(policy), lw=1.5, label=f"{LABELS.get(policy, policy)} cost")
        ax_cost.plot(
            t, revenue, color=COLORS.get(policy), lw=1, ls="--", label=f"{LABELS.get(policy, policy)} revenue"
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            margin = np.where(revenue > 0, (revenue - cost) / revenue, np.nan)
        ax_margin.plot(t, margin, color=COLORS.get(policy), lw=1.5, label=LABELS.get(policy, policy))
    ax_cost.set_xlabel(tlabel)
    ax_cost.set_ylabel("Cumulative $")
    ax_cost.legend(fontsize=6)
    ax_margin.set_xlabel(tlabel)
    ax_margin.set_ylabel("Profit margin")
    ax_margin.set_ylim(-1.5, 1.0)
    ax_margin.legend(fontsize=7)
    save(fig, "fig12_cost_revenue_margin.png")

    if nbos is not None:
        fig, ax = plt.subplots(figsize=(5.0, 3.2))
        scale = 86_400 if grid[-1] > 4 * 86_400 else 3600
        for hours in nbos.params.reclaim_after_h:
            when, gpu_h = reexecution_events(nbos.trace, hours)
            order = np.argsort(when)
            ax.step(
                when[order] / scale,
                np.cumsum(gpu_h[order]),
                where="post",
                lw=1.5,
                label=f"reclaim after {hours:g} h",
            )
        ax.set_xlabel(tlabel)
        ax.set_ylabel("GPU-hours saved (cumulative)")
        ax.legend(fontsize=7)
        save(fig, "fig13_reexecution_saved.png")
    return written
