"""Libraries' process-wide settings travel with the executor (kernel_replica/library_settings.py):
what one replica's tracker captures, another's applies, and the next draw, dtype, precision,
filter or style is the one the notebook set. Both sides run in this process here, so each test
puts the settings it changes back (``restored``)."""

from __future__ import annotations

import decimal
import locale
import logging
import pickle
import random
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
import sklearn
import torch
from sklearn.preprocessing import StandardScaler

from kernel_replica.library_settings import SETTINGS, Setting, SettingsTracker, _python_rng_reader
from kernel_replica.process_context import ProcessContext, ProcessState


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    saved = (
        random.getstate(),
        np.random.get_state(),
        np.geterr(),
        np.get_printoptions(),
        torch.get_rng_state(),
        torch.get_default_dtype(),
        decimal.getcontext().copy(),
        sys.getrecursionlimit(),
        sys.get_int_max_str_digits(),
    )
    root = logging.getLogger()
    more = (
        torch._tensor_str.PRINT_OPTS.precision,
        torch.are_deterministic_algorithms_enabled(),
        locale.setlocale(locale.LC_ALL),
        socket.getdefaulttimeout(),
        root.level,
        list(root.handlers),
    )
    with (
        warnings.catch_warnings(),
        matplotlib.rc_context(),
        pd.option_context("display.max_columns", 20),
        sklearn.config_context(),
    ):
        yield
    torch.set_printoptions(precision=more[0])
    torch.use_deterministic_algorithms(more[1])
    locale.setlocale(locale.LC_ALL, more[2])
    socket.setdefaulttimeout(more[3])
    root.setLevel(more[4])
    root.handlers[:] = more[5]
    logging.getLogger("tandem.test.noisy").setLevel(logging.NOTSET)
    logging.disable(logging.NOTSET)
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    np.seterr(**saved[2])
    np.set_printoptions(**saved[3])
    torch.set_rng_state(saved[4])
    torch.set_default_dtype(saved[5])
    decimal.setcontext(saved[6])
    sys.setrecursionlimit(saved[7])
    sys.set_int_max_str_digits(saved[8])


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1).item())


def test_the_next_executor_draws_what_the_seeded_notebook_would_have_drawn() -> None:
    executor, standby = SettingsTracker(), SettingsTracker()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    first = _draws()
    after_first = executor.capture()
    second = _draws()  # what one process draws next
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # the other process: its own state
    assert standby.apply(after_first) is None
    assert _draws() == second != first


def test_dtype_error_print_decimal_recursion_filters_and_rcparams_follow() -> None:
    executor, standby = SettingsTracker(), SettingsTracker()
    threads = torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(threads + 1)
    np.seterr(divide="raise")
    np.set_printoptions(precision=2)
    decimal.getcontext().prec = 6
    sys.setrecursionlimit(4321)
    sys.set_int_max_str_digits(0)
    warnings.filterwarnings("error", category=UserWarning)
    matplotlib.rcParams["lines.linewidth"] = 7.0
    captured = executor.capture()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(threads)
    np.seterr(divide="warn")
    np.set_printoptions(precision=8)
    decimal.getcontext().prec = 28
    sys.setrecursionlimit(1000)
    sys.set_int_max_str_digits(4300)
    warnings.resetwarnings()
    matplotlib.rcParams["lines.linewidth"] = 1.5
    assert standby.apply(captured) is None
    assert torch.get_default_dtype() == torch.float64 and torch.ones(1).dtype == torch.float64
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    assert np.geterr()["divide"] == "raise" and np.array2string(np.array([1 / 3])) == "[0.33]"
    assert str(decimal.Decimal(1) / decimal.Decimal(7)) == "0.142857"
    assert sys.getrecursionlimit() == 4321 and len(str(10**5000)) == 5001
    with pytest.raises(UserWarning):
        warnings.warn("now an error", UserWarning, stacklevel=1)
    assert matplotlib.rcParams["lines.linewidth"] == 7.0


def test_torch_pandas_locale_socket_and_logging_settings_follow() -> None:
    executor, standby = SettingsTracker(), SettingsTracker()
    torch.set_printoptions(precision=2)
    torch.use_deterministic_algorithms(True, warn_only=True)
    pd.set_option("display.max_columns", 3)
    sklearn.set_config(transform_output="pandas")
    locale.setlocale(locale.LC_ALL, "C")
    socket.setdefaulttimeout(7.0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s|%(message)s", force=True)
    executor.capture()
    logging.getLogger("tandem.test.noisy").setLevel(logging.ERROR)  # seen, after a capture too
    logging.disable(logging.DEBUG)
    captured = executor.capture()
    torch.set_printoptions(precision=4)
    torch.use_deterministic_algorithms(False)
    pd.set_option("display.max_columns", 20)
    sklearn.set_config(transform_output="default")
    locale.setlocale(locale.LC_ALL, "C.UTF-8")
    socket.setdefaulttimeout(None)
    logging.getLogger().handlers.clear()
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("tandem.test.noisy").setLevel(logging.NOTSET)
    logging.disable(logging.NOTSET)
    assert standby.apply(captured) is None
    assert str(torch.tensor([1 / 3])) == "tensor([0.33])"
    assert (
        torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    )
    assert pd.get_option("display.max_columns") == 3
    assert type(StandardScaler().fit_transform(pd.DataFrame({"a": [1.0, 2.0]}))) is pd.DataFrame
    assert locale.setlocale(locale.LC_ALL) == "C" and socket.getdefaulttimeout() == 7.0
    root = logging.getLogger()
    (handler,) = root.handlers
    assert root.level == logging.INFO and handler.stream is sys.stderr
    assert handler.format(logging.makeLogRecord({"levelname": "INFO", "msg": "hi"})) == "INFO|hi"
    assert logging.getLogger("tandem.test.noisy").level == logging.ERROR
    assert logging.root.manager.disable == logging.DEBUG


def test_torch_numerics_and_grad_mode_follow() -> None:
    executor, standby = SettingsTracker(), SettingsTracker()
    torch.set_float32_matmul_precision("medium")
    torch.set_grad_enabled(False)  # as a notebook statement: off for the cells that follow
    captured = executor.capture()
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(True)
    try:
        assert standby.apply(captured) is None
        assert torch.get_float32_matmul_precision() == "medium" and not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)
        torch.set_float32_matmul_precision("highest")


def test_torch_default_device_follows() -> None:
    """``torch.set_default_device("cuda")``: before, the next executor made new tensors on the
    CPU, silently (here with the meta device, which needs no GPU)."""
    executor, standby = SettingsTracker(), SettingsTracker()
    standby.capture()
    torch.set_default_device("meta")
    try:
        captured = executor.capture()
    finally:
        torch.set_default_device(None)
    try:
        assert standby.apply(captured) is None
        assert torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
    assert torch.empty(1).device.type == "cpu"


def test_torch_backend_switches_follow() -> None:
    """``torch.backends.cudnn.allow_tf32 = False`` (convolutions in full fp32, for reproducible
    numbers) or an attention kernel switched off: process state the next executor lacked."""
    backends = torch.backends
    executor, standby = SettingsTracker(), SettingsTracker()
    standby.capture()
    backends.cudnn.allow_tf32 = False
    backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    backends.cuda.enable_flash_sdp(False)
    captured = executor.capture()
    backends.cudnn.allow_tf32 = True
    backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    backends.cuda.enable_flash_sdp(True)
    try:
        assert standby.apply(captured) is None
        assert not backends.cudnn.allow_tf32 and not backends.cuda.flash_sdp_enabled()
        assert not backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert backends.cuda.math_sdp_enabled() and backends.cudnn.enabled  # left as they were
        assert standby.capture()["torch.backends"] == captured["torch.backends"]  # no change of its own
    finally:
        backends.cudnn.allow_tf32 = True
        backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        backends.cuda.enable_flash_sdp(True)


def test_a_cell_showing_every_expression_is_kept_on_the_next_executor(tmp_path: Path) -> None:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config, ipython_dir=str(tmp_path))
    try:
        executor, standby = SettingsTracker(), SettingsTracker()
        shell.ast_node_interactivity = "all"
        captured = executor.capture()
        shell.ast_node_interactivity = "last_expr"
        assert standby.apply(captured) is None
        assert shell.ast_node_interactivity == "all"
    finally:
        InteractiveShell.clear_instance()


def test_an_unchanged_setting_yields_the_same_bytes_and_a_state_carries_only_what_changed() -> None:
    process = ProcessState()
    logged = process.capture()
    again = process.capture()
    assert again is logged  # nothing changed: nothing to compare beyond identity
    np.random.rand()
    drawn = process.capture()
    delta = drawn.changed_since(logged)
    assert set(delta.settings) == {"numpy.random.state"}
    assert all(drawn.settings[k] is logged.settings[k] for k in logged.settings if k != "numpy.random.state")
    assert delta.merged_onto(logged) == drawn


def test_the_plotting_backend_stays_each_replicas_own() -> None:
    captured = pickle.loads(SettingsTracker().capture()["matplotlib.rcParams"])
    assert "backend" not in captured and "lines.linewidth" in captured


def test_a_setting_that_cannot_be_pickled_is_left_out_and_the_others_travel() -> None:
    np.set_printoptions(formatter={"float": lambda x: f"{x:.1f}"})  # a lambda: not picklable
    captured = SettingsTracker().capture()
    assert "numpy.printoptions" not in captured and "numpy.random.state" in captured


def test_a_value_that_fails_here_is_named_and_the_rest_applied() -> None:
    bad = {
        "torch.default_dtype": pickle.dumps("torch.not_a_dtype"),
        "sys.recursionlimit": pickle.dumps(2345),
    }
    notice = SettingsTracker().apply(bad)
    assert notice is not None and "torch.default_dtype" in notice and "not_a_dtype" in notice
    assert sys.getrecursionlimit() == 2345


def test_settings_in_the_wire_form_are_checked_and_a_newer_replicas_unknown_ones_dropped() -> None:
    base = {"cwd": "/", "env": {}, "path": []}
    context = ProcessContext.from_wire(
        {**base, "settings": {"sys.recursionlimit": b"x", "future.thing": b"y"}}
    )
    assert context.settings == {"sys.recursionlimit": b"x"}
    assert ProcessContext.from_wire(context.to_wire()) == context
    with pytest.raises(ValueError, match="'settings' must map setting names to bytes"):
        ProcessContext.from_wire({**base, "settings": {"sys.recursionlimit": "not bytes"}})
    with pytest.raises(ValueError, match="'settings'"):
        ProcessContext.from_wire({**base, "settings": ["sys.recursionlimit"]})


def test_the_cheap_probe_of_pythons_generator_sees_every_draw_and_seed() -> None:
    probe = _python_rng_reader()
    assert probe is not None  # CPython lays out random's generator as checked
    before = probe(random)
    random.random()
    drawn = probe(random)
    random.seed(0)
    assert len({before, drawn, probe(random)}) == 3
    assert {s.name for s in SETTINGS} >= {"random.state", "numpy.random.state", "torch.random.state"}


def test_a_setting_already_as_the_executor_left_it_is_not_written_again() -> None:
    def write(module: object, value: object) -> None:
        raise AssertionError("written")  # torch.use_deterministic_algorithms takes 1.3 s the first time

    same = Setting("probe.same", "sys", lambda m: 5, write)
    assert SettingsTracker((same,)).apply({"probe.same": pickle.dumps(5)}) is None


def test_a_warnings_filter_of_a_module_not_imported_here_is_dropped_not_imported() -> None:
    executor_filters = [
        ("ignore", None, ("tandem_test_not_imported", "SomeWarning"), None, 0),
        ("error", ("notebook says stop", 0), ("builtins", "UserWarning"), None, 0),
    ]
    assert SettingsTracker().apply({"warnings.filters": pickle.dumps(executor_filters)}) is None
    assert "tandem_test_not_imported" not in sys.modules
    assert [(f[0], f[2]) for f in warnings.filters] == [("error", UserWarning)]
    with pytest.raises(UserWarning):
        warnings.warn("notebook says stop", UserWarning, stacklevel=1)


def test_tqdm_pandas_follows_with_its_class_and_options() -> None:
    """``tqdm.pandas()`` patches pandas' classes: the next executor's ``df.progress_apply(f)``
    raised AttributeError."""
    tqdm_std = pytest.importorskip("tqdm.std")
    executor, standby = SettingsTracker(), SettingsTracker()
    tqdm_std.tqdm.pandas(desc="rows", disable=True)
    captured = executor.capture()
    assert pickle.loads(captured["tqdm.pandas"]) == ("tqdm.std", "tqdm", {"desc": "rows", "disable": True})
    del pd.DataFrame.progress_apply, pd.Series.progress_map  # a standby's pandas, never patched
    assert standby.apply(captured) is None
    frame = pd.DataFrame({"a": [1, 2]})
    assert frame.progress_apply(lambda column: column.sum()).tolist() == [3]
    assert pd.Series([1]).progress_map(str).tolist() == ["1"]
