"""``tandem-provisioner``: jupyter_client's hook that makes a distributed kernel look local.

JupyterLab, nbclient, papermill and ``jupyter console`` start kernels through a KernelManager,
which asks its provisioner to "launch" and gets connection info back. Instead of spawning a
process we ask the gateway (found via ``cluster.json``) for a new distributed kernel and return the
gateway's five ports with the key the KernelManager generated. Process-like calls map onto the
gateway API: poll -> ``kernel.status``, SIGINT -> ``kernel.interrupt``, terminate/kill ->
``kernel.shutdown``.

With ``sessions_dir`` set (the Kernel Gateway API sets it), each kernel it starts is recorded
there, key included (0600), and forgotten when the kernel is shut down for good; a start for a
kernel id that has a record re-attaches to that kernel if the cluster still runs it, instead of
starting one: how the API, restarted after a crash, takes its kernels back.

A kernel that died for good (fewer than two replicas) is reported dead by ``poll`` and the
KernelManager's auto-restarter is told not to restart it: a silent restart would hand the user a
fresh, empty namespace that looks like the old kernel. An explicit restart still works.

Running this module directly is what the kernelspec's ``argv`` does when a Jupyter client is too
old to know provisioners; it explains that and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from traitlets import Bool, Float, Integer, Unicode

from services.cluster_file import ClusterNotRunning, ask, pid_alive, read_cluster
from shared import messages
from shared.host_address import address_host, is_wildcard
from shared.kernel_launch import KernelLaunch, from_client
from shared.private_files import private_dir, write_private
from shared.resources import Resources
from shared.rpc import RpcError, RpcTimeout
from shared.security import curve

RESOURCE_ENV = {
    "gpus": "TANDEM_GPUS",
    "millicpus": "TANDEM_MILLICPUS",
    "memory_mb": "TANDEM_MEMORY_MB",
    "vram_gb": "TANDEM_VRAM_GB",
}

DEAD_EXIT_CODE = 1
STOPPED_EXIT_CODE = 0
# Consecutive unanswered status questions before the kernel counts as gone (a busy gateway
# must not be mistaken for a dead kernel).
UNREACHABLE_POLLS_BEFORE_DEAD = 3
CONNECTION_FIELDS = ("transport", "ip", "shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def session_path(sessions_dir: str, kernel_id: str) -> Path:
    return Path(sessions_dir) / f"{kernel_id}.json"


def read_session(sessions_dir: str, kernel_id: str) -> dict[str, Any] | None:
    """The record of a kernel started through ``sessions_dir``'s owner, None when there is none
    (or it cannot be read: the kernel is then simply not re-attached)."""
    if not sessions_dir or not kernel_id:
        return None
    try:
        record = json.loads(session_path(sessions_dir, kernel_id).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("kernel_id") == kernel_id else None


def recorded_kernels(sessions_dir: str) -> list[str]:
    """The ids of the kernels recorded in ``sessions_dir``."""
    try:
        return sorted(path.stem for path in Path(sessions_dir).glob("*.json"))
    except OSError:
        return []


def forget_session(sessions_dir: str, kernel_id: str) -> None:
    if sessions_dir and kernel_id:
        with contextlib.suppress(OSError):
            session_path(sessions_dir, kernel_id).unlink()


class TandemConfigError(ValueError):
    """A resource request or environment variable that cannot be used."""


def resource_request(
    spec_config: dict[str, Any], environ: dict[str, str] | os._Environ[str] | None = None
) -> Resources:
    """Kernelspec provisioner config, overridden by TANDEM_* variables; bad values are refused."""
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {k: v for k, v in spec_config.items() if k in RESOURCE_ENV}
    for field, var in RESOURCE_ENV.items():
        text = environ.get(var)
        if text is None or text.strip() == "":
            continue
        try:
            raw[field] = float(text) if field == "vram_gb" else int(text)
        except ValueError:
            kind = "a number" if field == "vram_gb" else "a whole number"
            raise TandemConfigError(f"{var}={text!r}: must be {kind}") from None
    try:
        return Resources.from_dict(raw, what="Tandem kernel resource request")
    except ValueError as exc:
        raise TandemConfigError(str(exc)) from None


class TandemProvisioner(KernelProvisionerBase):  # type: ignore[misc]
    """See the module docstring."""

    gpus = Integer(1, config=True, help="GPUs the kernel binds while a cell runs")
    millicpus = Integer(1000, config=True, help="CPU request, 1000 = one vCPU")
    memory_mb = Integer(2048, config=True, help="memory request in MB")
    vram_gb = Float(8.0, config=True, help="GPU memory request in GB")
    start_timeout = Float(120.0, config=True, help="seconds to wait for the gateway to start the kernel")
    restart_dead_kernels = Bool(
        False, config=True, help="let jupyter_client auto-restart a kernel that died (loses its state)"
    )
    sessions_dir = Unicode(
        "",
        config=True,
        help="record each kernel started here (0600, with its key) and re-attach to a recorded kernel "
        "the cluster still runs when it is started again by id; empty: no records",
    )

    _launched: bool = False
    _exit_code: int | None = None
    _gateway: str = ""
    _keys_dir: str = ""
    _cluster_pid: int = 0
    _cluster_pid_start: int | None = None  # its start time: a pid reused since is not the cluster
    _unanswered_polls: int = 0
    _resources: dict[str, Any] = {}
    _dead_reason: str = ""
    _launch: KernelLaunch = KernelLaunch()
    _adopting: dict[str, Any] | None = None
    _launched_once: bool = False  # a restart (same provisioner) starts afresh, never re-attaches

    @property
    def has_process(self) -> bool:
        return self._launched

    # ---- launch ----------------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        try:
            cluster = read_cluster()
        except ClusterNotRunning as exc:
            raise RuntimeError(str(exc)) from None
        spec = {
            "gpus": self.gpus,
            "millicpus": self.millicpus,
            "memory_mb": self.memory_mb,
            "vram_gb": self.vram_gb,
        }
        try:
            self._resources = resource_request(spec).to_dict()
        except TandemConfigError as exc:
            raise RuntimeError(f"Tandem kernel: {exc}") from None
        self._gateway = cluster.gateway
        self._keys_dir = str(cluster.keys_dir or "")  # "": a cluster from before keys
        self._cluster_pid = cluster.pid
        self._cluster_pid_start = cluster.pid_start
        kwargs.pop("extra_arguments", None)
        kwargs = await super().pre_launch(**kwargs)
        # what a local kernel would get from Popen(cwd=..., env=...): its replicas start with it
        self._launch = from_client(kwargs.get("env"), kwargs.get("cwd"), os.environ, os.getcwd())
        kwargs["cmd"] = []  # nothing is spawned here; the cluster starts the replicas
        self._adopting = None if self._launched_once else read_session(self.sessions_dir, self.kernel_id)
        if self._adopting is not None:  # the kernel it started before: its launch, not this one's
            self._launch = KernelLaunch.from_wire(self._adopting.get("launch", {}))
            self._resources = dict(self._adopting.get("resources") or self._resources)
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        self._launched_once = True
        if self._adopting is not None:
            record, self._adopting = self._adopting, None
            return await self._reattach(record)
        session = self.parent.session if self.parent is not None else None
        key: bytes = session.key if session is not None else os.urandom(16).hex().encode()
        scheme: str = session.signature_scheme if session is not None else "hmac-sha256"
        body = {
            "kernel_id": self.kernel_id,
            "key": key.decode(),
            "signature_scheme": scheme,
            "resources": self._resources,
            "name": str(getattr(self.parent, "kernel_name", "") or ""),
            "launch": self._launch.to_wire(),
        }
        self.log.info(
            "Tandem: starting distributed kernel %s with %s in %s",
            self.kernel_id,
            self._resources,
            self._launch.cwd or "the hosts' default directory",
        )
        try:
            info = await self._ask(messages.KERNEL_START, body, timeout=self.start_timeout)
        except RpcError as exc:
            raise RuntimeError(f"Tandem could not start kernel {self.kernel_id}: {exc.reason}") from None
        except RpcTimeout:
            raise RuntimeError(
                f"Tandem gateway at {self._gateway} did not start kernel {self.kernel_id} within "
                f"{self.start_timeout:g}s; is `tandem up` healthy? (`tandem status`)"
            ) from None
        self._launched = True
        self._exit_code = None
        self._unanswered_polls = 0
        self._dead_reason = ""
        ip = str(info["ip"])
        if is_wildcard(ip):  # the gateway binds every interface: its kernels are where its API is
            ip = address_host(self._gateway)[0]
        self.connection_info = {
            "transport": info["transport"],
            "ip": ip,
            "shell_port": info["shell_port"],
            "iopub_port": info["iopub_port"],
            "stdin_port": info["stdin_port"],
            "control_port": info["control_port"],
            "hb_port": info["hb_port"],
            "key": key,
            "signature_scheme": scheme,
        }
        self._record_session()
        return self.connection_info

    def _record_session(self) -> None:
        """What re-attaching to this kernel needs, should this process die (``sessions_dir``)."""
        if not self.sessions_dir:
            return
        info = dict(self.connection_info)
        key = info.get("key", b"")
        record = {
            "kernel_id": self.kernel_id,
            "kernel_name": str(getattr(self.parent, "kernel_name", "") or ""),
            "connection": {k: info[k] for k in CONNECTION_FIELDS if k in info},
            "key": key.decode() if isinstance(key, bytes) else str(key),
            "signature_scheme": info.get("signature_scheme", "hmac-sha256"),
            "resources": self._resources,
            "launch": self._launch.to_wire(),
        }
        private_dir(self.sessions_dir, tighten=False)
        write_private(session_path(self.sessions_dir, self.kernel_id), json.dumps(record))

    async def _reattach(self, record: dict[str, Any]) -> KernelConnectionInfo:
        """The kernel ``record`` describes, if the cluster still runs it: its ports and key, as
        when this process started it; otherwise the record is dropped and the start fails."""
        try:
            status = await self._ask(messages.KERNEL_STATUS, {"kernel_id": self.kernel_id}, timeout=10.0)
        except (RpcError, RpcTimeout) as exc:
            status = {"state": "unknown", "reason": getattr(exc, "reason", str(exc))}
        if status.get("state") not in ("alive", "starting"):
            forget_session(self.sessions_dir, self.kernel_id)
            raise RuntimeError(
                f"Tandem kernel {self.kernel_id} is not running any more ({status.get('state')}: "
                f"{status.get('reason') or 'no reason given'}); not re-attached"
            )
        self._launched = True
        self._exit_code = None
        self._unanswered_polls = 0
        self._dead_reason = ""
        self.connection_info = {
            **record["connection"],
            "key": str(record["key"]).encode(),
            "signature_scheme": record.get("signature_scheme", "hmac-sha256"),
        }
        if self.parent is not None:
            # the crashed process's connection file (named after the kernel id) may still hold
            # these values: jupyter_client then takes them as loaded already, and they are not
            self.parent.load_connection_info(self.connection_info)
        self.log.info("Tandem: re-attached to running kernel %s", self.kernel_id)
        return self.connection_info

    async def _ask(self, msg_type: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """One request to the gateway, with the operator's key read from the cluster's 0600 files."""
        credentials = (
            curve.client_curve(Path(self._keys_dir), curve.OPERATOR, curve.GATEWAY)
            if self._keys_dir
            else None
        )
        return await ask(self._gateway, msg_type, body, credentials=credentials, timeout=timeout)

    # ---- process-like surface --------------------------------------------------------------

    async def poll(self) -> int | None:
        if not self._launched:
            return self._exit_code if self._exit_code is not None else STOPPED_EXIT_CODE
        if self._exit_code is not None:
            return self._exit_code
        if self._cluster_pid and not pid_alive(self._cluster_pid, self._cluster_pid_start):
            return self._died("the Tandem cluster (`tandem up`) is no longer running")
        try:
            status = await self._ask(messages.KERNEL_STATUS, {"kernel_id": self.kernel_id}, timeout=3.0)
        except RpcTimeout:
            self._unanswered_polls += 1
            if self._unanswered_polls >= UNREACHABLE_POLLS_BEFORE_DEAD:
                return self._died(f"the gateway at {self._gateway} stopped answering")
            return None
        except RpcError as exc:
            return self._died(exc.reason)
        self._unanswered_polls = 0
        state = status.get("state")
        if state == "dead":
            return self._died(str(status.get("reason") or "fewer than two replicas are alive"))
        if state == "stopped":
            self._exit_code = STOPPED_EXIT_CODE
            if status.get("stopped_by") in ("operator", "culler"):
                # `tandem kernel stop` or idle culling: restarting it would undo the decision
                self.log.warning("Tandem kernel %s was stopped: %s", self.kernel_id, status.get("reason"))
                self._no_auto_restart()
            return self._exit_code
        return None

    def _died(self, reason: str) -> int:
        self._exit_code = DEAD_EXIT_CODE
        if self._dead_reason != reason:
            self._dead_reason = reason
            self.log.error("Tandem kernel %s is dead: %s", self.kernel_id, reason)
        if not self.restart_dead_kernels:
            self._no_auto_restart()  # report "dead" instead of restarting into an empty kernel
        return self._exit_code

    def _no_auto_restart(self) -> None:
        restarter = getattr(self.parent, "_restarter", None)
        if restarter is not None and hasattr(restarter, "restart_limit"):
            restarter.restart_limit = 0

    async def wait(self) -> int | None:
        while (code := await self.poll()) is None:
            await asyncio.sleep(0.1)
        self._launched = False
        return code

    async def send_signal(self, signum: int) -> None:
        if not self._launched or signum == 0:
            return
        if signum == signal.SIGINT:
            try:
                await self._ask(messages.KERNEL_INTERRUPT, {"kernel_id": self.kernel_id}, timeout=5.0)
            except (RpcError, RpcTimeout) as exc:
                self.log.warning("Tandem: interrupt of %s failed: %s", self.kernel_id, exc)
        elif signum in (signal.SIGTERM, signal.SIGKILL):
            await self._shutdown(restart=True)  # the ports are released by cleanup(restart=False)
        else:
            self.log.warning("Tandem: signal %s has no meaning for a distributed kernel; ignored", signum)

    async def shutdown_requested(self, restart: bool = False) -> None:
        """The client sent shutdown_request on control; stop the replicas now rather than after a grace period."""
        await self._shutdown(restart=restart)

    async def terminate(self, restart: bool = False) -> None:
        await self._shutdown(restart=True)

    async def kill(self, restart: bool = False) -> None:
        """Stop the replicas but keep the kernel's ports: jupyter_client's ``restart_kernel(now=True)``
        calls ``kill(restart=False)`` and only then ``cleanup(restart=True)``, so ``restart`` here
        cannot tell a restart from a final stop. ``cleanup(restart=False)`` releases the ports."""
        await self._shutdown(restart=True)

    async def cleanup(self, restart: bool = False) -> None:
        if self._launched and self._exit_code is None:
            await self._shutdown(restart=restart)
        if not restart:
            # Releases the gateway's sockets if only a restart-shutdown happened; an error means
            # already forgotten or the cluster is gone: nothing left to release either way.
            with contextlib.suppress(RpcError, RpcTimeout):
                await self._ask(messages.KERNEL_SHUTDOWN, {"kernel_id": self.kernel_id}, timeout=5.0)
            forget_session(self.sessions_dir, self.kernel_id)
        self._launched = False

    async def _shutdown(self, *, restart: bool) -> None:
        if not self._gateway or self._exit_code == STOPPED_EXIT_CODE:
            return
        try:
            await self._ask(
                messages.KERNEL_SHUTDOWN,
                {"kernel_id": self.kernel_id, "restart": restart},
                timeout=15.0,
            )
        except RpcError as exc:
            self.log.info("Tandem: shutdown of %s: %s", self.kernel_id, exc.reason)
        except RpcTimeout:
            self.log.warning("Tandem: gateway did not confirm shutdown of %s", self.kernel_id)
        self._exit_code = STOPPED_EXIT_CODE

    # ---- persistence -----------------------------------------------------------------------

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update(
            gateway=self._gateway,
            keys_dir=self._keys_dir,
            cluster_pid=self._cluster_pid,
            cluster_pid_start=self._cluster_pid_start,
            resources=self._resources,
        )
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self._gateway = provisioner_info.get("gateway", "")
        self._keys_dir = provisioner_info.get("keys_dir", "")
        self._cluster_pid = int(provisioner_info.get("cluster_pid", 0))
        start = provisioner_info.get("cluster_pid_start")
        self._cluster_pid_start = start if isinstance(start, int) else None
        self._resources = dict(provisioner_info.get("resources", {}))
        self._launched = True

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        return max(recommended, 10.0)


def main() -> int:
    print(
        "The 'tandem' kernelspec needs a Jupyter client with kernel provisioners (jupyter_client >= 7) "
        "and the tandem package installed; it cannot be started as a plain process.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
