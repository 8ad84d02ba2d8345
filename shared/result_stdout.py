"""Keep a command's result output on stdout clean of what C libraries print to fd 1.

HiGHS (``scipy.optimize.milp``, the arbiter's partial allocation) prints debugging lines such as
"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" with C ``printf`` for
some MIPs; no HiGHS option silences it (``output_flag``/``log_to_console`` govern its logger, not
these raw prints). On a pipe, C stdio buffers it and flushes it whenever it likes, possibly after
or inside a JSON line a script prints. ``result_stdout()`` points fd 1 at stderr for the duration
while Python's ``sys.stdout`` keeps writing the real stdout, and flushes C stdio before it puts
fd 1 back, so no C write reaches the result stream, neither during nor after the block.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO

STDOUT_FD = 1
STDERR_FD = 2


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: what C code buffered for fd 1 goes out now, while fd 1 is stderr."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def result_stdout() -> Iterator[TextIO]:
    """For the block, fd 1 is stderr and ``sys.stdout`` (also yielded) writes the real stdout.

    If ``sys.stdout`` is not fd 1 (pytest's capture, a StringIO), it is left as it is; fd 1 is
    still pointed at stderr, so C writes stay out of whatever captures fd 1."""
    try:
        os.fstat(STDOUT_FD)
        os.fstat(STDERR_FD)
    except OSError:
        yield sys.stdout
        return
    try:
        python_on_fd1 = sys.stdout.fileno() == STDOUT_FD
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        python_on_fd1 = False
    sys.stdout.flush()
    _flush_c_stdio()
    saved = os.dup(STDOUT_FD)
    os.dup2(STDERR_FD, STDOUT_FD)
    previous = sys.stdout
    stream: TextIO | None = None
    if python_on_fd1:
        stream = open(  # noqa: SIM115 - closed in the finally below
            os.dup(saved), "w", encoding=previous.encoding, errors=previous.errors, buffering=1
        )
        sys.stdout = stream
    try:
        yield sys.stdout
    finally:
        _flush_c_stdio()
        if stream is not None:
            stream.flush()
            sys.stdout = previous
            stream.close()
        os.dup2(saved, STDOUT_FD)
        os.close(saved)
