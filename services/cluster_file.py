"""Finding a running cluster (``$TANDEM_STATE_DIR/cluster.json``) and asking it one question.

Shared by the provisioner and the CLI, which are short-lived clients: each question opens a DEALER,
waits for the answer with a deadline, and closes it, so nothing lingers in a Jupyter server's loop.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from shared import messages
from shared.envelope import Envelope
from shared.process_signals import read_stat
from shared.rpc import RpcClient
from shared.security import curve

CLUSTER_FILE = "cluster.json"


class ClusterNotRunning(RuntimeError):
    """No usable cluster.json, or the process that wrote it is gone; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    gateway: str
    scheduler: str
    pid: int
    path: Path
    raw: dict[str, Any]

    @property
    def pid_start(self) -> int | None:
        """``tandem up``'s start time (``/proc/<pid>/stat``), None for a cluster from before it."""
        start = self.raw.get("pid_start")
        return start if isinstance(start, int) else None

    @property
    def keys_dir(self) -> Path | None:
        """Where the cluster's keys are: ``cluster.json`` names it, or beside it. None for a
        cluster from before keys (no ``keys_dir`` and no ``keys/``): it is spoken to in the clear,
        which only a server that requires no keys accepts."""
        named = self.raw.get("keys_dir")
        if named:
            return Path(str(named))
        beside = self.path.parent / "keys"
        return beside if beside.exists() else None

    def operator_curve(self, server: str) -> curve.ClientCurve | None:
        """The operator's credentials towards ``server`` (``curve.GATEWAY`` or ``curve.SCHEDULER``):
        whoever can read the 0600 key files of this cluster may operate it, nobody else."""
        keys_dir = self.keys_dir
        return None if keys_dir is None else curve.client_curve(keys_dir, curve.OPERATOR, server)


def state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``explicit`` > ``$TANDEM_STATE_DIR`` > ``~/.tandem`` (the config default)."""
    chosen = explicit or os.environ.get("TANDEM_STATE_DIR") or "~/.tandem"
    return Path(os.path.expanduser(str(chosen)))


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` runs; with ``start_ticks`` (recorded beside it), whether it still is the
    process that was recorded, not one that got its number after it exited."""
    if start_ticks is not None and (stat := read_stat(pid)) is not None:
        return stat.start_ticks == start_ticks and stat.state != "Z"
    try:
        os.kill(pid, 0)  # a probe (no signal is sent), where /proc cannot say who it is
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_cluster(explicit_state_dir: str | os.PathLike[str] | None = None) -> ClusterInfo:
    path = state_dir(explicit_state_dir) / CLUSTER_FILE
    hint = "start one with `tandem up` (or set TANDEM_STATE_DIR to the state directory of a running cluster)"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterNotRunning(f"no Tandem cluster is running: {path} does not exist; {hint}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ClusterNotRunning(f"cannot read {path}: {exc}; {hint}") from exc
    try:
        info = ClusterInfo(str(raw["gateway"]), str(raw["scheduler"]), int(raw["pid"]), path, raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterNotRunning(f"{path} lacks gateway/scheduler/pid ({exc}); {hint}") from exc
    if not pid_alive(info.pid, info.pid_start):
        raise ClusterNotRunning(f"the cluster in {path} is not running (pid {info.pid} is gone); {hint}")
    return info


_shared_ctx: zmq.asyncio.Context | None = None


def _context() -> zmq.asyncio.Context:
    global _shared_ctx
    if _shared_ctx is None or _shared_ctx.closed:
        _shared_ctx = zmq.asyncio.Context()
    return _shared_ctx


async def ask(
    address: str,
    msg_type: str,
    body: dict[str, Any],
    *,
    credentials: curve.ClientCurve | None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """One request to a ROUTER service; returns the reply body, raises RpcError / RpcTimeout.
    ``credentials``: the operator's keys (``ClusterInfo.operator_curve``); a service refuses a
    client without them, which then sees only the timeout."""
    client = RpcClient(_context(), name=f"ask-{msg_type}", curve=credentials)
    client.connect(address)
    try:
        answer = await client.request(Envelope(msg_type, body), timeout=timeout)
    finally:
        await client.close()
    return answer.body


async def cluster_status(
    cluster: ClusterInfo, *, stopped: bool = False, timeout: float = 5.0
) -> dict[str, Any]:
    """What ``tandem status --json`` prints and the dashboard draws: the global scheduler's
    ``cluster.status`` (stopped kernels too with ``stopped``), and, for each of the arbiter, the
    serving controller and the checkpoint service the cluster runs, its status (under ``batch``,
    ``serving``, ``checkpoints``). Asked afresh each time: nobody keeps a copy."""
    scheduler_curve = cluster.operator_curve(curve.SCHEDULER)
    status = await ask(
        cluster.scheduler,
        messages.CLUSTER_STATUS,
        {"all": stopped},
        credentials=scheduler_curve,
        timeout=timeout,
    )
    services = (
        ("batch", "arbiter", curve.ARBITER, messages.ARBITER_STATUS),
        ("serving", "serving", curve.SERVING, messages.SERVING_STATUS),
        ("checkpoints", "checkpoint", curve.CHECKPOINT, messages.CHECKPOINT_STATUS),
    )
    for key, name, principal, msg_type in services:
        address = cluster.raw.get(name)
        if address:
            status[key] = await ask(
                str(address), msg_type, {}, credentials=cluster.operator_curve(principal), timeout=timeout
            )
    return status


def ask_sync(
    address: str,
    msg_type: str,
    body: dict[str, Any],
    *,
    credentials: curve.ClientCurve | None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """``ask`` for synchronous callers (the CLI)."""
    return asyncio.run(ask(address, msg_type, body, credentials=credentials, timeout=timeout))
