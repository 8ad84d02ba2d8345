"""``tandem sim``: run scheduling policies on a trace, plot the paper's figures, print a summary.

``services/cli.py`` registers it with ``add_sim_command(subparsers)`` and dispatches to
``cmd_sim(args, cfg)``; the configuration (``--config``/``--set simulator.key=value``) is already
layered by then. Heavy imports (numpy, matplotlib, the policies) happen inside the command so
``tandem --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.config import Config
    from shared.workload.model import Trace

SYNTHETIC = "synthetic-idlt"
SYNTHETIC_EXCERPT = "synthetic-idlt-excerpt"
DEFAULT_POLICIES = "notebookos,reservation,batch,lcp"
#: notebookos with best-effort training apps on the GPUs its cells leave idle (a mixed run)
MIXED_POLICY = "notebookos+be"
#: shared.simulator.be.POLICIES, spelled out so that parsing the CLI does not import scipy
BE_POLICIES = (
    "themis",
    "tiresias",
    "gandiva_fair",
    "las_app",
    "gandiva",
    "slaq",
    "optimus",
    "srtf",
    "srsf",
    "fifo",
)
JSON_KEYS = (
    "gpu_hours",
    "gpu_hours_saved_vs_reservation",
    "interactivity_delay_p50_s",
    "interactivity_delay_p99_s",
    "immediate_commit_fraction",
    "tct_p50_s",
    "provider_cost",
    "revenue",
    "profit_margin",
    "wall_s",
)


def add_sim_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``sim`` to ``tandem``'s subcommands (``subparsers`` from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "sim",
        help="simulate scheduling policies on a notebook trace (NotebookOS §5 figures)",
        description=(
            "Discrete-event simulation of the live scheduler's policy objects on an IDLT trace. "
            "Writes PNG figures to --out, prints a summary table, and with --json one JSON object "
            "keyed by policy on the last line."
        ),
    )
    p.add_argument("--config", help="TOML configuration file ([simulator] table)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override e.g. simulator.cold_start_s=20",
    )
    p.add_argument(
        "--trace",
        default=SYNTHETIC,
        help=f"{SYNTHETIC} (generated, --days long), {SYNTHETIC_EXCERPT} (the 17.5-hour excerpt), or a CSV file",
    )
    p.add_argument(
        "--days",
        type=float,
        default=None,
        help=f"trace length for {SYNTHETIC} (default 1); for a CSV: cut after D days",
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=(
            f"comma-separated (default {DEFAULT_POLICIES}); {MIXED_POLICY} is notebookos with "
            "best-effort training apps on the GPUs its cells leave idle (cells always win)"
        ),
    )
    p.add_argument("--seed", type=int, default=1, help="seeds the generator and the simulator")
    p.add_argument("--out", type=Path, default=Path("sim-out"), help="directory for the PNG figures")
    p.add_argument("--json", action="store_true", help="one JSON object keyed by policy on the last line")
    p.add_argument("--no-plots", action="store_true", help="skip the figures")
    p.add_argument(
        "--be-load",
        type=float,
        default=1.5,
        help=(
            f"for {MIXED_POLICY}: BE work as a multiple of the GPU-time cells leave idle "
            "(Themis Workload-1-like apps scaled to the cluster; default 1.5)"
        ),
    )
    p.add_argument(
        "--be-policy",
        default="themis",
        choices=BE_POLICIES,
        help=f"for {MIXED_POLICY}: the BE allocation policy (default themis; the others are baselines)",
    )
    return p


class SimUsageError(ValueError):
    """Bad arguments to ``tandem sim``; the message says which."""


def parse_policies(text: str) -> list[str]:
    from shared.simulator.engine import POLICY_NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise SimUsageError("--policies is empty")
    unknown = [n for n in names if n not in (*POLICY_NAMES, MIXED_POLICY)]
    if unknown:
        known = ", ".join((*POLICY_NAMES, MIXED_POLICY))
        raise SimUsageError(f"unknown policy {unknown[0]!r} in --policies; known: {known}")
    return list(dict.fromkeys(names))


def load_trace(spec: str, days: float | None, seed: int) -> tuple[Trace, float]:
    """The trace and the window (seconds) its GPU-hours and billing are measured over."""
    from shared.workload.idlt import DAY, EXCERPT_HOURS, excerpt_17_5h, generate
    from shared.workload.model import Trace

    if days is not None and not (math.isfinite(days) and days > 0):
        raise SimUsageError(f"--days must be > 0, got {days}")
    if spec == SYNTHETIC:
        d = 1.0 if days is None else days
        return generate(d, seed), d * DAY
    if spec == SYNTHETIC_EXCERPT:
        if days is not None:
            raise SimUsageError(f"{SYNTHETIC_EXCERPT} is {EXCERPT_HOURS} hours long; drop --days")
        return excerpt_17_5h(seed), EXCERPT_HOURS * 3600.0
    path = Path(spec)
    if not path.is_file():
        raise SimUsageError(
            f"--trace {spec!r}: not {SYNTHETIC}, {SYNTHETIC_EXCERPT}, or an existing CSV file"
        )
    from shared.workload.trace_csv import read_trace_csv

    trace = read_trace_csv(path)
    if days is None:
        return trace, trace.horizon_s[1]
    cut = days * DAY
    keep = [i for i, s in enumerate(trace.sessions) if s.start_s < cut]
    sessions = tuple(trace.sessions[i] for i in keep)
    remap = {old: new for new, old in enumerate(keep)}
    tasks = [k for k in range(trace.n_tasks) if int(trace.task_session[k]) in remap]
    import numpy as np

    idx = np.array([remap[int(trace.task_session[k])] for k in tasks], dtype=np.int64)
    sel = np.array(tasks, dtype=np.int64)
    return (
        Trace(sessions, idx, trace.task_submit_s[sel], trace.task_duration_s[sel], trace.task_gpus[sel]),
        cut,
    )


def run_sim(
    trace: Trace,
    policies: list[str],
    *,
    cfg: Config | None = None,
    seed: int = 1,
    window_end_s: float | None = None,
    progress: bool = True,
    be_load: float = 1.5,
    be_policy: str = "themis",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Simulate each policy; returns ({policy: SimResult}, {policy: Summary}).

    Reservation always runs first (added if absent) because every other policy's savings are
    measured against it; it is reported only if asked for.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from shared.simulator.engine import Simulator
    from shared.simulator.mixed import CommittedRecorder, run_be_on_cells
    from shared.simulator.params import SimParams
    from shared.simulator.results import summarize_run

    params = SimParams.from_config(cfg)
    order = ["reservation", *[p for p in policies if p != "reservation"]]
    results: dict[str, Any] = {}
    mixed: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        disable=not progress,
        transient=False,
        console=_stderr_console(),
    ) as bar:
        tasks = {name: bar.add_task(name, total=1.0) for name in order}
        for name in order:
            task = tasks[name]
            recorder = CommittedRecorder() if name == MIXED_POLICY else None
            sim = Simulator(trace, _notebook_policy(name), params, seed=seed, gpu_recorder=recorder)
            results[name] = sim.run(progress=lambda f, task=task: bar.update(task, completed=f))
            if recorder is not None:
                window = window_end_s if window_end_s is not None else results[name].end_s
                mixed[name] = run_be_on_cells(recorder, window, load=be_load, policy=be_policy, seed=seed)
    summaries = {name: summarize_run(results[name], results["reservation"], window_end_s) for name in order}
    for name, summary in summaries.items():
        n = summary.numbers
        cells = n["allocated_gpu_hours"] / n["gpu_hours"] if n["gpu_hours"] else None
        n["provisioned_gpu_utilization"] = round(cells, 4) if cells is not None else None
        if name in mixed:
            n.update(mixed[name].numbers(n["gpu_hours"]))
    return results, summaries


def _notebook_policy(name: str) -> str:
    """The notebook policy a run simulates: a mixed run's notebooks are notebookos's (cells always
    win and BE never delays a cell, so BE changes no notebook decision)."""
    return "notebookos" if name == MIXED_POLICY else name


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr)


def render_table(summaries: dict[str, Any], policies: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tandem sim")
    columns = (
        ("policy", None),
        ("GPU-h", "gpu_hours"),
        ("saved vs res.", "gpu_hours_saved_vs_reservation"),
        ("delay p50 s", "interactivity_delay_p50_s"),
        ("delay p99 s", "interactivity_delay_p99_s"),
        ("immediate", "immediate_commit_fraction"),
        ("TCT p50 s", "tct_p50_s"),
        ("cost $", "provider_cost"),
        ("revenue $", "revenue"),
        ("margin", "profit_margin"),
        ("migrations", "migrations"),
        ("wall s", "wall_s"),
    )
    for title, _ in columns:
        table.add_column(title, justify="right" if title != "policy" else "left")
    for name in policies:
        n = summaries[name].numbers
        table.add_row(name, *(_fmt(n.get(key)) for _, key in columns[1:]))
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def json_line(summaries: dict[str, Any], policies: list[str]) -> str:
    out: dict[str, Any] = {}
    for name in policies:
        numbers = summaries[name].numbers
        out[name] = {k: numbers[k] for k in JSON_KEYS} | {
            k: v for k, v in numbers.items() if k not in JSON_KEYS
        }
    return json.dumps(out, separators=(",", ":"), allow_nan=False, default=_json_default)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def cmd_sim(args: argparse.Namespace, cfg: Config) -> int:
    """Run, plot, print the table and (``--json``) the JSON line. C libraries' writes to fd 1
    (HiGHS's debug prints in a mixed run's auctions) go to stderr: stdout stays the table and
    one parsable JSON line (``shared.result_stdout``)."""
    from shared.result_stdout import result_stdout

    with result_stdout():
        return _cmd_sim(args, cfg)


def _cmd_sim(args: argparse.Namespace, cfg: Config) -> int:
    from shared.workload.trace_csv import TraceCsvError

    try:
        policies = parse_policies(args.policies)
        trace, window = load_trace(args.trace, args.days, args.seed)
        print(
            f"tandem sim: {len(trace.sessions)} sessions, {trace.n_tasks} tasks, "
            f"{window / 3600:.1f} h window, policies {','.join(policies)}, seed {args.seed}",
            file=sys.stderr,
        )
        results, summaries = run_sim(
            trace,
            policies,
            cfg=cfg,
            seed=args.seed,
            window_end_s=window,
            be_load=args.be_load,
            be_policy=args.be_policy,
        )
    except (SimUsageError, TraceCsvError, ValueError) as exc:
        print(f"tandem sim: {exc}", file=sys.stderr)
        return 2
    if not args.no_plots:
        from shared.simulator.plots import write_plots

        shown = {name: results[name] for name in policies if name in results}
        if "reservation" not in shown:
            shown = {"reservation": results["reservation"], **shown}
        written = write_plots(args.out, shown, {name: summaries[name] for name in shown}, window)
        print(f"tandem sim: {len(written)} figures in {args.out}", file=sys.stderr)
    render_table(summaries, policies)
    if args.json:
        print(json_line(summaries, policies), flush=True)
    return 0
