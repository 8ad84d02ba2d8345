"""Process-wide settings that notebooks change in their libraries, replicated with the executor.

A notebook seeds its random generators at the top (``np.random.seed(0)``, ``random.seed(0)``,
``torch.manual_seed(0)``) and expects its later cells to draw the same numbers every run; it sets
``torch.set_default_dtype(torch.float64)``, ``np.seterr(all="raise")``,
``decimal.getcontext().prec = 50``, ``warnings.filterwarnings("error")``,
``sys.setrecursionlimit(10_000)``, ``plt.rcParams[...]`` / ``plt.style.use(...)``,
``pd.set_option(...)``, ``sklearn.set_config(transform_output="pandas")``,
``logging.basicConfig(level=logging.INFO)``. None of that is
in the namespace: it lives in the libraries' module state, per process. Without this module the
next executor drew other random numbers, computed in float32, ignored the warnings filters and
drew figures in another style, silently (each replica has its own process).

Each ``Setting`` reads one such state (``read``: the value, picklable), tells cheaply whether it
changed since a memo (``probe``), and puts a value back (``write``). Only settings of modules the
executor has imported are read; values travel pickled, in the process context
(``process_context.ProcessContext.settings``), only those that changed since the log's last.
Telling whether any changed costs ~30 us after a cell of a notebook with numpy, torch, pandas and
matplotlib imported (~10 us with none of them); a value is read and pickled only when it changed.
"""

from __future__ import annotations

import copy
import ctypes
import importlib
import pickle
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import structlog

from kernel_replica.cuda_rng import CARRIER
from kernel_replica.library_patches import LibraryPatches
from kernel_replica.notebook_modules import NotebookModules

log = structlog.get_logger("library_settings")

#: A value larger than this (pickled) is not replicated: logged, the executor's own.
MAX_VALUE_BYTES = 256 * 1024
#: rcParams each replica keeps its own: its plotting backend, chosen by the kernel.
RC_OWN = frozenset({"backend", "backend_fallback", "interactive"})
_MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos


@dataclass(frozen=True)
class Setting:
    """One process-wide setting of ``module``. ``snapshot``: what tells later whether it changed
    (by default the value itself), compared by ``changed`` (by default: a new snapshot differs)."""

    name: str
    module: str
    read: Callable[[ModuleType], Any]
    write: Callable[[ModuleType, Any], None]
    snapshot: Callable[[ModuleType], Any] | None = None
    changed: Callable[[ModuleType, Any], bool] | None = None

    def memo(self, module: ModuleType, value: Any) -> Any:
        return value if self.snapshot is None else self.snapshot(module)

    def has_changed(self, module: ModuleType, memo: Any) -> bool:
        if self.changed is not None:
            return self.changed(module, memo)
        return bool((self.snapshot or self.read)(module) != memo)


def _numpy_rng_probe(random: ModuleType) -> Any:
    """The legacy global generator's raw state (key and position: any draw changes them), ~1 us
    against ~40 for ``get_state``; through numpy's documented ``ctypes.state_address``."""
    bit_generator = random.mtrand._rand._bit_generator
    if type(bit_generator).__name__ != "MT19937":
        return random.get_state()
    return ctypes.string_at(bit_generator.ctypes.state_address, _MT19937_STATE_BYTES)


def _python_rng_reader() -> Callable[[ModuleType], Any] | None:
    """A ~1 us probe of ``random``'s global generator (its C struct: index, then the 624-word
    key, after the object header), where ``getstate`` builds a 625-tuple (~11 us); None where this
    build lays it out otherwise, checked here against ``getstate`` before and after a draw."""
    offset, size = object.__basicsize__, 4 + 624 * 4
    try:
        import _random
        import random

        if _random.Random.__basicsize__ < offset + size:
            return None
        sample = random.Random(20261127)
        for _ in range(2):
            state = sample.getstate()[1]
            raw = struct.unpack_from("=i624I", ctypes.string_at(id(sample) + offset, size))
            if raw != (state[-1], *state[:-1]):
                return None
            sample.random()
    except Exception:
        return None
    return lambda random: ctypes.string_at(id(random._inst) + offset, size)


def _torch_rng(torch: ModuleType) -> bytes:
    return bytes(torch.get_rng_state().numpy().tobytes())


def _set_torch_rng(torch: ModuleType, value: bytes) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(value), dtype=torch.uint8))


def _set_torch_dtype(torch: ModuleType, value: str) -> None:
    dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype {value!r}")
    torch.set_default_dtype(dtype)


def _decimal_context(decimal: ModuleType) -> tuple[Any, ...]:
    c = decimal.getcontext()
    traps = tuple(sorted(s.__name__ for s, on in c.traps.items() if on))
    return (c.prec, c.rounding, c.Emin, c.Emax, c.capitals, c.clamp, traps)


def _set_decimal_context(decimal: ModuleType, value: tuple[Any, ...]) -> None:
    prec, rounding, emin, emax, capitals, clamp, traps = value
    c = decimal.getcontext()
    c.prec, c.rounding, c.Emin, c.Emax, c.capitals, c.clamp = prec, rounding, emin, emax, capitals, clamp
    for signal in c.traps:
        c.traps[signal] = signal.__name__ in traps


Filter = tuple[str, Any, tuple[str, str], Any, int]


def _pattern(regex: Any) -> Any:
    """A filter's message or module regex as (pattern, flags); a plain string or None as is."""
    return (regex.pattern, regex.flags) if isinstance(regex, re.Pattern) else regex


def _compiled(pattern: Any) -> Any:
    return re.compile(*pattern) if isinstance(pattern, tuple) else pattern


def _warning_filters(warnings: ModuleType) -> list[Filter]:
    """The filters with their categories by name, not pickled by reference: unpickling those would
    import every module a category comes from (the executor's ``torch._dynamo`` and the like:
    250 ms on the first cell a standby ran)."""
    return [
        (action, _pattern(message), (category.__module__, category.__qualname__), _pattern(module), lineno)
        for action, message, category, module, lineno in warnings.filters
    ]


def _by_name(module: ModuleType | None, qualname: str) -> Any:
    """``module``'s object named ``qualname`` (``"tqdm"``, ``"Outer.Inner"``), or None."""
    found: Any = module
    for part in qualname.split(".") if module is not None else ():
        found = getattr(found, part, None)
    return found


def _set_warning_filters(warnings: ModuleType, value: list[Filter]) -> None:
    """The executor's filters, but those whose category's module is not imported here: no such
    warning can be raised before it is, and a library's own filters come with its import."""
    filters = []
    for action, message, (home, name), module, lineno in value:
        category = _by_name(sys.modules.get(home), name)
        if isinstance(category, type) and issubclass(category, Warning):
            filters.append((action, _compiled(message), category, _compiled(module), lineno))
    warnings.filters[:] = filters
    warnings._filters_mutated()


def _rc(matplotlib: ModuleType) -> dict[str, Any]:
    return {k: v for k, v in dict.items(matplotlib.rcParams) if k not in RC_OWN}


def _set_rc(matplotlib: ModuleType, value: Mapping[str, Any]) -> None:
    rc = matplotlib.rcParams
    changed = {k: v for k, v in value.items() if k not in RC_OWN and dict.get(rc, k) != v}
    with warnings.catch_warnings():  # a key deprecated in this version: set all the same
        warnings.simplefilter("ignore")
        rc.update(changed)


_TORCH_PRINT = ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")


def _torch_print(torch: ModuleType) -> dict[str, Any]:
    options = torch._tensor_str.PRINT_OPTS
    return {k: getattr(options, k) for k in _TORCH_PRINT}


def _torch_deterministic(torch: ModuleType) -> tuple[bool, bool, bool, bool]:
    cudnn = torch.backends.cudnn
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        bool(cudnn.deterministic),
        bool(cudnn.benchmark),
    )


def _set_torch_deterministic(torch: ModuleType, value: tuple[bool, bool, bool, bool]) -> None:
    enabled, warn_only, cudnn_deterministic, cudnn_benchmark = value
    now = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if now != (enabled, warn_only):  # its first call takes ~1.3 s
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark


def _torch_numerics(torch: ModuleType) -> tuple[str, bool, bool]:
    """What changes a computation's numbers or its autograd: float32 matmul precision (TF32 on
    GPUs follows it), grad mode (``torch.set_grad_enabled(False)`` as a statement: the cells'
    thread's), anomaly detection."""
    return torch.get_float32_matmul_precision(), torch.is_grad_enabled(), torch.is_anomaly_enabled()


def _set_torch_numerics(torch: ModuleType, value: tuple[str, bool, bool]) -> None:
    precision, grad, anomaly = value
    if torch.get_float32_matmul_precision() != precision:
        torch.set_float32_matmul_precision(precision)
    torch.set_grad_enabled(grad)
    torch.autograd.set_detect_anomaly(anomaly)


def _torch_default_device(torch: ModuleType) -> str:
    """``torch.set_default_device("cuda")``: where new tensors go (per thread: the cells')."""
    return str(torch.get_default_device())


def _set_torch_default_device(torch: ModuleType, value: str) -> None:
    torch.set_default_device(None if value == "cpu" else value)


#: Backend switches that change a GPU computation's numbers or which kernel computes it, as
#: (path under ``torch.backends``, attribute or getter, setter or None for an attribute).
_TORCH_BACKEND_SWITCHES = (
    ("cudnn", "enabled", None),
    ("cudnn", "allow_tf32", None),  # convolutions in TF32 (on by default on Ampere and later)
    ("cuda.matmul", "allow_fp16_reduced_precision_reduction", None),
    ("cuda.matmul", "allow_bf16_reduced_precision_reduction", None),
    ("cuda", "flash_sdp_enabled", "enable_flash_sdp"),  # which attention kernel runs
    ("cuda", "mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    ("cuda", "math_sdp_enabled", "enable_math_sdp"),
)


def _backend(torch: ModuleType, path: str) -> Any:
    found: Any = torch.backends
    for part in path.split("."):
        found = getattr(found, part)
    return found


def _torch_backends(torch: ModuleType) -> tuple[bool, ...]:
    """``torch.backends.cudnn.allow_tf32 = False`` for reproducible convolutions, the SDP
    attention kernels switched off or on, ...: read without starting CUDA."""
    values = []
    for path, name, setter in _TORCH_BACKEND_SWITCHES:
        value = getattr(_backend(torch, path), name)
        values.append(bool(value() if setter is not None else value))
    return tuple(values)


def _torch_backends_probe(torch: ModuleType) -> tuple[Any, ...]:
    """The same switches through torch's C getters: ~1 us, where the properties take ~15 us."""
    c = torch._C
    return (
        c._get_cudnn_enabled(),
        c._get_cudnn_allow_tf32(),
        c._get_cublas_allow_fp16_reduced_precision_reduction(),
        c._get_cublas_allow_bf16_reduced_precision_reduction(),
        c._get_flash_sdp_enabled(),
        c._get_mem_efficient_sdp_enabled(),
        c._get_math_sdp_enabled(),
    )


def _set_torch_backends(torch: ModuleType, value: tuple[bool, ...]) -> None:
    now = _torch_backends(torch)
    for (path, name, setter), wanted, current in zip(_TORCH_BACKEND_SWITCHES, value, now, strict=True):
        if wanted == current:
            continue  # only what differs: a switch set is sometimes warned about
        backend = _backend(torch, path)
        if setter is not None:
            getattr(backend, setter)(wanted)
        else:
            setattr(backend, name, wanted)


def _progress_apply(_tqdm: ModuleType) -> Any:
    """pandas' ``DataFrame.progress_apply``, which ``tqdm.pandas()`` adds, or None."""
    frame = sys.modules.get("pandas.core.frame")
    return getattr(getattr(frame, "DataFrame", None), "progress_apply", None)


def _tqdm_pandas(tqdm: ModuleType) -> tuple[str, str, dict[str, Any]] | None:
    """``tqdm.pandas()`` / ``tqdm.auto.tqdm.pandas(desc=...)``, a common first cell: it adds
    ``progress_apply``, ``progress_map`` and friends to pandas' classes, and the next executor's
    ``df.progress_apply(f)`` raised AttributeError. The patch is a closure over the tqdm class and
    its keyword arguments: (that class's module, its name, the arguments), or None."""
    patched = _progress_apply(tqdm)
    code = getattr(patched, "__code__", None)
    if code is None or not patched.__closure__:
        return None
    cells = dict(zip(code.co_freevars, patched.__closure__, strict=True))
    cls, kwargs = cells.get("cls"), cells.get("tqdm_kwargs")
    if cls is None or kwargs is None:
        return None
    tclass, options = cls.cell_contents, kwargs.cell_contents
    if not isinstance(tclass, type) or not isinstance(options, dict):
        return None
    return (tclass.__module__, tclass.__qualname__, dict(options))


def _set_tqdm_pandas(_tqdm: ModuleType, value: tuple[str, str, dict[str, Any]] | None) -> None:
    if value is None:
        return  # a patch cannot be taken back: tqdm offers no undo
    module, name, options = value
    tclass = _by_name(importlib.import_module(module), name)
    if tclass is None:
        raise LookupError(f"{module}.{name} is not in this tqdm")
    tclass.pandas(**options)


def _shell_interactivity(module: ModuleType) -> str | None:
    """Which expressions of a cell are shown (``InteractiveShell.ast_node_interactivity = "all"``,
    a notebook's common first line, sets the class attribute, not through ``%config``)."""
    shell = module.InteractiveShell._instance
    return None if shell is None else str(shell.ast_node_interactivity)


def _set_shell_interactivity(module: ModuleType, value: str | None) -> None:
    shell = module.InteractiveShell._instance
    if shell is not None and value is not None and shell.ast_node_interactivity != value:
        shell.ast_node_interactivity = value


def _pandas_options(pandas: ModuleType) -> dict[str, Any]:
    """Every registered option's value (a callable one, ``display.float_format = lambda ...``,
    left out if it cannot be pickled)."""
    with warnings.catch_warnings():  # a deprecated option: read all the same
        warnings.simplefilter("ignore")
        options = {key: pandas.get_option(key) for key in pandas._config.config._registered_options}
    return {k: v for k, v in options.items() if not callable(v) or _picklable(v)}


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _set_pandas_options(pandas: ModuleType, value: Mapping[str, Any]) -> None:
    registered = pandas._config.config._registered_options
    with warnings.catch_warnings():  # a deprecated option: set all the same
        warnings.simplefilter("ignore")
        for key, option in value.items():
            if key in registered and pandas.get_option(key) != option:
                pandas.set_option(key, option)


_UNCHANGED = "tandem: logger levels unchanged"  # a key no level lookup uses (see _logging_probe)


def _logging(
    logging: ModuleType,
) -> tuple[int, int, dict[str, int], list[tuple[str, int, str | None, str | None, str]]]:
    """The root logger's level, ``logging.disable``'s, the levels set on named loggers, and the
    root's handlers that print to the cell's output (``logging.basicConfig(level=...)``: the
    stream, level, format)."""
    root = logging.getLogger()
    levels = {
        name: logger.level
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and logger.level
    }
    handlers = []
    for handler in root.handlers:
        stream = (
            _stream_name(getattr(handler, "stream", None)) if type(handler) is logging.StreamHandler else None
        )
        if stream is not None:
            formatter = handler.formatter
            style = next(
                (k for k, v in logging._STYLES.items() if formatter and type(formatter._style) is v[0]), "%"
            )
            handlers.append(
                (
                    stream,
                    handler.level,
                    formatter._fmt if formatter else None,
                    formatter.datefmt if formatter else None,
                    style,
                )
            )
    return root.level, logging.root.manager.disable, levels, handlers


def _logging_mark(logging: ModuleType) -> tuple[Any, ...]:
    """Marks the root logger's level cache, and returns its level and handlers (the memo)."""
    root = logging.getLogger()
    cache = getattr(root, "_cache", None)
    if isinstance(cache, dict):
        cache[_UNCHANGED] = True
    return root.level, tuple(root.handlers)


def _logging_changed(logging: ModuleType, memo: tuple[Any, ...]) -> bool:
    """~1 us where reading every logger's level is ~6: ``setLevel`` on any logger and
    ``logging.disable`` clear every logger's level cache (``Manager._clear_cache``), the root's
    too, so the mark ``_logging_mark`` left in it is gone after any of them."""
    root = logging.getLogger()
    cache = getattr(root, "_cache", None)
    if not isinstance(cache, dict) or cache.get(_UNCHANGED) is not True:
        return True
    return (root.level, tuple(root.handlers)) != memo


def _stream_name(stream: Any) -> str | None:
    return "stdout" if stream is sys.stdout else "stderr" if stream is sys.stderr else None


def _set_logging(logging: ModuleType, value: tuple[int, int, dict[str, int], list[Any]]) -> None:
    level, disabled, levels, handlers = value
    root = logging.getLogger()
    root.setLevel(level)
    logging.disable(disabled)
    for name, named_level in levels.items():
        logging.getLogger(name).setLevel(named_level)
    for handler in list(root.handlers):  # the notebook's own, as the executor has them now
        if type(handler) is logging.StreamHandler and _stream_name(handler.stream) is not None:
            root.removeHandler(handler)
    for stream, handler_level, fmt, datefmt, style in handlers:
        handler = logging.StreamHandler(sys.stdout if stream == "stdout" else sys.stderr)
        handler.setLevel(handler_level)
        handler.setFormatter(logging.Formatter(fmt, datefmt, style))
        root.addHandler(handler)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "random.state", "random", lambda m: m.getstate(), lambda m, v: m.setstate(v), _python_rng_reader()
    ),
    Setting(
        "numpy.random.state",
        "numpy.random",
        lambda m: m.get_state(),
        lambda m, v: m.set_state(v),
        snapshot=_numpy_rng_probe,
    ),
    Setting("numpy.errors", "numpy", lambda m: m.geterr(), lambda m, v: m.seterr(**v)),
    Setting(
        "numpy.printoptions", "numpy", lambda m: m.get_printoptions(), lambda m, v: m.set_printoptions(**v)
    ),
    Setting("torch.random.state", "torch", _torch_rng, _set_torch_rng),
    # the GPUs' generator: put on the next cell's GPU when it is bound (kernel_replica/cuda_rng.py)
    Setting("torch.cuda.random.state", "torch", CARRIER.read, CARRIER.write),
    Setting("torch.default_dtype", "torch", lambda m: str(m.get_default_dtype()), _set_torch_dtype),
    Setting("torch.default_device", "torch", _torch_default_device, _set_torch_default_device),
    Setting("torch.printoptions", "torch", _torch_print, lambda m, v: m.set_printoptions(**v)),
    Setting("torch.deterministic", "torch", _torch_deterministic, _set_torch_deterministic),
    Setting("torch.numerics", "torch", _torch_numerics, _set_torch_numerics),
    Setting("torch.backends", "torch", _torch_backends, _set_torch_backends, snapshot=_torch_backends_probe),
    # torch.set_num_threads(4): a notebook sharing its machine, or timing a CPU model
    Setting("torch.num_threads", "torch", lambda m: m.get_num_threads(), lambda m, v: m.set_num_threads(v)),
    Setting("tqdm.pandas", "tqdm", _tqdm_pandas, _set_tqdm_pandas, snapshot=_progress_apply),
    Setting(
        "ipython.ast_node_interactivity",
        "IPython.core.interactiveshell",
        _shell_interactivity,
        _set_shell_interactivity,
    ),
    Setting(
        "pandas.options",
        "pandas",
        _pandas_options,
        _set_pandas_options,
        snapshot=lambda m: copy.deepcopy(m._config.config._global_config),
        changed=lambda m, memo: m._config.config._global_config != memo,  # nested dicts, compared in place
    ),
    # transform_output="pandas" changes what every transformer returns; a thread's own config
    Setting("sklearn.config", "sklearn", lambda m: m.get_config(), lambda m, v: m.set_config(**v)),
    Setting("decimal.context", "decimal", _decimal_context, _set_decimal_context),
    Setting("locale", "locale", lambda m: m.setlocale(m.LC_ALL), lambda m, v: m.setlocale(m.LC_ALL, v)),
    Setting(
        "socket.defaulttimeout",
        "socket",
        lambda m: m.getdefaulttimeout(),
        lambda m, v: m.setdefaulttimeout(v),
    ),
    Setting("logging", "logging", _logging, _set_logging, snapshot=_logging_mark, changed=_logging_changed),
    Setting(
        "sys.recursionlimit", "sys", lambda m: m.getrecursionlimit(), lambda m, v: m.setrecursionlimit(v)
    ),
    # sys.set_int_max_str_digits(0): str() of a 5,000-digit int raises ValueError without it
    Setting(
        "sys.int_max_str_digits",
        "sys",
        lambda m: m.get_int_max_str_digits(),
        lambda m, v: m.set_int_max_str_digits(v),
    ),
    Setting(
        "warnings.filters",
        "warnings",
        _warning_filters,
        _set_warning_filters,
        snapshot=lambda m: list(m.filters),  # compared as they are (~0.2 us)
    ),
    Setting(
        "matplotlib.rcParams",
        "matplotlib",
        _rc,
        _set_rc,
        snapshot=lambda m: dict.copy(m.rcParams),  # compared in place: ~5 us, a copy ~75
        changed=lambda m, memo: not dict.__eq__(m.rcParams, memo),
    ),
)
SETTING_NAMES = frozenset(s.name for s in SETTINGS)


def modules_missing(names: Iterable[str]) -> list[str]:
    """The modules the settings ``names`` are set in that this process has not imported: what a
    replica imports off its main thread when they arrive, not before the next cell runs."""
    wanted = set(names)
    return sorted({s.module for s in SETTINGS if s.name in wanted and s.module not in sys.modules})


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # numpy's state tuple holds an array: "ambiguous truth value"
        return False


class SettingsTracker:
    """This process's side: the value of each setting as last read or written here (pickled, so
    an unchanged setting yields the very same bytes), and its probe then."""

    def __init__(
        self,
        settings: tuple[Setting, ...] = SETTINGS,
        modules: NotebookModules | None = None,
        patches: LibraryPatches | None = None,
    ) -> None:
        self._settings = settings
        self._modules = modules  # the notebook's own modules' globals, settings of their own
        self._patches = patches  # what the notebook set on libraries' modules and classes
        self._memos: dict[str, Any] = {}
        self._values: dict[str, bytes] = {}
        self._unreplicable: set[str] = set()  # logged once

    def capture(self) -> dict[str, bytes]:
        """Every setting of a module imported here, pickled (re-read only where its probe changed)."""
        modules = sys.modules
        for setting in self._settings:
            module = modules.get(setting.module)
            if module is None:
                continue
            try:
                if setting.name in self._values and not setting.has_changed(
                    module, self._memos[setting.name]
                ):
                    continue
                raw = setting.read(module)
                memo, value = setting.memo(module, raw), pickle.dumps(raw, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # a formatter function, a value of another library version
                self._skip(setting, f"{exc.__class__.__name__}: {exc}")
                continue
            if len(value) > MAX_VALUE_BYTES:
                self._skip(setting, f"{len(value)} bytes pickled")
                continue
            self._memos[setting.name], self._values[setting.name] = memo, value
        captured = dict(self._values)
        if self._modules is not None:
            captured.update(self._modules.capture())
        if self._patches is not None:
            captured.update(self._patches.capture())
        return captured

    def _skip(self, setting: Setting, why: str) -> None:
        self._values.pop(setting.name, None)
        self._memos.pop(setting.name, None)
        if setting.name not in self._unreplicable:
            self._unreplicable.add(setting.name)
            log.warning("setting_not_replicated", setting=setting.name, reason=why)

    def apply(self, values: Mapping[str, bytes]) -> str | None:
        """Make this process's settings ``values`` (those that differ from what it has: importing
        a module the executor had, as the notebook's imports would); what failed, or None."""
        failed = []
        for setting in self._settings:
            value = values.get(setting.name)
            if value is None or value == self._values.get(setting.name):
                continue
            try:
                module = sys.modules.get(setting.module) or importlib.import_module(setting.module)
                raw = pickle.loads(value)
                if not _same(setting.read(module), raw):  # a write may be slow, or reset more
                    setting.write(module, raw)
                self._memos[setting.name], self._values[setting.name] = setting.memo(module, raw), value
            except Exception as exc:
                failed.append(f"{setting.name} ({exc.__class__.__name__}: {exc})")
        if self._modules is not None:
            failed += self._modules.apply(values)
        if self._patches is not None:
            failed += self._patches.apply(values)
        return f"setting {', '.join(failed)} failed on this host" if failed else None
