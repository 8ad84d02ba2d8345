"""TOML configuration layered over built-in defaults.

Layers, later wins: the defaults below (which serve the embedded single-machine cluster), a TOML
file that names only the keys it changes, then ``section.key=value`` overrides from CLI flags.
Unknown keys and wrongly typed values are rejected with the key's name, because a silently
ignored typo in a deployment config is worse than a refusal to start.
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shared.raft.transport import TRANSPORT_KINDS

DEFAULTS: dict[str, dict[str, Any]] = {
    "cluster": {
        "hosts": 4,
        "max_hosts": 0,  # autoscaling ceiling (`tandem up --max-hosts`); 0: = hosts, no autoscaling
        "ip": "127.0.0.1",
        "state_dir": "~/.tandem",
        "replicas_per_kernel": 3,
        # `tandem up` with a loopback cluster.ip: its gateway and hosts reach the global scheduler
        # on a Unix socket in a 0700 directory, authenticated by PLAIN credentials derived from
        # their keys, not CURVE-encrypted (only their own user's processes can open it; README
        # "Security"). false: over TCP with CURVE, as hosts on other machines do.
        "ipc_links": True,
    },
    "host": {
        # Resources a local scheduler declares. GPUs come from NVML when present, else these.
        "gpus": 8,
        "millicpus": 64_000,
        "memory_mb": 262_144,
        "vram_gb_per_gpu": 40,
        "use_nvml": True,
        # The address other hosts reach this host's replicas at (their Raft links). Empty: the
        # cluster.ip, or when that binds every interface (0.0.0.0), the source address of this
        # host's route to the global scheduler (shared/host_address.py).
        "advertise_ip": "",
    },
    "kernel": {
        # The default resource request of a kernel (the kernelspec and TANDEM_* variables override).
        "gpus": 1,
        "millicpus": 1000,
        "memory_mb": 2048,
        "vram_gb": 8,
        "python": "",  # interpreter for replica processes; empty: the one running Tandem
        # NotebookOS §3.3: tensors/modules/optimizers the notebook keeps on a GPU go to host memory
        # after each cell and back to the bound GPU before the next (kernel_replica/device_residency).
        "gpu_residency": "move",  # move | off
        # Idle culling (Jupyter Server / Enterprise Gateway's cull_idle_timeout): a kernel without
        # client or kernel messages this long is shut down and its replicas stopped; 0: never.
        "cull_idle_s": 0.0,
        "cull_interval_s": 60.0,  # how often the gateway looks for idle kernels
        "cull_connected": False,  # also cull kernels that clients are still connected to
        "cull_busy": False,  # also cull kernels running a cell (no message for cull_idle_s)
        # Hibernation (NotebookOS §5.5.2, made real): a kernel idle this long (clients connected
        # or not, never mid-cell) has its namespace written to the data store and its replicas
        # stopped; its next request resumes it on hosts placement picks. 0: never.
        "hibernate_after_s": 0.0,
        "hibernate_interval_s": 5.0,  # how often the gateway looks for kernels to hibernate
    },
    "election": {
        # The executor election of each cell among a kernel's replicas (kernel_replica/election_core.py).
        "propose_timeout_s": 5.0,  # a LEAD/YIELD/DONE not applied by then: the cell fails (quorum lost)
        "election_wait_s": 5.0,  # a yielder waits this long for silent voters, then yields for them
        "state_wait_s": 10.0,  # the next executor waits this long for the previous cell's STATE
        "quorum_timeout_s": 10.0,  # a standby with no Raft leader this long stops waiting for DONE
        # Standbys told to yield first give the candidate's LEAD this long to commit (saves a
        # YIELD per replica per cell; a failed election is noticed this much later).
        "yield_grace_s": 0.05,
        # VOTE entries (informational: the commit order decides) ride with the replica's next
        # proposal or go out after vote_flush_s of quiet; false: none are appended.
        "propose_votes": True,
        "vote_flush_s": 0.5,
        # A running cell's executor beats PROGRESS into the Raft log this often; standbys that hear
        # neither that nor its DONE for executor_silence_s commit ExecutorLost for the cell (it
        # never reruns).
        "progress_interval_s": 2.0,
        "executor_silence_s": 10.0,
        # silent for half of that, the executor's host is asked whether its process runs (user code
        # holding the GIL: no thread beats); while it does, the silence is waited out, at most this
        # long after the last beat
        "executor_busy_max_s": 600.0,
        # The Raft leader hands leadership to a replica that executed this many cells in a row
        # (its LEADs then commit one hop sooner); 0: never. At most once per leader_transfer_every_s.
        "leader_follows_executor": 3,
        "leader_transfer_every_s": 10.0,
    },
    "scheduler": {
        "heartbeat_interval_s": 1.0,
        "heartbeat_timeout_s": 5.0,
        "replica_start_timeout_s": 60.0,
        "request_timeout_s": 10.0,
        # A cell goes to its designated executor alone; if that replica sends nothing this long
        # after it could have (hung, yet alive to its local scheduler), the other replicas are
        # sent it too and hold the election without it (docs/protocol.md).
        "candidate_silence_s": 3.0,
        "subscription_ratio_watermark": 3.0,
        # Scheduling mode (shared/policies/baselines.make_policy names). The live scheduler runs
        # notebookos; the baselines are driven by the simulator (the live one logs a warning).
        "policy": "notebookos",  # notebookos | reservation | batch | lcp
        # Migration when no replica can bind a cell's GPUs (shared/policies/migration.py): retried
        # with backoff (base doubling up to max) while no host can; the cell then fails with an
        # error execute_reply once the deadline would pass.
        "migration_deadline_s": 30.0,
        "migration_retry_base_s": 0.5,
        "migration_retry_max_s": 4.0,
        "migration_catch_up_timeout_s": 30.0,  # a new member until it applied the group's log
        # Replace a replica that died for good (its process exited, its host went silent) by a
        # new one on another host, through the same membership change as a migration.
        "replace_dead_replicas": True,
        # A replica whose process exited on a live host is restarted in place (its own Raft log)
        # when its kernel is below a quorum (two cells in a row that crash their executor), or
        # when no other host could take its replacement; at most this many times per replica per
        # window. Past that, a kernel below a quorum is dead.
        "restart_in_place_limit": 3,
        "restart_in_place_window_s": 600.0,
        # Records of stopped kernels kept for `tandem status --json --all`; older ones are dropped.
        "stopped_kernels_kept": 200,
    },
    "autoscale": {
        # NotebookOS §3.4.2 (shared/policies/autoscale.py); active when cluster.max_hosts > hosts.
        "provider": "none",  # none | embedded (local-scheduler processes; set by `tandem up`)
        "scaling_factor": 1.05,  # f in: provisioned GPUs >= f * committed GPUs
        "buffer_hosts": 1,  # hosts kept beyond f * committed for bursts
        "max_release": 2,  # idle hosts released per evaluation
        "interval_s": 5.0,  # how often the periodic check runs
        "scale_in_idle_s": 30.0,  # a host must be idle this long before release (its standby replicas move)
        # A kernel start, or a held cell's migration (NotebookOS §3.4.2), waiting for the hosts a
        # scale-out asked for fails after this. It covers a cloud GPU server's provisioning (minutes;
        # `tandem sim` models simulator.host_provision_s = 120 s and refuses a timeout not above it);
        # an embedded cluster's local schedulers register in seconds, any value above that works.
        "scale_out_timeout_s": 300.0,
        "events_kept": 200,  # scale events listed by `tandem status --json`
    },
    "prewarm": {
        # Started-but-unassigned replica processes per host (shared/policies/prewarm.py).
        "policy": "none",  # none | fixed | min | littles_law
        "per_host": 1,  # fixed: exactly; min: at least; littles_law: at least (min_per_host)
        "max_per_host": 4,  # never more warm runtimes on one host (memory)
        "headroom": 1.0,  # littles_law: L = ceil(lambda * W * headroom)
        "half_life_s": 300.0,  # littles_law: the arrival rate's memory
        "interval_s": 2.0,  # how often the pool is reconciled with its target
        "imports": ["torch"],  # modules a warm runtime imports ahead (skipped when absent)
        # true: each host keeps a runtime template (kernel_replica/template.py, a fork server that
        # imported the above) and replica starts fork from it; a resumed kernel's modules (recorded
        # with its image) are imported by the template first. Independent of the policy above.
        "template": False,
    },
    "serving": {
        # The serving controller (services/serving_controller): decides every host's warm-runtime
        # pool at once with the [prewarm] policy and promises ready runtimes to replica starts.
        "address": "",  # its ROUTER; empty: none (`tandem up` starts one and sets it)
        "stale_s": 10.0,  # a host whose pool report is older is left out of the decisions
        "acquire_timeout_s": 0.5,  # the scheduler starts a replica without an answer after this
    },
    "metrics": {
        # Prometheus /metrics on the global scheduler: 0 off; -1 a free port (`tandem up` default).
        "prometheus_port": 0,
        "prometheus_address": "127.0.0.1",
        "cells_kept": 1000,  # recent per-cell records in `tandem status --json`
    },
    "raft": {
        "tick_ms": 20,
        "election_ticks": 10,
        "snapshot_every": 1000,
        # How soon after a commit the leader tells the standbys (who apply a cell's STATE only
        # then) when no append carries it sooner; without it they wait up to a tick (issue #21).
        # 2, not 1: the notice and the standbys' STATE apply then compete less with the reply on
        # its way to the client; 3 was faster still but broke #21's sync p50 <= 5 ms (README).
        "commit_notice_ms": 2.0,
        # false: no fdatasync per Raft Ready; the log is fenced by the boot id and a replica whose
        # host rebooted is replaced, not restarted (shared/raft/storage.py). true: etcd's fsync.
        "fsync": False,
        # Replica-to-replica Raft messages: "tcp" (asyncio streams; shared/raft/tcp_transport.py
        # says why) or "zmq" (DEALER/ROUTER, like the services).
        "transport": "tcp",
        # Mutual TLS on the replicas' Raft links under the cluster's Raft CA, which the global
        # scheduler keeps in <state_dir>/keys (shared/raft/tls.py): a peer must prove it is a
        # member of the same kernel before anything it sends is decoded. Needs transport "tcp".
        # false only where every host on the network is trusted (and on every node alike).
        "tls": True,
        # A link whose two ends are loopback addresses (replicas on one machine: the embedded
        # cluster) is authenticated by the same handshake and then carries its frames in the
        # clear, which only the kernel's loopback buffers see (shared/raft/tls.py). true: encrypt
        # every record there too, as between hosts.
        "encrypt_loopback": False,
    },
    "gateway": {
        # The Jupyter-facing edge. Port 0 picks a free port (the embedded cluster); a node
        # deployment pins it so the provisioner's cluster.json stays valid across restarts.
        "api_address": "tcp://127.0.0.1:0",
        "kernel_ip": "127.0.0.1",  # where each kernel's five Jupyter sockets are bound
        "kernel_start_timeout_s": 90.0,
        "status_poll_interval_s": 2.0,  # how often the liveness seen by heartbeats is refreshed
        "scheduler_address": "",  # empty: the one written in cluster.json / passed by `tandem up`
        # A kernel stopped for a restart keeps its five ports this long for the start that
        # follows (clients stay connected through restart_kernel); then they are released.
        "restart_ports_kept_s": 120.0,
    },
    "http": {
        # The Jupyter Kernel Gateway HTTP/WebSocket API (services/http_gateway): what
        # `jupyter lab --gateway-url`, jupyter_server's GatewayClient and JupyterHub speak.
        "enabled": True,  # `tandem up` starts it (a node deployment runs it beside its gateway)
        "ip": "127.0.0.1",  # bind address; "0.0.0.0" to serve other machines (set TLS then)
        "port": 0,  # 0: a free port, published in cluster.json as "http"; pin it for remote clients
        # The API token (`Authorization: token ...`): read from this file; empty:
        # <keys_dir>/http.token, made with a random token (0600) when absent.
        "token_file": "",
        "certfile": "",  # TLS: a PEM certificate (and key); both empty: plain HTTP
        "keyfile": "",
        "client_ca": "",  # TLS: also require client certificates signed by this CA
        "allow_origin": "",  # CORS Access-Control-Allow-Origin for browser clients; empty: none
        "max_kernels": 0,  # kernels the API may run at once; 0: no limit
        # a connection that sends no request, or stalls in a request's body, this long is closed
        # (a kernel's WebSocket, once open, is not): silent connections cannot pile up to the
        # process's file limit
        "idle_timeout_s": 60.0,
    },
    "security": {
        # The cluster's keys (shared/security): CurveZMQ keypairs of the scheduler, gateway,
        # operator and each host. Empty: <state_dir>/keys, created by `tandem up` or `tandem keys`.
        "keys_dir": "",
    },
    "embedded": {
        "virtual_gpus": True,  # hosts of `tandem up` declare host.gpus virtual GPUs, not NVML's
        "ready_timeout_s": 60.0,  # until every host has registered
        "log_dir": "",  # empty: <state_dir>/logs
    },
    "datastore": {
        # Where replicas keep large objects (shared/datastore); the Raft log carries only pointers.
        "backend": "local",  # local | s3 | redis
        "path": "",  # local: a directory; empty: <state_dir>/datastore
        "bucket": "tandem",  # s3 (credentials from the standard AWS variables)
        "endpoint_url": "",  # s3: empty for AWS itself, else e.g. http://127.0.0.1:9000
        "url": "redis://127.0.0.1:6379/0",  # redis
        "large_object_bytes": 1_048_576,  # objects above this go to the store, smaller ones to Raft
        "cache_bytes": 268_435_456,  # per-process LRU read cache
        "chunk_bytes": 8_388_608,  # stream unit: file write, S3 part (>= 5 MiB), Redis value
        # Large objects of a cell are copied aside in memory and written to the store after the
        # reply, on the replica's Raft thread; their STATE entry is proposed once written. The
        # next cell then waits for a memory copy, not for the write. false: written before the
        # next cell may start (no second copy in memory).
        "write_behind": True,
        # With write_behind, the large objects of a cell that has torch imported are not copied
        # aside before the reply: the executor marks the instant and a concurrent checkpoint
        # (kernel_replica/state_image.py, issue #17) copies them after it, content-addressed,
        # while the next cell may already change them (copy-on-write of what it writes first).
        "background_image": True,
        # A standby reads a STATE entry's large objects (store pointers, images) in the
        # background, off the threads that answer Raft and the scheduler; code it must run first
        # waits only for the names it may touch (kernel_replica/lazy_load.py). False: each entry
        # is read whole before the next thing the replica does (the path before, for comparison).
        "lazy_load": True,
        # At most this many bytes per cell are copied aside (the copy doubles their memory); a
        # larger model or dataset is streamed to the store before the next cell, held once.
        "write_behind_max_bytes": 536_870_912,
        # A value the store could not take stays in the executor's memory, unprotected (the cell
        # says so on its stderr); later cells store it again, at first after retry_initial_s,
        # then doubling up to retry_max_s between attempts while the store keeps failing.
        "retry_initial_s": 1.0,
        "retry_max_s": 60.0,
        # The reply of a cell whose large objects are written behind it waits this much longer
        # than its DONE commit for the write's outcome: a store that refuses writes fails within
        # it, and the cell that made the object then says so itself (not the next one).
        "write_outcome_wait_s": 0.005,
    },
    "simulator": {
        # `tandem sim` (shared/simulator): the discrete-event model's costs and cluster. Times are
        # seconds of simulated time; the defaults follow NotebookOS §5 (8-GPU p3.16xlarge servers).
        "gpus_per_host": 8,
        "initial_hosts": 3,  # hosts at t=0; the autoscaler adds/releases from there
        "min_hosts": 3,  # scale-in never goes below this (nor below the replicas per kernel)
        "max_hosts": 1000,
        "host_provision_s": 120.0,  # a requested server until its local scheduler registers
        "cold_start_s": 10.0,  # a container started on demand (mean; lognormal jitter below)
        "warm_start_s": 0.5,  # handing over a pre-warmed container
        "start_jitter_sigma": 0.25,  # lognormal sigma of container start times (seeded)
        "large_object_mb": 1024.0,  # model + data a fresh runtime reads (and batch/lcp write back)
        "datastore_read_mb_per_s": 400.0,  # §5.4: p99 large-object read ~4 s
        "datastore_write_mb_per_s": 200.0,  # §5.4: p99 large-object write ~7 s
        "election_s": 0.03,  # LEAD/YIELD election before a replica executes (tens of ms)
        "autoscale_interval_s": 120.0,  # how often the autoscaler's periodic check runs
        "scaling_factor": 1.05,  # f in expected GPUs = f * committed GPUs
        "buffer_hosts": 1,  # the scaling buffer of spare hosts for bursts
        "max_ratio_after_scale_in": 2.0,  # cluster subscription ratio a scale-in may not exceed
        "subscription_ratio_watermark": 3.0,  # per-host placement ceiling (notebookos)
        "prewarm_per_host": 1,  # notebookos: minimum warm containers per host (migrations)
        "lcp_pool_per_host": 8,  # lcp: warm containers per host
        "vm_rate_per_hour": 10.0,  # billing (§5.5.1): provider's price of one server-hour
        "markup": 1.15,  # users pay this multiple of the provider's rate for what they use
        "standby_fraction": 0.125,  # a standby replica is billed this share of the VM rate
        "timeline_step_s": 60.0,  # sampling step of the GPU and subscription-ratio timelines
        "reclaim_after_h": [0.5, 1.0, 2.0, 4.0, 8.0],  # idle-reclamation intervals of Figure 13
        # hibernation (kernel.hibernate_after_s > 0): a resume's measured costs (bench_hibernate)
        "resume_s": 1.5,  # small-namespace resume p50, first cell waiting (1.34-1.79 s measured)
        "resume_read_mb_per_s": 220.0,  # large objects read back on resume (500 MB: +2.3 s measured)
        "kernel_memory_mb": 770.0,  # RSS of a kernel's three replicas, torch imported (freed)
    },
    "arbiter": {
        # Best-effort training jobs on the GPUs no cell holds, leased by finish-time-fair auctions
        # (Themis; services/arbiter over the pure core shared/arbiter).
        "round_s": 5.0,  # an auction round this often (leases that expired are re-auctioned)
        # the allocation policy: themis, or a baseline of shared.arbiter.baselines (tiresias,
        # gandiva_fair, las_app, gandiva, slaq, optimus, srtf, srsf, fifo) for live comparisons
        "policy": "themis",
        "lease_s": 600.0,  # a lease's length (Themis §6.4: 10 minutes)
        "fairness_knob": 0.8,  # Themis f: the worst ceil((1 - f) * N) apps bid each round
        "leftovers_to_bidders": True,  # GPUs no non-bidder can use go to bidders still short
        "seed": 0,  # the seeded order in which leftovers go to non-bidders
        "report_interval_s": 1.0,  # each host's agent.report (idle GPUs, its jobs' progress)
        "stop_grace_s": 30.0,  # a job asked to stop (or pause) gets this long to reach a step boundary
        # a job that lost a start (a lease ended before its run stepped) keeps its next lease,
        # renewed, while that run has not reached its first step boundary, until it is this old:
        # else a job whose start outlasts a lease would restart from scratch at every lease
        "startup_allowance_s": 600.0,
        # > 0: a job (using the job-side API) whose lease ends pauses in place this long, and a
        # next lease of the same GPUs there resumes it without a new process; 0: it stops, which
        # frees its GPU memory for cells (services/local_scheduler/batch_jobs.py says why)
        "keep_paused_s": 0.0,
        # idle GPUs per host never leased, kept for cells; 0 since cells revoke leases (FitGpp,
        # services/local_scheduler/batch_jobs.py): a cell finding only leased GPUs takes them
        "cell_reserve_gpus": 0,
        # a job whose lease a cell revokes gets this long to pause at a step boundary, then SIGSTOP
        # (the cell runs at once either way; this bounds how long the two share the GPU)
        "preempt_pause_grace_s": 2.0,
        "fitgpp_s": 4.0,  # FitGpp's weight s of the grace period in the victim score (Eq. 3)
        "max_preemptions": 1,  # FitGpp's P: preempt a job at most this often while others qualify
        "address": "",  # the arbiter's ROUTER; empty: none (`tandem up` starts one and sets it)
        "prometheus_port": 0,  # the arbiter's /metrics: 0 a free port, -1 off (on only with metrics)
    },
    "packing": {
        # Two best-effort jobs per GPU, coordinated by Gimbal's search (issue #18, docs/packing.md).
        # Off: the live bench on this shared CPU-only machine has not shown its gain over sequential
        # (docs/packing.md: second round).
        "enabled": False,
        "trial_s": 3.0,  # one trial of the coordination search (the paper: up to 60 s or 5 steps)
        "settle_s": 0.5,  # after a new share, before measuring (the step in flight ends)
        "objective": "jct",  # Eq. 1-6: jct | jct_sequenced | deadline | makespan
        "min_gain": 0.03,  # a trial counts as a gain only if it beats the best by this fraction
        "futile_exit": True,  # end a search once no later trial can gain (false: Algorithm 1's exit)
    },
    "checkpoint": {
        # Jobs' images (issue #17): agents in the job processes write them to the data store, the
        # checkpoint service (services/checkpoint_service) keeps each job's latest complete one.
        "keep": 1,  # images kept per job (the latest; the agent's next increment reuses its packs)
        "protect_s": 600.0,  # packs stored ahead of their manifest are kept at least this long
        "collect_interval_s": 60.0,  # how often unneeded objects are collected (protections expire)
        "commit_timeout_s": 10.0,  # a host's relay of a commit, or its ask for the latest image
        "address": "",  # the service's ROUTER; empty: none (`tandem up` starts one and sets it)
    },
    "log": {
        "format": "console",  # "console" for development, "json" for production
        "level": "info",
        # Replicas log one info line per cell with the state replication steps' timings and wall
        # clock stamps (executor: state_sent; standbys: state_applied); scripts/bench_state_sync.py
        # joins them by msg_id into end-to-end sync latencies.
        "sync_timings": False,
    },
}


# Keys whose value must be one of a few names.
CHOICES: dict[str, tuple[str, ...]] = {
    "kernel.gpu_residency": ("move", "off"),
    "raft.transport": TRANSPORT_KINDS,
    "scheduler.policy": ("notebookos", "reservation", "batch", "lcp"),
    "autoscale.provider": ("none", "embedded"),
    "prewarm.policy": ("none", "fixed", "min", "littles_law"),
    "packing.objective": ("jct", "jct_sequenced", "deadline", "makespan"),
}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the source."""


class Config:
    """Read-only view of the merged configuration: ``cfg["cluster"]["hosts"]`` or ``cfg.get("cluster.hosts")``."""

    def __init__(self, data: dict[str, dict[str, Any]]) -> None:
        self._data = data

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self._data[section]

    def get(self, dotted: str) -> Any:
        section, key = _split(dotted, "lookup")
        return self._data[section][key]

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return copy.deepcopy(self._data)

    def as_overrides(self) -> dict[str, Any]:
        """Every key as ``section.key``: the form a child layers its own flags over."""
        return {
            f"{section}.{key}": value for section, keys in self._data.items() for key, value in keys.items()
        }

    def to_json(self) -> str:
        return json.dumps(self._data)

    def state_dir(self) -> Path:
        return Path(os.path.expanduser(os.environ.get("TANDEM_STATE_DIR") or self.get("cluster.state_dir")))

    def keys_dir(self) -> Path:
        explicit = self.get("security.keys_dir")
        return Path(os.path.expanduser(explicit)) if explicit else self.state_dir() / "keys"


def _split(dotted: str, source: str) -> tuple[str, str]:
    section, sep, key = dotted.partition(".")
    if not sep or section not in DEFAULTS or key not in DEFAULTS[section]:
        raise ConfigError(f"unknown configuration key {dotted!r} ({source})")
    return section, key


def _coerce(dotted: str, value: Any, source: str) -> Any:
    section, key = _split(dotted, source)
    default = DEFAULTS[section][key]
    if isinstance(value, str) and not isinstance(default, str):
        try:
            value = json.loads(value.lower() if isinstance(default, bool) else value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{dotted}: cannot parse {value!r} ({source})") from exc
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(
            f"{dotted} must be {type(default).__name__}, got {type(value).__name__} {value!r} ({source})"
        )
    choices = CHOICES.get(f"{section}.{key}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{dotted} must be one of {', '.join(choices)}; got {value!r} ({source})")
    return value


def _layer(data: dict[str, dict[str, Any]], updates: Mapping[str, Any], source: str) -> None:
    for dotted, value in updates.items():
        section, key = _split(dotted, source)
        data[section][key] = _coerce(dotted, value, source)


def _flatten(tree: Mapping[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, keys in tree.items():
        if not isinstance(keys, Mapping):
            raise ConfigError(f"top-level key {section!r} must be a [section] ({source})")
        for key, value in keys.items():
            flat[f"{section}.{key}"] = value
    return flat


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    """``["cluster.hosts=2", ...]`` -> ``{"cluster.hosts": "2"}`` (values coerced later)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"override {pair!r} must look like section.key=value")
        out[key.strip()] = value.strip()
    return out


def _check_relations(data: dict[str, dict[str, Any]], source: str) -> None:
    """Keys that only make sense together. A running cell's executor beats PROGRESS every
    ``progress_interval_s``: with ``executor_silence_s`` no longer than that, the standbys would
    give every cell that outlasts it up as lost, although its executor is alive."""
    election = data["election"]
    if election["executor_silence_s"] <= election["progress_interval_s"]:
        raise ConfigError(
            f"election.executor_silence_s ({election['executor_silence_s']:g}) must exceed "
            f"election.progress_interval_s ({election['progress_interval_s']:g}): every cell longer "
            f"than it would be given up as lost ({source})"
        )


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    data = copy.deepcopy(DEFAULTS)
    if path is not None:
        file = Path(path)
        try:
            tree = tomllib.loads(file.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"configuration file {file} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from exc
        _layer(data, _flatten(tree, str(file)), str(file))
    if overrides:
        _layer(data, {k: v for k, v in overrides.items() if v is not None}, "command line")
    _check_relations(data, "command line" if overrides else str(path or "defaults"))
    return Config(data)


def config_from_json(text: str) -> Config:
    """Children of ``tandem up`` receive the parent's merged configuration this way."""
    data = copy.deepcopy(DEFAULTS)
    _layer(data, _flatten(json.loads(text), "inherited configuration"), "inherited configuration")
    _check_relations(data, "inherited configuration")
    return Config(data)
