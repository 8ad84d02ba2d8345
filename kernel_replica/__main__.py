"""Launcher of one kernel replica, started by the local scheduler (docs/protocol.md, kernel start 3):

    python -m kernel_replica --kernel-id K --replica-id R --connection-file F \\
        --local-scheduler ADDR --data-dir DIR [--config-json JSON] [--join]

Order matters: the ipykernel app binds the five Jupyter sockets from the connection file; the Raft
thread starts and the replica registers ``{kernel_id, replica_id, raft_address, pid}`` with the local
scheduler; Raft itself starts when ``replica.configure {peers}`` arrives (bootstrap voters, or with
``--join`` the members of the group this replica is being added to). Until then cells are answered
with a ``ReplicaNotReady``-style error rather than hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import structlog

from shared import messages
from shared.config import Config, config_from_json, load_config
from shared.logs import configure_logging
from shared.private_files import open_private, private_dir, write_private
from shared.raft.storage import StaleLogAfterReboot, check_boot_fence
from shared.raft.tls import IdentityError, link_tls_for, take_identity_env
from shared.raft.transport import split_tcp_address
from shared.security import curve

HISTORY_CACHE = 20


def _safe_id(field: str) -> Callable[[str], str]:
    """An argparse type: the id as ``shared.messages`` admits it (it names directories)."""

    def check(value: str) -> str:
        problem = messages.id_problem(field, value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    return check


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kernel_replica", description=__doc__.split("\n")[0])
    parser.add_argument("--kernel-id", required=True, type=_safe_id("kernel_id"))
    parser.add_argument("--replica-id", required=True, type=_safe_id("replica_id"))
    parser.add_argument("--connection-file", required=True)
    parser.add_argument("--local-scheduler", required=True, help="the local scheduler's replica ROUTER")
    parser.add_argument("--data-dir", required=True, help="Raft WAL and snapshots of this replica")
    parser.add_argument("--config-json", default=None, help="the merged configuration of `tandem up`")
    parser.add_argument("--join", action="store_true", help="join an existing Raft group as a new member")
    parser.add_argument("--raft-host", default=None, help="IP the Raft listener binds (default: cluster.ip)")
    return parser.parse_args(argv)


RAFT_PORT_FLOOR = 10_000  # Raft ports are drawn from here up to the kernel's ephemeral range


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out for outgoing connections and ``bind(0)``."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def reserve_port(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``: it holds the port from the moment the Raft address is
    chosen until Raft serves on it (``PeerConfig.listener``). Listening, not only bound: Linux lets
    a second ``SO_REUSEADDR`` socket bind a port whose holder does not listen. Peers connect only
    after the replica is configured; until then nothing is accepted."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's old TIME_WAITs
        sock.bind(("0.0.0.0" if host == "*" else host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_free_port(host: str, rng: random.Random | None = None) -> socket.socket:
    """The Raft address must be known before Raft starts (it is registered, then peers are
    configured, and only then does Raft serve), so a port is chosen and held here. Not from the
    ephemeral range: every outgoing TCP connection on the node (ZMQ's included) takes a port from
    there. Chosen ports used to be probed, released and bound later: another replica drew the same
    port in between (a suite run's "address already in use" at configure)."""
    rng = rng or random.Random()
    ceiling = ephemeral_port_floor()
    for _ in range(100):
        port = rng.randrange(RAFT_PORT_FLOOR, ceiling) if ceiling > RAFT_PORT_FLOOR else 0
        try:
            return reserve_port(host, port)
        except OSError:
            continue
    raise RuntimeError(f"no free port for Raft on {host} in [{RAFT_PORT_FLOOR}, {ceiling})")


def raft_listener_for(data_dir: Path, host: str) -> tuple[str, socket.socket]:
    """The Raft address and the socket that holds it. The same address across restarts: peers
    know a member by the address it bootstrapped or joined with, so a replica restarted on its
    data dir must come back where they look for it."""
    saved = data_dir / "raft_address"
    if saved.exists():
        address = saved.read_text().strip()
        return address, reserve_port(*split_tcp_address(address))
    listener = reserve_free_port(host)
    address = f"tcp://{host}:{listener.getsockname()[1]}"
    write_private(saved, address)
    return address, listener


def stale_raft_log(data_dir: Path) -> str | None:
    """Why this replica must not start on ``data_dir``, or None: its Raft log (``<data_dir>/raft``,
    where the Raft bridge keeps it) was written without fsync before a machine reboot and may have
    forgotten entries it acknowledged. Checked before the replica registers, so a start or an
    in-place restart (local scheduler ``replica.restart``) fails with this reason in the replica's
    log tail and leaves no process behind; the member is replaced by a fresh one instead."""
    try:
        check_boot_fence(data_dir / "raft")
    except StaleLogAfterReboot as exc:
        return str(exc)
    return None


def preload_for_existing_state(imports: list[str]) -> None:
    """A replica that starts into a kernel's existing state (a replacement joining its group, an
    in-place restart on its Raft log) loads that state right after it registers. It imports the
    heavy modules such state usually needs first (``prewarm.imports``, as a warm runtime does), so
    that registered still means ready to run a cell within moments rather than after torch's
    import. A new kernel's replicas skip this: they import torch only when the notebook does."""
    from kernel_replica.warm import preload

    preload(imports)


def _log_stream() -> object:
    """A private copy of the real stderr: ipykernel later redirects fd 2 into the cell's output."""
    return os.fdopen(os.dup(2), "w", buffering=1)


# A replica runs three busy threads (the kernel, the Raft loop, ipykernel's IOPub) that hand work
# to each other many times per cell; a thread that released the GIL for a socket call waits up to
# the switch interval to get it back from one running Python. 5 ms (CPython's default) is longer
# than a whole trivial cell.
GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    link_curve = curve.link_curve_from_env()  # out of os.environ before any user code runs
    raft_identity = take_identity_env()  # out of os.environ before any user code runs
    args = parse_args(argv)
    config: Config = config_from_json(args.config_json) if args.config_json else load_config()
    configure_logging(config.get("log.format"), config.get("log.level"), service="replica")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=_log_stream()))  # type: ignore[arg-type]
    log = structlog.get_logger("replica").bind(kernel=args.kernel_id, replica=args.replica_id)
    os.environ["TANDEM_KERNEL_ID"] = args.kernel_id
    os.environ["TANDEM_REPLICA_ID"] = args.replica_id
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    stale = stale_raft_log(Path(args.data_dir))
    if stale is not None:
        log.error("stale_raft_log", error=stale)
        return 1
    try:
        raft_tls = link_tls_for(
            config.get("raft.tls"),
            config.get("raft.transport"),
            raft_identity,
            args.kernel_id,
            args.replica_id,
            encrypt_loopback=config.get("raft.encrypt_loopback"),
        )
    except IdentityError as exc:
        log.error("raft_identity_refused", error=str(exc))
        return 1

    if args.join or (Path(args.data_dir) / "raft").exists():
        preload_for_existing_state(list(config.get("prewarm.imports")))

    # Imported late: ipykernel pulls in IPython, and the logging above should catch its failures.
    from ipykernel.kernelapp import IPKernelApp
    from tornado import ioloop

    from kernel_replica.election_core import ElectionSettings
    from kernel_replica.kernel import TandemKernel
    from kernel_replica.raft_bridge import RaftBridge, ReplicaSettings

    data_dir = Path(args.data_dir)
    private_dir(data_dir)
    # sqlite creates the history with the umask's modes, and its journals like the database:
    # made 0600 here first, the code of every cell stays private
    os.close(open_private(data_dir / "history.sqlite", os.O_WRONLY))
    app = IPKernelApp.instance(kernel_class=TandemKernel)
    _init_sockets = app.init_sockets

    def init_sockets_without_subshells() -> None:
        # ipykernel 7 receives shell messages on a "shell channel" thread and hands each one to
        # the main thread over an inproc socket (and the reply back the same way), for subshells.
        # A replica serves one client through its local scheduler and never needs subshells; the
        # two thread hops per cell cost ~0.3 ms on the critical path (scripts/bench_latency.py).
        _init_sockets()
        app.shell_channel_thread = None

    app.init_sockets = init_sockets_without_subshells  # type: ignore[method-assign]
    app.initialize(
        [
            "-f",
            args.connection_file,
            "--IPKernelApp.quiet=True",
            "--IPKernelApp.outstream_class=kernel_replica.streams.BarrierOutStream",
            # Input history in the replica's own file: a host's replicas (and the user's own
            # kernels) would otherwise share ~/.ipython's database, and every cell's committed
            # write (an fsync, on each replica) competes with the Raft log's fsyncs. Written every
            # HISTORY_CACHE cells; history requests flush it first, so they still see every cell.
            f"--HistoryManager.hist_file={data_dir / 'history.sqlite'}",
            f"--HistoryManager.db_cache_size={HISTORY_CACHE}",
        ]
    )
    if app.transport == "ipc":  # bound with the umask's modes: 0600, as every other state file
        for port in (app.shell_port, app.iopub_port, app.stdin_port, app.control_port, app.hb_port):
            with contextlib.suppress(OSError):
                os.chmod(f"{app.ip}-{port}", 0o600)
    kernel: TandemKernel = app.kernel
    main_loop = ioloop.IOLoop.current().asyncio_loop  # the loop app.start() runs

    raft_address, raft_listener = raft_listener_for(data_dir, args.raft_host or config.get("cluster.ip"))
    settings = ReplicaSettings(
        gpus=int(os.environ.get("TANDEM_KERNEL_GPUS", config.get("kernel.gpus"))),
        tick_interval_s=config.get("raft.tick_ms") / 1000,
        election_ticks=config.get("raft.election_ticks"),
        snapshot_every=config.get("raft.snapshot_every"),
        commit_notice_s=config.get("raft.commit_notice_ms") / 1000,
        raft_fsync=config.get("raft.fsync"),
        raft_transport=config.get("raft.transport"),
        raft_tls=raft_tls,
        election=ElectionSettings.from_config(config["election"]),
        link_curve=link_curve,
        store_config=config,
    )
    bridge = RaftBridge.start(
        kernel_id=args.kernel_id,
        replica_id=args.replica_id,
        data_dir=data_dir,
        raft_address=raft_address,
        raft_listener=raft_listener,
        scheduler_address=args.local_scheduler,
        settings=settings,
        post_to_kernel=main_loop.call_soon_threadsafe,
        join=args.join,
    )
    kernel.attach(bridge, kernel_id=args.kernel_id, replica_id=args.replica_id, config=config)
    try:
        bridge.call_blocking(bridge.core.connect_scheduler(), timeout=30)
    except Exception as exc:
        log.error("register_failed", scheduler=args.local_scheduler, error=repr(exc))
        bridge.shutdown()
        return 1
    log.info("replica_started", pid=os.getpid(), raft_address=raft_address, join=args.join)
    try:
        app.start()
    finally:
        bridge.shutdown()
        log.info("replica_exited")
    return 0


def exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's teardown once the replica stopped in order (Raft stopped,
    its kernel's loop ended). That teardown (IPython's atexit ``reset``, whose ``gc.collect()``
    alone took 0.85 s over a replica's heap, then module finalization) outlasted the local
    scheduler's 2 s grace, so every kernel stop and restart waited for the SIGTERM after it.
    The input history is the one thing left to keep: it is written first."""
    from ipykernel.kernelapp import IPKernelApp

    if IPKernelApp.initialized():
        shell = getattr(IPKernelApp.instance(), "shell", None)
        history = getattr(shell, "history_manager", None)
        if history is not None:
            try:
                history.end_session()
                history.close()
            except Exception as exc:  # exiting anyway; the history is a convenience
                structlog.get_logger("replica").warning("history_not_saved", error=repr(exc))
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()  # type: ignore[union-attr]
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
