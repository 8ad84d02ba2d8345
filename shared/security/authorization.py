"""Who may send what to whom: the message types each principal may send to each server, and the
ids in a body that must be the sender's own.

Pure: the services call ``refusal`` with the principal the connection's key proved (see
``shared.security.curve``) and a lookup of where a replica runs; the answer is None or the reason
the message is refused, logged and returned to the sender as an ``unauthorized`` error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared import messages
from shared.security.curve import GATEWAY, OPERATOR, SCHEDULER, host_of

HOST = "host"  # role of every ``host.<id>`` principal
# a replica on its local scheduler's link, ``replica.<kernel>/<replica>``: the pid it was spawned
# with (ipc, shared.security.peer_credentials) or the key minted for it (tcp)
REPLICA_PREFIX = "replica."
REPLICA = "replica"

_KERNEL_LIFECYCLE = {
    messages.KERNEL_START,
    messages.KERNEL_SHUTDOWN,
    messages.KERNEL_STATUS,
    messages.KERNEL_INTERRUPT,
}
_ANSWERS = {messages.REPLY, messages.ERROR}
_OPERATIONS = {
    messages.CLUSTER_STATUS,
    messages.HOST_CORDON,
    messages.HOST_UNCORDON,
    messages.HOST_DRAIN,
    messages.REPLICA_RESTART,
}

# server -> role -> message types it accepts from that role
SCHEDULER_ACCEPTS: dict[str, frozenset[str]] = {
    GATEWAY: frozenset(
        _KERNEL_LIFECYCLE
        | {
            messages.JUPYTER_REQUEST,
            messages.CLUSTER_STATUS,
            messages.KERNEL_HIBERNATE,
            messages.KERNEL_RESUME,
        }
    ),
    OPERATOR: frozenset(_OPERATIONS | _KERNEL_LIFECYCLE),  # the cluster's administrator
    HOST: frozenset(
        _ANSWERS
        | {
            messages.HOST_REGISTER,
            messages.HOST_HEARTBEAT,
            messages.JUPYTER_REPLY,
            messages.REPLICA_EVENT,
            messages.BATCH,  # each item is then authorised on its own (shared.rpc)
        }
    ),
}
GATEWAY_ACCEPTS: dict[str, frozenset[str]] = {
    OPERATOR: frozenset(_KERNEL_LIFECYCLE | {messages.KERNEL_LIST, messages.KERNEL_HIBERNATE})
}
LOCAL_SCHEDULER_ACCEPTS: dict[str, frozenset[str]] = {
    REPLICA: frozenset(
        _ANSWERS
        | {messages.REPLICA_REGISTER, messages.GPU_COMMIT, messages.GPU_RELEASE, messages.REPLICA_EVENT}
    ),
}

_JOB_OPERATIONS = {
    messages.JOB_SUBMIT,
    messages.JOB_LIST,
    messages.JOB_SHOW,
    messages.JOB_LOGS,
    messages.JOB_CANCEL,
    messages.ARBITER_STATUS,
}
ARBITER_ACCEPTS: dict[str, frozenset[str]] = {
    OPERATOR: frozenset(_JOB_OPERATIONS),
    HOST: frozenset(_ANSWERS | {messages.AGENT_REPORT}),
}

SERVING_ACCEPTS: dict[str, frozenset[str]] = {
    HOST: frozenset({messages.POOL_REPORT}),
    SCHEDULER: frozenset({messages.RUNTIME_ACQUIRE, messages.SERVING_STATUS}),
    OPERATOR: frozenset({messages.SERVING_STATUS}),
}

CHECKPOINT_ACCEPTS: dict[str, frozenset[str]] = {
    # a host relays what its jobs' agents committed, asks for the image a job restarts from, and
    # forgets the images of a job that finished or was cancelled on it; when a job's process has
    # exited, it hands over what its agent stored (the packs of a capture killed mid-way)
    HOST: frozenset(
        _ANSWERS
        | {
            messages.CHECKPOINT_COMMIT,
            messages.CHECKPOINT_LATEST,
            messages.CHECKPOINT_FORGET,
            messages.CHECKPOINT_WRITTEN,  # what a job that died mid-capture had stored
        }
    ),
    OPERATOR: frozenset({messages.CHECKPOINT_LATEST, messages.CHECKPOINT_FORGET, messages.CHECKPOINT_STATUS}),
}

# (kernel_id, replica_id) -> the host it runs on, or None if the scheduler knows no such replica
ReplicaHost = Callable[[str, str], str | None]


def replica_principal(kernel_id: str, replica_id: str) -> str:
    return f"{REPLICA_PREFIX}{kernel_id}/{replica_id}"


def role_of(principal: str) -> str:
    if host_of(principal) is not None:
        return HOST
    if principal.startswith(REPLICA_PREFIX):
        return REPLICA
    return principal


def _type_refusal(table: dict[str, frozenset[str]], principal: str, env_type: str) -> str | None:
    if not principal:
        return "unauthenticated peer"
    allowed = table.get(role_of(principal))
    if allowed is None or env_type not in allowed:
        return f"{principal} may not send {env_type}"
    return None


def scheduler_refusal(principal: str, env_type: str, body: dict[str, Any], where: ReplicaHost) -> str | None:
    """Why the global scheduler refuses this message, or None.

    A host speaks only for itself: its registration and heartbeats carry its own id, and the
    replica events and Jupyter replies it relays are of replicas the scheduler placed on it."""
    refusal = _type_refusal(SCHEDULER_ACCEPTS, principal, env_type)
    if refusal is not None:
        return refusal
    host = host_of(principal)
    if host is None:
        return None
    if env_type in (messages.HOST_REGISTER, messages.HOST_HEARTBEAT):
        if body.get("host_id") != host:
            return f"{principal} may not speak for host {body.get('host_id')!r}"
    elif env_type in (messages.REPLICA_EVENT, messages.JUPYTER_REPLY):
        kernel_id, replica_id = body.get("kernel_id"), body.get("replica_id")
        if isinstance(kernel_id, str) and isinstance(replica_id, str):
            placed = where(kernel_id, replica_id)
            if placed is not None and placed != host:
                return f"{principal} relayed a message of {kernel_id}/{replica_id}, which runs on {placed}"
    return None


def gateway_refusal(principal: str, env_type: str) -> str | None:
    return _type_refusal(GATEWAY_ACCEPTS, principal, env_type)


def local_scheduler_refusal(principal: str, env_type: str, body: dict[str, Any]) -> str | None:
    """A replica speaks only for itself (its own kernel and replica ids)."""
    refusal = _type_refusal(LOCAL_SCHEDULER_ACCEPTS, principal, env_type)
    if refusal is not None:
        return refusal
    if env_type in _ANSWERS:
        return None
    own = principal[len(REPLICA_PREFIX) :]
    claimed = f"{body.get('kernel_id')}/{body.get('replica_id')}"
    if claimed != own:
        return f"{principal} may not speak for replica {claimed}"
    return None


def serving_refusal(principal: str, env_type: str, body: dict[str, Any]) -> str | None:
    """A host reports only its own pool; only the scheduler asks for runtimes."""
    return _host_report_refusal(SERVING_ACCEPTS, messages.POOL_REPORT, principal, env_type, body)


def arbiter_refusal(principal: str, env_type: str, body: dict[str, Any]) -> str | None:
    """A host reports only for itself; only the operator submits and cancels jobs."""
    return _host_report_refusal(ARBITER_ACCEPTS, messages.AGENT_REPORT, principal, env_type, body)


def _host_report_refusal(
    table: dict[str, frozenset[str]], report: str, principal: str, env_type: str, body: dict[str, Any]
) -> str | None:
    """``table``'s rule, and a host's ``report`` only for its own host id."""
    refusal = _type_refusal(table, principal, env_type)
    if refusal is not None:
        return refusal
    if env_type == report and body.get("host_id") != host_of(principal):
        return f"{principal} may not report for host {body.get('host_id')!r}"
    return None


def host_identity_refusal(principal: str, identity: bytes) -> str | None:
    """A host's connection must route under its own host id (no other host's replies reach it)."""
    host = host_of(principal)
    if host is not None and identity != host.encode():
        return f"{principal} may not use the routing identity {identity!r}"
    return None


def checkpoint_refusal(principal: str, env_type: str) -> str | None:
    """Hosts commit, read and forget images; the operator reads and forgets, and reads the status."""
    return _type_refusal(CHECKPOINT_ACCEPTS, principal, env_type)
