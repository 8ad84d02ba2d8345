"""What user code may ask Tandem about the running cell.

    from kernel_replica.helper import device
    model = model.to(device())  # the cell's first bound GPU, or the CPU without one

``gpu_ids()`` are the host GPU ids (NVML indices) the local scheduler bound to this replica for the
current cell (also in ``TANDEM_GPU_IDS``); outside a cell, or on a kernel without GPUs, the list is
empty. ``CUDA_VISIBLE_DEVICES`` is not changed per cell (CUDA reads it once per process, so a later
cell bound to another GPU could not reach it): ``device(i)`` maps bound id ``i`` to the index torch
uses here, and during a cell plain ``"cuda"`` is the first bound GPU (``torch.cuda.set_device``).
"""

from __future__ import annotations

import typing as t

if t.TYPE_CHECKING:
    import torch

_bound_gpu_ids: tuple[int, ...] = ()


def gpu_ids() -> list[int]:
    """Device ids bound to the cell that is running now."""
    return list(_bound_gpu_ids)


def device(position: int = 0) -> torch.device:
    """The torch device of the cell's bound GPU ``position``; the CPU when there is none, CUDA is
    unavailable, or the id is not visible to this process."""
    import torch

    from kernel_replica.device_residency import VISIBLE_AT_START, cuda_index

    ids = gpu_ids()
    if 0 <= position < len(ids) and torch.cuda.is_available():
        index = cuda_index(ids[position], VISIBLE_AT_START, torch.cuda.device_count())
        if index is not None:
            return torch.device("cuda", index)
    return torch.device("cpu")


def _bind(device_ids: list[int]) -> None:
    global _bound_gpu_ids
    _bound_gpu_ids = tuple(device_ids)


def _unbind() -> None:
    global _bound_gpu_ids
    _bound_gpu_ids = ()
