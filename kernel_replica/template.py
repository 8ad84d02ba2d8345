"""A runtime template (fork server): one process per host that has imported what a replica start
spends its time on, and forks a runtime on demand (restore-based fast start, issue 20):

    python -m kernel_replica.template [--import torch ...]

Checkpoint/restore of a whole process (CRIU) does not run on this machine: Debian's CRIU 3.17.1
stops at kernel feature detection on Linux 6.18 ("vdso: Unexpected rt vDSO area bounds", every
``criu check``), so the "image" a runtime starts from is this process's memory, copied on write by
``fork()``: the interpreter, IPython, ipykernel, tornado, the replica's modules, and the modules a
hibernated kernel's namespace needs (the scheduler passes those recorded with its image; the
template imports them once, before forking, so the next resume of such a kernel on this host finds
them loaded). A child then loads the kernel's namespace image from the data store like any
replica (``replica.configure`` ``restore``). Forked runtimes share the template's pages until they
write them, so they also cost less memory than runtimes that imported the same modules alone.

The local scheduler talks to it over stdin/stdout, one JSON or text line each way:

* stdout ``ready <pid>`` once the imports are done;
* stdin ``{"id": n, "imports": [...], "assignment": {...}}`` (the assignment of
  ``kernel_replica/warm.py``: argv, env, log_file, cwd) -> stdout ``forked <id> <pid> <start ticks>``
  (``/proc/<pid>/stat``'s start time, read while this process holds the child unreaped, -1 where
  unknown: the local scheduler pins the pid with it, and binds it on the replica link), or
  ``failed <id> <reason>``;
* stdout ``exit <pid> <returncode>`` when a child ends (negative: the signal that ended it), since
  a forked runtime is this process's child, not the local scheduler's.

The template holds no sockets, threads or event loop when it forks: children start clean. A child
is the leader of a new session (the local scheduler signals its group) and gets SIGTERM if the
template dies. End of input stops the template.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import selectors
import signal
import site
import sys
import sysconfig
from typing import Any

from kernel_replica.warm import become, preload
from shared.process_signals import read_stat

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGTERM when the template dies (Linux; elsewhere the local scheduler's stop does it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child(assignment: dict[str, Any], fds: list[int]) -> None:
    """In the forked process: leave the template's signal set-up and pipes, become the replica."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in fds:
            os.close(fd)
        os.setsid()
        _die_with_parent()
        argv = become(assignment)
        from kernel_replica.__main__ import exit_now
        from kernel_replica.__main__ import main as replica_main

        exit_now(replica_main(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def installed(name: str) -> bool:
    """Whether ``name`` is a top-level module of the Python installation (the standard library
    or site-packages), not one beside a notebook: the template's modules are in every runtime it
    forks, for every kernel on this host, so a notebook's own files never go there."""
    if not name.isidentifier():
        return False
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    where = [*(spec.submodule_search_locations or ()), spec.origin or ""]
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages())
    return all(
        w and any(os.path.abspath(w).startswith(os.path.abspath(r) + os.sep) for r in roots) for w in where
    )


def _import_all(names: list[str]) -> None:
    """Import what a kernel's image needs, once: later forks find the modules loaded."""
    for name in names:
        if name in sys.modules:
            continue
        if not installed(name):
            print(
                f"runtime template: not importing {name!r}: not an installed module",
                file=sys.stderr,
                flush=True,
            )
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # gone since the image was written: the child fails as it would
            print(f"runtime template: skipping {name}: {exc}", file=sys.stderr, flush=True)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def serve() -> int:
    """Fork a runtime per request line until end of input."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the fd
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "request")
    selector.register(read_fd, selectors.EVENT_READ, "signal")
    buffered = b""
    while True:
        for key, _ in selector.select():
            if key.data == "signal":
                with contextlib.suppress(BlockingIOError):
                    os.read(read_fd, 4096)
                _reap()
                continue
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return 0
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                if line.strip():
                    _handle(json.loads(line), [read_fd, write_fd, selector.fileno()])
        _reap()


def _handle(request: dict[str, Any], fds: list[int]) -> None:
    ident = request.get("id")
    try:
        _import_all([str(m) for m in request.get("imports") or []])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    except Exception as exc:
        _say(f"failed {ident} {exc.__class__.__name__}: {exc}".replace("\n", " "))
        return
    if pid == 0:
        _child(request["assignment"], fds)
    # its start time, read before this loop can reap it: the local scheduler pins the pid with it
    stat = read_stat(pid)
    _say(f"forked {ident} {pid} {stat.start_ticks if stat is not None else -1}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernel_replica.template", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], help="also import this module"
    )
    args = parser.parse_args(argv)
    imported = preload(args.imports)
    print(f"runtime template: imported {', '.join(imported)}", file=sys.stderr, flush=True)
    _say(f"ready {os.getpid()}")
    return serve()


if __name__ == "__main__":
    sys.exit(main())
