"""Malformed frames, bounded and seeded, to every socket a running cluster listens on: the
gateway's API and its kernels' Jupyter ports, the global scheduler (its ipc endpoint too), the arbiter, the serving
controller, the checkpoint service, the Kernel Gateway HTTP API, each local scheduler (its
replicas' ipc socket too), every replica (Raft port, ipykernel ports) and the metrics endpoint.
Found by asking the OS what the cluster's processes listen on (TCP ports and Unix socket paths),
so a socket added later is fuzzed without touching this test.
Afterwards every process is alive, a normal cell runs and sees its variables, and no GPU stays
committed."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import psutil
import pytest
import zmq
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

from shared import messages
from shared.envelope import Envelope
from shared.security import curve

pytestmark = pytest.mark.integration

SEED = 14
FRAMES_PER_SOCKET = 12
ZMTP_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f"


def _cluster_processes(cluster: ClusterHandle) -> list[psutil.Process]:
    """Every process the cluster's supervisor runs now: its services (restarted ones included,
    whose pids ``cluster.info`` no longer knows) and their kernel replicas."""
    return psutil.Process(cluster.process.pid).children(recursive=True)


def _listening(procs: list[psutil.Process]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket the processes listen on."""
    ports = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    ip = "127.0.0.1" if conn.laddr.ip in ("0.0.0.0", "::") else conn.laddr.ip
                    ports.append((proc.pid, ip, conn.laddr.port))
    return sorted(set(ports))


def _unix_paths(procs: list[psutil.Process]) -> list[str]:
    """Every Unix socket path the processes have bound (a listener's accepted connections share
    its path; unnamed socket pairs have none)."""
    paths = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections(kind="unix"):
                if isinstance(conn.laddr, str) and conn.laddr.startswith("/"):
                    paths.add(conn.laddr)
    return sorted(paths)


def _junk(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 2048))
    if kind == 1:  # a ZMTP greeting, then nonsense
        return ZMTP_GREETING + rng.randbytes(rng.randrange(0, 256))
    if kind == 2:  # a length prefix that lies
        return (2**31 - 1).to_bytes(4, "big") + rng.randbytes(16)
    if kind == 3:
        return b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + rng.randbytes(8)
    return msgpack.packb(
        {"type": rng.choice(["install_snapshot", "append", "hello", "x"]), "v": rng.random()}
    )


def _raw_tcp(ip: str, port: int, rng: random.Random) -> None:
    for _ in range(FRAMES_PER_SOCKET // 3):
        with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1.0) as conn:
            _send_junk(conn, rng)


def _raw_unix(path: str, rng: random.Random) -> None:
    for _ in range(FRAMES_PER_SOCKET // 3):
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(1.0)
            conn.connect(path)
            _send_junk(conn, rng)


def _send_junk(conn: socket.socket, rng: random.Random) -> None:
    conn.sendall(_junk(rng))
    conn.settimeout(0.05)
    with contextlib.suppress(OSError):
        conn.recv(4096)


def _random_frames(rng: random.Random) -> list[bytes]:
    frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 7))]
    if rng.random() < 0.5:  # something that parses as far as the Jupyter delimiter
        frames = [b"<IDS|MSG>", rng.randbytes(32).hex().encode(), b"{}", b"{", b"[]", b"null", *frames]
    return frames


def _envelope_junk(rng: random.Random) -> list[bytes]:
    msg_type = rng.choice(
        [
            messages.KERNEL_START,
            messages.KERNEL_SHUTDOWN,
            messages.HOST_REGISTER,
            messages.HOST_HEARTBEAT,
            messages.REPLICA_EVENT,
            messages.REPLICA_PROCESS,
            messages.REPLICA_MEMBERSHIP,
            messages.JUPYTER_REQUEST,
            messages.GPU_COMMIT,
            "nonsense",
            "",
        ]
    )
    body: Any = rng.choice(
        [
            None,
            [],
            {"kernel_id": rng.choice(["../..", "", 7, None, "x" * 500])},
            {"host_id": {"nested": 1}, "resources": "lots"},
            rng.randbytes(8),
        ]
    )
    variants = [
        Envelope(msg_type, body).encode(),  # a well-formed envelope around a body of the wrong shape
        msgpack.packb([msg_type, body]),
        rng.randbytes(rng.randrange(1, 128)),
        b"",
    ]
    return [rng.choice(variants)] + ([rng.randbytes(4)] if rng.random() < 0.2 else [])


@contextlib.contextmanager
def _dealer(address: str, credentials: curve.ClientCurve | None = None) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 200)
    if credentials is not None:
        credentials.connect(sock, address)  # CURVE on tcp://, PLAIN on a service's ipc:// endpoint
    else:
        sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


def _zmq_frames(
    address: str, rng: random.Random, make: Any, credentials: curve.ClientCurve | None = None
) -> None:
    with _dealer(address, credentials) as sock:
        for _ in range(FRAMES_PER_SOCKET):
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(make(rng))
        time.sleep(0.2)
        while sock.poll(50):
            sock.recv_multipart()


def _committed(cluster: ClusterHandle) -> dict[str, int]:
    return {h["id"]: h["committed"] for h in cluster.status()["hosts"]}


def test_malformed_frames_on_every_listening_socket_leave_the_cluster_working(
    tandem_cluster: ClusterHandle,
) -> None:
    rng = random.Random(SEED)
    keys = tandem_cluster.state_dir / "keys"
    with tandem_kernel() as (km, kc):
        assert run(kc, "survivor = [1, 2, 3]").status == "ok"
        procs = _cluster_processes(tandem_cluster)
        commands = [" ".join(p.cmdline()) for p in procs]
        assert any("kernel_replica" in c for c in commands), "no replica found"
        assert any("services.global_scheduler" in c for c in commands), "no global scheduler found"
        ports = _listening(procs)
        print("FUZZ", len(procs), ports)
        info = km.get_connection_info()
        jupyter_ports = {info[f"{c}_port"] for c in ("shell", "control", "stdin", "hb", "iopub")}
        assert jupyter_ports <= {port for _, _, port in ports}, "the kernel's Jupyter ports were not found"
        for _pid, ip, port in ports:
            address = f"tcp://{ip}:{port}"
            _raw_tcp(ip, port, rng)
            _zmq_frames(address, rng, _random_frames)
        unix_paths = _unix_paths(procs)
        print("FUZZ unix", unix_paths)
        assert any(p.endswith("replicas.sock") for p in unix_paths), "no local scheduler's replica link found"
        local_scheduler = next((p for p in unix_paths if p.endswith("scheduler.sock")), None)
        assert local_scheduler is not None, "the global scheduler's ipc endpoint was not found"
        for path in unix_paths:
            _raw_unix(path, rng)
            _zmq_frames(f"ipc://{path}", rng, _random_frames)
            _zmq_frames(f"ipc://{path}", rng, _envelope_junk)
        # past the handshake: well-keyed peers sending nonsense envelopes
        for service, server in (
            (tandem_cluster.gateway, curve.GATEWAY),
            (tandem_cluster.scheduler, curve.SCHEDULER),
        ):
            _zmq_frames(service, rng, _envelope_junk, curve.client_curve(keys, curve.OPERATOR, server))
        host = next(iter(_committed(tandem_cluster)))
        arbiter = str(tandem_cluster.info["arbiter"])
        for principal in (curve.OPERATOR, curve.host_principal(host)):  # job.* and agent.report
            _zmq_frames(arbiter, rng, _envelope_junk, curve.client_curve(keys, principal, curve.ARBITER))
        checkpoints = str(tandem_cluster.info["checkpoint"])
        for principal in (curve.OPERATOR, curve.host_principal(host)):  # checkpoint.*
            _zmq_frames(
                checkpoints, rng, _envelope_junk, curve.client_curve(keys, principal, curve.CHECKPOINT)
            )
        for scheduler in (tandem_cluster.scheduler, f"ipc://{local_scheduler}"):  # CURVE, then PLAIN
            _zmq_frames(
                scheduler,
                rng,
                _envelope_junk,
                curve.client_curve(keys, curve.host_principal(host), curve.SCHEDULER),
            )
        serving = str(tandem_cluster.info["serving"])  # pool.report, runtime.acquire, serving.status
        for principal in (curve.OPERATOR, curve.SCHEDULER, curve.host_principal(host)):
            _zmq_frames(serving, rng, _envelope_junk, curve.client_curve(keys, principal, curve.SERVING))

        time.sleep(1.0)
        dead = [p.pid for p in procs if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
        assert dead == [], f"processes died under fuzzing: {dead}"
        assert run(kc, "print(sum(survivor))").stdout.strip() == "6"
        assert run(kc, "survivor.append(4); print(len(survivor))").stdout.strip() == "4"
        logs = [*tandem_cluster.state_dir.rglob("replica.log"), *tandem_cluster.log_dir.glob("*.log")]
        fatal = [str(f) for f in logs if "raft.fatal" in f.read_text(errors="replace")]
        assert fatal == [], f"a replica's Raft stopped: {fatal}"
    tandem_cluster.wait_for_status(
        lambda s: all(h["committed"] == 0 for h in s["hosts"]), "every GPU released after fuzzing", timeout=20
    )
