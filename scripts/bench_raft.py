#!/usr/bin/env python
"""Benchmark shared.raft: three OS processes on loopback, the real transport, fdatasync'd storage.

Prints ONE JSON line:

* ``leader_p50_ms``/``leader_p99_ms``: one 1 KiB proposal at a time from the leader, propose() call
  to return (committed on a quorum and applied locally);
* ``follower_p50_ms``/``follower_p99_ms``: the same from a follower (forward to the leader, commit,
  learn the commit, apply); ``p50_ms``/``p99_ms`` are the worse of the two;
* ``commits_per_s``: ``--inflight`` concurrent proposers on the leader for ``--seconds``;
* ``baseline``: raw 1 KiB append + fdatasync latency and a bare ZMQ DEALER/ROUTER round trip between
  two processes, measured in the same run, and ``ratios`` of the results to them, because these
  machines are shared and noisy: a ratio travels between runs better than a millisecond figure.

``--transport zmq`` runs the group over the ZMQ transport instead of the default TCP one; compare
the two in alternating runs (``--no-fsync`` takes the disk out of the comparison). ``--tls`` runs
the TCP links under mutual TLS, as replicas do (``raft.tls``), with certificates from a fresh CA:
on loopback, as here, that is the handshake and then the clear, unless ``--encrypt-loopback``
(``raft.encrypt_loopback``) encrypts every record as links between hosts do.

Usage: ``python scripts/bench_raft.py [--samples 2000] [--seconds 3] [--inflight 128] [--transport tcp]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.raft.transport import TRANSPORT_KINDS


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _quiet_logs() -> None:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


# ------------------------------------------------------------------------------- baselines


def baseline_fdatasync(directory: str, samples: int, size: int) -> list[float]:
    path = os.path.join(directory, "fsync-baseline")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    buf = os.urandom(size)
    out = []
    try:
        for _ in range(samples):
            t = time.perf_counter()
            os.write(fd, buf)
            os.fdatasync(fd)
            out.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
    return sorted(out)


def _echo_server(address: str, ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"stop":
            break
        sock.send_multipart(frames)
    sock.close(0)
    ctx.destroy(linger=0)


def baseline_zmq_rtt(samples: int, size: int) -> list[float]:
    import zmq

    address = f"tcp://127.0.0.1:{_free_ports(1)[0]}"
    spawn = mp.get_context("spawn")
    ready = spawn.Event()
    proc = spawn.Process(target=_echo_server, args=(address, ready), daemon=True)
    proc.start()
    ready.wait(10)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"bench")
    sock.connect(address)
    payload = os.urandom(size)
    out = []
    try:
        for i in range(samples + 100):
            t = time.perf_counter()
            sock.send(payload)
            sock.recv()
            if i >= 100:
                out.append(time.perf_counter() - t)
        sock.send(b"stop")
    finally:
        sock.close(0)
        ctx.destroy(linger=0)
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    return sorted(out)


# ------------------------------------------------------------------------------- cluster node


def _node_main(node_id: str, addresses: dict[str, str], data_dir: str, conn: Connection, opts: dict) -> None:
    import uvloop

    _quiet_logs()
    uvloop.run(_node_async(node_id, addresses, data_dir, conn, opts))


async def _node_async(
    node_id: str, addresses: dict[str, str], data_dir: str, conn: Connection, opts: dict
) -> None:
    from shared.raft.driver import PeerConfig, RaftError, RaftPeer
    from shared.raft.tls import LinkTls, MemberIdentity

    applied = 0

    def on_apply(_entry: Any) -> None:
        nonlocal applied
        applied += 1

    cfg = PeerConfig(
        node_id,
        addresses[node_id],
        data_dir,
        peers={k: v for k, v in addresses.items() if k != node_id},
        bootstrap_voters=tuple(sorted(addresses)),
        sync_in_thread=opts["sync_in_thread"],
        fsync=opts["fsync"],
        snapshot_every=opts["snapshot_every"],
        transport_kind=opts["transport"],
        tls=LinkTls.from_identity(
            MemberIdentity.from_json(opts["identities"][node_id]), encrypt_loopback=opts["encrypt_loopback"]
        )
        if opts.get("identities")
        else None,
    )
    peer = RaftPeer(cfg, on_apply=on_apply, take_snapshot=lambda: applied.to_bytes(8, "little"))
    await peer.start()
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[Any] = asyncio.Queue()

    def on_command() -> None:
        try:
            commands.put_nowait(conn.recv())
        except (EOFError, OSError):  # the parent died: stop rather than spin on a dead pipe
            loop.remove_reader(conn.fileno())
            commands.put_nowait(("stop",))

    loop.add_reader(conn.fileno(), on_command)

    async def latency(n: int, size: int) -> list[float]:
        payload = os.urandom(size)
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await peer.propose(payload)
            out.append(time.perf_counter() - t)
        return out

    async def throughput(seconds: float, inflight: int, size: int) -> dict[str, Any]:
        payload = os.urandom(size)
        done = 0
        errors = 0
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop_at:
                try:
                    await peer.propose(payload)
                    done += 1
                except RaftError:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return {"commits": done, "errors": errors, "elapsed": time.perf_counter() - t0}

    profiler = None
    try:
        while True:
            cmd, *args = await commands.get()
            if cmd == "status":
                st = peer.status()
                conn.send({"leader": st.leader, "role": int(st.role), "applied": st.applied})
            elif cmd == "wait_leader":
                conn.send(await peer.wait_for_leader(timeout=args[0]))
            elif cmd == "latency":
                conn.send(await latency(*args))
            elif cmd == "throughput":
                conn.send(await throughput(*args))
            elif cmd == "profile_start":
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
                conn.send(True)
            elif cmd == "profile_stop":
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(args[0])
                conn.send(True)
            elif cmd == "stats":
                st = peer.status()
                conn.send(
                    {
                        "transport": dataclasses.asdict(peer.transport_stats),
                        "applied": st.applied,
                        "commit": st.commit,
                        "disk_bytes": sum(f.stat().st_size for f in Path(data_dir).iterdir()),
                    }
                )
            elif cmd == "stop":
                break
    finally:
        loop.remove_reader(conn.fileno())
        await peer.stop()
        with contextlib.suppress(OSError):
            conn.send("stopped")


class Cluster:
    def __init__(self, base_dir: str, opts: dict[str, Any]) -> None:
        ports = _free_ports(3)
        self.ids = ["n1", "n2", "n3"]
        self.addresses = {nid: f"tcp://127.0.0.1:{p}" for nid, p in zip(self.ids, ports, strict=True)}
        spawn = mp.get_context("spawn")
        self.conns: dict[str, Connection] = {}
        self.procs: dict[str, Any] = {}
        for nid in self.ids:
            parent, child = spawn.Pipe()
            proc = spawn.Process(
                target=_node_main,
                args=(nid, self.addresses, os.path.join(base_dir, nid), child, opts),
                daemon=True,
            )
            proc.start()
            self.conns[nid], self.procs[nid] = parent, proc

    def call(self, nid: str, *cmd: Any, timeout: float = 120.0) -> Any:
        conn = self.conns[nid]
        conn.send(cmd)
        if not conn.poll(timeout):
            raise TimeoutError(f"{nid} did not answer {cmd[0]} within {timeout}s")
        return conn.recv()

    def close(self) -> None:
        for _nid, conn in self.conns.items():
            with contextlib.suppress(Exception):
                conn.send(("stop",))
                conn.poll(5) and conn.recv()
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(1)


def _summary(lat: list[float]) -> tuple[float, float]:
    lat = sorted(lat)
    return _ms(_percentile(lat, 0.50)), _ms(_percentile(lat, 0.99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000, help="sequential proposals per latency run")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=3.0, help="throughput run length")
    ap.add_argument("--inflight", type=int, default=128, help="concurrent proposals in the throughput run")
    ap.add_argument("--size", type=int, default=1024, help="payload bytes")
    ap.add_argument("--sync-in-thread", action="store_true", help="fdatasync in a worker thread")
    ap.add_argument("--snapshot-every", type=int, default=10_000)
    ap.add_argument(
        "--no-fsync", action="store_true", help="diagnostic only: skip fdatasync to isolate disk cost"
    )
    ap.add_argument("--profile", metavar="DIR", help="cProfile the leader and a follower into DIR")
    ap.add_argument("--transport", choices=TRANSPORT_KINDS, default="tcp", help="the Raft peer transport")
    ap.add_argument("--tls", action="store_true", help="mutual TLS on the links (tcp only), as replicas run")
    ap.add_argument(
        "--encrypt-loopback", action="store_true", help="with --tls: encrypt every record, as between hosts"
    )
    args = ap.parse_args()
    if args.encrypt_loopback and not args.tls:
        ap.error("--encrypt-loopback goes with --tls")
    opts = {
        "encrypt_loopback": args.encrypt_loopback,
        "transport": args.transport,
        "sync_in_thread": args.sync_in_thread,
        "snapshot_every": args.snapshot_every,
        "fsync": not args.no_fsync,
    }
    if args.tls:
        from shared.raft.tls_ca import ClusterCA

        ca = ClusterCA.create()
        opts["identities"] = {nid: ca.issue("bench", nid).to_json() for nid in ("n1", "n2", "n3")}

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-raft-", dir=os.environ.get("BENCH_DIR")) as base:
        # The disk is shared with whatever else runs here, so the fsync baseline is sampled in three
        # windows (before each latency run and after the throughput run) and pooled.
        fsync_windows = [baseline_fdatasync(base, 500, args.size)]
        rtt = baseline_zmq_rtt(2000, args.size)
        cluster = Cluster(base, opts)
        try:
            leader = cluster.call("n1", "wait_leader", 30.0)
            follower = next(n for n in cluster.ids if n != leader)
            for nid in cluster.ids:  # everyone knows the leader before we measure
                cluster.call(nid, "wait_leader", 30.0)
            if args.profile:
                for nid in (leader, follower):
                    cluster.call(nid, "profile_start")
            cluster.call(leader, "latency", args.warmup, args.size)
            leader_lat = cluster.call(leader, "latency", args.samples, args.size)
            fsync_windows.append(baseline_fdatasync(base, 500, args.size))
            cluster.call(follower, "latency", args.warmup, args.size)
            follower_lat = cluster.call(follower, "latency", args.samples, args.size)
            tput = cluster.call(leader, "throughput", args.seconds, args.inflight, args.size)
            fsync_windows.append(baseline_fdatasync(base, 500, args.size))
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                for nid, role in ((leader, "leader"), (follower, "follower")):
                    cluster.call(nid, "profile_stop", os.path.join(args.profile, f"{role}.prof"))
            # Correctness check: every replica ends up having applied the same log.
            deadline = time.monotonic() + 10
            while True:
                stats = {nid: cluster.call(nid, "stats") for nid in cluster.ids}
                applied = {s["applied"] for s in stats.values()}
                if len(applied) == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            cluster.close()

    lp50, lp99 = _summary(leader_lat)
    fp50, fp99 = _summary(follower_lat)
    fsync = sorted(x for w in fsync_windows for x in w)
    fs50, fs99 = _ms(_percentile(fsync, 0.5)), _ms(_percentile(fsync, 0.99))
    rt50, rt99 = _ms(_percentile(rtt, 0.5)), _ms(_percentile(rtt, 0.99))
    commits_per_s = round(tput["commits"] / tput["elapsed"], 1)
    result = {
        "bench": "raft",
        "p50_ms": max(lp50, fp50),
        "p99_ms": max(lp99, fp99),
        "p_basis": "the worse of leader-side and follower-side proposers",
        "leader_p50_ms": lp50,
        "leader_p99_ms": lp99,
        "follower_p50_ms": fp50,
        "follower_p99_ms": fp99,
        "commits_per_s": commits_per_s,
        "throughput_errors": tput["errors"],
        "inflight": args.inflight,
        "payload_bytes": args.size,
        "samples": args.samples,
        "sync_in_thread": args.sync_in_thread,
        "fsync": not args.no_fsync,
        "raft_transport": args.transport,
        "raft_tls": args.tls,
        "raft_encrypt_loopback": args.encrypt_loopback,
        "baseline": {
            "fdatasync_p50_ms": fs50,
            "fdatasync_p99_ms": fs99,
            "fdatasync_p50_ms_per_window": [_ms(_percentile(w, 0.5)) for w in fsync_windows],
            "zmq_rtt_p50_ms": rt50,
            "zmq_rtt_p99_ms": rt99,
        },
        # An ideal commit costs one fdatasync plus one round trip from the leader (the leader's own
        # write overlaps the followers'); a follower's proposal adds a hop each way.
        "ratios": {
            "leader_p50_over_fsync_plus_rtt": round(lp50 / (fs50 + rt50), 2),
            "follower_p50_over_fsync_plus_2rtt": round(fp50 / (fs50 + 2 * rt50), 2),
            "commits_per_fsync_time": round(commits_per_s * fs50 / 1000, 2),
        },
        "targets_met": {
            "p50": max(lp50, fp50) <= 1.0,
            "p99": max(lp99, fp99) <= 5.0,
            "commits_per_s": commits_per_s >= 5000,
        },
        "replicas_converged": len({s["applied"] for s in stats.values()}) == 1,
        "applied": {nid: s["applied"] for nid, s in stats.items()},
        # Bounded by automatic snapshots + compaction, though far more than this was written.
        "disk_bytes": {nid: s["disk_bytes"] for nid, s in stats.items()},
        "transport": {nid: s["transport"] for nid, s in stats.items()},
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loop": "uvloop",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
