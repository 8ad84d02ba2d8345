"""What a training job's image holds, and how it is read out and put back.

Tensors (model parameters and buffers in module order, then the optimizer's per-parameter state)
are the bulk and are copied concurrently; everything else (optimizer hyper-parameters, LR
scheduler, AMP scaler, RNG states, data-loader position, step count) is small and copied at the
step boundary itself, in microseconds.
"""

from __future__ import annotations

import copy
import functools
import io
import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


_TENSOR = "__tensor__"


@dataclass(frozen=True)
class Structure:
    """Which objects an image is read from: every tensor by name (load-priority order), and the
    optimizer's per-parameter state dicts by parameter index. Walking the model for it costs
    ~1 ms for a few hundred tensors, so the agent reuses the last one at begin and checks it on
    the copier thread (``same_as``): a changed structure makes the attempt a retake."""

    tensors: tuple[tuple[str, torch.Tensor], ...]
    states: tuple[tuple[int, dict[str, Any]], ...]
    on_device: bool = False  # some tensor is in device memory (cloned at begin, stream ordered)

    @functools.cached_property
    def objects(self) -> tuple[torch.Tensor, ...]:
        """The tensors alone, in order (begin reads each one's version counter and address)."""
        return tuple(t for _, t in self.tensors)

    @functools.cached_property
    def state_template(self) -> dict[int, dict[str, Any]]:
        """The meta of the optimizer states whose every value is a tensor (each value stands for
        a tensor the copier reads): fixed for these state dicts, so begin reuses it instead of
        going over every state. Built when first used (at a begin); ``template_holds`` checks it
        on the copier."""
        return {i: dict.fromkeys(st, _TENSOR) for i, st in self.states if _all_tensors(st)}

    def template_holds(self) -> bool:
        """The states are still as ``state_template`` says (keys, and which values are tensors)."""
        template = self.state_template
        return all(
            (i in template) == _all_tensors(st) and (i not in template or template[i].keys() == st.keys())
            for i, st in self.states
        )

    def same_as(self, other: Structure) -> bool:
        """The same tensor objects under the same names, and the same optimizer state dicts."""
        return (
            len(self.tensors) == len(other.tensors)
            and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(self.tensors, other.tensors, strict=True))
            and len(self.states) == len(other.states)
            and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(self.states, other.states, strict=True))
        )


def _all_tensors(state: dict[str, Any]) -> bool:
    return all(isinstance(v, torch.Tensor) for v in state.values())


def add_specs(meta: dict[str, Any], structure: Structure) -> dict[str, Any]:
    """Complete an instant meta with the optimizer tensors' dtypes, shapes and devices (fixed for
    a given tensor object, so derived off the training thread)."""
    if "optimizer" in meta:
        meta["specs"] = {
            name: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "device": t.device.type,
            }
            for name, t in structure.tensors
            if name.startswith("optim.")
        }
    return meta


@dataclass
class TrainingState:
    """The live objects of one job. The runner sets ``step`` at each step boundary."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    loader: Stateful | None = None
    step: int = 0

    def module_tensors(self) -> list[tuple[str, nn.Module, torch.Tensor]]:
        """Parameters and buffers in module registration order (the order a forward pass usually
        touches them, which on-demand restore loads first); a tied tensor once, under its first name."""
        seen: set[int] = set()
        out: list[tuple[str, nn.Module, torch.Tensor]] = []
        for prefix, module in self.model.named_modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for local, tensor in own:
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                out.append((f"model.{prefix}.{local}" if prefix else f"model.{local}", module, tensor))
        return out

    def optimizer_params(self) -> list[torch.Tensor]:
        """Parameters in the order of ``optimizer.state_dict()``'s integer ids."""
        if self.optimizer is None:
            return []
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the image, by name, in load-priority order."""
        return list(self.structure().tensors)

    def structure(self) -> Structure:
        """The objects an image is read from, found by walking the model and the optimizer."""
        tensors = [(name, t) for name, _, t in self.module_tensors()]
        states: list[tuple[int, dict[str, Any]]] = []
        for index, param in enumerate(self.optimizer_params()):
            assert self.optimizer is not None
            st = self.optimizer.state.get(param)
            if st is None:
                continue
            states.append((index, st))
            for key, value in sorted(st.items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optim.{index}.{key}", value))
        on_device = any(t.device.type != "cpu" for _, t in tensors)
        return Structure(tuple(tensors), tuple(states), on_device)

    def meta(self, structure: Structure | None = None) -> dict[str, Any]:
        """The small state, copied now (the live objects keep changing once training resumes)."""
        structure = structure or self.structure()
        return add_specs(self.instant_meta(structure), structure)

    def instant_meta(self, structure: Structure) -> dict[str, Any]:
        """What of the small state must be copied at the checkpoint's instant, on the training
        thread: step, RNG, hyper-parameters, non-tensor optimizer state, scheduler, scaler, loader.
        ``structure`` is a cached one; the copier checks it still holds (``add_specs`` and the
        rest of the layout are derived from it there)."""
        meta: dict[str, Any] = {"step": self.step, "rng": rng_state()}
        if self.optimizer is not None:
            index = {id(p): i for i, p in enumerate(self.optimizer_params())}
            groups = [
                {
                    **copy.deepcopy({k: v for k, v in group.items() if k != "params"}),
                    "params": [index[id(p)] for p in group["params"]],
                }
                for group in self.optimizer.param_groups
            ]
            template = structure.state_template  # states of tensors only: nothing to copy now
            state = (
                dict(template)
                if len(template) == len(structure.states)
                else {
                    i: template[i]
                    if i in template
                    else {
                        k: (_TENSOR if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                        for k, v in st.items()
                    }
                    for i, st in structure.states
                }
            )
            meta["optimizer"] = {"state": state, "param_groups": groups}
        for key in ("scheduler", "scaler", "loader"):
            obj = getattr(self, key)
            if obj is not None:
                meta[key] = copy.deepcopy(obj.state_dict())
        return meta

    def tensor_specs(self, meta: dict[str, Any]) -> None:
        """Give a fresh optimizer the state structure of ``meta``, with uninitialised tensors the
        restore then fills in place (``load_state_dict`` keeps same-dtype, same-device tensors)."""
        if self.optimizer is None or "optimizer" not in meta:
            return
        params = self.optimizer_params()
        state: dict[int, dict[str, Any]] = {}
        for index, st in meta["optimizer"]["state"].items():
            param = params[int(index)]
            state[int(index)] = {
                k: (_placeholder(param, meta["specs"][f"optim.{index}.{k}"]) if v == _TENSOR else v)
                for k, v in st.items()
            }
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["optimizer"]["param_groups"]})

    def load_meta(self, meta: dict[str, Any]) -> None:
        """Put back everything but the tensors' contents."""
        self.step = int(meta["step"])
        set_rng_state(meta["rng"])
        self.tensor_specs(meta)
        for key in ("scheduler", "scaler", "loader"):
            obj = getattr(self, key)
            if obj is not None and key in meta:
                obj.load_state_dict(meta[key])


def _placeholder(param: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    """An uninitialised tensor where the saved one lived: with its parameter, or on the CPU (Adam's
    ``step`` counters stay there unless the optimizer is capturable or fused)."""
    device = torch.device("cpu") if spec["device"] == "cpu" else param.device
    return torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), numpy and Python RNG states, in forms torch.load(weights_only) reads."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def encode_meta(meta: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(meta, buf)
    return buf.getvalue()


def decode_meta(raw: bytes | memoryview) -> dict[str, Any]:
    """weights_only: an image read back from the store can hold tensors and plain data, no code."""
    return torch.load(io.BytesIO(bytes(raw)), weights_only=True)  # type: ignore[no-any-return]
