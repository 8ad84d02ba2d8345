"""What encryption and authentication cost per message on each kind of link, without a cluster.

A cluster A/B (``scripts/bench_ab.py --without-security``, ``--strip curve|raft-tls`` for one
part) says what security costs a trivial cell (README, Security, "What it costs": ~0.18 ms of p50
pooled over 200 rounds in 2026-11), but a run's noise (~0.15 ms) hides any change smaller than
that. This runs each link alone in one process, as a ping-pong of one message
each way, with and without its security, in alternating repeats, and reports the process's CPU
(all threads: the ZMQ I/O thread, where CURVE runs, included) per round trip:

- ``raft``: two ``shared.raft.tcp_transport.TcpTransport``s exchanging a 200-byte APPEND and its
  answer, in the clear or under mutual TLS (``shared.raft.tls``, as replicas run);
- ``rpc``: an ``RpcServer`` and an ``RpcClient`` exchanging ``replica.event`` envelopes, plain or
  with CURVE and the local scheduler's authorisation (as a replica's link to its host).

``security_us_per_message`` is half the median difference of a round trip: the cost of one
message's security, sender and receiver together, with hot caches. A trivial cell carries about
16 Raft records among its replicas and 15 envelopes on service links (counted in a cluster), so
these figures times those counts give the floor of what security costs a cell; on the loaded VM
each costs several times more in a cluster (cold caches, other processes between every hop).

Usage: ``python scripts/bench_link_security.py [--round-trips 20000] [--repeats 3]``; one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

from shared import messages  # noqa: E402
from shared.envelope import Envelope  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.raft.tcp_transport import TcpTransport  # noqa: E402
from shared.raft.tls import LinkTls  # noqa: E402
from shared.raft.tls_ca import ClusterCA  # noqa: E402
from shared.raft.types import Entry, Message, MessageType  # noqa: E402
from shared.rpc import RpcClient, RpcServer  # noqa: E402
from shared.security import curve  # noqa: E402
from shared.security.authorization import local_scheduler_refusal, replica_principal  # noqa: E402

WARMUP = 1_000  # round trips before the clock starts


class _Clock:
    """CPU and wall time between round trip ``WARMUP`` and round trip ``WARMUP + n``."""

    def __init__(self, n: int, done: asyncio.Future[tuple[float, float]]) -> None:
        self._n, self._done, self.count = n, done, 0
        self._start = (0.0, 0.0)

    def tick(self) -> bool:
        """Count one round trip; False once the measurement is over."""
        self.count += 1
        if self.count == WARMUP:
            self._start = (time.process_time(), time.perf_counter())
        elif self.count == WARMUP + self._n and not self._done.done():
            cpu, wall = time.process_time(), time.perf_counter()
            self._done.set_result(((cpu - self._start[0]) / self._n, (wall - self._start[1]) / self._n))
            return False
        return not self._done.done()


async def raft_round_trips(n: int, secure: bool) -> tuple[float, float]:
    ca = ClusterCA.create() if secure else None

    def tls(member: str) -> LinkTls | None:
        return LinkTls.from_identity(ca.issue("bench", member)) if ca is not None else None

    done: asyncio.Future[tuple[float, float]] = asyncio.get_running_loop().create_future()
    clock = _Clock(n, done)
    append = Message(MessageType.APPEND, "b", "a", 1, entries=(Entry(1, 1, data=b"x" * 200),))

    def on_a(msgs: list[Message]) -> None:
        if clock.tick():
            a.send(append)

    def on_b(msgs: list[Message]) -> None:
        for _ in msgs:
            b.send(Message(MessageType.APPEND_RESP, "a", "b", 1))

    a = TcpTransport("a", "tcp://127.0.0.1:0", on_a, tls=tls("a"))
    b = TcpTransport("b", "tcp://127.0.0.1:0", on_b, tls=tls("b"))
    try:
        a.set_peer("b", await b.start())
        b.set_peer("a", await a.start())
        while not a.send(append):  # until the link is up (TLS handshake included)
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(done, 120)
    finally:
        a.close()
        b.close()


async def rpc_round_trips(n: int, secure: bool) -> tuple[float, float]:
    ctx = zmq.asyncio.Context()
    done: asyncio.Future[tuple[float, float]] = asyncio.get_running_loop().create_future()
    clock = _Clock(n, done)
    body = {"kernel_id": "k", "replica_id": "r1", "event": messages.REPLICA_EVENTS[0], "detail": {"n": 1}}
    server_keys, client_keys = curve.new_keypair(), curve.new_keypair()
    authority = None
    server_curve = client_curve = None
    if secure:  # as a local scheduler and one of its replicas
        authority = curve.CurveAuthority.acquire(ctx)
        directory = curve.PeerDirectory()
        directory.allow(client_keys.public, replica_principal("k", "r1"))
        authority.serve("bench", directory)
        server_curve = curve.ServerCurve(server_keys, "bench")
        client_curve = curve.ClientCurve(client_keys, server_keys.public)

    def authorize(principal: str, identity: bytes, env: Envelope) -> str | None:
        return local_scheduler_refusal(principal, env.type, env.body)

    def on_server(identity: bytes, env: Envelope) -> None:
        if clock.tick():
            server.send(identity, Envelope(messages.REPLICA_EVENT, body))

    server = RpcServer(
        ctx, on_server, name="bench", curve=server_curve, authorize=authorize if secure else None
    )
    client = RpcClient(
        ctx,
        identity=b"k/r1/bench",
        on_message=lambda env: client.send(Envelope(messages.REPLICA_EVENT, body)),
        curve=client_curve,
    )
    try:
        address = server.bind("tcp://127.0.0.1:0")
        server.start()
        client.connect(address)
        client.send(Envelope(messages.REPLICA_EVENT, body))
        return await asyncio.wait_for(done, 120)
    finally:
        await client.close()
        await server.close()
        if authority is not None:
            authority.release()
        ctx.destroy(linger=0)


LINKS: dict[str, Callable[[int, bool], Coroutine[Any, Any, tuple[float, float]]]] = {
    "raft": raft_round_trips,
    "rpc": rpc_round_trips,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-trips", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per link and mode")
    args = parser.parse_args(argv)
    configure_logging(level="error")
    cpu: dict[str, dict[str, list[float]]] = {link: {"plain": [], "secure": []} for link in LINKS}
    wall: dict[str, dict[str, list[float]]] = {link: {"plain": [], "secure": []} for link in LINKS}
    for repeat in range(args.repeats):
        for link, run in LINKS.items():
            modes = ("plain", "secure") if repeat % 2 == 0 else ("secure", "plain")
            for mode in modes:
                cpu_s, wall_s = uvloop.run(run(args.round_trips, mode == "secure"))
                cpu[link][mode].append(cpu_s * 1e6)
                wall[link][mode].append(wall_s * 1e6)
    result: dict[str, Any] = {
        "bench": "link_security",
        "round_trips": args.round_trips,
        "repeats": args.repeats,
    }
    for link in LINKS:
        plain, secure = (statistics.median(cpu[link][m]) for m in ("plain", "secure"))
        result[link] = {
            "cpu_us_per_round_trip": {"plain": round(plain, 2), "secure": round(secure, 2)},
            "wall_us_per_round_trip": {m: round(statistics.median(wall[link][m]), 2) for m in wall[link]},
            "security_us_per_message": round((secure - plain) / 2, 2),
            "cpu_us_per_round_trip_runs": {m: [round(x, 2) for x in cpu[link][m]] for m in cpu[link]},
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
