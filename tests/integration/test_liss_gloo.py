"""LISS on a real 2-rank gloo job: with one rank slowed (as a co-located job would), the faster
rank steals samples, yet every step's global batch and the trained parameters equal the unstolen
run's (float64, same seeds; equal up to summation order)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from _liss_worker import GLOBAL_BATCH, train


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(steal: bool, slow: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=train, args=(r, 2, _port_cache[steal], steal, slow, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return result


_port_cache: dict[bool, int] = {}


@pytest.mark.timeout(120)
def test_stealing_keeps_global_batches_and_trained_parameters() -> None:
    _port_cache[False] = _port()
    _port_cache[True] = _port()
    plain = _run(steal=False, slow=0.0)
    stolen = _run(steal=True, slow=0.004)
    assert stolen["moves"] >= 1
    assert any(c[0] > c[1] for c in stolen["counts"]), "the fast rank never took samples"
    assert all(sum(c) == GLOBAL_BATCH for c in stolen["counts"])
    assert stolen["seen"] == plain["seen"]
    for a, b in zip(stolen["params"], plain["params"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12)
