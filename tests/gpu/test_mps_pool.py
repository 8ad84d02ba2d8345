"""MPS context pool on a real GPU (``shared.packing.mps``): contexts for every 10% step are created
up front and switching between them works. Skipped where no CUDA driver is present."""

from __future__ import annotations

import ctypes.util
import time

import pytest

from shared.packing.mps import MpsContextPool

pytestmark = pytest.mark.skipif(ctypes.util.find_library("cuda") is None, reason="no CUDA driver")


def test_pool_switches_between_every_share() -> None:
    pool = MpsContextPool()
    try:
        costs = []
        for percent in (*range(10, 101, 10), 100):
            t0 = time.perf_counter()
            pool.set_share(percent)
            costs.append(time.perf_counter() - t0)
            assert pool.share == percent
        assert max(costs) < 1.0
    finally:
        pool.close()
