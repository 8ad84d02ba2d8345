"""The local scheduler's ROUTER for its replicas (``replica.register``, ``gpu.*``, ``replica.event``),
and who may connect to it.

Its mechanism follows its address. ``ipc://`` (the default where the kernel reports an IPC peer's
pid, Linux): a Unix socket in a 0700 directory of this host's state (the socket 0600), admitting
only the processes this local scheduler spawned, each as the replica it spawned it as, from the
credentials the kernel reports for the connection (``shared.security.peer_credentials``): no
CURVE box per message on a link that never leaves the host. ``tcp://`` (elsewhere, or given
explicitly): CURVE, each replica with a keypair minted for it at launch and handed over in its
environment. Either way the connection's proven identity is a ``replica.<kernel>/<replica>``
principal and ``shared.security.authorization`` lets it speak only for that replica.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import zmq

from services.local_scheduler.replica_process import ReplicaProcess
from shared.envelope import Envelope
from shared.private_files import private_dir, private_socket_path
from shared.rpc import Authorizer, RpcServer, ServerHandler
from shared.security import curve
from shared.security.authorization import replica_principal
from shared.security.peer_credentials import (
    ServerPeerCredentials,
    SpawnedPeers,
    ipc_peer_credentials_supported,
)

DOMAIN = "replicas"
SOCKET_NAME = "replicas.sock"


def remove_stale_sockets(directory: Path, pattern: str) -> list[Path]:
    """Unix socket files in ``directory`` matching ``pattern`` that nothing listens on any more
    (a replica killed with its local scheduler leaves its five Jupyter sockets): removed, so the
    private directory does not fill up across crashes. One a live process still serves is kept."""
    removed = []
    for path in directory.glob(pattern):
        if not path.is_socket():
            continue
        with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as probe:
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:  # no listener: its process is gone
                path.unlink(missing_ok=True)
                removed.append(path)
            except OSError:
                continue
    return removed


def _principal(replica: ReplicaProcess) -> str:
    return replica_principal(replica.kernel_id, replica.replica_id)


class ReplicaLink:
    """The replica ROUTER of one local scheduler, bound by ``bind``."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        *,
        host_keys: curve.Keypair,
        handler: ServerHandler,
        authorize: Authorizer,
        name: str,
        state_dir: Path,
        default_ip: str,
    ) -> None:
        self._ctx = ctx
        self._host_keys = host_keys
        self._handler = handler
        self._authorize = authorize
        self._name = name
        self._state_dir = state_dir
        self._default_ip = default_ip
        self.peers = SpawnedPeers(os.getuid(), os.getpid())  # ipc: the processes spawned as replicas
        self._keys = curve.PeerDirectory()  # tcp: the keys minted for replicas
        self._authority: curve.CurveAuthority | None = None
        self._server: RpcServer | None = None
        self._made_dir: Path | None = None  # a temp dir of ours, removed on close
        self.socket_path: Path | None = None

    @property
    def server(self) -> RpcServer:
        assert self._server is not None, "ReplicaLink.bind first"
        return self._server

    def send(self, identity: bytes, env: Envelope) -> bool:
        return self.server.send(identity, env)

    @property
    def ipc(self) -> bool:
        return self.socket_path is not None

    def bind(self, address: str | None = None) -> str:
        """Bind ``address`` (``ipc://`` or ``tcp://``), by default an ipc socket of this host's
        state where the kernel reports peer pids, else a free TCP port of ``default_ip``."""
        if address is None:
            address = "ipc://" if ipc_peer_credentials_supported() else f"tcp://{self._default_ip}:0"
        self._authority = curve.CurveAuthority.acquire(self._ctx)
        if address.startswith("ipc://"):
            self._authority.serve_spawned(DOMAIN, self.peers)
            path = Path(address[len("ipc://") :]) if address != "ipc://" else self._default_socket()
            private_dir(path.parent)
            remove_stale_sockets(path.parent, "j*-*")  # replicas' Jupyter sockets left by a crash
            self._server = RpcServer(
                self._ctx,
                self._handler,
                name=self._name,
                peer_credentials=ServerPeerCredentials(DOMAIN),
                authorize=self._authorize,
            )
            bound = self._server.bind(f"ipc://{path}")
            os.chmod(path, 0o600)  # only this user can connect; ZAP then admits only replicas
            self.socket_path = path
            return bound
        self._authority.serve(DOMAIN, self._keys)
        self._server = RpcServer(
            self._ctx,
            self._handler,
            name=self._name,
            curve=curve.ServerCurve(self._host_keys, domain=DOMAIN),
            authorize=self._authorize,
        )
        return self._server.bind(address)

    def _default_socket(self) -> Path:
        path, self._made_dir = private_socket_path(self._state_dir / "link" / SOCKET_NAME, "tandem-link-")
        return path

    def prepare(self, replica: ReplicaProcess) -> None:
        """Before its launch: a tcp link mints the replica's keys (its environment carries them)."""
        if not self.ipc:
            replica.link_keys, replica.server_public = curve.new_keypair(), self._host_keys.public
            self._keys.allow(replica.link_keys.public, _principal(replica))

    def start_began(self) -> None:
        """A launch is under way: a handshake from a pid not known yet waits for ``spawned``."""
        self.peers.start_began()

    def start_ended(self) -> None:
        self.peers.start_ended()

    def spawned(self, replica: ReplicaProcess) -> None:
        """The replica's process exists (its pid is known, the process not yet reaped): admit it."""
        if self.ipc and replica.pid is not None:
            principal = _principal(replica)
            self.peers.allow(replica.pid, principal, replica.start_ticks)

    def exited(self, replica: ReplicaProcess) -> None:
        """The replica's process ended: its pid or key is admitted no more."""
        principal = _principal(replica)
        if replica.pid is not None:
            self.peers.forget(replica.pid, principal)
        if replica.link_keys is not None:
            self._keys.forget(replica.link_keys.public)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
        if self._authority is not None:
            self._authority.release()
            self._authority = None
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
        if self._made_dir is not None:
            shutil.rmtree(self._made_dir, ignore_errors=True)
