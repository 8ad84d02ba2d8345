"""What a notebook sets on libraries' modules and classes, carried to another replica's process
(here: the same process, the attribute put back in between, as the next executor's library has
it), with functions linked to that replica's namespace."""

from __future__ import annotations

import pickle
import sys
import threading
import types
from collections.abc import Iterator

import pytest

from kernel_replica.cell_analysis import analyse_cell
from kernel_replica.library_patches import LibraryPatches
from kernel_replica.process_context import ProcessContext


@pytest.fixture
def fakelib() -> Iterator[types.ModuleType]:
    """A library module with a class, as ``sys.modules`` has it; removed afterwards."""
    module = types.ModuleType("fakelib")

    class Frame:
        def describe(self) -> str:
            return "library"

    Frame.__module__, Frame.__qualname__ = "fakelib", "Frame"
    module.Frame = Frame  # type: ignore[attr-defined]
    module.scale = lambda x: x  # type: ignore[attr-defined]
    sys.modules["fakelib"] = module
    yield module
    del sys.modules["fakelib"]


def patched(code: str, namespace: dict[str, object]) -> LibraryPatches:
    """Run ``code`` as a cell on the executor; its patches, noted as the kernel notes them."""
    exec(code, namespace)
    patches = LibraryPatches()
    patches.namespace = namespace
    patches.note(analyse_cell(code, {}).attribute_targets, namespace)
    return patches


def test_functions_set_on_a_module_and_a_class_reach_the_next_replica_linked_to_its_namespace(
    fakelib: types.ModuleType,
) -> None:
    executor_ns: dict[str, object] = {"__name__": "__main__"}
    executor = patched(
        "import fakelib\nfactor = 2\n"
        "def scale(x):\n    return x * factor\n"
        "fakelib.scale = scale\n"
        "fakelib.Frame.describe = lambda self: f'patched x{factor}'\n"
        "fakelib.Frame.build = staticmethod(lambda: factor)\n",
        executor_ns,
    )
    values = executor.capture()
    assert sorted(values) == [
        "patch:fakelib:Frame.build",
        "patch:fakelib:Frame.describe",
        "patch:fakelib:scale",
    ]
    original = fakelib.Frame.__dict__["describe"]
    fakelib.scale = lambda x: x  # type: ignore[attr-defined]
    fakelib.Frame.describe = original  # type: ignore[attr-defined]
    del fakelib.Frame.build  # type: ignore[attr-defined]
    standby = LibraryPatches()
    standby.namespace = {"__name__": "__main__", "factor": 10}  # the next executor's namespace
    assert standby.apply(values) == []
    assert fakelib.scale(3) == 30 and fakelib.Frame().describe() == "patched x10"  # type: ignore[attr-defined]
    assert isinstance(fakelib.Frame.__dict__["build"], staticmethod) and fakelib.Frame.build() == 10  # type: ignore[attr-defined]


def test_a_deleted_attribute_is_deleted_on_the_next_replica(fakelib: types.ModuleType) -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    executor = patched("import fakelib\ndel fakelib.Frame.describe", namespace)
    values = executor.capture()
    fakelib.Frame.describe = lambda self: "library"  # type: ignore[attr-defined]
    assert LibraryPatches().apply(values) == []
    assert not hasattr(fakelib.Frame, "describe")


def test_setattr_and_delattr_with_a_literal_name_are_patches_too(fakelib: types.ModuleType) -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    executor = patched(
        "import fakelib\nsetattr(fakelib.Frame, 'shape', lambda self: 'patched')\ndelattr(fakelib, 'scale')",
        namespace,
    )
    values = executor.capture()
    fakelib.scale = lambda x: x  # type: ignore[attr-defined]
    del fakelib.Frame.shape  # type: ignore[attr-defined]
    assert LibraryPatches().apply(values) == []
    assert fakelib.Frame().shape() == "patched" and not hasattr(fakelib, "scale")  # type: ignore[attr-defined]


def test_a_patch_is_read_again_only_when_its_value_changed(fakelib: types.ModuleType) -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    executor = patched("import fakelib\nfakelib.scale = abs", namespace)
    first = executor.capture()["patch:fakelib:scale"]
    assert executor.capture()["patch:fakelib:scale"] is first
    fakelib.scale = round  # type: ignore[attr-defined]
    assert pickle.loads(executor.capture()["patch:fakelib:scale"]) != pickle.loads(first)


def test_what_the_notebook_owns_and_what_is_no_module_or_class_are_not_patches(
    fakelib: types.ModuleType,
) -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    executor = patched(
        "import fakelib, types\n"
        "class Mine:\n    pass\n"
        "Mine.x = 1\n"  # the notebook's class: travels as a variable, with its attributes
        "holder = types.SimpleNamespace()\nholder.y = 2\n"  # a variable's object
        "fakelib.Frame.describe.flag = 3\n",  # a function's attribute: not a module or class
        namespace,
    )
    assert executor.capture() == {}
    skipping = LibraryPatches(skip_module=lambda name: name == "fakelib")  # a notebook module
    skipping.note([("fakelib", "scale")], {"fakelib": fakelib})
    assert skipping.capture() == {}


def test_an_unpicklable_patch_is_named_once_and_stays_the_executors(fakelib: types.ModuleType) -> None:
    namespace: dict[str, object] = {"__name__": "__main__", "threading": threading}
    executor = patched("import fakelib\nfakelib.lock = threading.Lock()", namespace)
    assert executor.capture() == {}
    (notice,) = executor.take_warnings().values()
    assert "fakelib.lock is not replicated" in notice and "lock" in notice
    executor.capture()
    assert executor.take_warnings() == {}


def test_a_patch_of_a_module_missing_on_the_next_replica_is_reported() -> None:
    failed = LibraryPatches().apply({"patch:no_such_module_here:f": pickle.dumps(("del",))})
    assert len(failed) == 1 and failed[0].startswith("no_such_module_here:f (ModuleNotFoundError")


def test_patches_travel_in_the_logged_context() -> None:
    context = ProcessContext("/", settings={"patch:fakelib:Frame.describe": b"x"})
    assert ProcessContext.from_wire(context.to_wire()).settings == {"patch:fakelib:Frame.describe": b"x"}
