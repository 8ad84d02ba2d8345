"""The notebook's CUDA generator across executors (kernel_replica/cuda_rng.py).

Seeds queued before CUDA starts are read from the real torch here (CPU-only torch queues them
too). The generator states of started CUDA are played by CPU ``torch.Generator`` objects behind a
stand-in ``torch.cuda``; tests/gpu/test_real_gpu.py checks the numbers drawn on a real GPU.
"""

from __future__ import annotations

import pickle
import typing as t
from types import SimpleNamespace

import pytest
import torch
from torch._utils import _LazySeedTracker

from kernel_replica.cuda_rng import ALL, CURRENT, CudaRngCarrier, queued_seeds
from kernel_replica.device_residency import GpuResidency
from kernel_replica.library_settings import SettingsTracker


class StartedCuda:
    """``torch.cuda`` after CUDA started, with ``devices`` GPUs whose generators are CPU ones."""

    def __init__(self, devices: int = 2, current: int = 0, *, started: bool = True) -> None:
        self.default_generators = tuple(torch.Generator() for _ in range(devices))
        self._lazy_seed_tracker = _LazySeedTracker()
        self.current = current
        self.started = started

    def is_initialized(self) -> bool:
        return self.started

    def current_device(self) -> int:
        return self.current

    def queue_seed_all(self, seed: int) -> None:
        """As ``torch.cuda.manual_seed_all`` does before CUDA starts."""

        def cb() -> None:
            for generator in self.default_generators:
                generator.manual_seed(seed)

        self._lazy_seed_tracker.queue_seed_all(cb, [])


def process(cuda: StartedCuda) -> t.Any:
    return SimpleNamespace(cuda=cuda, frombuffer=torch.frombuffer, uint8=torch.uint8)


def draws(generator: torch.Generator) -> list[float]:
    return torch.rand(4, generator=generator).tolist()


@pytest.fixture
def fresh_seed_calls(monkeypatch: pytest.MonkeyPatch) -> _LazySeedTracker:
    tracker = _LazySeedTracker()
    monkeypatch.setattr(torch.cuda, "_lazy_seed_tracker", tracker)
    return tracker


def test_seeds_given_before_cuda_starts_are_read_from_the_calls_torch_queued(
    fresh_seed_calls: _LazySeedTracker,
) -> None:
    assert not torch.cuda.is_initialized()
    assert CudaRngCarrier().read(torch) is None
    torch.manual_seed(7)  # seeds the GPUs too, lazily
    torch.cuda.manual_seed(9)
    assert queued_seeds(torch.cuda) == ((ALL, 7), (CURRENT, 9))
    assert CudaRngCarrier().read(torch) == ("seeds", ((ALL, 7), (CURRENT, 9)))
    torch.cuda.manual_seed_all(11)  # the latest of the two kinds goes last
    assert CudaRngCarrier().read(torch) == ("seeds", ((CURRENT, 9), (ALL, 11)))
    assert not torch.cuda.is_initialized()


def test_a_seed_call_torch_keeps_otherwise_is_refused_by_name(fresh_seed_calls: _LazySeedTracker) -> None:
    fresh_seed_calls.queue_seed_all(lambda: None, [])
    with pytest.raises(ValueError, match="holds no 'seed'"):
        CudaRngCarrier().read(torch)


def test_the_state_lands_on_the_generator_of_the_gpu_the_next_cell_binds() -> None:
    executor = StartedCuda(current=1)
    executor.default_generators[1].manual_seed(5)
    draws(executor.default_generators[1])
    value = CudaRngCarrier().read(process(executor))
    assert value is not None and value[0] == "state"

    standby = StartedCuda(current=0)
    before = [g.get_state() for g in standby.default_generators]
    carrier = CudaRngCarrier()
    carrier.write(process(standby), value)
    assert carrier.pending and carrier.read(process(standby)) == value  # it reports no change of its own
    assert all(torch.equal(g.get_state(), b) for g, b in zip(standby.default_generators, before, strict=True))

    carrier.bind(process(standby), 1)
    assert not carrier.pending
    assert torch.equal(standby.default_generators[0].get_state(), before[0])
    assert draws(standby.default_generators[1]) == draws(executor.default_generators[1])


def test_seeds_carried_to_a_replica_without_cuda_seed_its_gpus_when_a_cell_binds_one() -> None:
    executor = StartedCuda(started=False)
    executor.queue_seed_all(7)
    value = CudaRngCarrier().read(process(executor))
    assert value == ("seeds", ((ALL, 7),))

    standby, carrier = StartedCuda(started=False), CudaRngCarrier()
    carrier.write(process(standby), pickle.loads(pickle.dumps(value)))
    carrier.bind(process(standby), 1)  # as CUDA starts for the cell
    reference = torch.Generator().manual_seed(7)
    assert [g.initial_seed() for g in standby.default_generators] == [7, 7]
    assert draws(standby.default_generators[1]) == draws(reference)


def test_the_notebooks_own_seeding_on_the_replica_after_the_value_arrived_wins() -> None:
    value = ("seeds", ((ALL, 7),))
    started, carrier = StartedCuda(), CudaRngCarrier()
    carrier.write(process(started), value)
    started.default_generators[0].manual_seed(3)  # a cell here seeds (or draws) before a GPU cell
    assert carrier.read(process(started)) == (
        "state",
        started.default_generators[0].get_state().numpy().tobytes(),
    )
    carrier.bind(process(started), 0)
    assert [g.initial_seed() for g in started.default_generators] == [3, torch.Generator().initial_seed()]

    not_started, carrier = StartedCuda(started=False), CudaRngCarrier()
    carrier.write(process(not_started), ("state", b"\0" * 16))
    not_started.queue_seed_all(4)
    assert carrier.read(process(not_started)) == ("seeds", ((ALL, 4),))
    assert not carrier.pending


def test_a_default_generator_carries_nothing_and_an_unknown_value_is_refused() -> None:
    cuda, carrier = StartedCuda(started=False), CudaRngCarrier()
    carrier.write(process(cuda), None)
    assert not carrier.pending
    with pytest.raises(ValueError, match="unknown CUDA generator value 'philox'"):
        carrier.write(process(cuda), ("philox", b""))


class RecordingCarrier(CudaRngCarrier):
    def __init__(self) -> None:
        super().__init__()
        self.bound: list[int] = []
        self._pending = ("seeds", ((ALL, 1),))

    def bind(self, torch: t.Any, index: int) -> None:
        self.bound.append(index)


def test_residency_puts_the_generator_state_on_the_bound_gpu_in_either_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_device: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    moving = RecordingCarrier()
    GpuResidency(visible=None, rng=moving).before_cell({}, [1])
    assert set_device == [1] and moving.bound == [1]
    off = RecordingCarrier()
    GpuResidency("off", visible=None, rng=off).before_cell({}, [1])  # the notebook's own devices
    assert set_device == [1] and off.bound == [0]
    unbound = RecordingCarrier()
    GpuResidency(visible=None, rng=unbound).before_cell({}, [])
    assert unbound.bound == []


def test_the_setting_is_read_without_starting_cuda(fresh_seed_calls: _LazySeedTracker) -> None:
    torch.manual_seed(3)
    values = SettingsTracker().capture()
    assert pickle.loads(values["torch.cuda.random.state"]) == ("seeds", ((ALL, 3),))
    assert not torch.cuda.is_initialized()
