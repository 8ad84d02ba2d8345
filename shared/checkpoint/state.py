"""What a training job's image holds, and how it is read out and put back.

Tensors (model parameters and buffers in module order, then the optimizer's per-parameter state)
are the bulk and are copied concurrently; everything else (optimizer hyper-parameters, LR
scheduler, AMP scaler, RNG states, data-loader position, step count) is small and copied at the
step boundary itself, in microseconds.
"""

from __future__ import annotations

import copy
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

    def optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        if self.optimizer is None:
            return []
        out: list[tuple[str, torch.Tensor]] = []
        for index, param in enumerate(self.optimizer_params()):
            for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"optim.{index}.{key}", value))
        return out

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the image, by name, in load-priority order."""
        return [(name, t) for name, _, t in self.module_tensors()] + self.optimizer_tensors()

    def meta(self) -> dict[str, Any]:
        """The small state, copied now (the live objects keep changing once training resumes)."""
        meta: dict[str, Any] = {"step": self.step, "rng": rng_state()}
        if self.optimizer is not None:
            # optimizer.state_dict() by hand: the same structure without its per-call overhead.
            params = self.optimizer_params()
            index = {id(p): i for i, p in enumerate(params)}
            groups = [
                {
                    **copy.deepcopy({k: v for k, v in group.items() if k != "params"}),
                    "params": [index[id(p)] for p in group["params"]],
                }
                for group in self.optimizer.param_groups
            ]
            state = {
                index[id(p)]: {
                    k: (_TENSOR if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in st.items()
                }
                for p, st in self.optimizer.state.items()
            }
            meta["optimizer"] = {"state": state, "param_groups": groups}
            meta["specs"] = {
                name: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "device": t.device.type,
                }
                for name, t in self.optimizer_tensors()
            }
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
