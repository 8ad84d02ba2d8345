"""How many messages a trivial cell sends, per link and per kind: what encryption is paid on.

Each CURVE message costs its sender a box and its receiver an unbox, each Raft TLS record the same;
what they cost a cell is roughly their number times a per-message price, so fewer messages is the
lever left (see ``scripts/bench_ab.py --without-security``). This checks out a revision in a
temporary worktree (as ``bench_ab.py`` does), adds counters there (never in a commit: they cost
the hot path), runs its embedded cluster, sends ``x = 1`` cells and prints one JSON line: per
process role, per sending socket (``curve``: whether it encrypts, by the socket's last security
setting: a global scheduler that also serves its ipc endpoint counts as ``plain``, though its
replies to the operator over TCP are CURVE), per envelope type (a ``batch``
is counted once as ``batch`` and its items under ``batch/<type>``), the messages sent per cell;
``raft`` the writes on Raft TLS links per cell (``raft/records``: a TLS record each where the link
is encrypted, the clear on a loopback link by default) and the Raft messages in them by type.

Usage: ``python scripts/count_messages.py [REV] [--cells 200] [--hosts 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_ab import checkout, cluster, patch_tree, tree_of  # noqa: E402
from bench_latency import one_cell, role_of, start  # noqa: E402

from services.kernelspec import install_private  # noqa: E402

# The counters, written into the checked-out tree: each process dumps its counts to
# $TANDEM_COUNT_DIR/<pid>.json every 0.2 s from a daemon thread.
_COUNTER = '''"""Message counters for scripts/count_messages.py (never committed)."""

import json
import os
import sys
import threading
import time
from collections import Counter

COUNTS: Counter = Counter()
TRACE: list = []  # (unix time, socket, kinds) of the last sends, for one cell's timeline
_DIR = os.environ.get("TANDEM_COUNT_DIR", "")


def _type_of(frames) -> list:
    try:
        import msgpack

        raw = msgpack.unpackb(frames[-1], raw=False)
        kind = raw.get("type")
        if kind == "batch":
            inner = []
            for item in raw["body"]["items"]:
                sub = msgpack.unpackb(item, raw=False)
                inner.append("batch/" + str(sub.get("type")))
                if sub.get("type") == "jupyter.reply":
                    inner.append("batch/jupyter.reply/" + _contents(sub["body"]))
                    inner += ["batch/jupyter.reply/msgs"] * (1 + len(sub["body"].get("more", ())))
            return ["batch", *inner]
        if kind == "jupyter.reply":
            return [str(kind), "jupyter.reply/" + _contents(raw["body"])] + ["jupyter.reply/msgs"] * (
                1 + len(raw["body"].get("more", ()))
            )
        return [str(kind)]
    except Exception:
        pass
    try:
        at = list(frames).index(b"<IDS|MSG>")
        return ["jupyter/" + json.loads(frames[at + 2]).get("msg_type", "?")]
    except Exception:
        return ["raw"]


def _contents(body) -> str:
    """The Jupyter messages in one jupyter.reply, e.g. ``execute_reply+idle``."""
    names = []
    for _, frames in [(body["channel"], body["frames"]), *body.get("more", ())]:
        header = json.loads(frames[1])
        name = header.get("msg_type", "?")
        if name == "status":
            name = json.loads(frames[4]).get("execution_state", "status")
        names.append(name)
    return "+".join(names)


def sent(name: str, sock, frames) -> None:
    if not _DIR:
        return
    import zmq

    try:
        curve = sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
    except Exception:
        curve = False
    kinds = _type_of(frames)
    for kind in kinds:
        COUNTS[f"{name.split(':')[0]}|{'curve' if curve else 'plain'}|{kind}"] += 1
    TRACE.append((time.time(), name.split(":")[0], curve, kinds[0], len(kinds)))
    del TRACE[:-3000]


def raft_record(kinds) -> None:
    if not _DIR:
        return
    COUNTS["raft|tls|records"] += 1
    TRACE.append((time.time(), "raft", True, "+".join(kinds), len(kinds)))
    del TRACE[:-3000]
    for kind in kinds:
        COUNTS[f"raft|tls|{kind}"] += 1


def _dump() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    while True:
        time.sleep(0.2)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"argv": sys.argv, "counts": dict(COUNTS), "trace": TRACE}, f)
        os.replace(tmp, path)


if _DIR:
    threading.Thread(target=_dump, daemon=True).start()
'''

# (file, anchor, replacement): the anchor must occur once in that revision's file
_PATCHES = (
    (
        "shared/zmq_drain.py",
        "        self._sock = sock\n",
        "        self._sock = sock\n        self._count_name = name\n",
    ),
    (
        "shared/zmq_drain.py",
        "            send_multipart_nowait(self._sock, frames)\n",
        "            send_multipart_nowait(self._sock, frames)\n"
        "            from shared import _msgcount\n"
        "            _msgcount.sent(self._count_name, self._sock, frames)\n",
    ),
    (
        "shared/zmq_drain.py",
        "            self._sock.send(frame, _NOBLOCK)\n",
        "            self._sock.send(frame, _NOBLOCK)\n"
        "            from shared import _msgcount\n"
        "            _msgcount.sent(self._count_name, self._sock, [frame])\n",
    ),
    (
        "shared/raft/tcp_transport.py",
        "        payload = encode_message(msg)\n",
        "        payload = encode_message(msg)\n        link.count_kinds.append(msg.type.name)\n",
    ),
    (
        "shared/raft/tcp_transport.py",
        "        small = len(frames) == 1 or sum(map(len, frames)) < _SMALL_FRAME\n",
        "        small = len(frames) == 1 or sum(map(len, frames)) < _SMALL_FRAME\n"
        "        if tls is not None:\n"
        "            from shared import _msgcount\n"
        "            _msgcount.raft_record(link.count_kinds)\n"
        "        link.count_kinds = []\n",
    ),
    (
        "shared/raft/tcp_transport.py",
        "    def __init__(self, owner: TcpTransport, peer_id: str, address: str) -> None:\n",
        "    def __init__(self, owner: TcpTransport, peer_id: str, address: str) -> None:\n"
        "        self.count_kinds = []\n",
    ),
)


def instrument(tree: Path) -> None:
    (tree / "shared" / "_msgcount.py").write_text(_COUNTER)
    patch_tree(tree, _PATCHES, "count_messages")


def dumps(count_dir: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(pid, what it dumped) of every process that counted."""
    for path in count_dir.glob("*.json"):
        try:
            yield int(path.stem), json.loads(path.read_text())
        except (OSError, ValueError):
            continue


def snapshot(count_dir: Path, roles: dict[int, str]) -> dict[str, int]:
    """Every process's counts so far, keyed ``role|socket|curve|type``."""
    totals: dict[str, int] = {}
    for pid, dumped in dumps(count_dir):
        for key, n in dumped["counts"].items():
            where = f"{roles.get(pid, 'other')}|{key}"
            totals[where] = totals.get(where, 0) + n
    return totals


def cell_timeline(count_dir: Path, roles: dict[int, str], start: float, end: float) -> list[str]:
    """Every send between the client's execute_request and its idle (``end``), in µs after it."""
    events = []
    for pid, dumped in dumps(count_dir):
        for at, socket, curve, kind, n in dumped["trace"]:
            if start <= at <= end + 0.05:
                events.append(
                    (at, f"{roles.get(pid, 'other')}:{pid} {socket} {'C' if curve else '-'} {kind} x{n}")
                )
    events.sort()
    return [f"{(at - start) * 1e6:8.0f} {what}" for at, what in events] + [
        f"{(end - start) * 1e6:8.0f} client done"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev", nargs="?", default=".", help="a git revision, or . for this checkout as it is")
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="tandem-count-") as tmp, contextlib.ExitStack() as stack:
        install_private(Path(tmp) / "prefix")
        count_dir = Path(tmp) / "counts"
        count_dir.mkdir()
        os.environ["TANDEM_COUNT_DIR"] = str(count_dir)
        tree = stack.enter_context(checkout(args.rev, Path(tmp), "a"))
        instrument(tree)
        state_dir = Path(tmp) / "a-run" / "state"
        state_dir.mkdir(parents=True)
        up = stack.enter_context(cluster(tree, state_dir, args.hosts, args.set))
        os.environ["TANDEM_STATE_DIR"] = str(state_dir)
        km, kc = start("tandem", cwd=tree)
        try:
            for _ in range(args.warmup):
                one_cell(kc)
            time.sleep(1.0)  # the warm-up's counts dumped
            roles = {p.pid: role_of(p) for p in tree_of(up)}
            before = snapshot(count_dir, roles)
            started = time.monotonic()
            for _ in range(args.cells):
                one_cell(kc)
            elapsed = time.monotonic() - started
            time.sleep(1.0)
            after = snapshot(count_dir, roles)
            time.sleep(0.3)  # quiet, then one cell whose sends are laid out in time
            sent_at = time.time()
            one_cell(kc)
            done_at = time.time()
            time.sleep(0.5)
            timeline = cell_timeline(count_dir, roles, sent_at, done_at)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    per_cell: dict[str, Any] = {}
    for key in sorted(after):
        n = after[key] - before.get(key, 0)
        if n:
            per_cell[key] = round(n / args.cells, 2)
    curve_total = sum(
        v for k, v in per_cell.items() if k.split("|")[2] == "curve" and "/" not in k.split("|")[3]
    )
    raft_records = sum(v for k, v in per_cell.items() if k.endswith("|raft|tls|records"))
    print(
        json.dumps(
            {
                "bench": "message_count",
                "rev": args.rev,
                "cells": args.cells,
                "seconds": round(elapsed, 1),
                "curve_messages_per_cell": round(curve_total, 2),
                "raft_tls_records_per_cell": round(raft_records, 2),
                "per_cell": per_cell,
                "timeline_us": timeline,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
