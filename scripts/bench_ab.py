"""A/B of the trivial-cell latency of two revisions, both running at once on this machine.

A latency run is not comparable with one taken minutes later on these shared machines (the same
code measured 4.3 and 6.8 ms p50 within two hours, and runs taken in turns still disagreed by more
than the changes being measured). So both revisions run side by side: each is checked out in a
temporary git worktree (``.`` means this checkout as it is, uncommitted changes to tracked files
included) and runs its own embedded cluster (``tandem up`` in that worktree, with this
interpreter), and one client sends blocks of ``x = 1`` cells to A, to B and to a stock ipykernel
in turn, as
``scripts/bench_latency.py`` does for one revision (A and B take turns going first: the side
measured right after the stock kernel ran slightly faster). Every slow second then hits all three
alike.

Prints one JSON line: per revision ``p50_ms``, ``p99_ms``, ``ratio_p50`` (to the stock kernel's
p50) and ``cpu_ms_per_cell`` (the client plus that cluster's processes, all threads, per cell;
steadier than latency on a loaded machine) and ``cpu_ms_per_cell_by_role``, the same split per
process role (client, gateway, global_scheduler, local_scheduler, replica), ZMQ's I/O threads
(``<role>/zmq_io``, where CURVE does its cryptography) apart; ``paired`` holds, per round of blocks, B's p50 and CPU
minus A's, and their medians (``p50_change_ms``, ``cpu_change_ms``; negative: B is cheaper).

Even so, an A/A run (one revision on both sides) is not centred on zero: five such runs on the
2-core VM (40 x 50 cells) all had side B ahead, by 0.08-0.20 ms per-round p50 (medians) and
0.2 ms of CPU per cell, mostly in the replicas; starting B's cluster first did not clearly move
it, and eight later runs of ``scripts/bench_security_cost.py`` put it at -0.06 and 0.00 ms. So a
change smaller than ~0.1 ms needs runs in both orders (``REV_A REV_B`` and ``REV_B REV_A``),
and the security cost ``scripts/bench_security_cost.py``, which does that.

``--without-security a`` runs side A without its encryption and authentication (CURVE and the
message authorisation on the service links, TLS on the Raft links; edited in A's temporary
worktree only), so ``bench_ab.py REV REV --without-security a`` measures what they cost REV;
``--strip curve`` or ``--strip raft-tls`` strips only the service links' part or only the Raft
links' TLS, to split that cost.

Usage: ``python scripts/bench_ab.py REV_A REV_B [--rounds 8] [--block 50] [--set KEY=VALUE]
[--without-security a|b [--strip all|curve|raft-tls]]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import psutil  # noqa: E402
from bench_latency import cpu_by_role, cpu_seconds, one_cell, percentile, role_of, start  # noqa: E402

from services.kernelspec import install_private  # noqa: E402

SIDES = ("a", "b")
READY_TIMEOUT_S = 120.0


# What --without-security changes in that side's temporary worktree (never in a commit), in two
# parts that ``--strip`` can take alone. "curve": no CURVE, no peer-credential check (a local
# scheduler's ipc replica link) and no authorisation on the service links but the gateway's
# lifecycle API (this process's provisioner keeps its operator key); "raft-tls": no TLS on the
# Raft links. (file, anchor, replacement)
_STRIP_SECURITY: dict[str, tuple[tuple[str, str, str], ...]] = {
    "curve": (
        (
            "shared/rpc.py",
            "        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)\n",
            "        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)\n"
            '        if name != "gateway-api":\n            curve = authorize = peer_credentials = None\n',
        ),
        (
            "shared/rpc.py",
            "        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)\n",
            "        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER, socket_class=zmq.Socket)\n"
            "        curve = None\n",
        ),
    ),
    "raft-tls": (("shared/config.py", '        "tls": True,\n', '        "tls": False,\n'),),
}
STRIP_PARTS = ("all", *_STRIP_SECURITY)


def strip_security(tree: Path, part: str = "all") -> None:
    """The same code without its encryption and authentication (``part``: all of it, or one of
    ``_STRIP_SECURITY``'s parts), to measure what they cost."""
    parts = _STRIP_SECURITY.values() if part == "all" else (_STRIP_SECURITY[part],)
    for patches in parts:
        patch_tree(tree, patches, f"--without-security --strip {part}")


def patch_tree(tree: Path, patches: tuple[tuple[str, str, str], ...], purpose: str) -> None:
    """Edit a temporary worktree: each (file, anchor, replacement); the anchor must occur once."""
    for name, anchor, replacement in patches:
        path = tree / name
        text = path.read_text()
        if text.count(anchor) != 1:
            raise SystemExit(f"{purpose}: {name} of this revision has no single {anchor.strip()!r}")
        path.write_text(text.replace(anchor, replacement))


@contextlib.contextmanager
def checkout(rev: str, parent: Path, side: str) -> Iterator[Path]:
    """A worktree of ``rev`` (for ``.``, of this checkout's tracked files as they are, through
    ``git stash create``), removed afterwards. Both sides run from worktrees alike: a cluster
    run from this checkout measured ~0.1 ms slower than the same commit from a worktree."""
    name = f"{side}-{rev.replace('/', '_')}"  # the side too: both may check out one revision
    if rev == ".":
        name = f"{side}-checkout"
        rev = (
            subprocess.run(
                ["git", "-C", str(ROOT), "stash", "create"], check=True, capture_output=True, text=True
            ).stdout.strip()
            or "HEAD"
        )
    path = parent / name
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(path), rev],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            check=False, capture_output=True,
        )  # fmt: skip


@contextlib.contextmanager
def cluster(tree: Path, state_dir: Path, hosts: int, overrides: list[str]) -> Iterator[psutil.Process]:
    """``tandem up`` of ``tree``'s code, until its cluster file appears; stopped with SIGTERM."""
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--hosts",
        str(hosts),
        "--state-dir",
        str(state_dir),
    ]
    command += ["--set", "log.level=warning", *(x for o in overrides for x in ("--set", o))]
    log = open(state_dir.parent / "up.log", "wb")  # noqa: SIM115 - closed below
    # the side's code for every process, wherever it starts (replicas: the kernel's directory)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (state_dir / "cluster.json").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (state_dir.parent / "up.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"tandem up in {tree} did not start (exit {process.poll()}): {tail}")
            time.sleep(0.2)
        yield psutil.Process(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def tree_of(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def measure(
    ups: dict[str, psutil.Process],
    state_dirs: dict[str, Path],
    trees: dict[str, Path],
    rounds: int,
    block: int,
    warmup: int,
) -> dict[str, Any]:
    kernels: dict[str, Any] = {}
    for side in SIDES:
        os.environ["TANDEM_STATE_DIR"] = str(state_dirs[side])  # the provisioner reads it at start
        # replicas start in the kernel's working directory, first on their sys.path: the side's
        # tree, or `import shared` there would find another checkout's code
        kernels[side] = start("tandem", cwd=trees[side])
    kernels["ipykernel"] = start("python3")
    samples: dict[str, list[list[float]]] = {name: [] for name in kernels}
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    by_role: dict[str, dict[str, float]] = {side: {} for side in SIDES}
    me = psutil.Process()
    try:
        for _, kc in kernels.values():
            for _ in range(warmup):
                one_cell(kc)
        processes = {side: [me, *tree_of(ups[side])] for side in SIDES}  # after warm-up: replicas up
        roles = {
            side: {p.pid: "client" if p.pid == me.pid else role_of(p) for p in processes[side]}
            for side in SIDES
        }
        for round_ in range(rounds):
            order = ("a", "b", "ipykernel") if round_ % 2 == 0 else ("b", "a", "ipykernel")
            for name in order:  # A and B take turns going first: no side gains from the order
                kc = kernels[name][1]
                before = cpu_seconds(processes[name]) if name in cpu else 0.0
                roles_before = cpu_by_role(roles[name]) if name in cpu else {}
                samples[name].append([one_cell(kc) for _ in range(block)])
                if name in cpu:
                    cpu[name].append((cpu_seconds(processes[name]) - before) * 1000.0 / block)
                    for role, seconds in cpu_by_role(roles[name]).items():
                        spent = seconds - roles_before.get(role, 0.0)
                        by_role[name][role] = by_role[name].get(role, 0.0) + spent
    finally:
        for km, kc in kernels.values():
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    everything = {name: [x for chunk in chunks for x in chunk] for name, chunks in samples.items()}
    stock_p50 = statistics.median(everything["ipykernel"])
    result: dict[str, Any] = {"ipykernel_p50_ms": round(stock_p50, 3)}
    for side in SIDES:
        p50 = statistics.median(everything[side])
        result[side] = {
            "p50_ms": round(p50, 3),
            "p99_ms": round(percentile(everything[side], 99), 3),
            "ratio_p50": round(p50 / stock_p50, 3),
            "cpu_ms_per_cell": round(statistics.fmean(cpu[side]), 3),
            # per process role (``/zmq_io``: its ZMQ I/O threads), over every block of this side
            "cpu_ms_per_cell_by_role": {
                role: round(seconds * 1000.0 / (rounds * block), 3)
                for role, seconds in sorted(by_role[side].items())
            },
        }
    p50_change = [
        round(statistics.median(b) - statistics.median(a), 3)
        for a, b in zip(samples["a"], samples["b"], strict=True)
    ]
    cpu_change = [round(b - a, 3) for a, b in zip(cpu["a"], cpu["b"], strict=True)]
    result["paired"] = {
        "p50_change_ms": round(statistics.median(p50_change), 3),
        "cpu_change_ms": round(statistics.median(cpu_change), 3),
        "p50_change_per_round": p50_change,
        "cpu_change_per_round": cpu_change,
    }
    return result


def run(
    rev_a: str,
    rev_b: str,
    *,
    rounds: int,
    block: int,
    warmup: int = 20,
    hosts: int = 3,
    overrides: list[str] | None = None,
    without_security: str | None = None,
    strip: str = "all",
) -> dict[str, Any]:
    """One A/B run (see the module docstring): the dict ``main`` prints."""
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="tandem-ab-") as tmp, contextlib.ExitStack() as stack:
        old_path = install_private(Path(tmp) / "prefix")
        ups: dict[str, psutil.Process] = {}
        trees: dict[str, Path] = {}
        state_dirs = {side: Path(tmp) / f"{side}-run" / "state" for side in SIDES}
        try:
            for side, rev in zip(SIDES, (rev_a, rev_b), strict=True):
                tree = trees[side] = stack.enter_context(checkout(rev, Path(tmp), side))
                if without_security == side:
                    strip_security(tree, strip)
                state_dirs[side].mkdir(parents=True)
                ups[side] = stack.enter_context(cluster(tree, state_dirs[side], hosts, overrides or []))
            result = measure(ups, state_dirs, trees, rounds, block, warmup)
        finally:
            os.environ["JUPYTER_PATH"] = old_path
    return {
        "bench": "latency_ab",
        "rounds": rounds,
        "block": block,
        "rev_a": rev_a,
        "rev_b": rev_b,
        "without_security": without_security,
        "strip": strip if without_security else None,
        **result,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rev_a", help="a git revision, or . for this checkout as it is")
    parser.add_argument("rev_b", help="a git revision, or . for this checkout as it is")
    parser.add_argument("--rounds", type=int, default=8, help="blocks per kernel")
    parser.add_argument("--block", type=int, default=50, help="cells per block")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for both sides")
    parser.add_argument(
        "--without-security",
        choices=SIDES,
        help="run that side without CURVE, authorisation and Raft TLS (what they cost; REV_A may equal REV_B)",
    )
    parser.add_argument(
        "--strip",
        choices=STRIP_PARTS,
        default="all",
        help="with --without-security: strip only the service links' CURVE and authorisation "
        "(curve) or only the Raft links' TLS (raft-tls); default all",
    )
    args = parser.parse_args(argv)
    if args.rev_a == args.rev_b and args.without_security is None:
        parser.error("give two different revisions")
    if args.strip != "all" and args.without_security is None:
        parser.error("--strip goes with --without-security")
    result = run(
        args.rev_a,
        args.rev_b,
        rounds=args.rounds,
        block=args.block,
        warmup=args.warmup,
        hosts=args.hosts,
        overrides=args.set,
        without_security=args.without_security,
        strip=args.strip,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
