"""GPU inventory: NVML when present and allowed, virtual GPUs otherwise (a fake pynvml stands in)."""

from __future__ import annotations

import sys
import types

import pytest

from services.local_scheduler.gpus import detect_gpus


class FakeNVMLError(Exception):
    pass


def fake_pynvml(count: int, *, init_fails: bool = False) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    mod.NVMLError = FakeNVMLError  # type: ignore[attr-defined]

    def init() -> None:
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")

    mod.nvmlInit = init  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 * 2**30)  # type: ignore[attr-defined]
    return mod


def test_nvml_devices_are_used_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(2))
    inv = detect_gpus(use_nvml=True, virtual_count=8, virtual_vram_gb=40)
    assert (inv.kind, inv.device_ids, inv.vram_gb_per_gpu) == ("nvidia", (0, 1), 80.0)
    assert inv.names == ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")


def test_nvml_disabled_gives_virtual_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(2))
    inv = detect_gpus(use_nvml=False, virtual_count=3, virtual_vram_gb=24)
    assert (inv.kind, inv.device_ids, inv.vram_gb_per_gpu) == ("virtual", (0, 1, 2), 24.0)


@pytest.mark.parametrize("module", [fake_pynvml(0), fake_pynvml(2, init_fails=True)])
def test_no_usable_nvml_falls_back_to_virtual(
    monkeypatch: pytest.MonkeyPatch, module: types.ModuleType
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert detect_gpus(use_nvml=True, virtual_count=4, virtual_vram_gb=40).kind == "virtual"
