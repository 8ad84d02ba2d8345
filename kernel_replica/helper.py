"""What user code may ask Tandem about the running cell.

    from kernel_replica.helper import gpu_ids
    device = f"cuda:{gpu_ids()[0]}" if gpu_ids() else "cpu"

The ids are those the local scheduler bound to this replica for the current cell (also in
``TANDEM_GPU_IDS`` and ``CUDA_VISIBLE_DEVICES``); outside a cell, or on a kernel without GPUs, the
list is empty.
"""

from __future__ import annotations

_bound_gpu_ids: tuple[int, ...] = ()


def gpu_ids() -> list[int]:
    """Device ids bound to the cell that is running now."""
    return list(_bound_gpu_ids)


def _bind(device_ids: list[int]) -> None:
    global _bound_gpu_ids
    _bound_gpu_ids = tuple(device_ids)


def _unbind() -> None:
    global _bound_gpu_ids
    _bound_gpu_ids = ()
