"""Fixtures shared by the whole suite; the main one is a real embedded cluster.

``tandem_cluster`` runs ``tandem up`` (the real CLI, as a subprocess) in a temporary state
directory once per test session, points this process's provisioner at it (``TANDEM_STATE_DIR``)
and installs the ``tandem`` kernelspec into a temporary prefix, so ``KernelManager(kernel_name=
"tandem")``, nbclient and ``jupyter_kernel_test`` all work unmodified. Teardown sends SIGTERM and
checks that no process of the cluster survived.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import ClusterHandle, running_cluster

from services.jsonschema_formats import skip_iri_grammar

skip_iri_grammar()  # the tests' nbformat loads jsonschema without its IRI grammar, as tandem run does


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        _trace_hard_exits_of_this_process()


def _trace_hard_exits_of_this_process() -> None:
    """A worker that dies ends the run with "node down: Not properly terminated" and nothing else
    (seen about once in ten full runs, cause unknown: no fatal signal is dumped by faulthandler,
    so SIGKILL, SIGTERM or ``os._exit``). Product code calls ``os._exit`` (a replica's fail-stop
    paths); if any of it ever runs in a worker, or a SIGTERM reaches one, every thread's stack is
    printed first. Forked children of the worker (multiprocessing) are not traced."""
    real_exit, worker = os._exit, os.getpid()
    assert sys.__stderr__ is not None
    stderr = os.dup(sys.__stderr__.fileno())  # the run's stderr: a test's fd 2 is its capture file
    # SIGTERM ends a process with no word either (faulthandler covers only fatal signals)
    faulthandler.register(signal.SIGTERM, file=stderr, all_threads=True, chain=True)
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))

    def traced_exit(status: int) -> None:
        if os.getpid() == worker:
            os.write(stderr, f"\nos._exit({status}) in pytest-xdist worker {worker}:\n".encode())
            faulthandler.dump_traceback(file=stderr, all_threads=True)
        real_exit(status)

    os._exit = traced_exit  # type: ignore[assignment]


@pytest.fixture(scope="session")
def tandem_kernelspec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The ``tandem`` kernelspec in a private prefix, visible to this process's Jupyter clients."""
    from services.kernelspec import install_private

    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    old = install_private(prefix)
    yield prefix
    if old:
        os.environ["JUPYTER_PATH"] = old
    else:
        os.environ.pop("JUPYTER_PATH", None)


@pytest.fixture(scope="session")
def tandem_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    with running_cluster(tmp_path_factory.mktemp("tandem-state")) as handle:
        yield handle
