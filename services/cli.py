"""``tandem``: run the embedded cluster, inspect it, run notebooks on it, install the kernelspec.

Every flag maps to a configuration key (``shared/config.py`` layering: defaults < ``--config``
TOML < flags and ``--set section.key=value``), so anything the CLI can do a config file can pin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.cluster_file import ClusterNotRunning, ask_sync, cluster_status, read_cluster
from services.http_gateway import V1_GATEWAY_CONNECTION
from shared import messages
from shared.config import Config, ConfigError, load_config, parse_overrides
from shared.messages import id_problem
from shared.rpc import RpcError, RpcTimeout
from shared.security import curve
from shared.simulator.cli import add_sim_command, cmd_sim

# flag dest -> configuration key
FLAG_KEYS = {
    "hosts": "cluster.hosts",
    "max_hosts": "cluster.max_hosts",
    "metrics_port": "metrics.prometheus_port",
    "gpus_per_host": "host.gpus",
    "state_dir": "cluster.state_dir",
    "log_format": "log.format",
    "http_port": "http.port",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Replicated, GPU-efficient Jupyter kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="TOML configuration file (see configs/local.toml)")
        p.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override a configuration key"
        )
        p.add_argument(
            "--state-dir", help="where cluster.json lives (cluster.state_dir; env TANDEM_STATE_DIR)"
        )

    up = sub.add_parser("up", help="run the embedded cluster in the foreground (Ctrl-C stops it)")
    common(up)
    up.add_argument("--hosts", type=int, help="number of local schedulers (cluster.hosts)")
    up.add_argument(
        "--max-hosts",
        type=int,
        help="autoscale up to this many hosts (cluster.max_hosts; default: --hosts, no autoscaling)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics port on the scheduler (metrics.prometheus_port; default a free one, 0 off)",
    )
    up.add_argument("--gpus-per-host", type=int, help="virtual GPUs per host (host.gpus)")
    up.add_argument(
        "--http-port", type=int, help="Kernel Gateway HTTP API port (http.port; default a free one)"
    )
    up.add_argument("--log-format", choices=["console", "json"], help="log.format")

    status = sub.add_parser("status", help="hosts, GPUs and kernels of the running cluster")
    common(status)
    status.add_argument("--json", action="store_true", help="the scheduler's cluster.status as JSON")
    status.add_argument("--all", action="store_true", help="stopped kernels too")

    kernel = sub.add_parser("kernel", help="list and stop kernels")
    kernel_sub = kernel.add_subparsers(dest="kernel_command", required=True)
    klist = kernel_sub.add_parser("list", help="kernels with their replicas, executor, activity and clients")
    common(klist)
    klist.add_argument("--json", action="store_true", help="one JSON list")
    klist.add_argument("--all", action="store_true", help="stopped kernels too")
    kstop = kernel_sub.add_parser("stop", help="shut KERNEL down and stop its replicas")
    common(kstop)
    kstop.add_argument("kernel_id", metavar="KERNEL", help="its id (see `tandem kernel list`)")
    kstop.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the stop")
    khib = kernel_sub.add_parser(
        "hibernate", help="write KERNEL's namespace to the data store and stop its replicas now"
    )
    common(khib)
    khib.add_argument("kernel_id", metavar="KERNEL", help="its id (see `tandem kernel list`)")
    khib.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")

    host = sub.add_parser("host", help="host administration")
    host_sub = host.add_subparsers(dest="host_command", required=True)
    for name, text in (
        ("cordon", "stop placing work on HOST"),
        ("uncordon", "allow work on HOST again"),
        ("drain", "cordon HOST and migrate every replica off it"),
    ):
        p = host_sub.add_parser(name, help=text)
        common(p)
        p.add_argument("host_id", metavar="HOST")
        if name == "drain":
            p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the moves")

    replica = sub.add_parser("replica", help="replica administration")
    replica_sub = replica.add_subparsers(dest="replica_command", required=True)
    restart = replica_sub.add_parser(
        "restart", help="restart REPLICA of KERNEL in place (same Raft member, namespace rebuilt)"
    )
    common(restart)
    restart.add_argument("kernel_id", metavar="KERNEL")
    restart.add_argument("replica_id", metavar="REPLICA", help="e.g. r2 (see `tandem status`)")
    restart.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the restart")

    add_job_commands(sub, common)

    run = sub.add_parser("run", help="execute a notebook on the tandem kernel")
    common(run)
    run.add_argument("notebook")
    run.add_argument("-o", "--output", help="write the executed notebook here")
    run.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    run.add_argument(
        "--allow-errors",
        action="store_true",
        help="run every cell even after one fails (the exit status still reports the failure)",
    )

    keys = sub.add_parser(
        "keys", help="the cluster's CurveZMQ keys (node deployments; `tandem up` makes its own)"
    )
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    for name, text in (
        (
            "init",
            "create the scheduler's, gateway's, operator's, arbiter's and serving controller's keys (idempotent)",
        ),
        ("host", "issue the key of each HOST (copy host.HOST.key_secret and scheduler.key to it)"),
        (
            "rotate",
            "replace the keys of NAME (scheduler, gateway, operator, host.HOST): restart what uses them",
        ),
        ("list", "the principals that have keys, and which have their secret here"),
    ):
        p = keys_sub.add_parser(name, help=text)
        common(p)
        p.add_argument("--keys-dir", help="default: security.keys_dir, else <state_dir>/keys")
        if name == "host":
            p.add_argument("host_ids", metavar="HOST", nargs="+")
        if name == "rotate":
            p.add_argument("names", metavar="NAME", nargs="+")

    ks = sub.add_parser("kernelspec", help="manage the 'tandem' kernelspec")
    ks_sub = ks.add_subparsers(dest="kernelspec_command", required=True)
    install = ks_sub.add_parser("install", help="install the 'Tandem (replicated)' kernelspec")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for the current user")
    where.add_argument("--sys-prefix", action="store_true", help="into sys.prefix (the active venv)")
    where.add_argument("--prefix", help="under this prefix")
    add_sim_command(sub)
    return parser


def add_job_commands(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """``tandem job submit|list|show|logs|cancel``: best-effort training jobs (issue #16)."""
    job = sub.add_parser("job", help="best-effort training jobs on the GPUs notebooks leave idle")
    job_sub = job.add_subparsers(dest="job_command", required=True)
    submit = job_sub.add_parser(
        "submit",
        help="run COMMAND (e.g. -- python train.py ARGS) from this directory, with this environment",
        description="The job runs as a real process under a local scheduler, on GPUs no cell holds, "
        "for as long as the arbiter leases them; it resumes at its next lease after each one ends.",
    )
    common(submit)
    submit.add_argument(
        "--app", help="the app (a sweep, an experiment) the job belongs to; default 'default'"
    )
    submit.add_argument("--gpus", type=int, default=1, help="GPUs the job needs (default 1)")
    submit.add_argument("--max-gpus", type=int, help="the most GPUs it can use (default: --gpus)")
    submit.add_argument("--name", help="a name to show (default: the script, module or program it runs)")
    submit.add_argument(
        "--iterations",
        type=int,
        help="its total iterations, for the arbiter's estimates before it reports its own",
    )
    submit.add_argument("job_argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="what to run")
    listing = job_sub.add_parser("list", help="every job: state, host, progress, GPU time")
    common(listing)
    listing.add_argument("--json", action="store_true", help="the jobs as JSON")
    for name, text in (("show", "one job in full"), ("cancel", "stop a job for good")):
        p = job_sub.add_parser(name, help=text)
        common(p)
        p.add_argument("job_id", metavar="ID")
    logs = job_sub.add_parser("logs", help="a job's output (stdout and stderr, all its runs)")
    common(logs)
    logs.add_argument("job_id", metavar="ID")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = parse_overrides(getattr(args, "set", []))
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = str(value) if not isinstance(value, str) else value
    return load_config(getattr(args, "config", None), overrides)


def state_dir_of(args: argparse.Namespace, cfg: Config) -> Path:
    """--state-dir > $TANDEM_STATE_DIR > configuration."""
    if getattr(args, "state_dir", None):
        return Path(os.path.expanduser(args.state_dir)).resolve()
    return cfg.state_dir().resolve()


# ---- commands ------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace, cfg: Config) -> int:
    from services.embedded import EmbeddedCluster, run_foreground
    from services.global_scheduler.service import require_live_policy
    from services.http_gateway.token_file import token_path
    from shared.logs import configure_logging

    require_live_policy(cfg)
    configure_logging(cfg.get("log.format"), cfg.get("log.level"), service="tandem-up")
    state = state_dir_of(args, cfg)
    hosts, max_hosts = cfg.get("cluster.hosts"), cfg.get("cluster.max_hosts")
    if max_hosts and max_hosts < hosts:
        print(f"tandem up: --max-hosts ({max_hosts}) must be at least --hosts ({hosts})", file=sys.stderr)
        return 2
    if args.metrics_port is None and cfg.get("metrics.prometheus_port") == 0:
        args.metrics_port = -1  # tandem up serves /metrics on a free port unless told otherwise
        cfg = config_from_args(args)
    if cfg.get("cluster.hosts") < cfg.get("cluster.replicas_per_kernel"):
        print(
            f"tandem up: warning: {cfg.get('cluster.hosts')} hosts cannot place a kernel's "
            f"{cfg.get('cluster.replicas_per_kernel')} replicas on distinct hosts; kernels will not start",
            file=sys.stderr,
        )
    cluster = EmbeddedCluster(cfg, state_dir=state)

    token_file = token_path(cfg, cluster.keys_dir)

    def announce(info: dict[str, Any]) -> None:
        print(
            f"Tandem is up: {len(info['hosts'])} hosts x {cfg.get('host.gpus')} GPUs, gateway {info['gateway']}\n"
            f"  cluster file: {cluster.cluster_file}\n  logs: {info['log_dir']}\n"
            + (
                f"  Jupyter Kernel Gateway API: {info['http']} (token in {token_file}):\n"
                f"    jupyter lab --gateway-url={info['http']} --GatewayClient.auth_token=$(cat {token_file}) "
                f"--ServerApp.kernel_websocket_connection_class={V1_GATEWAY_CONNECTION}\n"
                f"  dashboard: {info['http']}/dashboard?token=$(cat {token_file})\n"
                if info.get("http")
                else ""
            )
            + "  Pick the 'Tandem (replicated)' kernel in Jupyter. Ctrl-C stops the cluster.",
            file=sys.stderr,
            flush=True,
        )

    return run_foreground(cluster, on_ready=announce)


def _ask_scheduler(
    args: argparse.Namespace, cfg: Config, msg_type: str, body: dict[str, Any], *, timeout: float
) -> dict[str, Any]:
    return _ask(curve.SCHEDULER, args, cfg, msg_type, body, timeout=timeout)


def _ask_gateway(
    args: argparse.Namespace, cfg: Config, msg_type: str, body: dict[str, Any], *, timeout: float
) -> dict[str, Any]:
    return _ask(curve.GATEWAY, args, cfg, msg_type, body, timeout=timeout)


def _ask(
    service: str,
    args: argparse.Namespace,
    cfg: Config,
    msg_type: str,
    body: dict[str, Any],
    *,
    timeout: float,
) -> dict[str, Any]:
    """One request to the scheduler or the gateway (``curve.SCHEDULER``/``GATEWAY``) as the operator."""
    cluster = read_cluster(state_dir_of(args, cfg))
    address = cluster.scheduler if service == curve.SCHEDULER else cluster.gateway
    return ask_sync(address, msg_type, body, credentials=cluster.operator_curve(service), timeout=timeout)


def _ask_arbiter(
    args: argparse.Namespace, cfg: Config, msg_type: str, body: dict[str, Any], *, timeout: float = 10.0
) -> dict[str, Any]:
    return _ask_service(args, cfg, curve.ARBITER, msg_type, body, timeout=timeout)


def _ask_service(
    args: argparse.Namespace,
    cfg: Config,
    service: str,
    msg_type: str,
    body: dict[str, Any],
    *,
    timeout: float,
) -> dict[str, Any]:
    """One request to a service cluster.json names under ``service`` (the arbiter, the serving
    controller), as the operator."""
    cluster = read_cluster(state_dir_of(args, cfg))
    address = cluster.raw.get(service)
    if not address:
        raise ClusterNotRunning(
            f"the cluster in {cluster.path} runs no {service} (it was started by an older Tandem): "
            "restart it with `tandem up`"
        )
    return ask_sync(
        str(address), msg_type, body, credentials=cluster.operator_curve(service), timeout=timeout
    )


def cmd_status(args: argparse.Namespace, cfg: Config) -> int:
    status = asyncio.run(cluster_status(read_cluster(state_dir_of(args, cfg)), stopped=args.all))
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
        return 0
    render_status(status)
    return 0


def render_status(status: dict[str, Any]) -> None:
    """Hosts and kernels as tables; the shape is the global scheduler's ``cluster.status``."""
    from rich.table import Table

    out = console()
    table = Table(title="Tandem hosts")
    for column in (
        "host",
        "alive",
        "cordoned",
        "GPUs committed/total",
        "GPUs subscribed",
        "subscription ratio",
    ):
        table.add_column(column)
    for host in status.get("hosts", []):
        table.add_row(
            str(host.get("id", "?")),
            "yes" if host.get("alive", True) else "[red]no[/red]",
            "[yellow]yes[/yellow]" if host.get("cordoned") else "no",
            f"{host.get('committed', 0)}/{host.get('gpus', '?')}",
            str(host.get("subscribed", "")),
            str(host.get("subscription_ratio", "")),
        )
    out.print(table)
    render_scaling(out, status)
    render_batch(out, status.get("batch"))
    render_serving(out, status.get("serving"))
    hibernation = status.get("hibernation") or {}
    if hibernation.get("hibernated") or hibernation.get("resumes"):
        out.print(
            f"Hibernation: {hibernation.get('hibernated', 0)} kernels hibernated now, "
            f"{hibernation.get('resumes', 0)} resumes (last resume p50 {hibernation.get('last_resume_s_p50')} s), "
            f"{hibernation.get('gpu_hours_freed', 0)} GPU-hours of replica subscriptions freed"
        )
    kernels = status.get("kernels", [])
    if not kernels:
        out.print("no kernels")
        return
    ktable = Table(title="Kernels")
    for column in ("kernel", "state", "replicas (id@host role)", "last executor", "migrations"):
        ktable.add_column(column)
    for kernel in kernels:
        replicas = ", ".join(
            f"{r.get('id')}@{r.get('host')} {r.get('role') or ''}{'' if r.get('alive', True) else ' (dead)'}".strip()
            for r in kernel.get("replicas", [])
        )
        ktable.add_row(
            str(kernel.get("id", "?")),
            str(kernel.get("state", ""))
            + (hibernation_note(kernel) if kernel.get("state") == "hibernated" else ""),
            replicas,
            str(kernel.get("last_executor") or ""),
            _migrations(kernel),
        )
    out.print(ktable)


def hibernation_note(kernel: dict[str, Any]) -> str:
    """`` (image 12.3 MB, since 10:41:07)`` for a hibernated kernel's row; "" without its facts."""
    info = kernel.get("hibernation")
    if not isinstance(info, dict):
        return ""
    size = float(info.get("image_bytes") or 0) / 1e6
    since = info.get("hibernated_at")
    when = time.strftime(", since %H:%M:%S", time.localtime(since)) if isinstance(since, int | float) else ""
    return f" (image {size:.1f} MB{when})"


def kernel_rows(
    scheduler_status: dict[str, Any], gateway_list: dict[str, Any], *, stopped: bool
) -> list[dict[str, Any]]:
    """One row per kernel: the scheduler's view (state, replicas, executor) joined by id with the
    gateway's (kernelspec name, busy/idle, last activity, connected clients)."""
    seen = {k["id"]: k for k in gateway_list.get("kernels", [])}
    placed = {k["id"]: k for k in scheduler_status.get("kernels", [])}
    rows = []
    for kernel_id in [*placed, *(kid for kid in seen if kid not in placed)]:
        sched, gw = placed.get(kernel_id, {}), seen.get(kernel_id, {})
        state = str(sched.get("state") or gw.get("state") or "")
        if gw.get("state") in ("stopped", "dead") and state in ("running", "starting", ""):
            state = str(gw["state"])
        if state == "stopped" and not stopped:
            continue
        rows.append(
            {
                "id": kernel_id,
                "name": gw.get("name", ""),
                "state": state,
                "execution_state": gw.get("execution_state"),
                "replicas": [
                    {"id": r.get("id"), "host": r.get("host"), "role": r.get("role"), "alive": r.get("alive")}
                    for r in sched.get("replicas", [])
                ],
                "executor": sched.get("last_executor"),
                "last_activity": gw.get("last_activity"),
                "connections": gw.get("connections"),
                "reason": sched.get("reason") or gw.get("reason") or "",
                "stopped_by": gw.get("stopped_by", ""),
                "hibernation": sched.get("hibernation"),
            }
        )
    return rows


def cmd_kernel(args: argparse.Namespace, cfg: Config) -> int:
    if args.kernel_command == "stop":
        return stop_kernel(args, cfg, args.kernel_id)
    if args.kernel_command == "hibernate":
        body = {"kernel_id": args.kernel_id, "reason": "operator"}
        answer = _ask_gateway(args, cfg, messages.KERNEL_HIBERNATE, body, timeout=args.timeout)
        print(f"{args.kernel_id}: hibernated{hibernation_note(answer)}")
        return 0
    status = _ask_scheduler(args, cfg, messages.CLUSTER_STATUS, {"all": True}, timeout=5.0)
    listed = _ask_gateway(args, cfg, messages.KERNEL_LIST, {}, timeout=5.0)
    rows = kernel_rows(status, listed, stopped=args.all)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True, default=str))
        return 0
    from rich.table import Table

    table = Table(title="Tandem kernels")
    table.add_column("kernel", no_wrap=True, min_width=36)  # the whole id: `tandem kernel stop` takes it
    for column in ("name", "state", "replicas (id@host)", "executor", "last activity", "clients"):
        table.add_column(column)
    now = time.time()
    for row in rows:
        busy, by = row["execution_state"], row["stopped_by"]
        activity = row["last_activity"]
        table.add_row(
            row["id"],
            row["name"],
            row["state"]
            + (f" ({busy})" if row["state"] == "running" and busy else "")
            + (f" (by the {by})" if row["state"] == "stopped" and by else "")
            + (hibernation_note(row) if row["state"] == "hibernated" else ""),
            ", ".join(f"{r['id']}@{r['host']}" for r in row["replicas"]),
            str(row["executor"] or ""),
            f"{max(now - activity, 0):.0f}s ago" if isinstance(activity, int | float) else "",
            "" if row["connections"] is None else str(row["connections"]),
        )
    console().print(table if rows else "no kernels")
    return 0


def stop_kernel(args: argparse.Namespace, cfg: Config, kernel_id: str) -> int:
    """Through the gateway (it closes the kernel's ports, its clients see the kernel stopped and
    do not restart it); a kernel only the scheduler knows (its gateway lost it) there."""
    body = {"kernel_id": kernel_id, "by": "operator"}
    try:
        answer = _ask_gateway(args, cfg, messages.KERNEL_SHUTDOWN, body, timeout=args.timeout)
    except RpcError as exc:
        if exc.code != "unknown_kernel":
            raise
        status = _ask_scheduler(args, cfg, messages.CLUSTER_STATUS, {"all": True}, timeout=5.0)
        known = {k["id"]: k["state"] for k in status.get("kernels", [])}
        if kernel_id not in known:
            print(f"tandem kernel stop: no kernel {kernel_id!r} in this cluster (see `tandem kernel list`)",
                  file=sys.stderr)  # fmt: skip
            return 1
        answer = {}
        if known[kernel_id] != "stopped":
            shutdown = {"kernel_id": kernel_id}
            answer = _ask_scheduler(args, cfg, messages.KERNEL_SHUTDOWN, shutdown, timeout=args.timeout)
    if answer.get("scheduler_error"):
        print(f"tandem kernel stop: {kernel_id}: {answer['scheduler_error']}", file=sys.stderr)
        return 1
    print(f"{kernel_id}: stopped")
    return 0


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    return _ANSI_ESCAPE.sub("", text)


def console() -> Any:
    """A rich console for this CLI's output: no colours or other escapes when stdout is not a
    terminal (pipes, CI logs, files), and a wide fixed width there so tables are not squeezed."""
    from rich.console import Console

    tty = sys.stdout.isatty()
    return Console(width=None if tty else 120, no_color=not tty, highlight=tty, force_terminal=tty or None)


def cmd_replica(args: argparse.Namespace, cfg: Config) -> int:
    body = {"kernel_id": args.kernel_id, "replica_id": args.replica_id}
    kernel = _ask_scheduler(args, cfg, messages.REPLICA_RESTART, body, timeout=args.timeout)
    pid = next((r.get("pid") for r in kernel.get("replicas", []) if r.get("id") == args.replica_id), None)
    print(f"{args.kernel_id}/{args.replica_id}: restarted (pid {pid})")
    return 0


def render_scaling(console: Any, status: dict[str, Any]) -> None:
    """One line of cluster metrics, the autoscaler's state and its last scale events."""
    cluster, metrics, scaling = status.get("cluster"), status.get("metrics") or {}, status.get("autoscale")
    if cluster:
        delay = (metrics.get("interactivity_delay_ms") or {}).get("p50")
        console.print(
            f"cluster: SR {cluster.get('subscription_ratio')}, GPUs committed "
            f"{cluster.get('committed_gpus')}/{cluster.get('provisioned_gpus')}, "
            f"migrations {cluster.get('migrations')}, cells {metrics.get('cells_total', 0)} "
            f"(committed immediately: {metrics.get('immediate_commit_ratio')}, "
            f"interactivity delay p50 {delay} ms)"
        )
    if scaling and scaling.get("enabled"):
        console.print(
            f"autoscaling: {scaling.get('min_hosts')}..{scaling.get('max_hosts')} hosts, "
            f"{scaling.get('pending_hosts')} pending, {scaling.get('hosts_added')} added, "
            f"{scaling.get('hosts_released')} released"
        )
        for event in (status.get("scale_events") or [])[-5:]:
            console.print(f"  {event.get('kind')} {','.join(event.get('hosts', []))}: {event.get('reason')}")


def render_serving(console: Any, serving: dict[str, Any] | None) -> None:
    """The serving controller's warm-runtime pools: per host warm/warming/target."""
    if not serving or serving.get("policy") == "none":
        return
    pools = ", ".join(
        f"{h.get('host')} {h.get('warm', 0)}+{h.get('starting', 0)}/{h.get('target', 0)}"
        for h in serving.get("hosts", [])
    )
    console.print(
        f"Warm runtimes ({serving.get('policy')}, decided cluster-wide; warm+warming/target): {pools}; "
        f"promised {serving.get('grants', 0)}, cold {serving.get('cold', 0)}"
    )


def render_batch(console: Any, batch: dict[str, Any] | None) -> None:
    """GPUs by use (cells / BE / idle) and each app's rho and GPU time."""
    if not batch:
        return
    usage = batch.get("usage", {})
    now, share = usage.get("gpus_now", {}), usage.get("utilization", {})
    console.print(
        f"GPUs now: cells {now.get('cells', 0)}, best-effort {now.get('be', 0)}, idle {now.get('idle', 0)} "
        f"(of provisioned GPU time: cells {share.get('cells', 0):.0%}, best-effort {share.get('be', 0):.0%}, "
        f"idle {share.get('idle', 0):.0%})"
    )
    for app_id, app in sorted(batch.get("apps", {}).items()):
        rho = app.get("rho")
        jobs = ", ".join(f"{n} {state}" for state, n in sorted(app.get("jobs", {}).items()))
        console.print(
            f"  app {app_id}: rho {'-' if rho is None else f'{rho:.2f}'}, GPU time {app.get('gpu_seconds', 0):.0f} s, "
            f"{app.get('gpus_now', 0)} GPUs now; jobs: {jobs}"
        )


def _migrations(kernel: dict[str, Any]) -> str:
    """``2 (last: r1 host-0 -> host-3, host drained)``, or empty when none."""
    count, last = kernel.get("migrations") or 0, kernel.get("last_migration")
    if not count or not isinstance(last, dict):
        return ""
    move = f"{last.get('replica')} {last.get('from')} -> {last.get('to')}"
    return f"{count} (last: {move}, {last.get('reason')})"


def cmd_host(args: argparse.Namespace, cfg: Config) -> int:
    if args.host_command == "drain":
        outcome = _ask_scheduler(
            args, cfg, messages.HOST_DRAIN, {"host_id": args.host_id}, timeout=args.timeout
        )
        for move in outcome.get("moved", []):
            print(f"{move['kernel']}/{move['replica']} -> {move['to']}")
        for failure in outcome.get("failed", []):
            print(
                f"{failure['kernel']}/{failure['replica']}: not moved: {failure['reason']}", file=sys.stderr
            )
        print(f"{args.host_id}: drained, {outcome.get('replicas_left', 0)} replicas left")
        return 1 if outcome.get("failed") else 0
    msg_type = messages.HOST_CORDON if args.host_command == "cordon" else messages.HOST_UNCORDON
    _ask_scheduler(args, cfg, msg_type, {"host_id": args.host_id}, timeout=5.0)
    print(f"{args.host_id}: {args.host_command}ed")
    return 0


def cmd_job(args: argparse.Namespace, cfg: Config) -> int:
    if args.job_command == "submit":
        command = args.job_argv[1:] if args.job_argv[:1] == ["--"] else args.job_argv
        if not command:
            raise ConfigError(
                "tandem job submit: give the command to run after `--`, e.g. -- python train.py"
            )
        body: dict[str, Any] = {
            "argv": command,
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "gpus": args.gpus,
        }
        for key in ("app", "name", "max_gpus", "iterations"):
            if getattr(args, key) is not None:
                body[key] = getattr(args, key)
        job = _ask_arbiter(args, cfg, messages.JOB_SUBMIT, body)
        print(job["job_id"])
        return 0
    if args.job_command == "list":
        jobs = _ask_arbiter(args, cfg, messages.JOB_LIST, {})["jobs"]
        if args.json:
            print(json.dumps(jobs, indent=2, sort_keys=True))
        else:
            render_jobs(jobs)
        return 0
    if args.job_command == "show":
        print(
            json.dumps(
                _ask_arbiter(args, cfg, messages.JOB_SHOW, {"job_id": args.job_id}), indent=2, sort_keys=True
            )
        )
        return 0
    if args.job_command == "cancel":
        job = _ask_arbiter(args, cfg, messages.JOB_CANCEL, {"job_id": args.job_id}, timeout=60.0)
        print(f"{job['job_id']}: {job['state']}")
        return 0
    return follow_logs(args, cfg)


def follow_logs(args: argparse.Namespace, cfg: Config) -> int:
    """Print the job's output from the start; with ``-f``, until the job has ended."""
    offset = 0
    try:
        while True:
            chunk = _ask_arbiter(args, cfg, messages.JOB_LOGS, {"job_id": args.job_id, "offset": offset})
            sys.stdout.buffer.write(chunk["data"])
            sys.stdout.flush()
            offset = int(chunk["offset"])
            if chunk["data"]:
                continue
            if not args.follow:
                return 0
            state = _ask_arbiter(args, cfg, messages.JOB_SHOW, {"job_id": args.job_id})["state"]
            if state in ("finished", "failed", "cancelled"):
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0


def render_jobs(jobs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="Tandem jobs")
    for column in ("job", "app", "name", "state", "host GPUs", "packed", "progress", "GPU time s", "runs"):
        table.add_column(column, no_wrap=True)
    for job in jobs:
        total = job.get("iterations_total")
        progress = (
            f"{job.get('iterations_done', 0)}/{total}" if total else f"{job.get('run_seconds', 0):.0f} s run"
        )
        where = f"{job['host']} {job['device_ids']}" if job.get("host") else ""
        packing = job.get("packing") or {}
        packed = f"{packing.get('share', 100)}% with {packing.get('with')}" if packing else ""
        table.add_row(job["job_id"], job["app_id"], job["name"], job["state"], where, packed, progress,
                      f"{job.get('gpu_seconds', 0):.1f}", str(job.get("runs", 0)))  # fmt: skip
    console().print(table)


def cmd_run(args: argparse.Namespace, cfg: Config) -> int:
    from shared.logs import configure_logging

    # warnings of the provisioner's RPC links only, and in colour only on a terminal (structlog's
    # default colours even a pipe)
    configure_logging(cfg.get("log.format"), "warning", service="tandem-run")
    state = state_dir_of(args, cfg)
    read_cluster(state)  # a clear error before nbclient's
    os.environ["TANDEM_STATE_DIR"] = str(state)
    report = run_notebook(
        Path(args.notebook),
        Path(args.output) if args.output else None,
        timeout=args.timeout,
        allow_errors=args.allow_errors,
    )
    print_report(report)
    return 0 if report["ok"] else 1


AfterCell = Callable[[dict[str, Any]], Awaitable[None]]


class NotebookUnreadable(Exception):
    """The notebook to run cannot be read, or its executed copy cannot be written."""


def run_notebook(
    path: Path,
    output: Path | None,
    *,
    timeout: int = 600,
    after_cell: AfterCell | None = None,
    allow_errors: bool = False,
) -> dict[str, Any]:
    """Execute ``path`` on the tandem kernel; per code cell: executor replica, host, interactivity delay.
    ``allow_errors``: a failing cell does not stop the run (nbclient's option); ``ok`` is still
    false when one failed.

    ``after_cell`` (async) sees each cell's row as soon as it ran: the demo uses it to cordon the
    executor's host mid-notebook and show the namespace following the new executor.
    """
    from services.jsonschema_formats import skip_iri_grammar

    skip_iri_grammar()  # before nbformat loads jsonschema: a CPU-second of every `tandem run`
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    try:
        nb = nbformat.read(path, as_version=4)
    except OSError as exc:
        raise NotebookUnreadable(f"cannot read the notebook {path}: {exc.strerror or exc}") from exc
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        nbformat.ValidationError,
    ) as exc:  # NotJSONError: ValueError
        raise NotebookUnreadable(f"{path} is not a Jupyter notebook: {exc}") from exc
    cells: list[dict[str, Any]] = []

    async def on_cell_executed(cell: Any, cell_index: int, execute_reply: dict[str, Any]) -> None:
        meta = (execute_reply or {}).get("metadata", {}).get("tandem", {})
        row = {
            "cell": cell_index,
            "status": (execute_reply or {}).get("content", {}).get("status"),
            "replica": meta.get("replica_id"),
            "host": meta.get("host_id"),
            "interactivity_delay_ms": meta.get("interactivity_delay_ms"),
            "source": cell.source.splitlines()[0] if cell.source else "",
        }
        cells.append(row)
        if after_cell is not None:
            await after_cell(row)

    client = NotebookClient(
        nb, kernel_name="tandem", timeout=timeout, on_cell_executed=on_cell_executed,
        resources={"metadata": {"path": str(path.parent)}}, allow_errors=allow_errors,
    )  # fmt: skip
    started = time.monotonic()
    error = ""
    try:
        client.execute()
    except CellExecutionError as exc:
        error = str(exc)
    except Exception as exc:  # kernel start failure, timeout, dead kernel: report, do not trace back
        error = f"{exc.__class__.__name__}: {exc}"
    if output is not None:
        try:
            nbformat.write(nb, output)
        except OSError as exc:
            error = error or f"the executed notebook could not be written to {output}: {exc.strerror or exc}"
    failed = [c["cell"] for c in cells if c["status"] != "ok"]
    if failed and not error:
        error = f"cell{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed"
    ok = not error and not failed
    return {"ok": ok, "error": error, "cells": cells, "seconds": round(time.monotonic() - started, 2)}


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"Executed in {report['seconds']} s")
    for column in ("cell", "status", "executor", "host", "delay ms"):
        table.add_column(column, no_wrap=True)
    table.add_column("first line of the cell", no_wrap=True, overflow="ellipsis", max_width=44)
    for cell in report["cells"]:
        delay = cell["interactivity_delay_ms"]
        table.add_row(str(cell["cell"]), str(cell["status"]), str(cell["replica"]), str(cell["host"]),
                      f"{delay:.1f}" if isinstance(delay, int | float) else "?", cell["source"])  # fmt: skip
    out = console()
    out.print(table)
    if report["error"]:
        from rich.text import Text

        # nbclient's CellExecutionError carries IPython's coloured traceback: rendered on a
        # terminal, stripped of its escapes for a pipe or a file
        error = Text.from_ansi(report["error"]) if out.is_terminal else Text(strip_ansi(report["error"]))
        out.print(Text("failed: ", style="red") + error)


def cmd_keys(args: argparse.Namespace, cfg: Config) -> int:
    if args.keys_dir:
        keys_dir = Path(os.path.expanduser(args.keys_dir)).resolve()
    elif cfg.get("security.keys_dir"):
        keys_dir = cfg.keys_dir()
    else:
        keys_dir = state_dir_of(args, cfg) / "keys"
    if args.keys_command == "init":
        curve.ensure_cluster_keys(keys_dir)
        print(f"cluster keys in {keys_dir}")
    elif args.keys_command == "host":
        for host_id in args.host_ids:
            problem = id_problem("host id", host_id)
            if problem:
                raise ConfigError(problem)
            curve.issue(keys_dir, curve.host_principal(host_id))
            print(f"{keys_dir / curve.host_principal(host_id)}.key_secret: copy to host {host_id}")
    elif args.keys_command == "rotate":
        for name in args.names:
            curve.rotate(keys_dir, name)
            print(f"{name}: new keys in {keys_dir}; restart the services that use them")
    else:
        for name, has_secret in curve.principals(keys_dir):
            print(f"{name}\t{'secret+public' if has_secret else 'public only'}")
    return 0


def cmd_kernelspec(args: argparse.Namespace, _cfg: Config) -> int:
    from services.kernelspec import install

    prefix = sys.prefix if args.sys_prefix else args.prefix
    where = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec 'tandem' in {where}")
    return 0


COMMANDS = {
    "up": cmd_up,
    "status": cmd_status,
    "host": cmd_host,
    "replica": cmd_replica,
    "kernel": cmd_kernel,
    "run": cmd_run,
    "kernelspec": cmd_kernelspec,
    "keys": cmd_keys,
    "job": cmd_job,
    "sim": cmd_sim,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        return COMMANDS[args.command](args, cfg)
    except (ConfigError, ClusterNotRunning, curve.KeyError_, NotebookUnreadable) as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except RpcError as exc:
        print(f"tandem: the cluster refused: {exc.reason}", file=sys.stderr)
        return 1
    except RpcTimeout as exc:
        print(f"tandem: no answer from the cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
