"""What an executor switch must preserve of the namespace: shared objects stay shared, functions see
the notebook's globals. The switch is forced by cordoning the executor's host between two cells."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from _cluster import ClusterHandle
from _kernels import CellResult, run, tandem_kernel
from jupyter_client import BlockingKernelClient

pytestmark = pytest.mark.integration

TRAINING_SETUP = """
import torch

torch.manual_seed(0)
X = torch.randn(256, 3)
y = X @ torch.tensor([[2.0], [-3.0], [0.5]]) + 1.0
model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.05)


def step():
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), y)
    loss.backward()
    optimizer.step()
    return loss.item()


first = step()
"""

AFTER_SWITCH = """
bound = all(p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]["params"]))
for _ in range(100):
    last = step()
with torch.no_grad():
    final = torch.nn.functional.mse_loss(model(X), y).item()
print(bound, final < first / 10, round(first, 3), round(final, 4))
"""


@contextmanager
def _switched_executor(
    cluster: ClusterHandle, kc: BlockingKernelClient, first_cell: str
) -> Iterator[CellResult]:
    """Run ``first_cell``, then cordon its executor's host until the block ends."""
    first = run(kc, first_cell, timeout=60)
    assert first.status == "ok", first.errors
    host = first.tandem.get("host_id")
    assert host, first.tandem
    assert cluster.cli("host", "cordon", host).returncode == 0
    try:
        yield first
    finally:
        assert cluster.cli("host", "uncordon", host).returncode == 0


def test_model_and_optimizer_stay_bound_across_an_executor_switch(tandem_cluster: ClusterHandle) -> None:
    with tandem_kernel() as (_km, kc), _switched_executor(tandem_cluster, kc, TRAINING_SETUP) as first:
        cell = run(kc, AFTER_SWITCH, timeout=60)
        assert cell.status == "ok", cell.errors
        assert cell.tandem.get("host_id") != first.tandem.get("host_id")
        bound, learned, *losses = cell.stdout.split()
        assert bound == "True", "the optimizer no longer holds the model's parameters"
        assert learned == "True", f"the model did not learn on the new executor: {losses}"


def test_functions_see_globals_rebound_after_an_executor_switch(tandem_cluster: ClusterHandle) -> None:
    setup = "scale = 1\n\ndef scaled(x):\n    return scale * x\n"
    with tandem_kernel() as (_km, kc), _switched_executor(tandem_cluster, kc, setup):
        cell = run(kc, "scale = 10\nprint(scaled(2))")
        assert cell.status == "ok", cell.errors
        assert cell.stdout.strip() == "20"
