"""A notebook gives the outputs of a stock ipykernel with an executor change after every cell.

The notebook follows the NumPy chapters of a public data-science handbook (views of views,
structured arrays, ``recarray``, masked arrays, ``matrix``, float reductions on large arrays).
It runs twice: on a stock ``python3`` ipykernel (jupyter_client's ``KernelManager``), and on a
Tandem kernel of the embedded cluster where, before every cell, every host but one holding a
replica that did not run the previous cell is cordoned, so each cell runs on a replica that has
only what replication gave it. Every output (stdout, stderr, results, errors) must be the same.

It ends with state no variable shows: seeded global generators (numpy's and torch's), a tensor
and an array on one memory (``torch.from_numpy``, ``t.numpy()``), a ``memoryview`` of a
bytearray, a global the notebook changes in a module of its own, and a library function and
class the notebook patches.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _cluster import ClusterHandle
from _kernels import CellResult, jupyter_kernel, run, tandem_kernel
from jupyter_client import BlockingKernelClient

from shared import messages

pytestmark = pytest.mark.integration

QUIET_MATRIX = "warnings.simplefilter('ignore', PendingDeprecationWarning)\n"
NOTEBOOK = (
    "import warnings\n\nimport numpy as np\n\nrng = np.random.default_rng(0)",
    # views of views alias their base (the x2_sub)
    "x1 = rng.integers(10, size=6)\nx2 = rng.integers(10, size=(3, 4))\nx3 = rng.integers(10, size=(3, 4, 5))\nprint(x2)",
    "x2_sub = x2[:2, :2]\nprint(x2_sub)",
    "x2_sub[0, 0] = 99\nprint(x2_sub)",
    "print(x2)",
    "x2_sub_copy = x2[:2, :2].copy()\nx2_sub_copy[0, 0] = 42\nprint(x2_sub_copy)\nprint(x2)",
    "grid = np.arange(1, 10).reshape((3, 3))\nrow = grid[1]\ncol = grid[:, 2]\ncorner = grid[::2, ::2]",
    "row[:] = 0\ncol *= 10\nprint(grid)\ncorner",
    "x2[::-1, ::-1]",
    "back = x3[0].T[1:, ::2]\nback[0] = -1\nprint(x3[0])",
    # structured arrays and recarray
    "name = ['Alice', 'Bob', 'Cathy', 'Doug']\nage = [25, 45, 37, 19]\nweight = [55.0, 85.5, 68.0, 61.5]\n"
    "data = np.zeros(4, dtype={'names': ('name', 'age', 'weight'), 'formats': ('U10', 'i4', 'f8')})\n"
    "data['name'] = name\ndata['age'] = age\ndata['weight'] = weight\nprint(data)",
    "ages = data['age']\nages += 1\nprint(data[data['age'] < 30]['name'], data.dtype)",
    "data_rec = data.view(np.recarray)\ndata_rec.age",
    "data_rec.weight[0] = 50.0\nprint(type(data_rec).__name__, data['weight'], data_rec.age.mean())",
    "data_rec[1]",
    # masked arrays: the sum must skip the masked values on every executor
    "m = np.ma.masked_array([1, 2, 3, 4, 5], mask=[0, 0, 0, 1, 0])\nm.sum()",
    "print(type(m).__name__, m.sum(), m.mean(), m.filled(-1))",
    "m[0] = np.ma.masked\nm.sum()",
    "m.fill_value = -99\nprint(m.filled(), m.fill_value)",
    "tail = m[2:]\ntail[0] = 30\nprint(m, tail.sum())",
    "bad = np.ma.masked_invalid(np.array([1.0, np.nan, 3.0, np.inf]))\nbad.sum(), bad.count()",
    # matrix
    QUIET_MATRIX + "M = np.matrix([[1, 2], [3, 4]])\nM * M",
    QUIET_MATRIX + "print(type(M).__name__, M.I, M.T * M)",
    # float reductions on large arrays (restored arrays aligned as numpy allocates them)
    "big = rng.random(1_000_000)\nbig32 = rng.random(1_000_003).astype(np.float32)\nbig.sum()",
    "print(repr(big.sum()), repr(big.mean()), repr(big.std()), repr(big32.sum()), repr(big32[1:].sum()))",
    "print(repr(np.add.reduce(big32)), repr(big32.mean()), repr(np.dot(big, big)), repr(big @ big))",
    "half = big[::2]\nhalf[:] = 0.5\nprint(repr(big.sum()), repr(big[1::2].sum()))",
    "print(big.flags.aligned, big32.flags.aligned, np.shares_memory(big, half), np.shares_memory(x2, x2_sub))",
    "print([type(v).__name__ for v in (x2, x2_sub, data, data_rec, m, tail, M, big, rng)])",
    # state no variable shows
    "import torch\nnp.random.seed(7)\n_ = torch.manual_seed(7)",
    "print(np.random.rand(3), torch.rand(2))",
    "base = np.arange(6.0)\nt = torch.from_numpy(base[1:])\nowner = t.numpy()",
    "base[1] = 50\nprint(t)",
    "t.mul_(2)\nprint(base, owner)",
    "buf = bytearray(b'tandem')\nview = memoryview(buf)[1:4]",
    "buf[1] = ord('A')\nprint(bytes(view), type(view).__name__)",
    "import pathlib, sys, tempfile\nsrc = tempfile.mkdtemp()\n"
    "pathlib.Path(src, 'nbsettings.py').write_text('SCALE = 1\\n')\nsys.path.insert(0, src)\n"
    "import nbsettings\nnbsettings.SCALE = 3",
    "print(nbsettings.SCALE * 2)",
    "import fractions, statistics\nstatistics.mean = lambda xs: 42\nfractions.Fraction.half = lambda self: self / 2",
    "print(statistics.mean([1, 2]), fractions.Fraction(3).half())",
)


def _outputs(cell: CellResult) -> tuple[Any, ...]:
    errors = [(e.get("ename"), e.get("evalue")) for e in cell.errors]
    return (cell.status, cell.stdout, tuple(cell.results), tuple(errors))


@contextlib.contextmanager
def stock_kernel() -> Iterator[BlockingKernelClient]:
    with jupyter_kernel("python3") as (_km, kc):
        yield kc


def _status(cluster: ClusterHandle) -> dict[str, Any]:
    return cluster.ask_scheduler(messages.CLUSTER_STATUS, {})


def _replica_hosts(cluster: ClusterHandle, kernel_id: str) -> list[str]:
    """Hosts of the kernel's live replicas (one replica per host)."""
    deadline = time.monotonic() + 30
    while True:
        kernel = next(k for k in _status(cluster)["kernels"] if k["id"] == kernel_id)
        hosts = sorted({r["host"] for r in kernel["replicas"] if r.get("host")})
        if len(hosts) >= 2 or time.monotonic() > deadline:
            return hosts
        time.sleep(0.2)


def test_notebook_with_an_executor_change_after_every_cell_matches_a_stock_kernel(
    tandem_cluster: ClusterHandle,
) -> None:
    with stock_kernel() as stock:
        expected = [_outputs(run(stock, cell, timeout=60)) for cell in NOTEBOOK]
    assert all(out[0] == "ok" for out in expected), [out for out in expected if out[0] != "ok"]

    with tandem_kernel() as (km, kc):
        hosts = _replica_hosts(tandem_cluster, km.kernel_id)
        assert len(hosts) >= 2, f"replicas on {hosts}: an executor change needs two hosts"
        previous: str | None = None
        executors: list[str] = []
        mismatches: list[str] = []
        for index, cell in enumerate(NOTEBOOK):
            target = next(h for h in hosts[index % len(hosts) :] + hosts if h != previous)
            with tandem_cluster.only_host_open(target):
                result = run(kc, cell, timeout=90)
            executor = result.tandem.get("host_id")
            assert executor == target and executor != previous, (index, executor, target, previous)
            executors.append(executor)
            if _outputs(result) != expected[index]:
                mismatches.append(
                    f"cell {index}:\n{cell}\n  tandem: {_outputs(result)}\n  stock:  {expected[index]}"
                )
            previous = executor
    assert not mismatches, f"{len(mismatches)} of {len(NOTEBOOK)} cells differ:\n" + "\n".join(mismatches)
    assert len(set(executors)) >= 2 and all(a != b for a, b in itertools.pairwise(executors))
