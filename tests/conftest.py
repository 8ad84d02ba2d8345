"""Fixtures shared by the whole suite; the main one is a real embedded cluster.

``tandem_cluster`` runs ``tandem up`` (the real CLI, as a subprocess) in a temporary state
directory once per test session, points this process's provisioner at it (``TANDEM_STATE_DIR``)
and installs the ``tandem`` kernelspec into a temporary prefix, so ``KernelManager(kernel_name=
"tandem")``, nbclient and ``jupyter_kernel_test`` all work unmodified. Teardown sends SIGTERM and
checks that no process of the cluster survived.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import ClusterHandle, running_cluster

from services.jsonschema_formats import skip_iri_grammar

skip_iri_grammar()  # the tests' nbformat loads jsonschema without its IRI grammar, as tandem run does


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
