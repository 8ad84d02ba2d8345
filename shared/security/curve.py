"""CurveZMQ keys and peer authentication for the service links (gateway, schedulers, replicas),
and the ZAP handler that also admits a local scheduler's ipc replicas by their kernel-reported
credentials (``shared.security.peer_credentials``).

Why CurveZMQ: every service link is ZMQ already, and CURVE gives each one mutual authentication
and encryption with no extra transport; pyzmq ships the keypair files (``zmq.auth``) and the ZAP
authenticator, so nothing here implements cryptography.

Keys live in one directory per cluster (``security.keys_dir``, default ``<state_dir>/keys``;
mode 0700, every file 0600), one pair per principal in pyzmq's certificate format:

- ``scheduler``: the global scheduler's server key;
- ``gateway``: the gateway (server of the lifecycle API, client of the scheduler);
- ``operator``: the CLI and the Jupyter provisioner (client of the gateway and the scheduler);
- ``arbiter``: the arbiter's server key (best-effort jobs' leases; hosts and the operator are its clients);
- ``serving``: the serving controller's server key (warm runtimes; hosts, the scheduler and the
  operator are its clients);
- ``checkpoint``: the checkpoint service's server key (jobs' images; hosts relay, the operator asks);
- ``host.<host_id>``: one local scheduler; a host registers only with the key issued for its id.

A server learns who a peer is from the key it proved, never from what the peer says: the ZAP
handler maps the client's public key to its principal name, which ZMQ attaches to every message
from that connection (the ``User-Id`` property), and each service authorises message types and
the ids in their bodies against it.

**A service's ipc endpoint** (the global scheduler's, in the embedded cluster, where every service
runs on one machine as one user): a Unix socket in a 0700 directory, so only that user's processes
reach it (the filesystem authenticates the server to its clients, as CURVE's server key does on
TCP), and its bytes only cross kernel buffers, so CURVE's encryption would protect nothing there.
A client proves its principal with ZMQ's PLAIN mechanism instead: user name = principal,
password = ``ipc_password``, derived from the principal's secret key, which the ZAP handler
re-derives from the key directory (so only a server that holds that secret, on the same machine,
can check it). PLAIN's password in the clear is safe only because the channel is a local socket
no other user can open: the same password on TCP would not be, so only ``ipc://`` endpoints
speak PLAIN, and only ``tcp://`` ones CURVE.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from shared.private_files import private_dir
from shared.process_signals import read_stat
from shared.security.peer_credentials import (
    PENDING_WAIT_S,
    Admit,
    Refuse,
    SpawnedPeers,
)

log = structlog.get_logger("security")

SCHEDULER = "scheduler"
GATEWAY = "gateway"
OPERATOR = "operator"
ARBITER = "arbiter"
SERVING = "serving"
CHECKPOINT = "checkpoint"
HOST_PREFIX = "host."
CLUSTER_PRINCIPALS = (SCHEDULER, GATEWAY, OPERATOR, ARBITER, SERVING, CHECKPOINT)


class KeyError_(RuntimeError):
    """A key file is missing or unreadable; the message says which and how to issue it."""


def host_principal(host_id: str) -> str:
    return f"{HOST_PREFIX}{host_id}"


def host_of(principal: str) -> str | None:
    """The host id a ``host.<id>`` principal speaks for, else None."""
    return principal[len(HOST_PREFIX) :] if principal.startswith(HOST_PREFIX) else None


@dataclass(frozen=True, slots=True)
class Keypair:
    """z85-encoded CURVE keys (40 ASCII bytes each); ``secret`` is None for a peer's public key."""

    public: bytes
    secret: bytes | None = None


@dataclass(frozen=True, slots=True)
class ServerCurve:
    """What a ROUTER needs to be a CURVE server: its keypair and the ZAP domain it answers in."""

    keys: Keypair
    domain: str

    def apply(self, sock: zmq.Socket[Any]) -> None:
        assert self.keys.secret is not None, "a CURVE server needs its secret key"
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = self.domain.encode()
        # no ZAP handler running (not started yet, or stopped) refuses every peer, never admits all
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.curve_server = True

    def bind(self, sock: zmq.Socket[Any], address: str) -> None:
        """Bind ``address``: an ``ipc://`` endpoint speaks PLAIN (module docstring), checked by
        the same ZAP domain; ZMQ takes a socket's security options per endpoint, at bind."""
        if not address.startswith("ipc://"):
            sock.curve_server = True  # (after an ipc endpoint's PLAIN)
            sock.bind(address)
            return
        sock.plain_server = True
        sock.bind(address)
        os.chmod(address[len("ipc://") :], 0o600)  # its directory is 0700 already


@dataclass(frozen=True, slots=True)
class ClientCurve:
    """What a DEALER needs to reach a CURVE server: its own keypair and the server's public key;
    ``principal``, the name its keys were issued to, for a server's ipc endpoint (PLAIN)."""

    keys: Keypair
    server_public: bytes
    principal: str = ""

    def apply(self, sock: zmq.Socket[Any]) -> None:
        assert self.keys.secret is not None, "a CURVE client needs its secret key"
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_serverkey = self.server_public

    def connect(self, sock: zmq.Socket[Any], address: str) -> None:
        """Connect to ``address``: PLAIN with ``ipc_password`` on an ``ipc://`` endpoint, CURVE
        on any other (ZMQ takes a socket's security options per connection, at connect)."""
        if not address.startswith("ipc://"):
            self.apply(sock)
            sock.connect(address)
            return
        if not self.principal:
            raise ValueError(f"{address}: an ipc endpoint needs the client's principal name")
        sock.plain_username = self.principal.encode()
        sock.plain_password = ipc_password(self.keys, self.principal)
        sock.connect(address)


_IPC_PASSWORD_CONTEXT = b"tandem service ipc PLAIN password v1\0"


def ipc_password(keys: Keypair, principal: str) -> bytes:
    """The PLAIN password ``principal`` proves itself with on a service's ipc endpoint: an HMAC of
    its name under its secret key (nothing more to issue, store or rotate)."""
    assert keys.secret is not None, "only a holder of the secret key can derive the password"
    mac = hmac.new(keys.secret, _IPC_PASSWORD_CONTEXT + principal.encode(), hashlib.sha256)
    return mac.hexdigest().encode("ascii")


def new_keypair() -> Keypair:
    public, secret = zmq.curve_keypair()
    return Keypair(public, secret)


# ---- the key directory -----------------------------------------------------------------------


@contextlib.contextmanager
def _locked(keys_dir: Path) -> Iterator[None]:
    """Serialise issuers (``tandem up``, the scheduler's host provider, ``tandem keys``)."""
    with open(keys_dir / ".lock", "a") as handle:
        os.chmod(keys_dir / ".lock", 0o600)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _paths(keys_dir: Path, name: str) -> tuple[Path, Path]:
    return keys_dir / f"{name}.key", keys_dir / f"{name}.key_secret"


def issue(keys_dir: Path, name: str) -> Keypair:
    """The keypair of ``name``, created (atomically, files 0600) if the directory lacks it."""
    private_dir(keys_dir)
    public_path, secret_path = _paths(keys_dir, name)
    with _locked(keys_dir):
        if not secret_path.exists():
            with tempfile.TemporaryDirectory(dir=keys_dir, prefix=".issue-") as scratch:
                made_public, made_secret = zmq.auth.create_certificates(scratch, name)
                for made in (made_public, made_secret):
                    os.chmod(made, 0o600)
                os.replace(made_public, public_path)
                os.replace(made_secret, secret_path)
            log.info("key_issued", principal=name, keys_dir=str(keys_dir))
    return load(keys_dir, name)


def rotate(keys_dir: Path, name: str) -> Keypair:
    """New keys for ``name``; the old ones stop working where the new public key is loaded (a
    server re-reads the directory for an unknown key; a client must be restarted with the new
    secret)."""
    public_path, secret_path = _paths(keys_dir, name)
    with _locked(private_dir(keys_dir)):
        public_path.unlink(missing_ok=True)
        secret_path.unlink(missing_ok=True)
    return issue(keys_dir, name)


def principals(keys_dir: Path) -> list[tuple[str, bool]]:
    """Every principal with a key in ``keys_dir``, and whether its secret is here."""
    names = sorted(path.name[: -len(".key")] for path in keys_dir.glob("*.key"))
    return [(name, _paths(keys_dir, name)[1].exists()) for name in names]


def ensure_cluster_keys(keys_dir: Path) -> None:
    """The scheduler's, gateway's, operator's, arbiter's and serving controller's keys (idempotent)."""
    for name in CLUSTER_PRINCIPALS:
        issue(keys_dir, name)


def issue_hint(name: str) -> str:
    host = host_of(name)
    return f"`tandem keys host {host}`" if host is not None else "`tandem keys init`"


def load(keys_dir: Path, name: str) -> Keypair:
    """``name``'s keypair from ``keys_dir``; the secret only where its ``.key_secret`` file is."""
    public_path, secret_path = _paths(keys_dir, name)
    path = secret_path if secret_path.exists() else public_path
    if not path.exists():
        raise KeyError_(
            f"no key for {name!r} in {keys_dir}: issue one with {issue_hint(name)} (on the operator's "
            "machine) and copy it to the machine that needs it (README, Security)"
        )
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyError_(f"the key file {path} cannot be used: {exc}") from None
    return Keypair(public, secret)


def load_secret(keys_dir: Path, name: str) -> Keypair:
    keys = load(keys_dir, name)
    if keys.secret is None:
        raise KeyError_(
            f"{keys_dir} holds only the public key of {name!r}; this process needs its secret key"
        )
    return keys


def server_curve(keys_dir: Path, name: str) -> ServerCurve:
    return ServerCurve(load_secret(keys_dir, name), domain=name)


def client_curve(keys_dir: Path, name: str, server: str) -> ClientCurve:
    return ClientCurve(load_secret(keys_dir, name), load(keys_dir, server).public, name)


# A replica's keys on a tcp link to its local scheduler (where the OS reports no peer pid, so the
# link cannot be ipc: services/local_scheduler/replica_link.py) travel in its environment
# (readable only by its own user, unlike its command line), never in a file.
LINK_ENV = ("TANDEM_LINK_PUBLIC", "TANDEM_LINK_SECRET", "TANDEM_LINK_SERVER")


def link_env(keys: Keypair, server_public: bytes) -> dict[str, str]:
    assert keys.secret is not None
    values = (keys.public, keys.secret, server_public)
    return {name: value.decode("ascii") for name, value in zip(LINK_ENV, values, strict=True)}


def link_curve_from_env(environ: dict[str, str] | None = None) -> ClientCurve | None:
    """The replica's side of ``link_env``, removed from the environment so that the user's code,
    which runs in the replica, does not find the key lying in ``os.environ``; None when absent
    (a replica started by hand or by a test against an unauthenticated server)."""
    source = os.environ if environ is None else environ
    values = [source.pop(name, "") for name in LINK_ENV]
    if not all(values):
        return None
    public, secret, server = (value.encode("ascii") for value in values)
    return ClientCurve(Keypair(public, secret), server)


# ---- who may connect -------------------------------------------------------------------------


class PeerDirectory:
    """Public key -> principal name: the keys in a directory, plus keys allowed at run time
    (a local scheduler's per-replica keys). Unknown keys are refused."""

    def __init__(self, keys_dir: Path | None = None, *, exclude: tuple[str, ...] = ()) -> None:
        self._keys_dir = keys_dir
        self._exclude = exclude
        self._from_files: dict[bytes, str] = {}
        self._at_run_time: dict[bytes, str] = {}
        self._loaded_version: tuple[int, int] | None = None
        if keys_dir is not None:
            self._reload_if_changed()

    def _reload_if_changed(self) -> None:
        """Issuing, rotating or removing a key renames files in the directory, which changes its
        mtime: one ``stat`` per handshake tells whether to read the files again."""
        assert self._keys_dir is not None
        try:
            st = self._keys_dir.stat()
        except OSError:
            return
        version = (st.st_mtime_ns, st.st_ino)
        if version == self._loaded_version:
            return
        self._loaded_version = version
        found: dict[bytes, str] = {}
        for path in self._keys_dir.glob("*.key"):
            name = path.name[: -len(".key")]
            if name in self._exclude:
                continue
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError):
                continue
            if public:
                found[public] = name
        self._from_files = found

    def ipc_password_of(self, name: str) -> bytes | None:
        """The ipc PLAIN password of ``name``, re-derived from its secret key in the directory;
        None for a name the directory does not list (never a path built from what a peer
        claimed) or whose secret is not on this machine."""
        if self._keys_dir is None or name in self._exclude:
            return None
        self._reload_if_changed()
        if name not in self._from_files.values():
            return None
        try:
            keys = load_secret(self._keys_dir, name)
        except KeyError_:
            return None
        return ipc_password(keys, name)

    def name_of(self, public_z85: bytes) -> str | None:
        """Looked up at each handshake, against the key files as they are now: a host key issued
        after the server started is admitted at once (ZMQ does not retry a refused handshake),
        and a key rotated away is refused from its next connection on."""
        if self._keys_dir is not None:
            self._reload_if_changed()
        return self._at_run_time.get(public_z85) or self._from_files.get(public_z85)

    def allow(self, public_z85: bytes, name: str) -> None:
        self._at_run_time[public_z85] = name

    def forget(self, public_z85: bytes) -> None:
        self._at_run_time.pop(public_z85, None)


class _Authenticator(ThreadAuthenticator):
    """ZAP in a thread: a CURVE client is admitted only if its key is in the domain's directory,
    and its User-Id is the principal name that key was issued to. A NULL (unencrypted) client is
    admitted only to a domain of spawned peers (an ``ipc://`` replica link), by the credentials
    the kernel reported for it (``shared.security.peer_credentials``), as the replica it was
    spawned as; never elsewhere (pyzmq's default admits every NULL client). A PLAIN client (only
    a service's ipc endpoint speaks PLAIN) is admitted with its principal's ``ipc_password``."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        super().__init__(ctx, log=None)
        self.directories: dict[str, PeerDirectory] = {}
        self.spawned: dict[str, SpawnedPeers] = {}
        self.refused = 0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 6 or msg[5] != b"NULL":
            await super().handle_zap_message(msg)
            return
        version, request_id, domain_raw, address_raw = msg[:4]
        domain, address = domain_raw.decode(errors="replace"), address_raw.decode(errors="replace")
        if version != b"1.0":
            self._send_zap_reply(request_id, b"400", b"Invalid version")
            return
        peers = self.spawned.get(domain)
        if peers is None:
            self._refuse(request_id, domain, "a peer without CURVE keys, on a link that needs them")
            return
        deadline = time.monotonic() + PENDING_WAIT_S
        decision = peers.decide(address, read_stat)
        while not isinstance(decision, Admit | Refuse) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # a start under way: its launcher is about to name its pid
            decision = peers.decide(address, read_stat)
        if isinstance(decision, Admit):
            self._send_zap_reply(request_id, b"200", b"OK", decision.principal)
        else:
            self._refuse(request_id, domain, decision.reason, peer=address)

    def _refuse(self, request_id: bytes, domain: str, reason: str, **context: str) -> None:
        self.refused += 1
        log.warning("peer_refused", domain=domain, reason=reason, **context)
        self._send_zap_reply(request_id, b"400", reason.encode()[:200])

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        """An ipc endpoint's client (only ipc endpoints speak PLAIN): its password must be the one
        its principal's secret key derives; its User-Id is then that principal."""
        directory = self.directories.get(domain)
        if directory is None:
            self.refused += 1
            log.warning("peer_refused", domain=domain, reason="unknown ZAP domain")
            return False, b"Unknown domain"
        expected = directory.ipc_password_of(username)
        if expected is None or not hmac.compare_digest(expected, password.encode("utf-8", "replace")):
            self.refused += 1
            log.warning(
                "peer_refused", domain=domain, reason="ipc credentials not issued by this cluster",
                principal=username[:80],
            )  # fmt: skip
            return False, b"Unknown credentials"
        return True, b"OK"

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        directory = self.directories.get(domain)
        if directory is None:
            self.refused += 1
            log.warning("peer_refused", domain=domain, reason="unknown ZAP domain")
            return False, b"Unknown domain"
        if directory.name_of(z85.encode(client_key)) is None:
            self.refused += 1
            log.warning("peer_refused", domain=domain, reason="key not issued by this cluster")
            return False, b"Unknown key"
        return True, b"OK"

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        for directory in self.directories.values():
            name = directory.name_of(key)
            if name is not None:
                return name
        return ""


class CurveAuthority:
    """The ZAP handler of one ZMQ context, shared by every server of that context (ZMQ allows
    one per context). ``acquire`` / ``release`` in pairs; the last ``release`` stops the
    handler's thread, which must happen before the context is destroyed (the thread owns a
    socket of it)."""

    _of_context: dict[int, CurveAuthority] = {}

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self._ctx = ctx
        self._auth = _Authenticator(ctx)
        self._auth.start()
        self._users = 0

    @classmethod
    def acquire(cls, ctx: zmq.Context[Any]) -> CurveAuthority:
        authority = cls._of_context.get(id(ctx))
        if authority is None or authority._ctx is not ctx:
            authority = cls._of_context[id(ctx)] = cls(ctx)
        authority._users += 1
        return authority

    @classmethod
    def for_cluster_server(cls, ctx: zmq.Context[Any], keys_dir: Path, name: str) -> CurveAuthority:
        """The authority of a cluster service whose server key is ``name``: every other key in
        ``keys_dir`` may connect to it (the service's own authorization decides what each may send)."""
        authority = cls.acquire(ctx)
        authority.serve(name, PeerDirectory(keys_dir, exclude=(name,)))
        return authority

    def serve(self, domain: str, directory: PeerDirectory) -> None:
        """Admit to servers of ``domain`` the clients whose keys ``directory`` knows."""
        self._auth.directories[domain] = directory

    def serve_spawned(self, domain: str, peers: SpawnedPeers) -> None:
        """Admit to (``ipc://``, unencrypted) servers of ``domain`` the processes ``peers`` knows."""
        self._auth.spawned[domain] = peers

    @property
    def refused(self) -> int:
        return self._auth.refused

    def release(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        if self._of_context.get(id(self._ctx)) is self:
            del self._of_context[id(self._ctx)]
        if self._auth.is_alive():
            self._auth.stop()
