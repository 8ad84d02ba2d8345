"""One kernel replica process on this host, and the Jupyter client sockets that talk to it.

The replica runs in its own session (``start_new_session=True``) so an ipykernel interrupt's
``killpg`` never reaches the local scheduler, and so stopping it can signal its whole process
group: nothing it started outlives it. It is pinned at its start (``shared.process_signals``), so
neither that group signal nor any other ever reaches a process that got its number after it was
reaped. Its exit is noticed at once (we await the process), and the
local scheduler reports it to the global scheduler.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import structlog
import zmq
import zmq.asyncio
from jupyter_core.paths import secure_write

from shared.jupyter_wire import DELIMITER
from shared.kernel_launch import KernelLaunch
from shared.private_files import open_private_file, private_dir
from shared.process_signals import PinnedProcess
from shared.raft.tls import IDENTITY_ENV, MemberIdentity
from shared.security import curve
from shared.zmq_drain import DrainingSocket

if TYPE_CHECKING:
    from services.local_scheduler.runtime_template import ForkedProcess, RuntimeTemplate
    from services.local_scheduler.warm_pool import WarmRuntime

FrameSink = Callable[[str, list[bytes]], None]  # (channel, [sig, header, parent, metadata, content, ...])

REQUEST_CHANNELS = ("shell", "control", "stdin")
CHANNELS = (*REQUEST_CHANNELS, "iopub", "hb")
SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None
LOG_TAIL_BYTES = 4000


def raft_identity_json(raw: Any, kernel_id: str, replica_id: str) -> str | None:
    """The ``raft_identity`` of a ``replica.start``/``restart`` as the replica's environment
    carries it; ValueError if it is malformed or for another replica (None: none was sent)."""
    if raw is None:
        return None
    identity = MemberIdentity.from_wire(raw)
    if (identity.group, identity.member) != (kernel_id, replica_id):
        raise ValueError(
            f"raft_identity is for {identity.group}/{identity.member}, not {kernel_id}/{replica_id}"
        )
    return identity.to_json()


class ReplicaProcess:
    def __init__(
        self,
        *,
        host_id: str,
        kernel_id: str,
        replica_id: str,
        key: str,
        signature_scheme: str,
        resources: dict[str, Any],
        data_dir: Path,
        ip: str = "127.0.0.1",
        jupyter_ipc_dir: Path | None = None,
        raft_host: str | None = None,
        raft_identity: str | None = None,
        launch: KernelLaunch | None = None,
        working_dir: str | None = None,
    ) -> None:
        self.host_id = host_id
        self.kernel_id = kernel_id
        self.replica_id = replica_id
        self.key = key
        self.signature_scheme = signature_scheme
        self.resources = resources
        self.data_dir = data_dir.absolute()  # the replica starts in its kernel's working directory
        self.ip = ip
        # Where its Jupyter sockets are Unix sockets (a private 0700 directory: no other user can
        # connect, not even to read iopub); None: TCP on ``ip``, as where the link itself is TCP.
        self.jupyter_ipc_dir = jupyter_ipc_dir
        self.raft_host = raft_host  # the address its Raft listener binds and registers; None: cluster.ip
        # the kernel's working directory and variables (shared/kernel_launch.py); working_dir:
        # where this replica starts, None for this local scheduler's own directory
        self.launch = launch or KernelLaunch()
        self.working_dir = working_dir
        # its Raft TLS identity (shared/raft/tls.py, JSON), handed over in its environment only:
        # never argv (visible to every user), never on disk, never in describe()
        self.raft_identity = raft_identity
        self.connection_file = self.data_dir / "connection.json"
        self.log_file = self.data_dir / "replica.log"
        self.process: asyncio.subprocess.Process | ForkedProcess | None = None
        self._pin: PinnedProcess | None = None  # what its signals go through (None: nothing to signal)
        self.identity: bytes | None = None  # its DEALER identity on our replica ROUTER
        self.raft_address = ""
        self.role: str | None = None
        # its latest %tandem pin / unpin: (pinned, wall-clock time), for a restarted global scheduler
        self.pin: tuple[bool, float] | None = None
        self.registered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.stopping = False
        self.returncode: int | None = None
        # A restart in place (replica.restart): the same member of its Raft group, so its data dir
        # (Raft log, snapshots, Raft address) is kept rather than wiped as for a fresh replica.
        self.keep_data = False
        # the kernel's client sockets, drained by event-loop reader callbacks (shared.zmq_drain)
        self._sockets: dict[str, DrainingSocket] = {}
        self._watcher: asyncio.Task[None] | None = None
        self.log = structlog.get_logger("replica").bind(host=host_id, kernel=kernel_id, replica=replica_id)
        # on a tcp link to this local scheduler (replica_link.py): its CURVE keys and the local
        # scheduler's public key it must find there, handed over in its environment; None on ipc
        self.link_keys: curve.Keypair | None = None
        self.server_public = b""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def start_ticks(self) -> int | None:
        """Its process's start time (clock ticks since boot), which binds its pid on the replica
        link: as pinned (read while we, or for a fork the template, held it unreaped)."""
        return self._pin.start_ticks if self._pin is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.returncode is None

    def os_state(self) -> str:
        """Whether its process runs, as the OS says: ``running`` (on a CPU or waiting: user code
        holding the GIL is running), ``stopped`` (SIGSTOP, a tracer), or ``gone``. Read without
        the replica's help, so it answers when the replica's own threads cannot."""
        if not self.running or self.pid is None:
            return "gone"
        try:
            status = psutil.Process(self.pid).status()
        except psutil.Error:
            return "gone"
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return "stopped"
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return "gone"
        return "running"

    def describe(self) -> dict[str, Any]:
        """What ``host.register`` reports, enough for a restarted global scheduler to adopt it."""
        return {
            "kernel_id": self.kernel_id,
            "replica_id": self.replica_id,
            "pid": self.pid,
            "raft_address": self.raft_address,
            "role": self.role,
            "pin": list(self.pin) if self.pin is not None else None,
            "alive": self.running,
            "key": self.key,
            "signature_scheme": self.signature_scheme,
            "resources": self.resources,
            "launch": self.launch.to_wire(),
        }

    async def spawn(
        self,
        *,
        python: str,
        local_scheduler: str,
        config_json: str,
        join: bool,
        on_exit: Callable[[ReplicaProcess], None],
        on_spawned: Callable[[ReplicaProcess], None],
    ) -> None:
        """A cold start; ``on_spawned`` once its pid is known (it cannot connect before it runs
        Python's start-up and imports)."""
        self._prepare(join)
        args = self._replica_args(local_scheduler, config_json, join)
        argv = [python or sys.executable, "-m", "kernel_replica", *args]
        if SETPRIV is not None:
            # Linux: if this local scheduler is SIGKILLed, its replicas get SIGTERM instead of
            # living on unmanaged (setpriv execs, so the pid stays the replica's).
            argv = [SETPRIV, "--pdeathsig", "TERM", *argv]
        env = dict(os.environ)
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        env.update(self._replica_env())
        with open_private_file(self.log_file, "ab") as out:
            self.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=self.working_dir,
            )
        self._pin = PinnedProcess.of_child(self.process.pid)
        on_spawned(self)
        self.log.info("replica_spawned", pid=self.process.pid, cwd=self.working_dir)
        self._watcher = asyncio.ensure_future(self._watch(on_exit))

    async def adopt(
        self,
        runtime: WarmRuntime,
        *,
        local_scheduler: str,
        config_json: str,
        join: bool,
        on_exit: Callable[[ReplicaProcess], None],
        on_spawned: Callable[[ReplicaProcess], None],
    ) -> None:
        """Become a pre-warmed runtime of this host's pool (services/local_scheduler/warm_pool.py):
        the same launch arguments a cold spawn gets, handed to a process that already imported
        them (``on_spawned`` before: it connects as soon as it has them)."""
        self._prepare(join)
        self.process, self._pin = runtime.process, runtime.pin
        on_spawned(self)
        await runtime.assign(
            argv=self._replica_args(local_scheduler, config_json, join),
            env=self._replica_env(),
            log_file=self.log_file,
            cwd=self.working_dir,
        )
        self.log.info("replica_adopted_warm_runtime", pid=self.process.pid)
        self._watcher = asyncio.ensure_future(self._watch(on_exit))

    async def fork_from(
        self,
        template: RuntimeTemplate,
        *,
        imports: list[str],
        local_scheduler: str,
        config_json: str,
        join: bool,
        on_exit: Callable[[ReplicaProcess], None],
        on_spawned: Callable[[ReplicaProcess], None],
    ) -> None:
        """Become a runtime forked from this host's runtime template (runtime_template.py), the
        template having imported ``imports`` (a resumed kernel's modules) first; ``on_spawned``
        once the template said which pid it got."""
        self._prepare(join)
        assignment = {
            "argv": self._replica_args(local_scheduler, config_json, join),
            "env": self._replica_env(),
            "log_file": str(self.log_file),
            "cwd": self.working_dir,
        }
        self.process = await template.fork(assignment, imports)
        self._pin = self.process.pin
        on_spawned(self)
        self.log.info("replica_forked_from_template", pid=self.process.pid, imports=imports)
        self._watcher = asyncio.ensure_future(self._watch(on_exit))

    def _prepare(self, join: bool) -> None:
        if not join and not self.keep_data and self.data_dir.exists():
            # A fresh replica (a new kernel, or a restart under the same kernel id) must not
            # recover the Raft log of a previous incarnation that happened to use this path.
            shutil.rmtree(self.data_dir, ignore_errors=True)
        private_dir(self.data_dir)  # its Raft WAL holds the notebook's variables; its history, the code
        self._write_connection_file()

    def _replica_env(self) -> dict[str, str]:
        """The kernel's own variables, then Tandem's (which its variables cannot name)."""
        env = {
            **self.launch.env,
            "TANDEM_HOST_ID": self.host_id,
            "TANDEM_KERNEL_GPUS": str(int(self.resources.get("gpus", 0))),  # what it asks gpu.commit for
        }
        if self.link_keys is not None:
            env |= curve.link_env(self.link_keys, self.server_public)
        if self.raft_identity is not None:
            env[IDENTITY_ENV] = self.raft_identity
        return env

    def _replica_args(self, local_scheduler: str, config_json: str, join: bool) -> list[str]:
        """``python -m kernel_replica`` arguments (docs/protocol.md, kernel start step 3)."""
        argv = [
            "--kernel-id",
            self.kernel_id,
            "--replica-id",
            self.replica_id,
            "--connection-file",
            str(self.connection_file),
            "--local-scheduler",
            local_scheduler,
            "--data-dir",
            str(self.data_dir),
            "--config-json",
            config_json,
        ]
        if self.raft_host:
            argv += ["--raft-host", self.raft_host]
        if join:
            argv.append("--join")
        return argv

    def _write_connection_file(self) -> None:
        """The replica's connection file with every port 0: the replica binds each socket to a port
        the OS picks at bind time and ipykernel writes the actual ports back into this file before
        the replica registers (``connect`` reads them after ``replica.register``).

        Choosing the ports here instead (jupyter_client's ``write_connection_file`` binds port 0,
        reads the port and closes the socket) leaves a window between the release and the
        replica's bind in which any other process, or an outgoing connection's ephemeral source
        port, can take the port: the replica then dies with "Address already in use".
        """
        info: dict[str, Any] = {
            "ip": self.jupyter_ip,
            "transport": "tcp" if self.jupyter_ipc_dir is None else "ipc",
            "key": self.key,
            "signature_scheme": self.signature_scheme,
            "kernel_name": "tandem",
            **{f"{channel}_port": 0 for channel in CHANNELS},
        }
        self.connection_file.unlink(missing_ok=True)
        with secure_write(str(self.connection_file)) as f:  # it holds the kernel's HMAC key
            json.dump(info, f, indent=1)

    @property
    def jupyter_ip(self) -> str:
        """The connection file's ``ip``: an address, or for ipc the sockets' path prefix (ipykernel
        binds ``<prefix>-1``, ``<prefix>-2``, ...). Short, so it fits a socket path."""
        if self.jupyter_ipc_dir is None:
            return self.ip
        digest = hashlib.blake2b(f"{self.kernel_id}/{self.replica_id}".encode(), digest_size=5).hexdigest()
        return str(self.jupyter_ipc_dir / f"j{digest}")

    def _remove_jupyter_sockets(self) -> None:
        """ipykernel removes its socket files when it exits normally; a killed replica leaves them."""
        if self.jupyter_ipc_dir is not None:
            prefix = Path(self.jupyter_ip)
            for path in prefix.parent.glob(f"{prefix.name}-*"):
                path.unlink(missing_ok=True)

    async def _watch(self, on_exit: Callable[[ReplicaProcess], None]) -> None:
        assert self.process is not None
        self.returncode = await self.process.wait()
        if self._pin is not None:
            self._pin.reaped()
        self._kill_group(signal.SIGKILL)  # anything the replica started goes with it
        if self._pin is not None:
            self._pin.close()  # from now on nothing of it is signalled
        if not self.registered.done():
            self.registered.set_exception(
                RuntimeError(f"replica exited with {self.returncode} before registering: {self.log_tail()}")
            )
        self.close_sockets()
        self._remove_jupyter_sockets()
        on_exit(self)

    async def wait_exit(self) -> None:
        """Until the exit watcher has run (the exit is reported and the sockets are closed)."""
        if self._watcher is not None:
            await asyncio.shield(self._watcher)

    def log_tail(self) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - LOG_TAIL_BYTES, 0))
                return f.read().decode(errors="replace").strip()[-LOG_TAIL_BYTES:]
        except OSError:
            return ""

    # ---- Jupyter client sockets -------------------------------------------------------------

    def connect(self, ctx: zmq.asyncio.Context, sink: FrameSink) -> None:
        """shell/control/stdin DEALERs with one identity (stdin requests go to the shell's
        sender) and an iopub SUB, each with a reader forwarding frames to ``sink``."""
        info = json.loads(self.connection_file.read_text())
        transport, ip = info.get("transport", "tcp"), info["ip"]
        unbound = [channel for channel in CHANNELS if not info.get(f"{channel}_port")]
        if unbound:  # the replica registers only after ipykernel wrote its bound ports back
            raise RuntimeError(f"{self.connection_file} lacks the replica's bound ports for {unbound}")
        identity = f"tandem-{self.host_id}-{self.kernel_id}-{self.replica_id}".encode()
        for channel in (*REQUEST_CHANNELS, "iopub"):
            sock: zmq.Socket[bytes] = ctx.socket(
                zmq.SUB if channel == "iopub" else zmq.DEALER, socket_class=zmq.Socket
            )
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if channel == "iopub":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                sock.setsockopt(zmq.IDENTITY, identity)
            port = info[channel + "_port"]
            sock.connect(f"ipc://{ip}-{port}" if transport == "ipc" else f"{transport}://{ip}:{port}")
            drained = DrainingSocket(sock, self._reader(channel, sink), name=channel, logger=self.log)
            self._sockets[channel] = drained
            drained.start()

    def _reader(self, channel: str, sink: FrameSink) -> Callable[[list[bytes]], None]:
        delimiter = DELIMITER

        def on_replica_message(frames: list[bytes]) -> None:
            try:
                at = frames.index(delimiter)
            except ValueError:
                self.log.warning("frames_without_delimiter", channel=channel)
                return
            msg = frames[at + 1 :]
            if len(msg) < 5:
                self.log.warning("short_message", channel=channel, frames=len(msg))
                return
            try:
                sink(channel, msg)
            except Exception:
                self.log.exception("forward_failed", channel=channel)

        return on_replica_message

    def send(self, channel: str, frames: list[bytes]) -> bool:
        """Forward a client message ``[sig, header, parent, metadata, content, ...]`` to the replica."""
        sock = self._sockets.get(channel)
        if sock is None:
            return False
        try:
            sock.send_multipart([DELIMITER, *frames])
        except zmq.ZMQError as exc:
            self.log.warning("send_failed", channel=channel, error=str(exc))
            return False
        return True

    def close_sockets(self) -> None:
        for drained in self._sockets.values():
            drained.close(linger=0)
        self._sockets.clear()

    # ---- stopping ---------------------------------------------------------------------------

    async def stop(self, *, ask: Callable[[], None] | None, grace_s: float = 2.0) -> int | None:
        """Ask (``replica.stop``), then SIGTERM, then SIGKILL the process group, a grace apart."""
        self.stopping = True
        if self.process is None:
            return None
        if self.returncode is None and ask is not None:
            ask()
            if await self._wait(grace_s):
                return self.returncode
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.returncode is not None:
                break
            self.log.info("signalling_replica", signal=sig.name)
            self._kill_group(sig)
            if await self._wait(grace_s):
                break
        self._kill_group(signal.SIGKILL)
        return self.returncode

    async def _wait(self, timeout: float) -> bool:
        assert self.process is not None
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), timeout)
        except TimeoutError:
            return False
        self.returncode = self.process.returncode
        return True

    def _kill_group(self, sig: signal.Signals) -> None:
        if self._pin is not None:
            self._pin.signal_group(sig)
