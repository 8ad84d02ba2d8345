"""Every internal message type and the shape of its body, in one place.

Services exchange these over ZMQ ROUTER/DEALER inside an ``Envelope``. A request is answered by
a ``reply`` (same envelope id) or an ``error`` carrying a reason. Schemas are deliberately light
(required keys and their Python types after msgpack decoding) because validation runs on the
execute path for every Jupyter frame we forward.

Who sends what (G = gateway, S = global scheduler, L = local scheduler, R = kernel replica,
C = CLI / provisioner):

    C -> G   kernel.start, kernel.shutdown, kernel.status, kernel.interrupt, kernel.list
    G -> S   kernel.start, kernel.shutdown, kernel.status, jupyter.request, kernel.hibernate,
             kernel.resume
    S -> G   jupyter.reply, kernel.dead
    C -> S   cluster.status, host.cordon, host.uncordon, host.drain, replica.restart
    L -> S   host.register, host.heartbeat, jupyter.reply, replica.event, batch (of the last
             two, to a scheduler whose host.register answer said it takes them)
    S -> L   replica.start, replica.configure, replica.stop, replica.membership, replica.restart,
             replica.hibernate, replica.process, jupyter.request
    R -> L   replica.register, gpu.commit, gpu.release, replica.event
    L -> R   replica.configure, replica.stop, replica.membership, replica.hibernate

Best-effort batch jobs (A = arbiter; issue #16):

    C -> A   job.submit, job.list, job.show, job.logs, job.cancel, arbiter.status
    L -> A   agent.report
    A -> L   lease.grant, lease.end, job.logs

Warm runtimes (V = serving controller; issue #20):

    L -> V   pool.report (answered with the host's target)
    S -> V   runtime.acquire ("a runtime on host H, now"), serving.status
    C -> V   serving.status
"""

from __future__ import annotations

import re
from typing import Any

# ---- generic answers -------------------------------------------------------------------------
REPLY = "reply"
ERROR = "error"
# Envelopes one loop turn had for the same peer, in order, as one message (``items``: each one
# encoded): a link pays its CURVE box and its frame handling once. The receiver validates and
# authorises each item as if it had come alone; a batch never holds a batch.
BATCH = "batch"
MAX_BATCH_ITEMS = 1_024

# ---- kernels (client-facing lifecycle) -------------------------------------------------------
KERNEL_START = "kernel.start"
KERNEL_SHUTDOWN = "kernel.shutdown"
KERNEL_STATUS = "kernel.status"
KERNEL_INTERRUPT = "kernel.interrupt"
KERNEL_DEAD = "kernel.dead"
KERNEL_LIST = "kernel.list"  # the gateway's kernels with connections and last activity
# G -> S: save an idle kernel's namespace to the data store and stop its replicas; bring it back
KERNEL_HIBERNATE = "kernel.hibernate"
KERNEL_RESUME = "kernel.resume"

# ---- Jupyter traffic, carried opaquely -------------------------------------------------------
JUPYTER_REQUEST = "jupyter.request"  # towards the replicas
JUPYTER_REPLY = "jupyter.reply"  # towards the client (shell/control/stdin replies and iopub)

# ---- cluster ---------------------------------------------------------------------------------
CLUSTER_STATUS = "cluster.status"
HOST_REGISTER = "host.register"
HOST_HEARTBEAT = "host.heartbeat"
HOST_CORDON = "host.cordon"
HOST_UNCORDON = "host.uncordon"
HOST_DRAIN = "host.drain"  # cordon, then migrate every replica off the host

# ---- replicas --------------------------------------------------------------------------------
REPLICA_START = "replica.start"
REPLICA_CONFIGURE = "replica.configure"
REPLICA_STOP = "replica.stop"
# Restart one replica in place: the same id and Raft storage (not a replacement by a new member)
REPLICA_RESTART = "replica.restart"
# Raft membership change or status, asked of one replica (it forwards the change to its leader);
# ``lost`` tells a member that another one's process died (no Raft change); ``busy`` that another
# one's process runs although its Raft is silent (answering its ``executor_quiet``)
REPLICA_MEMBERSHIP = "replica.membership"
MEMBERSHIP_ACTIONS = ("add_learner", "promote", "remove", "status", "lost", "busy")
# S -> L: whether a replica's process runs, as the host's OS says (``running``, ``stopped``:
# SIGSTOP or a tracer, ``gone``): asked for an executor whose Raft went quiet
REPLICA_PROCESS = "replica.process"
# S -> L -> R: write the replicated namespace (the Raft state machine's data) to the data store
# and answer its reference: the image a hibernated kernel's replicas restore (``configure.restore``)
REPLICA_HIBERNATE = "replica.hibernate"
REPLICA_REGISTER = "replica.register"
REPLICA_EVENT = "replica.event"
GPU_COMMIT = "gpu.commit"
GPU_RELEASE = "gpu.release"
# L -> replica push, just before it forwards an execute_request: GPUs already bound (or why not),
# so the designated replica's gpu.commit needs no round trip on the critical path
GPU_BOUND = "gpu.bound"

# ---- best-effort jobs and the arbiter ------------------------------------------------------------
JOB_SUBMIT = "job.submit"
JOB_LIST = "job.list"
JOB_SHOW = "job.show"
JOB_LOGS = "job.logs"
JOB_CANCEL = "job.cancel"
ARBITER_STATUS = "arbiter.status"
AGENT_REPORT = "agent.report"  # a host's idle GPUs and its jobs' progress (the Themis agent's report)
LEASE_GRANT = "lease.grant"  # run (or keep running) a job on this many GPUs until expires_at
LEASE_END = "lease.end"  # stop the job at a step boundary and free its GPUs

# ---- warm runtimes and the serving controller -----------------------------------------------------
POOL_REPORT = "pool.report"  # a host's warm-runtime pool; the answer is the host's target
RUNTIME_ACQUIRE = "runtime.acquire"  # a ready runtime on host H promised to one replica start
SERVING_STATUS = "serving.status"

# ---- the checkpoint service (jobs' images: services/checkpoint_service) -------------------------
CHECKPOINT_COMMIT = "checkpoint.commit"  # a host relays its job's committed image (manifest in the store)
CHECKPOINT_LATEST = "checkpoint.latest"  # the job's latest complete image, for a restore
CHECKPOINT_FORGET = "checkpoint.forget"  # the job is over: its images may be collected
CHECKPOINT_STATUS = "checkpoint.status"
CHECKPOINT_WRITTEN = (
    "checkpoint.written"  # objects a job's agent stored that no commit may name (it died mid-capture)
)

CHANNELS = ("shell", "control", "stdin", "iopub")
# cell_timings: the executor's per-cell step times (ms), sent after its reply (metrics only);
# pinned: ``%tandem pin`` / ``unpin`` ran on the replica (``detail.pinned``, a bool);
# executor_quiet: the executor of ``msg_id`` (``detail.executor``) has been silent a while;
# leaving: the log overruled ``msg_id``'s outcome on this replica, which exits (send it no cell)
# exit: the notebook called exit() in ``msg_id`` on this executor: the kernel stops once that
# cell's reply has gone by, as a kernel process would (kernel_replica.kernel ``_ask_exit``)
REPLICA_EVENTS = (
    "elected",
    "election_failed",
    "done",
    "raft_role",
    "exited",
    "ready",
    "cell_timings",
    "pinned",
    "executor_quiet",
    "leaving",
    "exit",
)

_int = (int,)
_str = (str,)
_bool = (bool,)
_list = (list,)
_map = (dict,)
_num = (int, float)
_opt_str = (str, type(None))
_opt_int = (int, type(None))

# type -> {key: (allowed types, required)}
_SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    REPLY: {},
    ERROR: {"reason": (_str, True), "code": (_str, False)},
    BATCH: {"items": (_list, True)},
    KERNEL_START: {
        "kernel_id": (_str, True),
        "key": (_str, True),
        "signature_scheme": (_str, False),
        "resources": (_map, True),
        "name": (_str, False),  # C -> G: the kernelspec's name, for `tandem kernel list`
        "launch": (_map, False),  # working directory and environment (shared/kernel_launch.py)
    },
    # restart: keep the kernel's ports for the start that follows; by: who asks, "client"
    # (default) or "operator" (`tandem kernel stop`), shown by kernel.status and kernel.list
    KERNEL_SHUTDOWN: {"kernel_id": (_str, True), "restart": (_bool, False), "by": (_str, False)},
    KERNEL_STATUS: {"kernel_id": (_str, True)},
    KERNEL_INTERRUPT: {"kernel_id": (_str, True)},
    KERNEL_DEAD: {"kernel_id": (_str, True), "reason": (_str, True)},
    KERNEL_HIBERNATE: {"kernel_id": (_str, True), "reason": (_str, False)},
    KERNEL_RESUME: {"kernel_id": (_str, True)},
    JUPYTER_REQUEST: {
        "kernel_id": (_str, True),
        "channel": (_str, True),
        "frames": (_list, True),  # [signature, header, parent, metadata, content, *buffers] as bytes
        "replica_id": (_str, False),  # set by the global scheduler when addressing one replica
        "designated": (_bool, False),  # the one replica sent execute_request; the others yield
        "revoke": (_list, False),  # job ids whose leases the designated executor's host suspends
    },
    JUPYTER_REPLY: {
        "kernel_id": (_str, True),
        "channel": (_str, True),
        "frames": (_list, True),
        "replica_id": (_str, False),
        # [channel, frames] of the same kernel's (and replica's) next messages, in order: what one
        # turn of the sender's loop had for that peer goes in one envelope (``jupyter_messages``)
        "more": (_list, False),
    },
    KERNEL_LIST: {},
    CLUSTER_STATUS: {"all": (_bool, False)},  # all: stopped kernels too
    HOST_REGISTER: {
        "host_id": (_str, True),
        "address": (_str, False),
        "resources": (_map, True),  # millicpus, memory_mb, gpus, vram_gb
        "gpu_kind": (_str, True),  # "nvidia" | "virtual"
        "replicas": (_list, False),  # what already runs there (a restarted scheduler rebuilds from it)
    },
    HOST_HEARTBEAT: {
        "host_id": (_str, True),
        "committed": (_map, False),
        "replicas": (_list, False),
        "pool": (_map, False),  # the host's pre-warmed runtimes: warm, starting, target, taken, misses
        # jobs on leased GPUs: [job_id, device ids, measured grace period s or None, preemptions]
        "leased": (_list, False),
    },
    HOST_CORDON: {"host_id": (_str, True)},
    HOST_UNCORDON: {"host_id": (_str, True)},
    HOST_DRAIN: {"host_id": (_str, True)},
    REPLICA_START: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "key": (_str, True),
        "signature_scheme": (_str, False),
        "resources": (_map, True),
        "launch": (_map, False),  # as in kernel.start
        "join": (_bool, False),  # True: start as a new member of an existing Raft group
        # a resumed kernel's modules (its image's import statements): the host's runtime
        # template imports the installed ones before it forks (services/local_scheduler/runtime_template.py)
        "imports": (_list, False),
        # its TLS identity on the Raft links (shared/raft/tls.MemberIdentity.to_wire); absent
        # only when raft.tls is off
        "raft_identity": (_map, False),
    },
    REPLICA_CONFIGURE: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "peers": (_map, True),  # replica_id -> raft address, the initial voters
        # a resumed kernel's namespace image (an ObjectRef map), restored before Raft starts
        "restore": (_map, False),
    },
    REPLICA_HIBERNATE: {"kernel_id": (_str, True), "replica_id": (_str, True)},
    REPLICA_STOP: {"kernel_id": (_str, True), "replica_id": (_str, True)},
    REPLICA_PROCESS: {"kernel_id": (_str, True), "replica_id": (_str, True)},
    # C -> S: kernel_id and replica_id; S -> L adds what starting the process needs
    REPLICA_RESTART: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "key": (_str, False),
        "signature_scheme": (_str, False),
        "resources": (_map, False),
        "launch": (_map, False),  # as in kernel.start
        "raft_identity": (_map, False),  # as in replica.start
    },
    REPLICA_MEMBERSHIP: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),  # the replica asked (a current member)
        "action": (_str, True),  # one of MEMBERSHIP_ACTIONS
        "member": (_str, False),  # the replica added, promoted or removed
        "address": (_str, False),  # add_learner: the new member's Raft address
        "cells": (_list, False),  # lost: msg_ids the dead member had started (its GPUs were bound)
    },
    REPLICA_REGISTER: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "raft_address": (_str, True),
        "pid": (_int, True),
    },
    REPLICA_EVENT: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "event": (_str, True),
        "msg_id": (_opt_str, False),
        "detail": (_map, False),
    },
    GPU_COMMIT: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "msg_id": (_str, True),
        "gpus": (_int, True),
    },
    GPU_RELEASE: {"kernel_id": (_str, True), "replica_id": (_str, True), "msg_id": (_str, True)},
    GPU_BOUND: {
        "kernel_id": (_str, True),
        "replica_id": (_str, True),
        "msg_id": (_str, True),
        "device_ids": (_list, False),  # absent: none bound yet (the replica asks with gpu.commit)
        "designated": (_bool, False),  # the scheduler sent the others yield_request
    },
    JOB_SUBMIT: {
        "argv": (_list, True),
        "cwd": (_str, True),
        "env": (_map, True),
        "app": (_str, False),
        "name": (_str, False),
        "gpus": (_int, False),
        "max_gpus": (_int, False),
        "iterations": (_int, False),  # the job's total, until it reports its own (job-side API)
    },
    JOB_LIST: {},
    JOB_SHOW: {"job_id": (_str, True)},
    JOB_LOGS: {"job_id": (_str, True), "offset": (_int, False)},  # negative: from the end
    JOB_CANCEL: {"job_id": (_str, True)},
    ARBITER_STATUS: {},
    AGENT_REPORT: {
        "host_id": (_str, True),
        "gpus": (_int, True),
        "idle": (_list, True),  # device ids it may lease: neither committed, leased, nor reserved
        "reserved": (_int, False),  # idle GPUs kept for cells (arbiter.cell_reserve_gpus)
        "committed": (_int, True),
        "jobs": (_list, True),  # per job: progress, devices, whether it runs, how it ended
        "at": (_num, False),
    },
    LEASE_GRANT: {
        "job_id": (_str, True),
        "app_id": (_str, True),
        "gpus": (_int, True),
        "expires_at": (_num, True),  # wall-clock seconds
        "job": (_map, True),  # argv, cwd, env, start_iteration
    },
    LEASE_END: {"job_id": (_str, True), "reason": (_str, True)},
    POOL_REPORT: {
        "host_id": (_str, True),
        "warm": (_int, True),
        "starting": (_int, True),
        "idle_gpus": (_int, False),
        "taken": (_int, False),
        "misses": (_int, False),
        "warmup_s": (_num, False),
    },
    RUNTIME_ACQUIRE: {"host_id": (_str, True), "kernel_id": (_str, False), "purpose": (_str, False)},
    SERVING_STATUS: {},
    CHECKPOINT_COMMIT: {
        "job_id": (_str, True),
        "manifest": (_map, True),  # the manifest's ObjectRef (the manifest is itself a store object)
        "written": (_list, False),  # digests of packs its agent stored, failed attempts included
    },
    CHECKPOINT_LATEST: {"job_id": (_str, True)},
    CHECKPOINT_FORGET: {"job_id": (_str, True)},
    CHECKPOINT_STATUS: {},
    CHECKPOINT_WRITTEN: {"job_id": (_str, True), "digests": (_list, True)},
}

_CHECKED_CHANNEL = {JUPYTER_REQUEST, JUPYTER_REPLY}

# Kernel and replica ids name directories (``<state>/<kernel>/<replica>``) and ZMQ identities: one
# path component of safe characters, checked on arrival so no handler ever sees ``/etc`` or ``..``.
# Jupyter's own kernel ids (UUIDs) pass.
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ID_FIELDS = ("kernel_id", "replica_id", "job_id")


def id_problem(field: str, value: str) -> str | None:
    """Why ``value`` cannot be a ``kernel_id``/``replica_id``, or None if it can."""
    if _SAFE_ID.fullmatch(value) is None or ".." in value:
        return (
            f"field {field!r} must be one path component of letters, digits, '_', '.' or '-' "
            f"(at most 128, not starting with a symbol, no '..'), got {value[:80]!r}"
        )
    return None


def _jupyter_problem(channel: Any, frames: list[Any]) -> str | None:
    if channel not in CHANNELS:
        return f"unknown channel {channel!r}"
    if len(frames) < 5 or not all(isinstance(f, bytes) for f in frames):
        return "frames must be at least 5 byte strings (signature, header, parent, metadata, content)"
    return None


def jupyter_messages(body: dict[str, Any]) -> list[tuple[str, list[bytes]]]:
    """The (channel, frames) a validated ``jupyter.reply`` body carries, in order."""
    first = (body["channel"], body["frames"])
    more = body.get("more")
    return [first, *((channel, frames) for channel, frames in more)] if more else [first]


def jupyter_reply(kernel_id: str, items: list[tuple[str, list[bytes]]], **fields: Any) -> dict[str, Any]:
    """A ``jupyter.reply`` body carrying ``items`` ((channel, frames), at least one), in order."""
    (channel, frames), rest = items[0], items[1:]
    body = {"kernel_id": kernel_id, **fields, "channel": channel, "frames": frames}
    if rest:
        body["more"] = [[c, f] for c, f in rest]
    return body


def jupyter_replies(
    outgoing: list[tuple[tuple[str, str], str, list[bytes]]],
) -> list[dict[str, Any]]:
    """``jupyter.reply`` bodies for ((kernel, replica), channel, frames) in arrival order: one
    per run of the same replica's messages, so the order across replicas holds too."""
    bodies = []
    start = 0
    for end in range(1, len(outgoing) + 1):
        if end < len(outgoing) and outgoing[end][0] == outgoing[start][0]:
            continue
        kernel_id, replica_id = outgoing[start][0]
        items = [(channel, frames) for _, channel, frames in outgoing[start:end]]
        bodies.append(jupyter_reply(kernel_id, items, replica_id=replica_id))
        start = end
    return bodies


def validate(msg_type: str, body: dict[str, Any]) -> str | None:
    """Return why ``body`` is not a valid ``msg_type`` body, or None if it is."""
    schema = _SCHEMAS.get(msg_type)
    if schema is None:
        return "unknown message type"
    for key, (types, required) in schema.items():
        if key not in body:
            if required:
                return f"missing field {key!r}"
            continue
        value = body[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = "/".join(t.__name__ for t in types)
            return f"field {key!r} must be {expected}, got {type(value).__name__}"
    for key in _ID_FIELDS:
        value = body.get(key)
        if isinstance(value, str) and (problem := id_problem(key, value)) is not None:
            return problem
    if msg_type in _CHECKED_CHANNEL:
        problem = _jupyter_problem(body["channel"], body["frames"])
        if problem is not None:
            return problem
        for item in body.get("more", ()):
            if type(item) is not list or len(item) != 2 or not isinstance(item[1], list):
                return "each of 'more' must be [channel, frames]"
            if (problem := _jupyter_problem(item[0], item[1])) is not None:
                return f"in 'more': {problem}"
    if msg_type == BATCH:
        items = body["items"]
        if not items or len(items) > MAX_BATCH_ITEMS or not all(type(item) is bytes for item in items):
            return f"'items' must be 1 to {MAX_BATCH_ITEMS} encoded envelopes"
    if msg_type == REPLICA_MEMBERSHIP and body["action"] not in MEMBERSHIP_ACTIONS:
        return f"unknown membership action {body['action']!r}"
    if msg_type == REPLICA_MEMBERSHIP and body["action"] != "status" and not body.get("member"):
        return f"membership action {body['action']!r} needs the member it is about"
    if msg_type == REPLICA_EVENT and body["event"] not in REPLICA_EVENTS:
        return f"unknown replica event {body['event']!r}"
    return None
