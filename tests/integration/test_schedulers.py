"""Real global and local scheduler processes on loopback, driven as the gateway drives them.

Each test starts its own global scheduler and local schedulers (virtual GPUs, private state dir),
talks to the scheduler's ROUTER with ``shared.rpc`` under the identity ``gateway``, and speaks
raw Jupyter frames signed with ``jupyter_client.Session``, so the scheduler sees exactly what the
gateway would forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio
from _signals import signal_ours
from jupyter_client.session import Session

from shared import messages
from shared.envelope import Envelope
from shared.jupyter_wire import DELIMITER
from shared.rpc import RpcClient, RpcError
from shared.security import curve

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 4.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has not reaped it yet).
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True


def wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` (polling: a loaded machine stops processes slowly)."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def replica_available() -> bool:
    return (REPO / "kernel_replica" / "__main__.py").exists()


needs_replica = pytest.mark.skipif(not replica_available(), reason="kernel_replica has not landed")


@dataclass
class Cluster:
    tmp: Path
    address: str
    settings: list[str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    tcp_links: tuple[str, ...] = ()  # hosts whose replica link is tcp (CURVE) instead of ipc
    addresses: dict[str, str] = field(default_factory=dict)  # as each process announced it

    def _launch(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ, TANDEM_STATE_DIR=str(self.tmp / "state"), PYTHONPATH=str(REPO))
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        return subprocess.Popen(
            [sys.executable, "-m", *argv, *self.settings],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
        )

    def _announced(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the one JSON line announcing the address
        assert line, f"{name} exited: {(self.tmp / f'{name}.log').read_text()[-2000:]}"
        announced = json.loads(line)
        assert announced["event"] == "listening"
        self.addresses[name] = str(announced.get("address"))
        self.procs[name] = proc

    def start_scheduler(self) -> None:
        self._announced(
            "global", self._launch("global", ["services.global_scheduler", "--bind", self.address])
        )

    def start_hosts(self, *host_ids: str) -> None:
        """Every host's process at once, then each one's announcement: their start-ups overlap."""
        launched = []
        for host_id in host_ids:
            curve.issue(self.tmp / "state" / "keys", curve.host_principal(host_id))  # as `tandem keys host`
            argv = ["services.local_scheduler", "--host-id", host_id, "--scheduler", self.address]
            if host_id in self.tcp_links:
                argv += ["--bind", "tcp://127.0.0.1:0"]
            launched.append((host_id, self._launch(host_id, argv)))
        for host_id, proc in launched:
            self._announced(host_id, proc)

    def start_host(self, host_id: str) -> None:
        self.start_hosts(host_id)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        return proc.wait(timeout)

    def stop_all(self, names: list[str], timeout: float = 15.0) -> None:
        """SIGTERM to each of ``names`` at once, then wait for each (they stop side by side)."""
        stopping = [self.procs.pop(name) for name in names]
        for proc in stopping:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in stopping:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()


@contextlib.contextmanager
def cluster(
    tmp: Path, hosts: int = 3, gpus: int = 4, tcp_links: tuple[str, ...] = (), **extra: Any
) -> Iterator[Cluster]:
    settings = {
        "host.use_nvml": "false",
        "host.gpus": str(gpus),
        "scheduler.heartbeat_interval_s": "0.3",
        "scheduler.heartbeat_timeout_s": str(HEARTBEAT_TIMEOUT_S),
        "scheduler.request_timeout_s": str(REQUEST_TIMEOUT_S),
        "scheduler.replica_start_timeout_s": "40",
        "log.level": "info",
        **{k.replace("__", "."): str(v) for k, v in extra.items()},
    }
    c = Cluster(
        tmp,
        f"tcp://127.0.0.1:{free_port()}",
        [f"--set={k}={v}" for k, v in settings.items()],
        tcp_links=tcp_links,
    )
    try:
        c.start_scheduler()
        c.start_hosts(*(f"h{n}" for n in range(1, hosts + 1)))
        yield c
    finally:
        with contextlib.suppress(Exception):
            c.stop_all([n for n in c.procs if n != "global"])
        if "global" in c.procs:
            with contextlib.suppress(Exception):
                c.stop("global")
        for proc in c.procs.values():
            with contextlib.suppress(Exception):
                proc.kill()


class Gateway:
    """What the gateway does with the scheduler: RPCs, and Jupyter frames both ways."""

    def __init__(self, address: str, keys_dir: Path) -> None:
        self.ctx = zmq.asyncio.Context()
        self.inbox: asyncio.Queue[tuple[str, list[bytes]]] = asyncio.Queue()
        self.dead: list[dict[str, Any]] = []
        self.client = RpcClient(
            self.ctx,
            identity=b"gateway",
            on_message=self._on_message,
            name="test-gateway",
            curve=curve.client_curve(keys_dir, curve.GATEWAY, curve.SCHEDULER),
        )
        self.client.connect(address)
        # lifecycle and administration as the operator (`tandem host cordon`, ...), frames as the gateway
        self.admin = RpcClient(
            self.ctx,
            name="test-operator",
            curve=curve.client_curve(keys_dir, curve.OPERATOR, curve.SCHEDULER),
        )
        self.admin.connect(address)
        self.sessions: dict[str, Session] = {}

    def _on_message(self, env: Envelope) -> None:
        if env.type == messages.KERNEL_DEAD:
            self.dead.append(env.body)
        elif env.type == messages.JUPYTER_REPLY:  # one queue item per Jupyter message it carries
            for channel, frames in messages.jupyter_messages(env.body):
                self.inbox.put_nowait((channel, frames))

    async def call(self, msg_type: str, body: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        return (await self.admin.request(Envelope(msg_type, body), timeout=timeout)).body

    async def wait_hosts(self, count: int, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status = await self.call(messages.CLUSTER_STATUS, {})
            if sum(h["alive"] for h in status["hosts"]) >= count:
                return status
            assert time.monotonic() < deadline, f"hosts did not register: {status}"
            await asyncio.sleep(0.1)

    async def start_kernel(self, kernel_id: str, gpus: int = 1) -> dict[str, Any]:
        key = uuid.uuid4().hex
        self.sessions[kernel_id] = Session(key=key.encode())
        body = {
            "kernel_id": kernel_id,
            "key": key,
            "signature_scheme": "hmac-sha256",
            "resources": {"gpus": gpus},
        }
        return await self.call(messages.KERNEL_START, body, timeout=60)

    def send(self, kernel_id: str, channel: str, msg_type: str, content: dict[str, Any]) -> str:
        session = self.sessions[kernel_id]
        msg = session.msg(msg_type, content)
        wire = session.serialize(msg)
        frames = wire[wire.index(DELIMITER) + 1 :]
        self.client.send(
            Envelope(messages.JUPYTER_REQUEST, {"kernel_id": kernel_id, "channel": channel, "frames": frames})
        )
        return str(msg["header"]["msg_id"])

    def execute(self, kernel_id: str, code: str) -> str:
        content = {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
        }
        return self.send(kernel_id, "shell", "execute_request", content)

    async def collect(
        self, kernel_id: str, msg_id: str, timeout: float = 30.0
    ) -> list[tuple[str, dict[str, Any]]]:
        """Every message for ``msg_id`` until its reply and its idle have both arrived."""
        session = Session(key=self.sessions[kernel_id].key)  # own digest history: replicas are many senders
        got: list[tuple[str, dict[str, Any]]] = []
        have_reply = have_idle = False
        deadline = time.monotonic() + timeout
        while not (have_reply and have_idle):
            channel, frames = await asyncio.wait_for(self.inbox.get(), max(deadline - time.monotonic(), 0.01))
            msg = session.deserialize(frames)  # verifies the signature
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            got.append((channel, msg))
            have_reply |= channel in ("shell", "control")
            have_idle |= msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
        return got

    async def close(self) -> None:
        await self.client.close()
        await self.admin.close()
        self.ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def gateway(c: Cluster, hosts: int = 3) -> AsyncIterator[Gateway]:
    gw = Gateway(c.address, c.tmp / "state" / "keys")
    try:
        await gw.wait_hosts(hosts)
        yield gw
    finally:
        await gw.close()


def by_socket(got: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[str]]:
    """``kinds`` per socket, iopub then shell: the protocol orders each socket, not the two."""
    every = kinds(got)
    return [k for k in every if k.startswith("iopub:")], [k for k in every if k.startswith("shell:")]


def message(got: list[tuple[str, dict[str, Any]]], msg_type: str) -> dict[str, Any]:
    return next(msg for _, msg in got if msg["msg_type"] == msg_type)


def kinds(got: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = []
    for channel, msg in got:
        kind = msg["msg_type"]
        if kind == "status":
            kind = msg["content"]["execution_state"]
        out.append(f"{channel}:{kind}")
    return out


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- cluster membership ---------------------------------------------------------------------


def test_hosts_register_cordon_and_status(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            status = await gw.wait_hosts(3)
            assert [h["id"] for h in status["hosts"]] == ["h1", "h2", "h3"]
            for host in status["hosts"]:
                assert host == host | {
                    "gpus": 4,
                    "committed": 0,
                    "subscribed": 0,
                    "cordoned": False,
                    "alive": True,
                }
            assert status["kernels"] == []
            await gw.call(messages.HOST_CORDON, {"host_id": "h2"})
            status = await gw.call(messages.CLUSTER_STATUS, {})
            assert [h["cordoned"] for h in status["hosts"]] == [False, True, False]
            with pytest.raises(RpcError, match="cannot place"):
                await gw.start_kernel("k-cordoned")  # only 2 schedulable hosts
            await gw.call(messages.HOST_UNCORDON, {"host_id": "h2"})
            status = await gw.call(messages.CLUSTER_STATUS, {})
            assert not any(h["cordoned"] for h in status["hosts"])
            with pytest.raises(RpcError, match="unknown host"):
                await gw.call(messages.HOST_CORDON, {"host_id": "nope"})

    with cluster(tmp_path) as c:
        run(scenario(c))


def test_silent_host_is_declared_dead_and_comes_back_on_restart(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            c.stop("h3", signal.SIGKILL)
            deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 3
            while True:
                hosts = {h["id"]: h for h in (await gw.call(messages.CLUSTER_STATUS, {}))["hosts"]}
                if not hosts["h3"]["alive"]:
                    break
                assert time.monotonic() < deadline, "h3 never declared dead"
                await asyncio.sleep(0.2)
            assert hosts["h1"]["alive"] and hosts["h2"]["alive"]
            c.start_host("h3")
            await gw.wait_hosts(3)

    with cluster(tmp_path) as c:
        run(scenario(c))


def test_scheduler_restart_is_healed_by_re_registration(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            await gw.call(messages.HOST_CORDON, {"host_id": "h1"})
        c.stop("global")
        c.start_scheduler()
        async with gateway(c) as gw:
            status = await gw.wait_hosts(3)
            assert len(status["hosts"]) == 3

    with cluster(tmp_path) as c:
        run(scenario(c))


# ---- kernels --------------------------------------------------------------------------------


@needs_replica
def test_kernel_start_execute_and_merged_stream(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            started = time.monotonic()
            info = await gw.start_kernel("k1")
            start_s = time.monotonic() - started
            assert info["state"] == "running" and info["alive"]
            assert sorted(r["host"] for r in info["replicas"]) == ["h1", "h2", "h3"]
            assert all(r["pid"] and r["alive"] for r in info["replicas"])

            # ipykernel publishes iopub from its own thread, so the reply (shell) may overtake
            # iopub messages (a loaded run saw 1/0's reply before busy): each socket's order holds
            got = await gw.collect("k1", gw.execute("k1", "x = 40"))
            assert by_socket(got) == (
                ["iopub:busy", "iopub:execute_input", "iopub:idle"],
                ["shell:execute_reply"],
            )
            got = await gw.collect("k1", gw.execute("k1", "print(x + 2)"))
            assert by_socket(got) == (
                ["iopub:busy", "iopub:execute_input", "iopub:stream", "iopub:idle"],
                ["shell:execute_reply"],
            )
            assert message(got, "stream")["content"]["text"] == "42\n"
            reply = message(got, "execute_reply")["content"]
            assert reply["status"] == "ok" and reply["execution_count"] == 2

            got = await gw.collect("k1", gw.execute("k1", "1/0"))
            assert by_socket(got) == (
                ["iopub:busy", "iopub:execute_input", "iopub:error", "iopub:idle"],
                ["shell:execute_reply"],
            )
            assert message(got, "error")["content"]["ename"] == "ZeroDivisionError"

            got = await gw.collect("k1", gw.send("k1", "shell", "kernel_info_request", {}))
            # the reply (shell) and busy/idle (iopub) travel different sockets, and ipykernel sends
            # iopub from its own thread: the reply may come first (a stock ipykernel's too)
            assert sorted(kinds(got)) == ["iopub:busy", "iopub:idle", "shell:kernel_info_reply"]
            assert [k for k in kinds(got) if k.startswith("iopub:")] == ["iopub:busy", "iopub:idle"]

            timings = []
            for _ in range(20):
                t = time.perf_counter()
                await gw.collect("k1", gw.execute("k1", "x = 1"))
                timings.append(time.perf_counter() - t)
            timings.sort()
            print(f"kernel start {start_s:.2f}s; x = 1 p50 {timings[10] * 1000:.1f} ms")
            # Each cell's GPUs went back as its execute_reply passed the local scheduler: after two
            # heartbeats (the ledgers' own view replaces the scheduler's) nothing is committed.
            await asyncio.sleep(2.5)
            hosts = (await gw.call(messages.CLUSTER_STATUS, {}))["hosts"]
            assert [h["committed"] for h in hosts] == [0, 0, 0]

            status = await gw.call(messages.KERNEL_STATUS, {"kernel_id": "k1"})
            assert status["state"] == "running" and status["last_executor"] in {"r1", "r2", "r3"}
            cluster_status = await gw.call(messages.CLUSTER_STATUS, {})
            assert [h["subscribed"] for h in cluster_status["hosts"]] == [1, 1, 1]
            assert cluster_status["kernels"][0]["replicas"][0].keys() >= {
                "id",
                "host",
                "pid",
                "role",
                "alive",
            }

            pids = [r["pid"] for r in status["replicas"]]
            answer = await gw.call(messages.KERNEL_SHUTDOWN, {"kernel_id": "k1"}, timeout=30)
            assert answer["state"] == "stopped"
            assert wait_dead(pids, 2.0) == []
            status = await gw.call(messages.KERNEL_STATUS, {"kernel_id": "k1"})
            assert status["state"] == "stopped" and not status["alive"]

    with cluster(tmp_path) as c:
        run(scenario(c))


@needs_replica
def test_a_replica_link_over_tcp_is_curve_and_runs_cells(tmp_path: Path) -> None:
    """Where the OS reports no peer pid (macOS, BSD), or when ``--bind tcp://...`` says so, the
    replica link is CURVE with a keypair minted per replica; elsewhere it is ipc by default."""

    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            await gw.start_kernel("k1")
            got = await gw.collect("k1", gw.execute("k1", "print(6 * 7)"))
            assert message(got, "stream")["content"]["text"] == "42\n"

    with cluster(tmp_path, tcp_links=("h1", "h2")) as c:
        assert c.addresses["h1"].startswith("tcp://") and c.addresses["h2"].startswith("tcp://")
        assert c.addresses["h3"].startswith("ipc://")
        run(scenario(c))


@needs_replica
def test_replica_failures_one_tolerated_two_kill_the_kernel(tmp_path: Path) -> None:
    """Without in-place restarts (``scheduler.restart_in_place_limit = 0``; with them, the second
    loss is restarted in place: tests/integration/test_failover.py)."""

    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            info = await gw.start_kernel("k2")
            await gw.collect("k2", gw.execute("k2", "y = 5"))
            pids = {r["id"]: r["pid"] for r in info["replicas"]}
            status = await gw.call(messages.KERNEL_STATUS, {"kernel_id": "k2"})
            executor = status["last_executor"]
            assert signal_ours(pids[executor], signal.SIGKILL)  # the executor dies; two remain
            await asyncio.sleep(1.0)
            status = await gw.call(messages.KERNEL_STATUS, {"kernel_id": "k2"})
            assert status["alive"] and status["state"] == "running"
            got = await gw.collect("k2", gw.execute("k2", "print(y)"), timeout=30)
            assert [m["content"]["text"] for ch, m in got if m["msg_type"] == "stream"] == ["5\n"], [
                (ch, m["msg_type"], m["content"]) for ch, m in got
            ]

            # A long cell is running when a second replica dies: it is failed within seconds.
            long_id = gw.execute("k2", "import time; time.sleep(60)")
            await asyncio.sleep(1.5)
            survivor = next(r for r in pids if r != executor and pid_alive(pids[r]))
            failed_at = time.monotonic()
            assert signal_ours(pids[survivor], signal.SIGKILL)
            got = await gw.collect("k2", long_id, timeout=15)
            assert time.monotonic() - failed_at < 5
            reply = next(m for ch, m in got if ch == "shell")
            assert reply["content"]["status"] == "error"
            assert kinds(got)[-1] == "iopub:idle"
            # kernel.dead follows the failed request's answers on the same link: let it arrive
            for _ in range(50):
                if gw.dead:
                    break
                await asyncio.sleep(0.05)
            assert gw.dead and gw.dead[0]["kernel_id"] == "k2"
            status = await gw.call(messages.KERNEL_STATUS, {"kernel_id": "k2"})
            assert status["state"] == "dead" and not status["alive"]

            # Later requests are answered at once with the same error.
            got = await gw.collect("k2", gw.execute("k2", "1"), timeout=3)
            assert next(m for ch, m in got if ch == "shell")["content"]["ename"] == "KernelDead"
            assert wait_dead(list(pids.values())) == [], "the last survivor is stopped"

    with cluster(tmp_path, scheduler__restart_in_place_limit=0) as c:
        run(scenario(c))


@needs_replica
def test_request_without_any_answer_is_failed_after_the_deadline(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            info = await gw.start_kernel("k3")
            pids = [r["pid"] for r in info["replicas"]]
            for pid in pids:
                assert signal_ours(pid, signal.SIGSTOP)
            try:
                sent = time.monotonic()
                got = await gw.collect("k3", gw.execute("k3", "1"), timeout=REQUEST_TIMEOUT_S + 5)
                assert REQUEST_TIMEOUT_S - 0.5 < time.monotonic() - sent < REQUEST_TIMEOUT_S + 3
                assert kinds(got) == ["iopub:busy", "iopub:error", "shell:execute_reply", "iopub:idle"]
                assert got[2][1]["content"]["ename"] == "RequestTimeout"
            finally:
                for pid in pids:
                    signal_ours(pid, signal.SIGCONT)

    with cluster(tmp_path) as c:
        run(scenario(c))


@needs_replica
def test_local_scheduler_sigterm_leaves_no_orphan_replicas(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            info = await gw.start_kernel("k4", gpus=0)
            pids = [r["pid"] for r in info["replicas"]]
            started = time.monotonic()
            for host in ("h1", "h2", "h3"):
                assert c.stop(host) == 0, c.log(host)[-3000:]
            assert time.monotonic() - started < 30
            assert wait_dead(pids, 2.0) == []

    with cluster(tmp_path) as c:
        run(scenario(c))


@needs_replica
def test_sigkilled_local_scheduler_takes_its_replica_with_it(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            info = await gw.start_kernel("k5", gpus=0)
            pid = next(r["pid"] for r in info["replicas"] if r["host"] == "h1")
            c.stop("h1", signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pid_alive(pid):
                assert time.monotonic() < deadline, "replica outlived its SIGKILLed local scheduler"
                await asyncio.sleep(0.1)

    with cluster(tmp_path) as c:
        run(scenario(c))


@needs_replica
def test_restarted_global_scheduler_adopts_running_kernels(tmp_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        async with gateway(c) as gw:
            await gw.start_kernel("k6", gpus=0)
            await gw.collect("k6", gw.execute("k6", "z = 7"))
            sessions = gw.sessions
        c.stop("global")
        c.start_scheduler()
        async with gateway(c) as gw:
            gw.sessions = sessions
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(RpcError):
                    status = await gw.call(messages.KERNEL_STATUS, {"kernel_id": "k6"})
                    if len([r for r in status["replicas"] if r["alive"]]) == 3:
                        break
                assert time.monotonic() < deadline, "kernel not adopted after the scheduler restart"
                await asyncio.sleep(0.2)
            got = await gw.collect("k6", gw.execute("k6", "print(z)"))
            assert [m["content"]["text"] for _, m in got if m["msg_type"] == "stream"] == ["7\n"]

    with cluster(tmp_path) as c:
        run(scenario(c))
