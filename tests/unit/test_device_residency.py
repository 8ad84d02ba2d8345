"""Notebook tensors follow the bound GPUs (kernel_replica/device_residency.py).

No GPU here: the pure core is driven with the ``meta`` device as the target (it drops tensor data,
so only devices, identities and the records are checked), and the kernel's shell with CUDA
unavailable (its real state on this machine) or faked where the test says so.
"""

from __future__ import annotations

import importlib.abc
import sys
import typing as t
import warnings
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from kernel_replica import helper
from kernel_replica.device_residency import (
    MAX_CONTAINER_DEPTH,
    AfterImport,
    GpuResidency,
    Location,
    cuda_index,
    find_resident,
    offload,
    restore,
)
from kernel_replica.log_entries import State, decode, encode

META = torch.device("meta")
Pair = namedtuple("Pair", "left right")


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_restore_moves_modules_and_optimizers_in_place_keeping_every_reference() -> None:
    model, optimizer = trained()
    weight = model[0].weight
    namespace: dict[str, t.Any] = {"model": model, "opt": optimizer, "w": weight}
    locations = [Location("model", kind="module"), Location("opt", kind="optimizer"), Location("w")]

    report = restore(namespace, locations, META)

    assert report.failed == {}
    assert namespace["model"] is model and namespace["opt"] is optimizer and namespace["w"] is weight
    assert model[0].weight is weight and optimizer.param_groups[0]["params"][0] is weight
    assert {p.device for p in model.parameters()} == {META}
    assert {b.device for b in model.buffers()} == {META}
    assert weight.grad is not None and weight.grad.device == META
    state = optimizer.state[weight]
    assert state["exp_avg"].device == META and state["exp_avg_sq"].device == META
    assert state["step"].device.type == "cpu"  # as torch places it for a non-capturable Adam
    assert [str(loc) for loc in report.locations] == ["model", "opt", "w"]
    assert report.nbytes > 0


def test_plain_tensors_are_rebound_and_aliases_share_one_copy() -> None:
    x = torch.randn(5)
    inner = [torch.ones(2), "text"]
    namespace: dict[str, t.Any] = {
        "x": x,
        "y": x,
        "d": {"a": x, "inner": inner},
        "tup": (x, 1),
        "pair": Pair(x, 2),
        "cpu_only": torch.zeros(3),
    }
    d = namespace["d"]
    locations = [
        Location("x"),
        Location("y"),
        Location("d", ("a",)),
        Location("d", ("inner", 0)),
        Location("tup", (0,)),
        Location("pair", (0,)),  # tuples, named ones too, are indexed by position
    ]

    report = restore(namespace, locations, META)

    assert report.failed == {}
    moved = namespace["x"]
    assert moved is not x and moved.device == META and x.device.type == "cpu"
    assert namespace["y"] is moved and namespace["d"]["a"] is moved
    assert namespace["d"] is d and d["inner"] is inner and inner[0].device == META  # in place
    assert namespace["tup"][0] is moved and namespace["tup"][1] == 1
    assert isinstance(namespace["pair"], Pair) and namespace["pair"].left is moved
    assert namespace["cpu_only"].device.type == "cpu"  # not recorded: stays where the user put it
    assert report.nbytes == x.numel() * x.element_size() + inner[0].numel() * inner[0].element_size()


def test_find_resident_lists_only_objects_off_the_host_within_two_container_levels() -> None:
    class Holder:
        def __init__(self) -> None:
            self.tensor = torch.empty(2, device=META)

    deep: t.Any = torch.empty(1, device=META)
    for _ in range(MAX_CONTAINER_DEPTH + 1):
        deep = [deep]
    namespace = {
        "on_device": torch.empty(2, device=META),
        "on_host": torch.zeros(2),
        "nested": {"a": [torch.empty(1, device=META), torch.zeros(1)]},
        "too_deep": deep,
        "holder": Holder(),  # arbitrary objects are not walked
        "text": "meta",
    }

    found = find_resident(namespace, "cpu")

    assert [str(loc) for loc in found] == ["on_device", "nested['a'][0]"]


def test_offload_then_restore_round_trip_records_what_to_bring_back() -> None:
    model, optimizer = trained()
    namespace: dict[str, t.Any] = {"model": model, "opt": optimizer, "data": torch.zeros(4)}

    # "Host" = meta here, so the CPU objects count as resident and move (data is lost on meta).
    report = offload(namespace, META)

    assert report.failed == {}
    assert {str(loc) for loc in report.locations} == {"model", "opt", "data"}
    assert namespace["model"] is model and namespace["opt"] is optimizer
    assert namespace["data"].device == META


def test_offloaded_cell_outputs_keep_no_autograd_history_but_stay_trainable() -> None:
    """``preds = model(x)``: a copy with its history would keep the graph's activations on the
    device it came from; the copy is a leaf that requires grad, as the standbys get it."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    inputs = torch.randn(4, 3)
    namespace: dict[str, t.Any] = {"model": model, "preds": model(inputs), "frozen": model(inputs).detach()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a non-leaf's .grad warns
        report = offload(namespace, META)

    assert report.failed == {}
    preds = namespace["preds"]
    assert preds.device == META and preds.grad_fn is None and preds.is_leaf and preds.requires_grad
    assert namespace["frozen"].device == META and not namespace["frozen"].requires_grad
    assert {p.device for p in model.parameters()} == {META} and all(p.is_leaf for p in model.parameters())


def test_a_failing_copy_leaves_the_whole_variable_untouched() -> None:
    model, _ = trained()
    params = [(p, p.data, p.device) for p in model.parameters()]
    copies = 0

    def copy_then_fail(tensor: torch.Tensor, device: t.Any) -> torch.Tensor:
        nonlocal copies
        copies += 1
        if copies == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return tensor.to(device)

    namespace: dict[str, t.Any] = {"model": model, "x": torch.ones(2)}
    report = restore(namespace, [Location("model", kind="module"), Location("x")], META, copy=copy_then_fail)

    assert set(report.failed) == {"model"} and "out of memory" in report.failed["model"]
    assert [(p, p.data.data_ptr(), p.device) for p in model.parameters()] == [
        (p, data.data_ptr(), device) for p, data, device in params
    ]
    assert namespace["x"].device == META  # other variables still move


def test_offloading_a_tensor_that_cannot_be_copied_keeps_it_bound() -> None:
    stuck = torch.empty(3, device=META)  # meta tensors cannot be copied to the CPU
    namespace: dict[str, t.Any] = {"stuck": stuck, "fine": [stuck, torch.zeros(1)]}

    report = offload(namespace, "cpu")

    assert set(report.failed) == {"stuck", "fine"}
    assert namespace["stuck"] is stuck and namespace["fine"][0] is stuck


def test_cuda_index_maps_host_ids_through_the_visibility_at_start() -> None:
    assert cuda_index(3, None, 8) == 3
    assert cuda_index(8, None, 8) is None
    assert cuda_index(5, "4,5", 2) == 1
    assert cuda_index(3, "4,5", 2) is None
    assert cuda_index(0, "", 0) is None
    assert cuda_index(0, "GPU-1a2b", 1) is None  # UUIDs cannot be mapped to NVML indices


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CUDA "available" with 2 devices; moves to cuda:N then fail (CPU-only torch). Returns the
    set_device calls."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    return calls


def test_a_variable_that_cannot_move_to_the_gpu_stays_and_is_reported_once(
    fake_cuda: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    x = torch.ones(2)
    namespace: dict[str, t.Any] = {"x": x}
    residency = GpuResidency(visible=None)
    residency._record = [Location("x")]

    for _ in range(2):
        residency.before_cell(namespace, [1])
        residency.after_cell(namespace)

    assert namespace["x"] is x and fake_cuda == [1, 1]
    warnings = capsys.readouterr().err
    assert warnings.count("variable 'x' could not be moved to the bound GPU") == 1
    assert residency._record == [Location("x")]  # still wanted on the GPU: retried next cell
    assert "to_gpu_ms" in residency.timings and "to_host_ms" in residency.timings


def test_the_next_executor_moves_what_the_last_one_kept_for_the_gpu(
    fake_cuda: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    executor = GpuResidency(visible=None)
    executor._record = [
        Location("model", kind="module"),
        Location("d", ("w", 0)),
        Location("odd", ((1, 2),)),  # a key a STATE cannot carry: stays in host memory
    ]
    state = decode(encode(State("m1", "r1", gpu_resident=executor.carried())))
    standby = GpuResidency(visible=None)
    standby.adopt(state.gpu_resident)
    assert standby._record == [Location("model", kind="module"), Location("d", ("w", 0))]

    model = torch.nn.Linear(2, 2)
    standby.before_cell({"model": model, "d": {"w": [torch.ones(1)]}}, [1])

    err = capsys.readouterr().err  # CPU-only torch: the move to cuda:1 is tried and fails
    assert "variable 'model' could not be moved to the bound GPU" in err
    assert "variable 'd' could not be moved to the bound GPU" in err


def test_an_unmappable_gpu_id_is_reported_and_nothing_moves(
    fake_cuda: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    residency = GpuResidency(visible=None)
    residency.before_cell({"x": torch.ones(1)}, [7])
    assert fake_cuda == [] and residency.timings == {}
    assert "bound GPU 7 is not visible" in capsys.readouterr().err


def test_off_mode_and_unbound_cells_do_nothing(fake_cuda: list[int]) -> None:
    namespace: dict[str, t.Any] = {"x": torch.ones(1)}
    off = GpuResidency("off", visible=None)
    off._record = [Location("x")]
    off.before_cell(namespace, [0])
    unbound = GpuResidency(visible=None)
    unbound._record = [Location("x")]
    unbound.before_cell(namespace, [])
    unbound.after_cell(namespace)
    assert fake_cuda == [] and off.timings == {} and unbound.timings == {}
    assert unbound._record == [Location("x")]


def test_without_cuda_the_live_hook_moves_nothing() -> None:
    assert not torch.cuda.is_available()  # this machine
    x = torch.ones(1)
    namespace: dict[str, t.Any] = {"x": x}
    residency = GpuResidency(visible=None)
    residency._record = [Location("x")]
    residency.before_cell(namespace, [0])
    residency.after_cell(namespace)
    assert namespace["x"] is x and residency.timings == {} and residency._record == [Location("x")]
    helper._bind([0])
    try:
        assert helper.device() == torch.device("cpu")
    finally:
        helper._unbind()


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="gpu_residency"):
        GpuResidency("sometimes")


class _RefuseTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: t.Any, target: t.Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise AssertionError(f"{name} was imported")
        return None


def test_a_notebook_without_torch_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "torch" or n.startswith("torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RefuseTorch(), *sys.meta_path])
    namespace: dict[str, t.Any] = {"x": [1, 2], "s": "text"}

    assert find_resident(namespace) == []
    assert offload(namespace).moved == [] and restore(namespace, [Location("x")], "cuda:0").moved == []
    residency = GpuResidency(visible=None)
    residency.before_cell(namespace, [0])
    residency.after_cell(namespace)
    assert residency.timings == {} and "torch" not in sys.modules


def test_after_import_calls_back_once_when_the_module_first_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "late_library.py").write_text("VALUE = 41\n")
    (tmp_path / "other_library.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    hook = AfterImport("late_library", lambda module: seen.append(module.VALUE + 1))
    hook.install()
    try:
        import other_library  # noqa: F401 - another module passes untouched

        assert seen == [] and hook in sys.meta_path
        import late_library  # noqa: F401 - the hooked import

        assert seen == [42] and hook not in sys.meta_path
    finally:
        hook.remove()
        for name in ("late_library", "other_library"):
            sys.modules.pop(name, None)


def test_a_failing_after_import_callback_does_not_break_the_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fragile_library.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def fail(module: t.Any) -> None:
        raise RuntimeError("callback failed")

    AfterImport("fragile_library", fail).install()
    try:
        import fragile_library

        assert fragile_library.VALUE == 7
    finally:
        sys.modules.pop("fragile_library", None)


def test_a_cell_that_imports_torch_itself_gets_its_bound_gpu_and_is_offloaded_after(
    fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first GPU cell of a notebook usually imports torch: the GPU is bound when the import
    finishes, so the cell's tensors go to host memory after it (seen on an H100: they stayed)."""
    import kernel_replica.device_residency as residency_module

    monkeypatch.setattr(residency_module, "_torch", lambda: None)  # torch not imported yet
    residency = GpuResidency(visible=None)
    residency.before_cell({}, [1])
    hook = residency._torch_import
    assert hook is not None and hook in sys.meta_path and residency._device is None

    monkeypatch.setattr(residency_module, "_torch", lambda: torch)  # the cell imports torch
    hook.callback(torch)
    assert fake_cuda == [1] and residency._device == torch.device("cuda", 1)
    residency.after_cell({"x": torch.ones(1)})
    assert hook not in sys.meta_path and residency._device is None and "to_host_ms" in residency.timings


def test_a_cell_bound_to_gpus_that_never_imports_torch_leaves_no_import_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kernel_replica.device_residency as residency_module

    monkeypatch.setattr(residency_module, "_torch", lambda: None)
    residency = GpuResidency(visible=None)
    before = list(sys.meta_path)
    residency.before_cell({"x": 1}, [0])
    residency.after_cell({"x": 1})
    assert sys.meta_path == before and residency.timings == {}
