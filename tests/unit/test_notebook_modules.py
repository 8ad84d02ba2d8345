"""The notebook's own modules: which they are, and their globals carried from one replica's
process to another's (here: the same process, the module imported afresh in between, as the
next executor's replayed import makes it)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import pickle
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel_replica import notebook_modules
from kernel_replica.notebook_modules import MAX_GLOBAL_BYTES, NotebookModules, data_globals, library_roots
from kernel_replica.object_codec import ObjectCodec
from kernel_replica.process_context import ProcessContext

SOURCE = """\
import threading
BATCH = 32
seen = []
lock = threading.Lock()

def bump():
    seen.append(len(seen))

class Config:
    pass
"""


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory of the notebook's on sys.path, with ``nbconfig.py``; removed afterwards."""
    (tmp_path / "nbconfig.py").write_text(SOURCE)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("nbconfig", None)


def warned(modules: NotebookModules) -> dict[str, str]:
    """The new warnings about ``nbconfig`` (this test process has modules of its own)."""
    return {k: v for k, v in modules.take_warnings().items() if k.startswith("nbconfig.")}


def reimport() -> object:
    """The module as the next executor's replayed import makes it."""
    sys.modules.pop("nbconfig", None)
    return importlib.import_module("nbconfig")


def test_only_the_notebooks_own_source_modules_are_its_modules(module_dir: Path) -> None:
    roots = library_roots()
    nbconfig = importlib.import_module("nbconfig")
    assert notebook_modules.is_notebook_module(nbconfig, roots)
    for library in (json, math, pytest, notebook_modules, sys.modules["__main__"]):
        assert not notebook_modules.is_notebook_module(library, roots), library


def test_a_module_loaded_from_outside_the_search_path_is_not_the_notebooks(tmp_path: Path) -> None:
    """As a compiler's generated modules (torch.compile's, in a temporary directory)."""
    (tmp_path / "generated.py").write_text("kernels = {}\n")
    spec = importlib.util.spec_from_file_location("generated", tmp_path / "generated.py")
    assert spec is not None and spec.loader is not None
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    assert not notebook_modules.is_notebook_module(generated, library_roots())


def test_data_globals_leave_out_what_the_file_defines_and_imported_modules(module_dir: Path) -> None:
    nbconfig = importlib.import_module("nbconfig")
    nbconfig.rate = math.sqrt  # a function from elsewhere, bound by the notebook: data
    assert sorted(data_globals(nbconfig)) == ["BATCH", "lock", "rate", "seen"]


def test_changed_added_and_deleted_globals_reach_the_next_executors_import(module_dir: Path) -> None:
    here = NotebookModules()
    nbconfig = importlib.import_module("nbconfig")
    first = here.capture()["module:nbconfig"]
    nbconfig.BATCH = 64
    nbconfig.bump()  # a helper changes a list in place
    nbconfig.extra = {"lr": 0.1}
    del nbconfig.lock
    changed = here.capture()
    assert changed["module:nbconfig"] != first and list(warned(here)) == ["nbconfig.lock"]
    fresh = reimport()
    assert NotebookModules().apply(changed) == []
    assert (fresh.BATCH, fresh.seen, fresh.extra) == (64, [0], {"lr": 0.1})  # type: ignore[attr-defined]
    assert not hasattr(fresh, "lock") and callable(fresh.bump)  # type: ignore[attr-defined]


def test_a_module_is_read_again_only_when_a_global_changed(module_dir: Path) -> None:
    here = NotebookModules()
    nbconfig = importlib.import_module("nbconfig")
    before = here.capture()["module:nbconfig"]
    assert here.capture()["module:nbconfig"] is before  # nothing changed: not pickled again
    nbconfig.seen.append("x")
    assert here.capture()["module:nbconfig"] != before


def test_a_name_from_imported_takes_the_executors_object_of_the_module(module_dir: Path) -> None:
    """``from nbconfig import seen`` is replayed on the next executor, binding the object its
    import made; once the module's globals arrive the name holds the module's object again."""
    here = NotebookModules()
    nbconfig = importlib.import_module("nbconfig")
    nbconfig.bump()
    state = here.capture()
    fresh = reimport()
    namespace = {"seen": fresh.seen, "other": [0]}  # type: ignore[attr-defined]
    standby = NotebookModules()
    standby.namespace = namespace
    assert standby.apply(state) == []
    assert namespace["seen"] is fresh.seen and namespace["seen"] == [0]  # type: ignore[attr-defined]
    assert namespace["other"] == [0]


def test_an_unpicklable_global_is_named_once_and_the_next_import_makes_its_own(module_dir: Path) -> None:
    here = NotebookModules()
    nbconfig = importlib.import_module("nbconfig")
    nbconfig.BATCH = 8
    state = here.capture()
    (why,) = warned(here).values()
    assert "lock" in why
    nbconfig.lock = threading.RLock()
    here.capture()
    assert warned(here) == {}  # told once
    fresh = reimport()
    assert NotebookModules().apply(state) == []
    assert fresh.BATCH == 8 and type(fresh.lock) is type(threading.Lock())  # type: ignore[attr-defined]


def test_a_global_over_the_size_limit_stays_and_is_named(module_dir: Path) -> None:
    here = NotebookModules()
    nbconfig = importlib.import_module("nbconfig")
    here.capture()
    warned(here)  # its lock
    nbconfig.table = bytes(MAX_GLOBAL_BYTES + 1)
    state = here.capture()
    assert list(warned(here)) == ["nbconfig.table"]
    fresh = reimport()
    NotebookModules().apply(state)
    assert not hasattr(fresh, "table")


def test_what_is_known_to_be_over_the_limit_is_not_pickled_and_other_pickles_stop_there() -> None:
    import numpy as np
    import pandas as pd
    import torch

    big = MAX_GLOBAL_BYTES + 8
    for value in (
        np.zeros(big, dtype=np.uint8),
        torch.zeros(big, dtype=torch.uint8)[:10],  # a view: its storage is what pickles
        torch.nn.Linear(big // 16, 4),
        pd.DataFrame({"a": np.zeros(big // 8)}),
        bytearray(big),
    ):
        assert notebook_modules.known_size(value) > MAX_GLOBAL_BYTES, type(value)
    with pytest.raises(notebook_modules._TooLarge):
        notebook_modules._pickled([f"{i:01000d}" for i in range(big // 1000)])  # unknown size: stops
    assert pickle.loads(notebook_modules._pickled({"small": [1, 2]})) == {"small": [1, 2]}


def test_a_module_missing_on_the_next_replica_is_reported(module_dir: Path) -> None:
    here = NotebookModules()
    importlib.import_module("nbconfig")
    state = here.capture()
    (module_dir / "nbconfig.py").unlink()
    sys.modules.pop("nbconfig")
    importlib.invalidate_caches()
    (failure,) = NotebookModules().apply(state)
    assert failure.startswith("nbconfig's globals (ModuleNotFoundError")


def test_a_global_holding_a_variables_object_is_named_as_travelling_as_a_copy(module_dir: Path) -> None:
    namespace = {"items": [1, 2]}
    codec = ObjectCodec(None)
    codec.index(namespace, ["items"])
    here = NotebookModules()
    here.holder = codec.holder_of
    nbconfig = importlib.import_module("nbconfig")
    nbconfig.seen = namespace["items"]
    here.capture()
    assert "holds the object the variable 'items' holds" in warned(here)["nbconfig.seen"]


def test_module_globals_travel_in_the_logged_context() -> None:
    context = ProcessContext(
        "/", settings={"module:nbconfig": b"x", "numpy.errors": b"y", "future.thing": b"z"}
    )
    assert ProcessContext.from_wire(context.to_wire()).settings == {
        "module:nbconfig": b"x",
        "numpy.errors": b"y",
    }
