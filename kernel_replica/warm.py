"""A pre-warmed replica runtime (NotebookOS §3.2.3's Container Prewarmer), started by a local
scheduler before any kernel needs it:

    python -m kernel_replica.warm [--import torch --import numpy ...]

It imports what a replica start spends its time on (IPython, ipykernel, tornado, the replica's own
modules, and the ``--import`` modules that are installed, torch by default), then waits for its
assignment. The local scheduler talks to it over the process's own stdin/stdout pipes, a launch
channel like argv (it is not yet a service anyone can address):

* stdout: one line ``ready <pid>`` once the imports are done;
* stdin: one JSON line ``{"argv": [...], "env": {...}, "log_file": "...", "cwd": "..."}``: the
  arguments of ``python -m kernel_replica`` for the replica it becomes, its extra environment,
  its log, and its working directory (null: stay where it started).

Then stdout/stderr go to the replica's log and ``kernel_replica.__main__.main(argv)`` runs exactly
as in a cold start. End of input before an assignment (the pool shrank) exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

PRELOAD = (
    "IPython",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "tornado.ioloop",
    "kernel_replica.kernel",
    "kernel_replica.raft_bridge",
)


def preload(extra: list[str]) -> list[str]:
    """Import the replica's modules and the installed ``extra`` ones; the names imported."""
    done = []
    for name in (*PRELOAD, *extra):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if name in PRELOAD:
                raise
            print(f"warm runtime: skipping {name}: {exc}", file=sys.stderr, flush=True)
            continue
        done.append(name)
    return done


def become(assignment: dict[str, Any]) -> list[str]:
    """Point fds 0-2 where a cold-started replica has them and take its environment; its argv."""
    argv = assignment.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("assignment needs argv: a list of strings")
    log_fd = os.open(str(assignment["log_file"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.update({str(k): str(v) for k, v in (assignment.get("env") or {}).items()})
    cwd = assignment.get("cwd")
    if cwd:
        started_in = os.getcwd()
        os.chdir(cwd)  # the kernel's working directory, where a cold start's Popen(cwd=...) puts it
        if sys.path and sys.path[0] == started_in:
            sys.path[0] = cwd  # ``python -m`` put the start directory first: modules beside the notebook
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernel_replica.warm", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], help="also import this module"
    )
    args = parser.parse_args(argv)
    imported = preload(args.imports)
    print(f"warm runtime: imported {', '.join(imported)}", file=sys.stderr, flush=True)
    sys.stdout.write(f"ready {os.getpid()}\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # released before it was needed
    replica_argv = become(json.loads(line))
    from kernel_replica.__main__ import exit_now
    from kernel_replica.__main__ import main as replica_main

    exit_now(replica_main(replica_argv))  # as a replica started cold: no slow teardown


if __name__ == "__main__":
    sys.exit(main())
