"""Notebook tensors follow the GPUs bound to the cell (NotebookOS §3.3).

A replica holds GPUs only while one of its cells runs, and the next cell may get other device ids
(or run on another replica). So after a cell the executor copies what the notebook keeps on a GPU
back to host memory (``offload``), and before its next GPU cell it moves exactly those objects to
the newly bound device (``restore``). Objects the user created on the CPU stay there. That
list travels in the cell's STATE (``GpuResidency.carried``/``adopt``), so a standby that becomes
the executor brings the same objects to its GPU.

What is found: torch tensors, ``nn.Module``s (parameters, their gradients, buffers), optimizers
(parameters and state tensors), and dicts/lists/tuples of them up to ``MAX_CONTAINER_DEPTH``
levels deep; arbitrary objects' attributes are not walked (their tensors stay where they are).
Modules, optimizers and trainable leaf tensors move in place, so other references (an optimizer's
parameter list, a name bound to ``model.weight``) stay valid; other tensors are copied and the
copy is bound where the original was (name, dict item, list item, rebuilt tuple). Aliases within
one pass get the same copy. Each variable moves atomically: every copy is made before anything is
changed, so a failure (OOM, a tensor that cannot be copied) leaves that variable as it was.

Device ids are those the local scheduler reports (NVML indices). ``CUDA_VISIBLE_DEVICES`` is read
by CUDA once per process, so the kernel does not change it per cell: the process sees the host's
GPUs in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, set before CUDA can start), and a bound
id is addressed as ``torch.device("cuda", cuda_index(id))``; ``torch.cuda.set_device`` makes plain
``"cuda"`` mean the bound GPU during the cell.

The pure part (``offload``, ``restore``, ``cuda_index``) takes the target device as an argument so
it can be tested on the ``meta`` device without a GPU; ``GpuResidency`` is the kernel's shell.
It never imports torch: a notebook that has not imported it has nothing to move.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import time
import typing as t
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field

import structlog

from kernel_replica.cuda_rng import CARRIER, CudaRngCarrier
from kernel_replica.log_entries import GpuResident  # a Location as a STATE entry carries it

MODES = ("move", "off")
MAX_CONTAINER_DEPTH = 2  # a name's dict/list/tuple, and the containers directly inside it
MAX_CONTAINER_ITEMS = 10_000  # larger containers are not walked (the per-cell cost stays small)
# IPython's output cache (``_``, ``__``, ``_5``, ``Out``): offloaded so it frees the GPU, never
# moved back (nobody asked for old outputs on the GPU).
OUTPUT_CACHE_NAME = re.compile(r"_{1,3}\d*|_oh|Out")
# Read once at import (the kernel imports this module before any cell runs): the GPUs this
# process can see for its whole life.
VISIBLE_AT_START = os.environ.get("CUDA_VISIBLE_DEVICES")

Path = tuple[Hashable, ...]
Copier = Callable[[t.Any, t.Any], t.Any]  # (tensor, device) -> tensor on device


@dataclass(frozen=True, slots=True)
class Location:
    """Where a notebook keeps a torch object: a top-level name and keys/indices below it."""

    name: str
    path: Path = ()
    kind: str = "tensor"  # tensor | module | optimizer

    def __str__(self) -> str:
        return self.name + "".join(f"[{key!r}]" for key in self.path)


@dataclass(slots=True)
class MoveReport:
    """What one pass moved (``moved``: location and bytes copied) and what it could not."""

    device: str
    moved: list[tuple[Location, int]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # top-level name -> why it stayed
    elapsed_ms: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.moved)

    @property
    def locations(self) -> list[Location]:
        return [location for location, _ in self.moved]


class MoveError(RuntimeError):
    """A tensor that cannot be moved in place (its identity must be kept)."""


def default_copy(tensor: t.Any, device: t.Any) -> t.Any:
    """Synchronous copy: a GPU -> host copy waits for the cell's kernels, as §3.3 requires."""
    return tensor.to(device)


def cuda_index(device_id: int, visible: str | None, device_count: int) -> int | None:
    """The index torch uses in this process for host GPU ``device_id``; None if it cannot see it.

    ``visible`` is ``CUDA_VISIBLE_DEVICES`` at process start: unset means every GPU, by NVML
    index; a list of integers renumbers them from 0; UUIDs/MIG names cannot be mapped."""
    if visible is None:
        return device_id if 0 <= device_id < device_count else None
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if not all(entry.isdigit() for entry in entries):
        return None
    ids = [int(entry) for entry in entries]
    if device_id not in ids:
        return None
    index = ids.index(device_id)
    return index if index < device_count else None


# ---- traversal -----------------------------------------------------------------------------------
def _torch() -> t.Any:
    return sys.modules.get("torch")


def _kind(torch: t.Any, value: t.Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    return None


def _is_container(value: t.Any) -> bool:
    if isinstance(value, dict | list):
        return len(value) <= MAX_CONTAINER_ITEMS
    if type(value) is tuple or (isinstance(value, tuple) and hasattr(value, "_make")):
        return len(value) <= MAX_CONTAINER_ITEMS  # plain tuples and namedtuples (rebuildable)
    return False


def _walk(torch: t.Any, value: t.Any, path: Path, depth: int) -> Iterator[tuple[Path, t.Any, str]]:
    kind = _kind(torch, value)
    if kind is not None:
        yield path, value, kind
    elif depth < MAX_CONTAINER_DEPTH and _is_container(value):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _walk(torch, item, (*path, key), depth + 1)


def _module_tensors(module: t.Any) -> Iterator[t.Any]:
    for param in module.parameters():
        yield param
        if param.grad is not None:
            yield param.grad
    yield from module.buffers()


def _optimizer_tensors(torch: t.Any, optimizer: t.Any, device: t.Any) -> Iterator[t.Any]:
    """Parameters, gradients and state tensors. ``step`` counters stay on the CPU unless their
    group is capturable/fused (where torch's ``Optimizer.load_state_dict`` puts them)."""
    for group in optimizer.param_groups:
        keep_step_on_cpu = device.type != "cpu" and not (group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            yield param
            if param.grad is not None:
                yield param.grad
            state = optimizer.state.get(param)
            if isinstance(state, dict):
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and not (key == "step" and keep_step_on_cpu):
                        yield value


def _tensors(torch: t.Any, value: t.Any, kind: str, device: t.Any) -> Iterator[t.Any]:
    """The tensors of a torch object that a move to ``device`` copies."""
    if kind == "module":
        return _module_tensors(value)
    if kind == "optimizer":
        return _optimizer_tensors(torch, value, device)
    grad = value.grad if value.is_leaf else None  # a non-leaf's .grad only warns
    return iter((value,) if grad is None else (value, grad))


def _nbytes(tensor: t.Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def find_resident(namespace: Mapping[str, t.Any], host: t.Any = "cpu") -> list[Location]:
    """Every location in ``namespace`` whose object holds a tensor that is not on ``host``."""
    torch = _torch()
    if torch is None:
        return []
    host = torch.device(host)
    found = []
    for name, value in list(namespace.items()):
        for path, obj, kind in _walk(torch, value, (), 0):
            if any(tensor.device != host for tensor in _tensors(torch, obj, kind, host)):
                found.append(Location(name, path, kind))
    return found


def _resolve(namespace: Mapping[str, t.Any], location: Location) -> t.Any:
    value = namespace[location.name]
    for key in location.path:
        value = value[key]
    return value


# ---- moving --------------------------------------------------------------------------------------
class _Pass:
    """One direction over a namespace: copies are made per variable, then committed together."""

    def __init__(self, torch: t.Any, device: t.Any, copy: Copier) -> None:
        self.torch = torch
        self.device = torch.device(device)
        self.copy = copy
        self.copies: dict[int, tuple[t.Any, t.Any]] = {}  # id(source) -> (source, copy), committed
        self.done: dict[int, t.Any] = {}  # objects already moved (kept alive so ids stay unique)

    def _copy_of(self, tensor: t.Any, staged: dict[int, tuple[t.Any, t.Any]]) -> int:
        """Stage the copy of ``tensor`` on the target (aliases share one); the bytes it cost."""
        if tensor.device == self.device or id(tensor) in self.copies or id(tensor) in staged:
            return 0
        # Without autograd history: a copy of a cell's output (``preds = model(x)``) made with
        # it would keep the whole graph, and the activations it saved, on the GPU. A tensor that
        # required grad becomes a leaf that does, as the standbys get it from the STATE.
        copy = self.copy(tensor.detach(), self.device)
        if tensor.requires_grad and not copy.requires_grad:
            copy.requires_grad_(True)
        staged[id(tensor)] = (tensor, copy)
        return _nbytes(tensor)

    def move_name(
        self, namespace: MutableMapping[str, t.Any], name: str, locations: list[Location]
    ) -> list[tuple[Location, int]]:
        """Move every location under ``name``; all or nothing (raises, with nothing changed)."""
        staged: dict[int, tuple[t.Any, t.Any]] = {}
        targets: list[tuple[Location, t.Any, int]] = []  # location, object, bytes copied
        for location in locations:
            try:
                obj = _resolve(namespace, location)
            except (KeyError, IndexError, TypeError):
                continue  # the recorded place no longer exists
            kind = _kind(self.torch, obj)
            if kind != location.kind:
                continue  # rebound to something else since it was recorded
            size = 0
            if id(obj) not in self.done:
                for tensor in _tensors(self.torch, obj, kind, self.device):
                    size += self._copy_of(tensor, staged)
            targets.append((location, obj, size))
        undo: list[Callable[[], None]] = []
        done: dict[int, t.Any] = {}
        try:
            for location, obj, _ in targets:
                self._commit(namespace, location, obj, staged, undo, done)
        except BaseException:
            for step in reversed(undo):
                with contextlib.suppress(Exception):  # best effort: the first error is the one to report
                    step()
            raise
        self.copies.update(staged)
        self.done.update(done)
        return [(location, size) for location, _, size in targets]

    def _commit(
        self,
        namespace: MutableMapping[str, t.Any],
        location: Location,
        obj: t.Any,
        staged: dict[int, tuple[t.Any, t.Any]],
        undo: list[Callable[[], None]],
        done: dict[int, t.Any],
    ) -> None:
        def lookup(tensor: t.Any) -> t.Any:
            for table in (staged, self.copies):
                entry = table.get(id(tensor))
                if entry is not None and entry[0] is tensor:
                    return entry[1]
            return tensor

        rebound = location.kind == "tensor" and not (obj.is_leaf and obj.requires_grad)
        if not rebound and (id(obj) in self.done or id(obj) in done):
            return  # moved in place through another reference
        if location.kind == "module":
            undo.append(_module_snapshot(obj))
            torch = self.torch
            swap = any(
                not torch._has_compatible_shallow_copy_type(source, copy) for source, copy in staged.values()
            )
            previous = torch.__future__.get_swap_module_params_on_conversion()
            # torch's own conversion (RNN flat weights etc.); set_data keeps parameter identity
            # for CPU <-> CUDA, the swap mode does where set_data cannot (e.g. the meta device)
            torch.__future__.set_swap_module_params_on_conversion(previous or swap)
            try:
                obj._apply(lookup)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(previous)
            for tensor in _module_tensors(obj):  # moved (a swap also changed the staged copies)
                done[id(tensor)] = tensor
        elif location.kind == "optimizer":
            for group in obj.param_groups:
                for param in group["params"]:
                    self._move_in_place(param, lookup, undo, done)
            for state in obj.state.values():
                if isinstance(state, dict):
                    for key, value in list(state.items()):
                        moved = lookup(value) if isinstance(value, self.torch.Tensor) else value
                        if moved is not value:
                            state[key] = moved
                            undo.append(lambda s=state, k=key, v=value: s.__setitem__(k, v))
        elif rebound:
            self._rebind(namespace, location, lookup(obj), undo)
        else:
            self._move_in_place(obj, lookup, undo, done)  # optimizers hold trainable leaves by identity
        done[id(obj)] = obj

    def _move_in_place(
        self,
        tensor: t.Any,
        lookup: Callable[[t.Any], t.Any],
        undo: list[Callable[[], None]],
        done: dict[int, t.Any],
    ) -> None:
        if id(tensor) in self.done or id(tensor) in done:
            return
        grad = tensor.grad
        moved, moved_grad = lookup(tensor), lookup(grad) if grad is not None else None
        if moved is tensor and moved_grad is grad:
            return
        torch = self.torch
        with torch.no_grad():
            if torch._has_compatible_shallow_copy_type(tensor, moved):
                old_data = tensor.data
                tensor.data = moved  # CPU <-> CUDA: what nn.Module.to does
                undo.append(lambda: _restore_data(tensor, old_data, grad))
            else:  # e.g. to or from meta: swap the payload, keep the Python object
                replacement = (
                    torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
                    if isinstance(tensor, torch.nn.Parameter)
                    else moved.detach().requires_grad_(tensor.requires_grad)
                )
                try:
                    torch.utils.swap_tensors(tensor, replacement)
                except Exception as exc:
                    raise MoveError(f"cannot move a tensor in place ({exc})") from exc
                undo.append(lambda: torch.utils.swap_tensors(tensor, replacement))
            if grad is not None:
                tensor.grad = moved_grad
        done[id(tensor)] = tensor

    def _rebind(
        self,
        namespace: MutableMapping[str, t.Any],
        location: Location,
        new: t.Any,
        undo: list[Callable[[], None]],
    ) -> None:
        """Bind ``new`` at ``location``: dicts/lists in place, tuples rebuilt up to the name."""
        chain = [namespace[location.name]]
        for key in location.path:
            chain.append(chain[-1][key])
        replacement = new
        for depth in range(len(location.path) - 1, -1, -1):
            container, key = chain[depth], location.path[depth]
            if isinstance(container, tuple):
                items = list(container)
                items[t.cast(int, key)] = replacement
                replacement = type(container)._make(items) if hasattr(container, "_make") else tuple(items)
            else:
                old = container[key]
                container[key] = replacement
                undo.append(lambda c=container, k=key, v=old: c.__setitem__(k, v))
                return
        old_value = namespace[location.name]
        namespace[location.name] = replacement
        undo.append(lambda: namespace.__setitem__(location.name, old_value))


def _module_snapshot(module: t.Any) -> Callable[[], None]:
    """An undo for a module move: every submodule's parameter/buffer tables and payloads."""
    tables = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
    payloads = [(p, p.data, p.grad) for p in module.parameters()]

    def undo() -> None:
        for owner, params, buffers in tables:
            owner._parameters.clear()
            owner._parameters.update(params)
            owner._buffers.clear()
            owner._buffers.update(buffers)
        for param, data, grad in payloads:
            _restore_data(param, data, grad)

    return undo


def _restore_data(tensor: t.Any, data: t.Any, grad: t.Any) -> None:
    tensor.data = data
    tensor.grad = grad


def _move(
    namespace: MutableMapping[str, t.Any], locations: Iterable[Location], device: t.Any, copy: Copier
) -> MoveReport:
    torch = _torch()
    report = MoveReport(str(device))
    if torch is None:
        return report
    started = time.perf_counter()
    by_name: dict[str, list[Location]] = {}
    for location in locations:
        by_name.setdefault(location.name, []).append(location)
    moving = _Pass(torch, device, copy)
    for name, group in by_name.items():
        try:
            report.moved.extend(moving.move_name(namespace, name, group))
        except Exception as exc:  # OOM, a tensor that cannot be copied: the variable stays put
            report.failed[name] = f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    report.elapsed_ms = (time.perf_counter() - started) * 1000
    return report


def offload(
    namespace: MutableMapping[str, t.Any], host: t.Any = "cpu", *, copy: Copier = default_copy
) -> MoveReport:
    """After a cell: move everything the namespace keeps off ``host`` to ``host``."""
    return _move(namespace, find_resident(namespace, host), host, copy)


def restore(
    namespace: MutableMapping[str, t.Any],
    locations: Iterable[Location],
    device: t.Any,
    *,
    copy: Copier = default_copy,
) -> MoveReport:
    """Before a cell: move the objects at ``locations`` (what the last ``offload`` moved, as
    ``MoveReport.locations``) to ``device``. Places that now hold something else are skipped."""
    return _move(namespace, locations, device, copy)


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` once, right after the first import of the top-level module
    ``name`` has run (before the importing code uses it), then leaves ``sys.meta_path``. A
    failing callback is logged and never breaks the user's import."""

    def __init__(self, name: str, callback: Callable[[t.Any], object]) -> None:
        self.name = name
        self.callback = callback

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: t.Any, target: t.Any = None) -> t.Any:
        if fullname != self.name:
            return None
        self.remove()  # once; and the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_then_call(module: t.Any) -> None:
            run_module(module)
            try:
                self.callback(module)
            except Exception:
                structlog.get_logger("replica.residency").exception("after_import_failed", module=fullname)

        loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


# ---- the kernel's shell --------------------------------------------------------------------------
class GpuResidency:
    """Per replica: moves the notebook's GPU objects in before a GPU cell and out after it.

    ``mode`` is ``kernel.gpu_residency`` ("move" | "off"). Construct it before any cell runs: it
    pins ``CUDA_DEVICE_ORDER`` to PCI bus order so torch indices match the scheduler's NVML ids."""

    def __init__(
        self,
        mode: str = "move",
        *,
        visible: str | None = VISIBLE_AT_START,
        log: t.Any = None,
        rng: CudaRngCarrier = CARRIER,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"kernel.gpu_residency must be one of {', '.join(MODES)}; got {mode!r}")
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        self.mode = mode
        self.visible = visible
        self.log = log if log is not None else structlog.get_logger("replica.residency")
        self.timings: dict[str, float] = {}  # the last cell's to_gpu_ms / to_host_ms (and bytes)
        self.index: int | None = None  # torch's index of the cell's first bound GPU, during a cell
        self._record: list[Location] = []  # what the last offload moved, to move back in
        self._device: t.Any = None  # the device moved to for the running cell
        self._warned: set[str] = set()
        self._lazy_device_queued = False
        self._torch_import: AfterImport | None = None  # a cell bound to GPUs before torch is imported
        self._rng = rng

    def before_cell(self, namespace: MutableMapping[str, t.Any], device_ids: list[int]) -> None:
        """Make the first bound GPU current and move the recorded objects onto it. Never raises:
        a failure here must not keep the cell from running."""
        self.timings, self._device, self.index = {}, None, None
        try:
            self._before(namespace, device_ids)
        except Exception:
            self.log.exception("gpu_residency_failed", step="before_cell")

    def after_cell(self, namespace: MutableMapping[str, t.Any]) -> None:
        """Copy what the notebook keeps on GPUs to host memory and remember it for the next cell.
        Never raises (the cell's reply and DONE must still go out)."""
        try:
            self._after(namespace)
        except Exception:
            self.log.exception("gpu_residency_failed", step="after_cell")
        finally:
            self._device, self.index = None, None

    def _before(self, namespace: MutableMapping[str, t.Any], device_ids: list[int]) -> None:
        self._stop_waiting_for_torch()
        if not device_ids:
            return
        torch = _torch()
        if torch is None:
            # A first GPU cell usually imports torch itself: bind its GPU the moment the import
            # finishes (before CUDA can start), so plain "cuda" is the bound GPU and what the
            # cell leaves there is offloaded after it.
            self._torch_import = AfterImport("torch", lambda module: self._bind(module, device_ids))
            self._torch_import.install()
            return
        if not self._bind(torch, device_ids) or not self._record:
            return
        report = restore(namespace, self._record, self._device)
        self.timings |= {"to_gpu_ms": report.elapsed_ms, "to_gpu_bytes": float(report.nbytes)}
        self._record = [loc for loc in self._record if loc.name in report.failed]  # retried next cell
        self._report(report, "to the bound GPU")

    def _bind(self, torch: t.Any, device_ids: list[int]) -> bool:
        """The cell's first bound GPU becomes its device (current now, or when CUDA starts), with
        the notebook's CUDA generator state on it (``cuda_rng``). With residency off, the
        notebook picks its devices itself: only the generator state goes to the current one."""
        if not torch.cuda.is_available():
            return False
        if self.mode == "off":
            if self._rng.pending and torch.cuda.is_initialized():
                self._rng.bind(torch, torch.cuda.current_device())
            elif self._rng.pending and not self._lazy_device_queued:
                self._lazy_device_queued = True
                torch.cuda._lazy_call(lambda: self._rng.bind(torch, torch.cuda.current_device()))
            return False
        index = cuda_index(device_ids[0], self.visible, torch.cuda.device_count())
        if index is None:
            self._warn(
                f"gpu:{device_ids[0]}",
                f"bound GPU {device_ids[0]} is not visible to this process (CUDA_VISIBLE_DEVICES="
                f"{self.visible!r}, {torch.cuda.device_count()} devices); notebook tensors stay in host memory",
            )
            return False
        self.index = index
        self._device = torch.device("cuda", index)
        if torch.cuda.is_initialized():
            torch.cuda.set_device(index)
            self._rng.bind(torch, index)
        elif not self._lazy_device_queued:  # plain "cuda" = the bound GPU, without starting CUDA now
            self._lazy_device_queued = True
            torch.cuda._lazy_call(self._set_current_device)
        return True

    def _stop_waiting_for_torch(self) -> None:
        if self._torch_import is not None:
            self._torch_import.remove()
            self._torch_import = None

    def _after(self, namespace: MutableMapping[str, t.Any]) -> None:
        self._stop_waiting_for_torch()
        if self._device is None:
            return
        torch = _torch()
        report = offload(namespace, "cpu")
        self.timings |= {"to_host_ms": report.elapsed_ms, "to_host_bytes": float(report.nbytes)}
        keep = [loc for loc in self._record if loc.name in namespace]  # failed to move in: retry
        moved = [loc for loc in report.locations if not OUTPUT_CACHE_NAME.fullmatch(loc.name)]
        self._record = list(dict.fromkeys([*keep, *moved]))
        self._report(report, "to host memory")
        # cuBLAS keeps its workspaces (32 MiB each on an H100: one per thread/stream that ran a
        # matmul, autograd's included) as live allocations of torch's allocator; free them too
        # (made again by the next matmul), then the allocator's cache
        clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_cublas_workspaces is not None:
            clear_cublas_workspaces()
        torch.cuda.empty_cache()  # the allocator's cache would keep the memory from the next holder
        left = torch.cuda.memory_allocated(self._device)
        if left:
            self.log.info("gpu_memory_left", device=str(self._device), bytes=left)

    def names(self) -> set[str]:
        """The names whose objects the next GPU cell moves onto its GPU first."""
        return {loc.name for loc in self._record}

    def carried(self) -> tuple[GpuResident, ...]:
        """What the executor keeps in host memory for the GPU, as its STATE carries it to the
        standbys (locations whose keys are strings or integers; others stay in host memory on an
        executor change)."""
        return tuple(
            (loc.name, loc.path, loc.kind)
            for loc in self._record
            if all(isinstance(key, str | int) for key in loc.path)
        )

    def adopt(self, carried: Iterable[GpuResident]) -> None:
        """A standby applied another executor's STATE: its namespace is that executor's, so is
        what goes to the GPU when a cell runs here next."""
        self._record = [Location(name, tuple(path), kind) for name, path, kind in carried]

    def _set_current_device(self) -> None:
        """Run by torch when this process first starts CUDA: the cell's GPU becomes current."""
        torch = _torch()
        if torch is not None and self.index is not None:
            torch.cuda.set_device(self.index)
            self._rng.bind(torch, self.index)

    def _report(self, report: MoveReport, where: str) -> None:
        if report.moved:
            self.log.debug(
                "tensors_moved",
                device=report.device,
                objects=len(report.moved),
                bytes=report.nbytes,
                ms=round(report.elapsed_ms, 3),
            )
        for name, reason in report.failed.items():
            self._warn(
                name, f"variable {name!r} could not be moved {where} ({reason}); it was left where it was"
            )

    def _warn(self, key: str, message: str) -> None:
        """Once per variable (or unmappable GPU) per replica, on the cell's stderr."""
        if key in self._warned:
            return
        self._warned.add(key)
        self.log.warning("gpu_residency", key=key, detail=message)
        if sys.stderr is not None:
            print(f"Tandem: {message}.", file=sys.stderr)
            sys.stderr.flush()
