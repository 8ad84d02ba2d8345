"""Starting and stopping a real embedded cluster for tests (used by conftest.py and tests).

``tandem_cluster`` runs ``tandem up`` (the real CLI, as a subprocess) in a temporary state
directory once per test session, points this process's provisioner at it (``TANDEM_STATE_DIR``)
and installs the ``tandem`` kernelspec into a temporary prefix, so ``KernelManager(kernel_name=
"tandem")``, nbclient and ``jupyter_kernel_test`` all work unmodified. Teardown sends SIGTERM and
checks that no process of the cluster survived.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.cluster_file import ClusterNotRunning, ask_sync, cluster_status, read_cluster
from services.embedded import die_with_parent
from shared import messages
from shared.process_signals import read_stat
from shared.rpc import RpcError, RpcTimeout
from shared.security import curve

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_MODULES = (
    "services/global_scheduler/__main__.py",
    "services/local_scheduler/__main__.py",
    "kernel_replica/__main__.py",
)
START_TIMEOUT_S = 120.0
# autoscaling that acts within a second: a placement above SR 0.34 asks for hosts, idle ones go
FAST_AUTOSCALING = (
    "--set", "scheduler.subscription_ratio_watermark=0.34",
    "--set", "autoscale.interval_s=0.3",
    "--set", "autoscale.scale_in_idle_s=0.5",
    "--set", "autoscale.scale_out_timeout_s=60",
)  # fmt: skip


# For a cluster whose tests never speak to the Kernel Gateway HTTP API: Jupyter Server is the
# costliest service to start (two CPU-seconds of imports) and to stop (its kernels first). The
# session cluster, and the tests of the API, of `tandem up` and of the state dir, keep it.
WITHOUT_HTTP_API = ("--set", "http.enabled=false")


@dataclass
class ClusterHandle:
    """A running embedded cluster: where it lives and how to reach it."""

    state_dir: Path
    log_dir: Path
    process: subprocess.Popen[bytes]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def gateway(self) -> str:
        return str(self.info["gateway"])

    @property
    def scheduler(self) -> str:
        return str(self.info["scheduler"])

    def ask_scheduler(self, msg_type: str, body: dict[str, Any], *, timeout: float = 10.0) -> dict[str, Any]:
        """One request to the global scheduler, as the cluster's operator."""
        credentials = curve.client_curve(self.state_dir / "keys", curve.OPERATOR, curve.SCHEDULER)
        return ask_sync(self.scheduler, msg_type, body, credentials=credentials, timeout=timeout)

    def ask_gateway(self, msg_type: str, body: dict[str, Any], *, timeout: float = 10.0) -> dict[str, Any]:
        """One request to the gateway's lifecycle API, as the cluster's operator."""
        credentials = curve.client_curve(self.state_dir / "keys", curve.OPERATOR, curve.GATEWAY)
        return ask_sync(self.gateway, msg_type, body, credentials=credentials, timeout=timeout)

    def dealer(
        self, service: str, principal: str | None = curve.OPERATOR, *, identity: bytes | None = None
    ) -> Any:
        """A raw DEALER on ``service`` ("gateway" or "global-scheduler") holding ``principal``'s
        key, or no key at all (``None``): for tests that send what no well-behaved client would."""
        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        server = curve.GATEWAY if service == "gateway" else curve.SCHEDULER
        if principal is not None:
            curve.client_curve(self.state_dir / "keys", principal, server).apply(sock)
        sock.connect(self.gateway if service == "gateway" else self.scheduler)
        return sock

    def cordon(self, host_id: str, cordoned: bool = True) -> None:
        self.ask_scheduler(messages.HOST_CORDON if cordoned else messages.HOST_UNCORDON, {"host_id": host_id})

    @contextmanager
    def only_host_open(self, host_id: str) -> Iterator[None]:
        """Every host but ``host_id`` cordoned while the block runs, then each as it was: the
        next cell runs on ``host_id``'s replica (an executor change, made on purpose)."""
        before = {
            h["id"]: bool(h["cordoned"]) for h in self.ask_scheduler(messages.CLUSTER_STATUS, {})["hosts"]
        }
        for host, cordoned in before.items():
            if (host != host_id) != cordoned:
                self.cordon(host, host != host_id)
        try:
            yield
        finally:
            for host, cordoned in before.items():
                if (host != host_id) != cordoned:
                    self.cordon(host, cordoned)

    def processes(self) -> dict[str, int]:
        """Service name -> pid now, from the cluster.json ``tandem up`` rewrites when it restarts
        a service (``info`` holds the pids it started with)."""
        try:
            current = read_cluster(self.state_dir).raw.get("processes", {})
        except ClusterNotRunning:  # stopped: cluster.json is gone
            current = self.info.get("processes", {})
        return {name: int(pid) for name, pid in current.items() if pid is not None}

    def log_text(self, service: str) -> str:
        path = self.log_dir / f"{service}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args, "--state-dir", str(self.state_dir)],
            capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        """``tandem status --json``."""
        result = self.cli("status", "--json")
        assert result.returncode == 0, result.stderr
        return dict(json.loads(result.stdout))

    def status_here(self) -> dict[str, Any]:
        """What ``tandem status --json`` prints, computed in this process by the code the CLI
        runs (``cluster_file.cluster_status``): for polling, where a CLI process per poll costs a
        Python start-up each time (a third of a CPU-second, on two cores shared with the cluster)."""
        report = asyncio.run(cluster_status(read_cluster(self.state_dir)))
        return dict(json.loads(json.dumps(report, default=str)))

    def wait_for_status(
        self, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Polls ``tandem status --json``'s report (``status_here``) until ``predicate`` holds (a
        status that cannot be read, as while the scheduler restarts, is polled again) and
        returns that status."""
        deadline = time.monotonic() + timeout
        current: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                current = self.status_here()
            except (ClusterNotRunning, RpcError, RpcTimeout, OSError, ValueError):
                pass
            else:
                if predicate(current):
                    return current
            time.sleep(0.3)
        pytest.fail(f"{what} did not happen; last status: {json.dumps(current)[:4000]}")

    def scheduled_replica_pids(self, kernel_id: str) -> list[int]:
        """The live replicas' processes as the scheduler knows them (``replica_pids`` cannot see
        a pre-warmed runtime: its command line and initial environment name no kernel)."""
        status = self.ask_scheduler(messages.KERNEL_STATUS, {"kernel_id": kernel_id})
        return [int(r["pid"]) for r in status["replicas"] if r["alive"]]

    def replica_cwds(self, kernel_id: str) -> list[str]:
        """The working directory of each live replica process, sorted."""
        return sorted(os.readlink(f"/proc/{pid}/cwd") for pid in self.scheduled_replica_pids(kernel_id))

    def replica_pids(self, kernel_id: str) -> list[int]:
        """Live replica processes of ``kernel_id`` (found by the kernel id in their command line or env)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                if b"kernel_replica" not in cmdline:
                    continue
                if (
                    kernel_id.encode() in cmdline
                    or kernel_id.encode() in Path(f"/proc/{entry}/environ").read_bytes()
                ):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] != "Z":
                        pids.append(int(entry))
            except OSError:
                continue
        return pids


def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``predicate`` holds within ``timeout`` (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def missing_services() -> list[str]:
    return [m for m in REQUIRED_MODULES if not (ROOT / m).exists()]


def start_cluster(state_dir: Path, *extra: str) -> ClusterHandle:
    """Run ``tandem up`` in the background and wait for its cluster.json."""
    state_dir.mkdir(parents=True, exist_ok=True)
    # closed by stop_cluster; 0600 like everything else in a state dir (tests/security/test_file_modes.py)
    out = os.fdopen(os.open(state_dir / "tandem-up.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--state-dir", str(state_dir), "--log-format", "json", *extra],
        stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        preexec_fn=die_with_parent(os.getpid()),  # a killed test run must not leave a cluster behind
    )  # fmt: skip
    handle = ClusterHandle(state_dir, state_dir / "logs", process)
    deadline = time.monotonic() + START_TIMEOUT_S
    cluster_file = state_dir / "cluster.json"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if cluster_file.exists():
            handle.info = json.loads(cluster_file.read_text())
            return handle
        time.sleep(0.1)
    stop_cluster(handle)
    output = (state_dir / "tandem-up.out").read_text(errors="replace")[-4000:]
    pytest.fail(f"tandem up did not become ready (exit code {process.returncode}):\n{output}")


def stop_cluster(handle: ClusterHandle) -> list[int]:
    """SIGTERM ``tandem up``; return the pids of its services that are still alive afterwards."""
    pids = sorted({*handle.info.get("processes", {}).values(), *handle.processes().values()})
    if handle.process.poll() is None:
        handle.process.send_signal(signal.SIGTERM)
        try:
            handle.process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(handle.process.pid, signal.SIGKILL)
            handle.process.wait(timeout=10)
    return [pid for pid in pids if _runs_for(pid, handle.state_dir)]


def _runs_for(pid: int, state_dir: Path) -> bool:
    """Whether ``pid`` is still a live service of the cluster in ``state_dir`` (its command line
    carries the cluster's configuration): a service that died earlier (a test killed it, tandem up
    restarted it) may have handed its pid to anyone, which is not a survivor."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)  # a probe, no signal: where there is no /proc to tell who it is
        except ProcessLookupError:
            return False
        return True
    stat = read_stat(pid)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return stat is not None and stat.state != "Z" and str(state_dir).encode() in cmdline


@contextmanager
def running_cluster(state_dir: Path, *extra: str) -> Iterator[ClusterHandle]:
    """``tandem up`` in ``state_dir`` with ``extra`` flags, made this process's provisioner target
    (``TANDEM_STATE_DIR``) while the block runs; afterwards no process of it may survive SIGTERM.
    Skips the test when the services are not there."""
    missing = missing_services()
    if missing:
        pytest.skip(f"cluster services not written yet: {', '.join(missing)}")
    handle = start_cluster(state_dir, *extra)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_STATE_DIR", str(state_dir))
        try:
            yield handle
        finally:
            survivors = stop_cluster(handle)
    assert not survivors, f"services survived tandem up's SIGTERM: {survivors}"
