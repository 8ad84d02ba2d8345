"""Soft copy-on-write: see every aten op's writes before they happen, on the training thread.

Each aten op's schema marks the arguments it mutates (``Tensor(a!)``), foreach and fused optimizer
kernels included (``_fused_adam_`` declares params, grads, moments). A ``TorchDispatchMode`` sees
each op before it runs, so the checkpoint can copy a tensor just before its first write; this is
POS's argument-based dataflow inference with the op schema as the rule source. Ops that write what
they do not declare are listed in ``UNDECLARED_WRITES`` (POS's rule table); what neither source
names is caught afterwards by validation (version counters, fingerprints) in ``capture``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

WriteRule = Callable[[Sequence[Any], dict[str, Any]], list[torch.Tensor]]


def _batch_norm_running_stats(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """``native_batch_norm(input, weight, bias, running_mean, running_var, training, ...)`` updates
    the running statistics in place when training, though its schema declares no write (and the
    version counters do not move)."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if not bound.get("training"):
        return []
    return [t for t in (bound.get("running_mean"), bound.get("running_var")) if isinstance(t, torch.Tensor)]


UNDECLARED_WRITES: dict[Any, WriteRule] = {
    torch.ops.aten.native_batch_norm.default: _batch_norm_running_stats,
}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class WriteGuard(TorchDispatchMode):
    """Calls ``before_writes(tensors)`` with the tensors an op is about to write (once per op that
    writes any: a foreach optimizer op hands its whole list at once), then runs the op.

    Pushed on the training thread for the duration of a checkpoint only (dispatch modes are
    thread-local: the copying thread's own ops are not intercepted).
    """

    def __init__(
        self, before_writes: Callable[[list[torch.Tensor]], None], rules: dict[Any, WriteRule]
    ) -> None:
        super().__init__()
        self._before_writes = before_writes
        self._rules = rules
        self._declared: dict[Any, tuple[tuple[int, str], ...]] = {}

    def _written_positions(self, func: Any) -> tuple[tuple[int, str], ...]:
        positions = self._declared.get(func)
        if positions is None:
            positions = tuple(
                (i, arg.name)
                for i, arg in enumerate(func._schema.arguments)
                if arg.alias_info is not None and arg.alias_info.is_write
            )
            self._declared[func] = positions
        return positions

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        written: list[torch.Tensor] = []
        for index, name in self._written_positions(func):
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                written.append(value)
            elif isinstance(value, list | tuple):
                written.extend(_tensors(value))
        rule = self._rules.get(func)
        if rule is not None:
            written.extend(rule(args, kwargs))
        if written:
            self._before_writes(written)
        return func(*args, **kwargs)


class AccessGuard(TorchDispatchMode):
    """Calls ``before_access(tensor)`` for every tensor an op reads or writes, then runs the op:
    on-demand restore's gate (POS: a kernel launches once all its buffers are loaded)."""

    def __init__(self, before_access: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._before_access = before_access

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            for tensor in _tensors(value):
                self._before_access(tensor)
        return func(*args, **kwargs)
