"""Does a Raft record's cryptography release the GIL? A probe for #14's security cost.

A replica runs three busy threads (the kernel's main thread, the IOPub thread, the Raft thread).
A C call that releases the GIL lets another runnable thread take it, and the caller then waits
for it back for up to a switch interval (``sys.getswitchinterval()``, 5 ms). This runs each
operation in a loop for ``--seconds``, alone and then beside one pure-Python thread that only
counts, and reports per operation:

- ``calls_per_s_alone`` and ``calls_per_s_beside_counter``: an operation that keeps the GIL keeps
  about half its rate beside the counter (the interpreter switches every interval); one that
  releases it on every call falls towards one call per switch interval;
- ``counter_per_call``: how far the counting thread got per call of the operation.

Operations: ``tls`` (one 200-byte record through ``shared.raft.tls.TlsSession``s over memory
BIOs: ``encrypt`` on one side, ``receive`` on the other, as the TCP transport runs them),
``aesgcm`` (``cryptography``'s AESGCM encrypt then decrypt of the same 200 bytes, as the sealed
records of d00a44b ran them) and ``python`` (a pure-Python loop of about the same length, the
reference for an operation that never releases the GIL).

Usage: ``python scripts/probe_gil_release.py [--seconds 2]``; one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from shared.raft.tls import LinkTls, TlsSession  # noqa: E402
from shared.raft.tls_ca import ClusterCA  # noqa: E402

PAYLOAD = b"x" * 200  # about a Raft APPEND of a trivial cell


def tls_record() -> Callable[[], None]:
    """One record, sealed by a TLS client and opened by its server, after a real handshake."""
    ca = ClusterCA.create()
    a = LinkTls.from_identity(ca.issue("probe", "r1"))
    b = LinkTls.from_identity(ca.issue("probe", "r2"))
    client, server = TlsSession(a.client, server_side=False), TlsSession(b.server, server_side=True)
    to_server = client.start()
    while not (client.established and server.established):
        server.receive(to_server)
        client.receive(server.pending())
        to_server = client.pending()
    if to_server:
        server.receive(to_server)

    def op() -> None:
        if server.receive(client.encrypt(PAYLOAD)) != PAYLOAD:
            raise AssertionError("the TLS record did not round-trip")

    return op


def aesgcm_record() -> Callable[[], None]:
    aead, nonce, aad = AESGCM(AESGCM.generate_key(bit_length=256)), bytes(12), b"\0\0\0\xd8"

    def op() -> None:
        aead.decrypt(nonce, aead.encrypt(nonce, PAYLOAD, aad), aad)

    return op


def python_work() -> Callable[[], None]:
    def op() -> None:
        sum(i for i in range(40))  # a generator: bytecode all along, no C call that could release

    return op


def rate(op: Callable[[], None], seconds: float) -> int:
    calls, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            op()
        calls += 20
    return calls


def beside_counter(op: Callable[[], None], seconds: float) -> tuple[int, int]:
    stop = threading.Event()
    count = [0]

    def counter() -> None:
        n = 0
        while not stop.is_set():
            for _ in range(1000):
                n += 1
        count[0] = n

    thread = threading.Thread(target=counter)
    thread.start()
    try:
        calls = rate(op, seconds)
    finally:
        stop.set()
        thread.join()
    return calls, count[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="per operation and condition")
    args = parser.parse_args(argv)
    result: dict[str, object] = {"switch_interval_s": sys.getswitchinterval()}
    for name, make in (("tls", tls_record), ("aesgcm", aesgcm_record), ("python", python_work)):
        op = make()
        alone = rate(op, args.seconds)
        calls, counted = beside_counter(op, args.seconds)
        result[name] = {
            "calls_per_s_alone": round(alone / args.seconds),
            "calls_per_s_beside_counter": round(calls / args.seconds),
            "counter_per_call": round(counted / max(calls, 1), 1),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
