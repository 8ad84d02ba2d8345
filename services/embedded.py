"""The embedded cluster behind ``tandem up``: every service as a real OS process on loopback.

Start order: the Kernel Gateway HTTP API (``http.enabled``: the slowest to import, it needs no
address), then the arbiter (best-effort jobs' leases), the checkpoint service and the serving
controller (warm runtimes) side by side, the global scheduler, then the gateway and N local
schedulers (virtual GPUs); then wait until every host has registered and the API serves, write ``cluster.json`` and hand control back. Stop order is the
reverse (the API first, while the gateway still stops its kernels), and
the "no orphans, ever" rule is enforced three ways, because each alone has a hole:

1. every child gets ``PR_SET_PDEATHSIG`` (SIGTERM), so if ``tandem up`` is killed outright the
   services still receive a polite stop and stop their replicas;
2. ``tandem up`` is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so replicas orphaned by a
   crashed local scheduler are re-parented to us instead of init;
3. on stop, after the polite SIGTERM and a grace period, every process still descending from us
   (a /proc walk) gets SIGKILL, and zombies are reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import structlog

from services.cluster_file import CLUSTER_FILE, ClusterNotRunning, ask_sync, pid_alive, read_cluster
from services.global_scheduler.hibernated_file import forget_hibernated
from shared import messages
from shared.config import Config
from shared.host_address import is_loopback
from shared.private_files import open_private_file, private_dir, private_socket_path, write_private
from shared.process_signals import PinnedProcess, descendants_of, process_table, read_stat
from shared.rpc import RpcError, RpcTimeout
from shared.security import curve

log = structlog.get_logger("embedded")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_GRACE_S = 10.0
# A gateway that dies more often than this is not restarted again: the cluster stops instead.
GATEWAY_RESTARTS_PER_WINDOW = 5
GATEWAY_RESTART_WINDOW_S = 60.0
HTTP_SERVICE = "http-gateway"
HTTP_SESSIONS = Path("http") / "sessions"  # the HTTP API's kernel records (services/http_gateway/app.py)
HTTP_STOP_GRACE_S = 8.0  # its kernels' shutdowns run concurrently, each a gateway round trip


class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message names the service and the tail of its log."""


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int) -> Any:
    """preexec_fn for children: SIGTERM when ``tandem up`` dies; exit if it already has."""

    def setup() -> None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def descendants(root: int) -> list[int]:
    """All live descendants of ``root`` (children first), from /proc; empty where /proc is absent."""
    return [p.pid for p in descendants_of(root, process_table())]


def registered_hosts(status: dict[str, Any]) -> list[str]:
    """Ids of the live hosts in a ``cluster.status`` reply (``hosts: [{id, alive, ...}]``)."""
    up = []
    for host in status.get("hosts", []):
        if isinstance(host, dict) and host.get("alive", True):
            up.append(str(host.get("id", host.get("host_id", ""))))
    return up


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    critical: bool  # its death ends the cluster
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = field(default=None, repr=False)


class EmbeddedCluster:
    """Start, watch and stop the embedded cluster's processes; see the module docstring."""

    def __init__(self, cfg: Config, *, state_dir: Path, python: str | None = None) -> None:
        self.cfg = cfg
        self.state_dir = state_dir
        self.python = python or sys.executable
        self.ip: str = cfg.get("cluster.ip")
        self.hosts: int = cfg.get("cluster.hosts")
        log_dir = cfg.get("embedded.log_dir")
        self.log_dir = Path(os.path.expanduser(log_dir)) if log_dir else state_dir / "logs"
        self.children: list[Child] = []
        self._scheduler_args: list[str] = []
        self._arbiter_args: list[str] = []
        self._serving_args: list[str] = []
        self._checkpoint_args: list[str] = []
        self._gateway_args: list[str] = []
        self._gateway_restarts: list[float] = []
        self._http_args: list[str] = []
        self._http_restarts: list[float] = []
        self.http_url = ""
        self.scheduler_address = ""
        # the scheduler's ipc endpoint, which this machine's gateway and hosts use (empty: none)
        self.scheduler_local_address = ""
        self._made_run_dir: Path | None = None  # a private temp dir for it, when the state dir is deep
        self.gateway_address = ""
        self.arbiter_address = ""
        self.serving_address = ""
        self.checkpoint_address = ""
        self.cluster_file = state_dir / CLUSTER_FILE
        self.keys_dir = cfg.keys_dir() if cfg.get("security.keys_dir") else state_dir / "keys"

    # ---- start -----------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Bring every service up and write cluster.json; on any failure stop what started."""
        # namespaces (Raft WAL, data store), history and logs live below: this user's only. An
        # existing directory is the operator's: told about, not changed.
        private_dir(self.state_dir, tighten=False)
        if self.state_dir.stat().st_mode & 0o077:
            log.warning("state_dir_readable_by_others", state_dir=str(self.state_dir), hint="chmod 700 it")
        private_dir(self.log_dir, tighten=False)
        with contextlib.suppress(ClusterNotRunning):
            running = read_cluster(self.state_dir)
            raise ClusterStartError(
                f"a cluster is already running from {self.state_dir} (pid {running.pid}); "
                "stop it or use another --state-dir"
            )
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _child_config(
        self, arbiter_address: str = "", serving_address: str = "", checkpoint_address: str = ""
    ) -> str:
        data = self.cfg.as_dict()
        data["arbiter"]["address"] = arbiter_address
        data["serving"]["address"] = serving_address
        data["checkpoint"]["address"] = checkpoint_address
        if self.cfg.get("embedded.virtual_gpus"):
            data["host"]["use_nvml"] = False
        data["cluster"]["state_dir"] = str(self.state_dir)
        scaling = data["cluster"]["max_hosts"] > data["cluster"]["hosts"]
        if scaling and data["autoscale"]["provider"] == "none":
            data["autoscale"]["provider"] = "embedded"  # the scheduler starts and stops local schedulers
        return json.dumps(data)

    def _start(self) -> dict[str, Any]:
        # `tandem up` is the operator of its own cluster: it issues every key (shared/security)
        curve.ensure_cluster_keys(self.keys_dir)
        for index in range(self.hosts):
            curve.issue(self.keys_dir, curve.host_principal(f"host-{index}"))
        log_format = ["--log-format", self.cfg.get("log.format")]
        deadline = time.monotonic() + float(self.cfg.get("embedded.ready_timeout_s"))
        forget_kernel_table(self.state_dir)  # no kernel outlives the cluster that ran it
        # The HTTP API first: importing Jupyter Server is the longest start of all, and it needs
        # no other service's address (it finds the gateway through cluster.json, per request).
        # It serves once cluster.json names it; the others start meanwhile.
        self._http_args = ["-m", "services.http_gateway", "--config-json", self._child_config(), *log_format]
        http_child = self._start_http() if self.cfg.get("http.enabled") else None
        # The arbiter next: every other service is told its address (hosts report to it). Like
        # the scheduler, it binds a port the OS picks and announces it.
        # The checkpoint service (jobs' images; hosts relay to it) and the serving controller
        # (warm runtimes: hosts report their pools to it, the scheduler asks it for runtimes)
        # start beside it: none of the three needs another's address.
        arbiter_log = self.log_dir / "arbiter.log"
        offset = arbiter_log.stat().st_size if arbiter_log.exists() else 0
        self._arbiter_args = ["-m", "services.arbiter", "--config-json", self._child_config(), *log_format]
        arbiter = self._spawn("arbiter", [*self._arbiter_args, "--bind", f"tcp://{self.ip}:0"], critical=True)
        checkpoint_log = self.log_dir / "checkpoint.log"
        checkpoint_offset = checkpoint_log.stat().st_size if checkpoint_log.exists() else 0
        self._checkpoint_args = ["-m", "services.checkpoint_service", "--config-json", self._child_config(), *log_format]  # fmt: skip
        checkpoint = self._spawn(
            "checkpoint", [*self._checkpoint_args, "--bind", f"tcp://{self.ip}:0"], critical=True
        )
        serving_log = self.log_dir / "serving-controller.log"
        serving_offset = serving_log.stat().st_size if serving_log.exists() else 0
        self._serving_args = [
            "-m",
            "services.serving_controller",
            "--config-json",
            self._child_config(),
            *log_format,
        ]
        serving = self._spawn(
            "serving-controller", [*self._serving_args, "--bind", f"tcp://{self.ip}:0"], critical=True
        )
        self.arbiter_address = self._wait_for_announcement(arbiter, offset, deadline)
        self.serving_address = self._wait_for_announcement(serving, serving_offset, deadline)
        self.checkpoint_address = self._wait_for_announcement(checkpoint, checkpoint_offset, deadline)
        config_json = self._child_config(self.arbiter_address, self.serving_address, self.checkpoint_address)
        # The scheduler binds a port the OS picks at bind time and announces it; a port chosen here
        # and bound there later could be taken in between (by any process, or as the ephemeral
        # source port of an outgoing connection).
        scheduler_log = self.log_dir / "global-scheduler.log"
        offset = scheduler_log.stat().st_size if scheduler_log.exists() else 0
        self._scheduler_args = ["-m", "services.global_scheduler", "--config-json", config_json, *log_format]
        self.scheduler_local_address = self._local_endpoint("scheduler.sock")
        if self.scheduler_local_address:
            self._scheduler_args += ["--bind-local", self.scheduler_local_address]
        scheduler = self._spawn(
            "global-scheduler", [*self._scheduler_args, "--bind", f"tcp://{self.ip}:0"], critical=True
        )
        self.scheduler_address = self._wait_for_announcement(scheduler, offset, deadline)
        # this machine's gateway and hosts reach the scheduler on its ipc endpoint when it has one
        local_scheduler = self.scheduler_local_address or self.scheduler_address
        address_file = self.state_dir / "gateway.address"
        address_file.unlink(missing_ok=True)
        self._gateway_args = [
            "-m", "services.gateway", "--scheduler", local_scheduler,
            "--address-file", str(address_file), "--config-json", config_json, *log_format,
        ]  # fmt: skip
        self._spawn(
            "gateway", [*self._gateway_args, "--bind", self.cfg.get("gateway.api_address")], critical=True
        )
        for index in range(self.hosts):
            host_id = f"host-{index}"
            self._spawn(
                host_id,
                ["-m", "services.local_scheduler", "--host-id", host_id, "--scheduler", local_scheduler,
                 "--config-json", config_json, *log_format],
                critical=False,
            )  # fmt: skip
        # a restarted HTTP API gets the whole configuration, as every later start of a service does
        self._http_args = ["-m", "services.http_gateway", "--config-json", config_json, *log_format]
        self.gateway_address = self._wait_for_file(address_file, deadline)
        hosts = self._wait_for_hosts(deadline)
        if http_child is not None:
            self.http_url = self._wait_for_announcement(*http_child, deadline)
        info = {
            "gateway": self.gateway_address,
            "scheduler": self.scheduler_address,
            **({"http": self.http_url} if self.http_url else {}),
            "arbiter": self.arbiter_address,
            "serving": self.serving_address,
            "checkpoint": self.checkpoint_address,
            "pid": os.getpid(),
            "pid_start": stat.start_ticks if (stat := read_stat(os.getpid())) is not None else None,
            "hosts": hosts,
            "state_dir": str(self.state_dir),
            "keys_dir": str(self.keys_dir),
            "log_dir": str(self.log_dir),
            "processes": {c.name: c.process.pid for c in self.children if c.process is not None},
            "started_at": time.time(),
        }
        self._write_cluster_file(info)
        log.info(
            "cluster_ready", gateway=self.gateway_address, scheduler=self.scheduler_address, hosts=len(hosts)
        )
        return info

    def _start_http(self, extra: list[str] | None = None) -> tuple[Child, int]:
        """The Kernel Gateway HTTP/WebSocket API (services/http_gateway); its kernels go through
        the gateway. The child and where its announcement will be in its log."""
        log_path = self.log_dir / f"{HTTP_SERVICE}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        child = self._spawn(HTTP_SERVICE, [*self._http_args, *(extra or [])], critical=True)
        return child, offset

    def _spawn(self, name: str, args: list[str], *, critical: bool) -> Child:
        child = Child(name, [self.python, *args], self.log_dir / f"{name}.log", critical)
        child.log_file = open_private_file(child.log_path, "ab")  # lives as long as the child
        # Children resolve the state dir as $TANDEM_STATE_DIR before configuration: an inherited
        # value (another cluster's) must not win over this cluster's --state-dir.
        env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_STATE_DIR=str(self.state_dir))
        child.process = subprocess.Popen(
            child.argv,
            stdin=subprocess.DEVNULL,
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            preexec_fn=die_with_parent(os.getpid()),
            env=env,
            cwd=os.getcwd(),
        )
        self.children.append(child)
        log.info("service_started", service=name, pid=child.process.pid, log=str(child.log_path))
        return child

    def _check_children(self) -> None:
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                raise ClusterStartError(
                    f"{child.name} exited with code {child.process.returncode} during start-up; "
                    f"last lines of {child.log_path}:\n{tail(child.log_path)}"
                )

    def _wait_for_announcement(
        self, child: Child, offset: int, deadline: float, *, only_this_child: bool = False
    ) -> str:
        """The address in the ``{"event": "listening", "address": ...}`` line a service prints on
        stdout once bound (its stdout is its log, from ``offset`` on: the log is appended to)."""
        while time.monotonic() < deadline:
            if only_this_child and child.process is not None and child.process.poll() is not None:
                raise ClusterStartError(f"{child.name} exited with code {child.process.returncode}")
            if not only_this_child:  # at start-up, any service's death is fatal
                self._check_children()
            with open(child.log_path, "rb") as log_file:
                log_file.seek(offset)
                for line in log_file:
                    try:
                        message = json.loads(line)
                    except ValueError:  # another log line, or one still being written
                        continue
                    if isinstance(message, dict) and message.get("event") == "listening":
                        address = message.get("address")
                        if isinstance(address, str) and address:
                            return address
            time.sleep(0.05)
        raise ClusterStartError(
            f"{child.name} did not announce its address; last lines of its log:\n{tail(child.log_path)}"
        )

    def _local_endpoint(self, name: str) -> str:
        """``ipc://`` path of a service endpoint for this machine's other services, in a private
        (0700) directory, so that only this user reaches it (``shared/security/curve.py``); empty
        when ``cluster.ipc_links`` is off or the services bind beyond loopback (hosts on other
        machines then share the TCP endpoint, and a host finds its Raft address by its route to
        the scheduler)."""
        if not self.cfg.get("cluster.ipc_links") or not is_loopback(self.ip):
            return ""
        path, self._made_run_dir = private_socket_path(self.state_dir / "run" / name, "tandem-run-")
        return f"ipc://{path}"

    def _wait_for_file(self, path: Path, deadline: float) -> str:
        while time.monotonic() < deadline:
            self._check_children()
            if path.exists():
                return path.read_text().strip()
            time.sleep(0.05)
        raise ClusterStartError(
            f"gateway did not come up; last lines of its log:\n{tail(self.log_dir / 'gateway.log')}"
        )

    def _wait_for_hosts(self, deadline: float) -> list[str]:
        hosts: list[str] = []
        while time.monotonic() < deadline:
            self._check_children()
            try:
                status = ask_sync(
                    self.scheduler_address,
                    messages.CLUSTER_STATUS,
                    {},
                    credentials=curve.client_curve(self.keys_dir, curve.OPERATOR, curve.SCHEDULER),
                    timeout=1.0,
                )
            except (RpcTimeout, RpcError):
                time.sleep(0.1)
                continue
            hosts = registered_hosts(status)
            if len(hosts) >= self.hosts:
                return sorted(hosts)
            time.sleep(0.1)
        raise ClusterStartError(
            f"only {len(hosts)} of {self.hosts} hosts registered in time ({hosts}); "
            f"global scheduler log:\n{tail(self.log_dir / 'global-scheduler.log')}"
        )

    # ---- run -------------------------------------------------------------------------------

    def restart_scheduler(self, timeout: float = 30.0) -> None:
        """The global scheduler died: start a new one on the same address. The local schedulers
        register again (with the replicas they run) and the gateway reconnects, so the new one
        rebuilds its view and no kernel is lost (NotebookOS §3.2.5)."""
        child = self._restart_announced(
            "global-scheduler", self._scheduler_args, self.scheduler_address, timeout
        )
        log.warning("scheduler_restarted", pid=child.process.pid if child.process else None)

    def restart_arbiter(self, timeout: float = 30.0) -> None:
        """The arbiter died: start a new one on the same address. It reads the job registry it
        persisted, and the hosts, whose links reconnect, report their jobs and GPUs again."""
        child = self._restart_announced("arbiter", self._arbiter_args, self.arbiter_address, timeout)
        log.warning("arbiter_restarted", pid=child.process.pid if child.process else None)

    def restart_serving(self, timeout: float = 30.0) -> None:
        """The serving controller died: start a new one on the same address. It keeps nothing on
        disk: the hosts' next reports rebuild every pool, and they keep their targets meanwhile."""
        child = self._restart_announced(
            "serving-controller", self._serving_args, self.serving_address, timeout
        )
        log.warning("serving_controller_restarted", pid=child.process.pid if child.process else None)

    def restart_checkpoint(self, timeout: float = 30.0) -> None:
        """The checkpoint service died: a new one on the same address reads the book it persisted
        (every answered commit); hosts' relays retry what it did not answer."""
        child = self._restart_announced("checkpoint", self._checkpoint_args, self.checkpoint_address, timeout)
        log.warning("checkpoint_restarted", pid=child.process.pid if child.process else None)

    def _restart_announced(self, name: str, args: list[str], address: str, timeout: float) -> Child:
        old = next(c for c in self.children if c.name == name)
        self.children.remove(old)
        if old.log_file is not None:
            old.log_file.close()
        log_path = self.log_dir / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        child = self._spawn(name, [*args, "--bind", address], critical=True)
        self._wait_for_announcement(child, offset, time.monotonic() + timeout, only_this_child=True)
        self._record_pid(name, child)
        return child

    def restart_gateway(self, timeout: float = 30.0) -> None:
        """The gateway died: start a new one on the same API address. It serves every kernel
        again on the ports its clients hold (services/gateway/kernel_table.py); the replicas
        and the scheduler never stopped. Refused when it keeps dying (a crash loop)."""
        self._gateway_restarts = self._restart_allowed("gateway", self._gateway_restarts)
        old = next(c for c in self.children if c.name == "gateway")
        place = self.children.index(old)
        self.children.remove(old)
        if old.log_file is not None:
            old.log_file.close()
        address_file = self.state_dir / "gateway.address"
        address_file.unlink(missing_ok=True)
        child = self._spawn("gateway", [*self._gateway_args, "--bind", self.gateway_address], critical=True)
        self.children.remove(child)
        self.children.insert(place, child)  # stop() goes in reverse start order
        deadline = time.monotonic() + timeout
        while not address_file.exists():
            if child.process is not None and child.process.poll() is not None:
                raise ClusterStartError(
                    f"the restarted gateway exited with code {child.process.returncode}; "
                    f"last lines of its log:\n{tail(child.log_path)}"
                )
            if time.monotonic() > deadline:
                raise ClusterStartError(f"the restarted gateway did not answer within {timeout:g}s")
            time.sleep(0.05)
        self._record_pid("gateway", child)
        log.warning("gateway_restarted", pid=child.process.pid if child.process else None)

    def _restart_allowed(self, name: str, restarts: list[float]) -> list[float]:
        """``restarts`` (monotonic times) with this one, or ClusterStartError when ``name`` keeps
        dying (GATEWAY_RESTARTS_PER_WINDOW within GATEWAY_RESTART_WINDOW_S: a crash loop)."""
        now = time.monotonic()
        recent = [t for t in restarts if now - t < GATEWAY_RESTART_WINDOW_S]
        if len(recent) >= GATEWAY_RESTARTS_PER_WINDOW:
            raise ClusterStartError(
                f"the {name} died {len(recent) + 1} times within {GATEWAY_RESTART_WINDOW_S:g}s; "
                f"last lines of its log:\n{tail(self.log_dir / f'{name}.log')}"
            )
        return [*recent, now]

    def restart_http(self, timeout: float = 60.0) -> None:
        """The Kernel Gateway API died: start it again on the same port, so remote front ends
        keep their URL. The kernels it had started keep running (their replicas never noticed)
        but the new process does not know them: a front end reconnecting to one is told it does
        not exist. Refused when it keeps dying (a crash loop)."""
        self._http_restarts = self._restart_allowed(HTTP_SERVICE, self._http_restarts)
        old = next(c for c in self.children if c.name == HTTP_SERVICE)
        self.children.remove(old)
        if old.log_file is not None:
            old.log_file.close()
        port = urlsplit(self.http_url).port
        child, offset = self._start_http(["--port", str(port)] if port else [])
        self._wait_for_announcement(child, offset, time.monotonic() + timeout, only_this_child=True)
        self._record_pid(HTTP_SERVICE, child)
        log.warning("http_api_restarted", pid=child.process.pid if child.process else None, url=self.http_url)

    def _record_pid(self, name: str, child: Child) -> None:
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(self.cluster_file.read_text())
            info["processes"][name] = child.process.pid if child.process else None
            self._write_cluster_file(info)

    def _write_cluster_file(self, info: dict[str, Any]) -> None:
        """Atomically, and readable by this user only: it says where the keys are."""
        tmp = self.cluster_file.with_suffix(".tmp")
        write_private(tmp, json.dumps(info, indent=2))
        os.replace(tmp, self.cluster_file)

    def failed_critical(self) -> Child | None:
        """A critical service that died on its own (the cluster cannot go on without it)."""
        for child in self.children:
            if child.critical and child.process is not None and child.process.poll() is not None:
                return child
        return None

    def reap_orphans(self) -> None:
        """Collect exit statuses of re-parented replicas so they do not linger as zombies."""
        known = {c.process.pid for c in self.children if c.process is not None}
        for pid in descendants(os.getpid()):
            if pid in known:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)

    # ---- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM (reverse start order), grace period, then SIGKILL to everything still ours."""
        with contextlib.suppress(FileNotFoundError):
            if (
                self.cluster_file.exists()
                and json.loads(self.cluster_file.read_text()).get("pid") == os.getpid()
            ):
                self.cluster_file.unlink()
        self._stop_http_first()
        running = [c for c in reversed(self.children) if c.process is not None and c.process.poll() is None]
        # Local schedulers first (they stop their replicas), then the gateway, the scheduler last.
        for child in running:
            log.info("service_stopping", service=child.name, pid=child.process.pid if child.process else None)
            with contextlib.suppress(ProcessLookupError):
                assert child.process is not None
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in running:
            assert child.process is not None
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("service_kill", service=child.name, reason="did not stop within grace period")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait(timeout=5)
        self._kill_leftovers()
        (self.state_dir / "gateway.address").unlink(missing_ok=True)
        if self._made_run_dir is not None:
            shutil.rmtree(self._made_run_dir, ignore_errors=True)
        for child in self.children:
            if child.log_file is not None:
                child.log_file.close()
        self.children.clear()

    def _stop_http_first(self) -> None:
        """The HTTP API shuts its kernels down through the gateway: before the gateway stops."""
        for child in self.children:
            if child.name != HTTP_SERVICE or child.process is None or child.process.poll() is not None:
                continue
            log.info("service_stopping", service=child.name, pid=child.process.pid)
            child.process.send_signal(signal.SIGTERM)
            try:
                child.process.wait(timeout=HTTP_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("service_kill", service=child.name, reason="did not stop within grace period")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait(timeout=5)

    def _kill_leftovers(self) -> None:
        """SIGKILL every descendant still there, each pinned by the start time the walk saw: one
        that a living parent reaped meanwhile may have handed its pid to a stranger."""
        found = descendants_of(os.getpid(), process_table())
        for stat in found:
            pinned = PinnedProcess.of_pid(stat.pid, start_ticks=stat.start_ticks)
            if pinned is None:
                continue  # gone since the walk
            if pinned.signal(signal.SIGKILL):
                log.warning("orphan_killed", pid=stat.pid)
            pinned.close()
        leftovers = [stat.pid for stat in found]
        for pid in leftovers:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_foreground(cluster: EmbeddedCluster, *, on_ready: Any = None) -> int:
    """``tandem up``: start, then wait for Ctrl-C / SIGTERM / SIGHUP or a critical service's death."""
    stop_signal: list[int] = []

    def request_stop(signum: int, _frame: Any) -> None:
        if stop_signal:  # a second Ctrl-C while stopping: hurry
            for child in cluster.children:
                if child.process is not None and child.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.process.pid, signal.SIGKILL)
        stop_signal.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, request_stop)
    try:
        info = cluster.start()
    except ClusterStartError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    if stop_signal:
        cluster.stop()
        return 0
    if on_ready is not None:
        on_ready(info)
    exit_code = 0
    # services a new process replaces on the same address (each rebuilds its state, see there)
    restarts = {
        "global-scheduler": cluster.restart_scheduler,
        "arbiter": cluster.restart_arbiter,
        "serving-controller": cluster.restart_serving,
        "checkpoint": cluster.restart_checkpoint,
        "gateway": cluster.restart_gateway,
        HTTP_SERVICE: cluster.restart_http,
    }
    try:
        while not stop_signal:
            failed = cluster.failed_critical()
            restart = restarts.get(failed.name) if failed is not None else None
            if failed is not None and restart is not None:
                try:
                    restart()
                    continue
                except ClusterStartError as exc:
                    what = failed.name.replace("-", " ")
                    print(f"tandem up: the {what} could not be restarted: {exc}", file=sys.stderr)
            if failed is not None:
                assert failed.process is not None
                print(
                    f"tandem up: {failed.name} exited with code {failed.process.returncode}; stopping the cluster. "
                    f"Last lines of {failed.log_path}:\n{tail(failed.log_path)}",
                    file=sys.stderr,
                )
                exit_code = 1
                break
            cluster.reap_orphans()
            time.sleep(0.5)
    finally:
        cluster.stop()
    return exit_code


def forget_kernel_table(state_dir: Path) -> None:
    """A new cluster starts with no kernel: the previous gateway's table must not be restored,
    nor the previous scheduler's hibernated kernels resumed, nor the previous HTTP API's kernels
    re-adopted (its records would only be dropped once the re-attach failed, by asking a cluster
    that is not up yet: the API starts first)."""
    with contextlib.suppress(FileNotFoundError):
        (state_dir / "gateway" / "kernels.json").unlink()
    for record in (state_dir / HTTP_SESSIONS).glob("*.json"):
        record.unlink(missing_ok=True)
    forget_hibernated(state_dir)


def cluster_alive(state_dir: Path) -> bool:
    try:
        info = read_cluster(state_dir)
    except ClusterNotRunning:
        return False
    return pid_alive(info.pid)
