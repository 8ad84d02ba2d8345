"""A local scheduler's link to its replicas is an ``ipc://`` socket with no CURVE: what admits a
peer there is the pid, uid and start time the kernel reports for the connection, matched against
the processes this local scheduler spawned. These tests try it as an intruder on the same host
and as the same user would: the test process, a process a notebook cell starts, and user code
inside a replica speaking for another replica."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from _cluster import ClusterHandle, eventually
from _kernels import run, tandem_kernel

from services.local_scheduler.replica_link import remove_stale_sockets
from shared import messages
from shared.envelope import Envelope
from shared.rpc import RpcClient

pytestmark = pytest.mark.integration


def _link_sockets(cluster: ClusterHandle) -> dict[str, Path]:
    """host id -> the ipc socket its local scheduler listens on for its replicas."""
    found: dict[str, Path] = {}
    for name, pid in cluster.processes().items():
        if not name.startswith("host-"):
            continue
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(int(pid)).net_connections(kind="unix"):
                if isinstance(conn.laddr, str) and conn.laddr.endswith("replicas.sock"):
                    found[name] = Path(conn.laddr)
    return found


def test_the_replica_link_is_a_private_unix_socket(tandem_cluster: ClusterHandle) -> None:
    sockets = _link_sockets(tandem_cluster)
    hosts = [h["id"] for h in tandem_cluster.status()["hosts"]]
    assert sorted(sockets) == sorted(hosts), f"every host's replica link is ipc: {sockets}"
    for path in sockets.values():
        sock, directory = path.stat(), path.parent.stat()
        assert stat.S_ISSOCK(sock.st_mode)
        assert stat.S_IMODE(sock.st_mode) == 0o600, oct(sock.st_mode)
        assert stat.S_IMODE(directory.st_mode) == 0o700, oct(directory.st_mode)
        assert sock.st_uid == directory.st_uid == os.getuid()


def test_a_replicas_jupyter_sockets_are_unix_sockets_in_the_private_link_directory(
    tandem_cluster: ClusterHandle,
) -> None:
    """Its shell, iopub, stdin, control and heartbeat sockets: on loopback TCP any local user
    could subscribe to iopub and read every output in plain text (ipykernel warns of it)."""
    link_dirs = {path.parent for path in _link_sockets(tandem_cluster).values()}
    with tandem_kernel() as (km, kc):
        assert run(kc, "print('private')").status == "ok"
        kernel_id = km.kernel_id
        [kernel] = [k for k in tandem_cluster.status()["kernels"] if k["id"] == kernel_id]
        raft_ports = {int(r["raft_address"].rsplit(":", 1)[1]) for r in kernel["replicas"]}
        pids = tandem_cluster.replica_pids(kernel_id)
        assert len(pids) == 3
        for pid in pids:
            replica = psutil.Process(pid)
            listening = {
                c.laddr.port for c in replica.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
            }
            # its Raft listener, and ipykernel's pipe for forked children's output (loopback,
            # keyed by a random id only those children get): nothing of Jupyter's channels
            assert len(listening & raft_ports) == 1 and len(listening - raft_ports) <= 1, listening
            bound = {Path(c.laddr) for c in replica.net_connections(kind="unix") if c.laddr}
            jupyter = {path for path in bound if path.parent in link_dirs and path.name != "replicas.sock"}
            assert len(jupyter) == 5, bound  # shell, iopub, stdin, control, heartbeat
        sockets = [path for d in link_dirs for path in d.iterdir() if path.name.startswith("j")]
        assert len(sockets) >= 15
        stopped = tandem_cluster.cli("kernel", "stop", kernel_id)
        assert stopped.returncode == 0, stopped.stderr
        assert eventually(lambda: not tandem_cluster.replica_pids(kernel_id), timeout=15)
    assert eventually(lambda: not any(path.exists() for path in sockets), timeout=10)


def _refusals(cluster: ClusterHandle, host: str, pid: int) -> bool:
    text = cluster.log_text(host)
    return "peer_refused" in text and f"pid {pid} is not a replica this local scheduler started" in text


async def _intrude(address: str, kernel_id: str, replica_id: str) -> str:
    """As this process (same user, not a spawned replica): claim a replica's exit."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    client = RpcClient(ctx, identity=f"{kernel_id}/{replica_id}/{os.getpid()}".encode(), name="intruder")
    client.connect(address)
    body = {"kernel_id": kernel_id, "replica_id": replica_id, "event": "exited", "msg_id": None, "detail": {}}
    try:
        await client.request(Envelope(messages.REPLICA_EVENT, body), timeout=1.5)
        outcome = "answered"
    except Exception as exc:
        outcome = type(exc).__name__
    await client.close()
    ctx.destroy(linger=0)
    return outcome


def test_a_process_that_is_not_a_spawned_replica_is_refused_at_the_handshake(
    tandem_cluster: ClusterHandle,
) -> None:
    import asyncio

    sockets = _link_sockets(tandem_cluster)
    with tandem_kernel() as (km, kc):
        assert run(kc, "x = 1").status == "ok"
        status = tandem_cluster.status()
        kernel = next(k for k in status["kernels"] if k["id"] == km.kernel_id)
        replica = kernel["replicas"][0]
        host = str(replica["host"])
        # the test process itself: same uid, a pid no local scheduler spawned
        outcome = asyncio.run(_intrude(f"ipc://{sockets[host]}", km.kernel_id, str(replica["id"])))
        assert outcome == "RpcTimeout"  # no answer: the connection never got past ZAP
        assert eventually(lambda: _refusals(tandem_cluster, host, os.getpid()), timeout=5)
        # a process a cell starts: a child of a replica, on the replica's host, as its user
        paths = {h: str(p) for h, p in sockets.items()}
        code = textwrap.dedent(
            f"""
            import os, subprocess, sys
            path = {paths!r}[os.environ["TANDEM_HOST_ID"]]
            script = (
                "import os, zmq, time\\n"
                "s = zmq.Context().socket(zmq.DEALER); s.linger = 0\\n"
                "s.identity = (os.environ['TANDEM_KERNEL_ID'] + '/' + os.environ['TANDEM_REPLICA_ID'] + '/1').encode()\\n"
                f"s.connect('ipc://{{path}}'); s.send(b'x')\\n"
                "print(os.getpid(), bool(s.poll(1500)))\\n"
            )
            out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
            print(os.environ["TANDEM_HOST_ID"], out.stdout.strip(), out.stderr[-300:])
            """
        )
        reply = run(kc, code)
        assert reply.status == "ok", reply
        child_host, child_pid, answered = reply.stdout.split()[:3]
        assert answered == "False"
        assert eventually(lambda: _refusals(tandem_cluster, child_host, int(child_pid)), timeout=5)
        time.sleep(0.5)
        after = next(k for k in tandem_cluster.status()["kernels"] if k["id"] == km.kernel_id)
        assert all(r["alive"] for r in after["replicas"]), "a refused peer's exit claim was processed"
        assert run(kc, "print(x + 1)").stdout.strip() == "2"


def test_a_replica_may_send_only_for_itself(tandem_cluster: ClusterHandle) -> None:
    """User code runs in the replica's own process, so it is admitted, as that replica: what it
    sends for another replica, or under another replica's routing identity, is refused."""
    paths = {h: str(p) for h, p in _link_sockets(tandem_cluster).items()}
    with tandem_kernel() as (km, kc):
        code = textwrap.dedent(
            f"""
            import os, zmq
            from shared import messages
            from shared.envelope import Envelope, decode
            path = {paths!r}[os.environ["TANDEM_HOST_ID"]]
            me, kernel = os.environ["TANDEM_REPLICA_ID"], os.environ["TANDEM_KERNEL_ID"]
            other = next(r for r in ("r1", "r2", "r3") if r != me)
            def attempt(identity, replica_id):
                s = zmq.Context.instance().socket(zmq.DEALER)
                s.linger = 0
                s.identity = identity.encode()
                s.connect("ipc://" + path)
                body = {{"kernel_id": kernel, "replica_id": replica_id, "event": "exited",
                         "msg_id": None, "detail": {{}}}}
                s.send(Envelope(messages.REPLICA_EVENT, body).encode())
                answer = decode(s.recv()) if s.poll(3000) else None
                s.close()
                return answer.body.get("code") if answer is not None else "silence"
            print("for-other", attempt(f"{{kernel}}/{{me}}/x", other))
            print("as-other", attempt(f"{{kernel}}/{{other}}/x", other))
            """
        )
        reply = run(kc, code)
        assert reply.status == "ok", reply
        lines = dict(line.split() for line in reply.stdout.strip().splitlines())
        assert lines == {"for-other": "unauthorized", "as-other": "unauthorized"}, reply.stdout
        time.sleep(0.5)
        kernel = next(k for k in tandem_cluster.status()["kernels"] if k["id"] == km.kernel_id)
        assert all(r["alive"] for r in kernel["replicas"])
        text = "\n".join(tandem_cluster.log_text(h) for h in paths)
        assert "may not speak for replica" in text and "may not use the routing identity" in text


# ---- the link's shell alone, without a cluster ----------------------------------------------------

_CHILD = """
import sys, zmq, msgpack
from shared import messages
from shared.envelope import Envelope, decode
sock = zmq.Context().socket(zmq.DEALER)
sock.linger = 0
sock.identity = b"k1/r1/child"
sock.connect(sys.argv[1])
body = {"kernel_id": "k1", "replica_id": "r1", "event": "elected", "msg_id": "m1", "detail": {}}
sock.send(Envelope(messages.REPLICA_EVENT, body).encode())
print(decode(sock.recv()).type if sock.poll(3000) else "silence", flush=True)
"""


def _link(state_dir: Path) -> Any:
    import zmq.asyncio

    from services.local_scheduler.replica_link import ReplicaLink
    from services.local_scheduler.service import LocalScheduler
    from shared.security import curve

    return ReplicaLink(
        zmq.asyncio.Context(),
        host_keys=curve.new_keypair(),
        handler=lambda identity, env: env.reply({}),
        authorize=LocalScheduler._authorize_replica,
        name="test-link",
        state_dir=state_dir,
        default_ip="127.0.0.1",
    )


async def _child_outcome(link: Any, *, name_it_after_s: float | None) -> str:
    """A process connects while a start is under way; its launcher names its pid after
    ``name_it_after_s`` (None: never, and the start ends)."""
    import asyncio
    import sys

    from shared.process_signals import read_stat

    link.start_began()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, link.server.address, stdout=asyncio.subprocess.PIPE
    )
    if name_it_after_s is None:
        await asyncio.sleep(0.2)
        link.start_ended()
    else:
        await asyncio.sleep(name_it_after_s)  # it has connected and waits at ZAP by now
        link.peers.allow(
            child.pid, "replica.k1/r1", (read_stat(child.pid) or pytest.fail("no stat")).start_ticks
        )
        link.start_ended()
    out, _ = await child.communicate()
    return out.decode().strip()


def test_a_spawned_process_that_connects_before_its_pid_is_known_is_admitted_once_named(
    tmp_path: Path,
) -> None:
    """A warm or forked runtime can connect before its launcher has read its pid: its handshake
    waits for the start instead of being refused (ZMQ never retries a refused handshake). A
    process nobody names is refused, and its message never reaches the handler."""
    import asyncio

    async def scenario() -> tuple[str, str, int]:
        link = _link(tmp_path / "state")
        link.bind()
        link.server.start()
        try:
            admitted = await _child_outcome(link, name_it_after_s=0.8)
            refused = await _child_outcome(link, name_it_after_s=None)
            return admitted, refused, link._authority.refused
        finally:
            await link.close()

    admitted, refused, refusals = asyncio.run(scenario())
    assert (admitted, refused, refusals) == (messages.REPLY, "silence", 1)


def test_a_state_dir_too_deep_for_a_socket_path_gets_a_private_temporary_directory(tmp_path: Path) -> None:
    import asyncio

    async def scenario() -> None:
        link = _link(tmp_path / ("deep" * 30))
        link.bind()
        path = link.socket_path
        assert path is not None and len(str(path)) < 100
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        await link.close()
        assert not path.parent.exists()

    asyncio.run(scenario())


def test_a_local_scheduler_removes_the_jupyter_sockets_killed_replicas_left_and_keeps_live_ones(
    tmp_path: Path,
) -> None:
    """A replica killed with its local scheduler leaves its five Jupyter socket files in the
    private link directory; the next start of the link removes those nothing listens on."""
    live, stale = tmp_path / "jaaaaaaaaaa-1", tmp_path / "jbbbbbbbbbb-1"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(live))
    server.listen()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # as a killed process leaves it: the file stays, nothing listens
    plain = tmp_path / "jcccccccccc-1"
    plain.write_text("not a socket")
    try:
        assert remove_stale_sockets(tmp_path, "j*-*") == [stale]
        assert live.exists() and plain.exists() and not stale.exists()
    finally:
        server.close()
