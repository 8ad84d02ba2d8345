"""The GPUs a host declares: real ones through NVML when present and allowed, else virtual ones.

Virtual GPUs make everything except CUDA itself (accounting, binding, device ids handed to user
code) run on any machine, which is what the embedded cluster and CI use.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import structlog

log = structlog.get_logger("gpus")


@dataclass(frozen=True, slots=True)
class GpuInventory:
    kind: str  # "nvidia" | "virtual"
    device_ids: tuple[int, ...]
    vram_gb_per_gpu: float
    names: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.device_ids)


def _probe_nvml() -> GpuInventory | None:
    try:
        import pynvml
    except ImportError:
        log.info("nvml_unavailable", reason="nvidia-ml-py not installed")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("nvml_unavailable", reason=str(exc))
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        names: list[str] = []
        vram: list[float] = []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
            vram.append(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30)
    except pynvml.NVMLError as exc:
        log.warning("nvml_query_failed", reason=str(exc))
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    if count == 0:
        log.info("nvml_unavailable", reason="no NVIDIA devices")
        return None
    return GpuInventory("nvidia", tuple(range(count)), round(min(vram), 1), tuple(names))


def detect_gpus(*, use_nvml: bool, virtual_count: int, virtual_vram_gb: float) -> GpuInventory:
    if use_nvml:
        found = _probe_nvml()
        if found is not None:
            log.info("gpus_detected", kind="nvidia", count=found.count, names=list(found.names))
            return found
    inventory = GpuInventory("virtual", tuple(range(virtual_count)), float(virtual_vram_gb))
    log.info("gpus_detected", kind="virtual", count=inventory.count, nvml_allowed=use_nvml)
    return inventory
