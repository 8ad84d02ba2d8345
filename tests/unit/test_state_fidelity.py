"""State fidelity (issue 14): replicated arrays keep their values, classes, masks, alignment and
memory sharing, through one encode/decode and through cell sequences with an executor change
after every cell, compared with the namespace the same code makes in a plain dict."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_replica import log_entries
from kernel_replica.cell_analysis import FunctionFacts, analyse_cell, update_registry
from kernel_replica.log_entries import State
from kernel_replica.object_codec import EncodedGroup, ObjectCodec, decode_all, layout
from kernel_replica.state_sync import ReplicatedNamespace, apply_state, plan_state, replicable_names
from shared.datastore.local_backend import LocalStore
from tests.unit._fidelity import arrays, assert_same_namespace, assert_writes_alias_alike, programs, run

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encode_decode(ns: dict[str, Any], store: LocalStore | None, large: int) -> dict[str, Any]:
    target: dict[str, Any] = {"__name__": "__main__"}

    async def go() -> None:  # returns nothing: asyncio.run reprs its task, result included, and
        # a MaskedArray's repr stores its default fill value (numpy's, not the namespace's)
        result = await ObjectCodec(store, large_object_bytes=large).encode(ns, replicable_names(ns))
        assert not result.skipped
        groups = [EncodedGroup.from_dict(g.to_dict()) for g in result.groups]  # as the log holds them
        target.update(await decode_all(ObjectCodec(store), groups, target))

    asyncio.run(go())
    return target


@FAST
@given(cells=programs(), through_store=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_arrays_views_and_subclasses_round_trip_with_their_sharing(
    cells: list[str], through_store: bool, seed: int
) -> None:
    assert_round_trip_keeps(cells, through_store, seed)


def assert_round_trip_keeps(cells: list[str], through_store: bool, seed: int) -> None:
    """The namespace ``cells`` make, encoded and decoded (inline or through a store), is the same
    namespace, and writes through each name alias alike."""
    expected = run(cells)
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "store", fsync=False) if through_store else None
        actual = encode_decode(expected, store, 64 if through_store else 1 << 20)
    assert_same_namespace(expected, actual, restored=True)
    assert_writes_alias_alike(expected, actual, seed)


@FAST
@given(cells=programs(with_tensors=True), through_store=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_tensors_on_numpy_memory_round_trip_sharing_it(
    cells: list[str], through_store: bool, seed: int
) -> None:
    """``torch.from_numpy(a)``, ``t.numpy()`` and their views share memory with no shared object:
    after a decode, a write through either still shows in the other."""
    assert_round_trip_keeps(cells, through_store, seed)


class Replica:
    """One replica's side of the execute path: its own namespace, codec and function registry."""

    def __init__(self, store: LocalStore | None, large: int) -> None:
        self.ns: dict[str, Any] = {"__name__": "__main__", "np": np, "torch": torch}
        self.codec = ObjectCodec(store, large_object_bytes=large)
        self.registry: dict[str, FunctionFacts] = {}

    def execute(self, cell: str, replicated: ReplicatedNamespace) -> State:
        exec(cell, self.ns)
        effects = analyse_cell(cell, self.registry)
        update_registry(self.registry, effects)
        plan = asyncio.run(plan_state(effects, self.ns, replicated.digests(), self.codec))
        state = log_entries.decode(log_entries.encode(plan.state("m", "r")))
        assert isinstance(state, State) and not state.skipped
        return state

    def apply(self, state: State) -> None:
        groups = [(g, None) for g in state.groups]
        assert asyncio.run(apply_state(self.ns, self.codec, state.imports, groups, state.deleted)) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cells=programs(max_cells=10, mutations=True, with_tensors=True),
    through_store=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_executor_change_after_every_cell_keeps_the_namespace_of_a_single_kernel(
    cells: list[str], through_store: bool, seed: int
) -> None:
    """Three replicas; cell i runs on replica i % 3 and the others apply its STATE; after every
    cell every replica's arrays are those of one plain namespace, and at the end so is a replica
    rebuilt from the snapshot (each name's latest group) and writes alias alike on all of them."""
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "store", fsync=False) if through_store else None
        large = 64 if through_store else 1 << 20
        replicas = [Replica(store, large) for _ in range(3)]
        replicated = ReplicatedNamespace()
        for i, cell in enumerate(cells):
            executor = replicas[i % 3]
            state = executor.execute(cell, replicated)
            replicated.apply(state)
            for replica in replicas:
                if replica is not executor:
                    replica.apply(state)
            expected = run(cells[: i + 1])
            for replica in replicas:
                assert_same_namespace(expected, replica.ns, restored=False)
        restored = Replica(store, large)
        imports, groups = replicated.contents()
        assert asyncio.run(apply_state(restored.ns, restored.codec, imports, groups)) == []
        for replica in [*replicas, restored]:
            expected = run(cells)
            assert_same_namespace(expected, replica.ns, restored=False)
            assert_writes_alias_alike(expected, replica.ns, seed)


def test_view_of_a_view_aliases_its_base_after_two_executor_changes() -> None:
    """The notebook from the issue: x2_sub[0, 0] = 99 shows in x2 on the third replica."""
    replicas = [Replica(None, 1 << 20) for _ in range(3)]
    replicated = ReplicatedNamespace()
    cells = ["x2 = np.arange(12).reshape(3, 4)", "x2_sub = x2[:2, :2]", "x2_sub[0, 0] = 99"]
    for i, cell in enumerate(cells):
        state = replicas[i].execute(cell, replicated)
        replicated.apply(state)
        for replica in replicas[:i] + replicas[i + 1 :]:
            replica.apply(state)
    for replica in replicas:
        assert replica.ns["x2"][0, 0] == 99 and np.shares_memory(replica.ns["x2"], replica.ns["x2_sub"])
    replicas[0].ns["x2_sub"][1, 1] = -5
    assert replicas[0].ns["x2"][1, 1] == -5


@pytest.mark.parametrize("mode", ["w+", "r+"])
def test_a_file_backed_memmap_is_mapped_again_from_its_file_on_the_next_replica(
    tmp_path: Path, mode: str
) -> None:
    """``mm = np.memmap(path, mode="w+", ...)``, then ``mm[0] = 5; mm.flush()`` on the next
    executor: it was a copy detached from the file (``filename`` None, writes and flush going
    nowhere), silently. Its region is the file's, mapped again there; its bytes do not travel."""
    path = tmp_path / "data.bin"
    if mode == "r+":
        np.arange(16, dtype=np.float32).tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode=mode, offset=16, shape=(3, 2))
    mm[:] = 1
    ns = {"mm": mm, "col": mm[:, 1], "small": np.ones(3)}
    target = encode_decode(ns, None, 1 << 20)
    moved, col = target["mm"], target["col"]
    assert (
        type(moved) is np.memmap
        and moved.filename == path.resolve()
        and (moved.offset, moved.mode) == (16, mode)
    )
    assert col.filename == path.resolve() and np.shares_memory(col, moved)
    moved[0, 0] = 5
    col[2] = 7
    moved.flush()
    on_disk = np.fromfile(path, dtype=np.float32)
    assert on_disk[4] == 5 and on_disk[9] == 7 and mm[0, 0] == 5  # the same file, as one process has it
    big = np.memmap(tmp_path / "big.bin", dtype=np.float64, mode="w+", shape=(100_000,))
    (group,) = asyncio.run(ObjectCodec(None).encode({"big": big}, ["big"])).groups
    assert sum(group.to_dict()["sizes"]) < 2_000  # its 800 kB stay in the file


def test_a_copy_on_write_memmap_travels_as_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    np.zeros(4, dtype=np.float32).tofile(path)
    private = np.memmap(path, dtype=np.float32, mode="c", shape=(4,))
    private[0] = 3  # in this process only: the file keeps 0
    moved = encode_decode({"private": private}, None, 1 << 20)["private"]
    assert moved[0] == 3 and moved.filename is None and np.fromfile(path, dtype=np.float32)[0] == 0


def test_names_changed_in_different_cells_stay_views_of_one_base() -> None:
    """x is sent alone, then v = x[1:] on another replica pulls x into v's group (the new
    executor learns what its decoded x reaches), then w = x[::2] on a replica that encoded x
    before (what it recorded for x then is stale: its x was replaced by a decoded one)."""
    replicas = [Replica(None, 1 << 20) for _ in range(2)]
    replicated = ReplicatedNamespace()
    cells = ["x = np.arange(10.0)", "v = x[1:]", "w = x[::2]", "w[1] = -1"]
    for i, cell in enumerate(cells):
        state = replicas[i % 2].execute(cell, replicated)
        replicated.apply(state)
        replicas[(i + 1) % 2].apply(state)
    for replica in replicas:
        x, v, w = (replica.ns[n] for n in "xvw")
        assert x[2] == -1 and v[1] == -1 and np.shares_memory(v, w)


BASES = {
    "plain": "np.arange(4.0)",
    "structured": "np.array([(i, i / 2) for i in range(4)], dtype=[('a', 'i4'), ('b', 'f8')])",
    "masked": "np.ma.array(np.arange(4.0), mask=[0, 1, 0, 0])",  # a copy keeps sharing _basedict
}


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("rebind", ["v = x.copy()", "v = x[:]"])
def test_an_equal_value_that_shares_differently_is_sent_again(rebind: str, base: str) -> None:
    """v's bytes do not change, only whether it is a view of x: the standbys must follow."""
    first = "v = x[:]" if rebind == "v = x.copy()" else "v = x.copy()"
    replicas = [Replica(None, 1 << 20) for _ in range(2)]
    replicated = ReplicatedNamespace()
    for i, cell in enumerate([f"x = {BASES[base]}", first, rebind, "x[0] = x[2]"]):
        state = replicas[i % 2].execute(cell, replicated)
        replicated.apply(state)
        replicas[(i + 1) % 2].apply(state)
    expected = run([f"x = {BASES[base]}", first, rebind, "x[0] = x[2]"])
    for replica in replicas:
        assert_same_namespace(expected, replica.ns, restored=False)


@pytest.mark.parametrize("rebind", ["v = [x['l'], x['a'].copy()]", "v = [x['l'], x['a'][:]]"])
def test_what_a_name_shares_is_told_apart_from_whom_it_shares_with(rebind: str) -> None:
    """v shares the list x['l'] with x either way; only whether it also shares x['a']'s memory
    changes (the value does not): a signature of sharers' names alone would miss it."""
    cells = ["x = {'l': [1], 'a': np.arange(4.0)}"]
    cells.append("v = [x['l'], x['a'][:]]" if "copy" in rebind else "v = [x['l'], x['a'].copy()]")
    cells += [rebind, "x['a'][0] = 9.0"]
    replicas = [Replica(None, 1 << 20) for _ in range(2)]
    replicated = ReplicatedNamespace()
    for i, cell in enumerate(cells):
        state = replicas[i % 2].execute(cell, replicated)
        replicated.apply(state)
        replicas[(i + 1) % 2].apply(state)
    for replica in replicas:
        assert (replica.ns["v"][1][0] == 9.0) == ("copy" not in rebind)
        assert replica.ns["v"][0] is replica.ns["x"]["l"]


def test_arrays_that_only_share_a_dtype_are_not_grouped() -> None:
    """A structured dtype's pickle holds its live fields dict; it is not an object the arrays share."""
    dt = np.dtype([("a", "i4"), ("b", "f8")])
    ns = {"a": np.zeros(3, dt), "b": np.ones(3, dt)}
    result = asyncio.run(ObjectCodec(None).encode(ns, ["a", "b"]))
    assert sorted(g.names for g in result.groups) == [("a",), ("b",)]


def test_memoryviews_stay_memoryviews_on_their_owners_memory() -> None:
    """cloudpickle turns a memoryview into ``bytes``: before, after an executor change
    ``view[0] = 1`` failed and a write to the bytearray no longer showed in its view."""
    cells = [
        "import array\nbuf = bytearray(b'abcdefgh')\nview = memoryview(buf)[2:6]",
        "ints = memoryview(buf).cast('i')\nfrozen = memoryview(buf).toreadonly()[1:3]",
        "arr = np.arange(6.0)\nof_arr = memoryview(arr)[1:3]",
        "nums = array.array('i', [1, 2, 3])\nof_nums = memoryview(nums)",
        "of_bytes = memoryview(b'xyz')[1:]",
    ]
    actual = encode_decode(run(cells), None, 1 << 20)
    for name in ("view", "ints", "frozen", "of_arr", "of_nums", "of_bytes"):
        assert type(actual[name]) is memoryview, name
    assert (actual["frozen"].readonly, actual["view"].readonly) == (True, False)
    assert actual["ints"].format == "i" and actual["of_arr"].format == "d"
    actual["buf"][2] = ord("Z")
    actual["view"][1] = ord("Y")
    actual["arr"][1] = 9.0
    actual["nums"][0] = 5
    assert bytes(actual["buf"]) == b"abZYefgh" and bytes(actual["frozen"]) == b"bZ"
    assert actual["ints"].tolist() == list(memoryview(bytearray(b"abZYefgh")).cast("i"))
    assert actual["of_arr"].tolist() == [9.0, 2.0] and actual["of_nums"].tolist() == [5, 2, 3]
    assert bytes(actual["of_bytes"]) == b"yz"


def test_masked_sum_recarray_and_matrix_keep_their_class() -> None:
    ns = run(
        [
            "m = np.ma.array([1, 2, 3, 4, 5], mask=[0, 1, 0, 1, 0], fill_value=-9)",
            "r = np.rec.array([(1, 2.0), (3, 4.0)], dtype=[('a', 'i8'), ('b', 'f8')])",
            "mat = np.matrix([[1, 2], [3, 4]])",
        ]
    )
    out = encode_decode(ns, None, 1 << 20)
    assert type(out["m"]) is np.ma.MaskedArray and out["m"].sum() == 9 and out["m"].fill_value == -9
    assert type(out["r"]) is np.recarray and out["r"].b.tolist() == [2.0, 4.0]
    assert type(out["mat"]) is np.matrix and (out["mat"] * out["mat"]).tolist() == [[7, 10], [15, 22]]


def test_restored_large_array_is_aligned_and_reduces_like_the_original() -> None:
    big = np.random.default_rng(1).random(1_000_003).astype(np.float32)
    ns = {"big": big, "tail": big[3:]}
    with tempfile.TemporaryDirectory() as tmp:
        out = encode_decode(ns, LocalStore(Path(tmp) / "store", fsync=False), 1024)
    assert out["big"].ctypes.data % 64 == 0
    assert out["big"].sum() == big.sum() and out["tail"].sum() == big[3:].sum()


def test_unaligned_records_of_the_previous_format_are_realigned() -> None:
    """A /1 record (parts packed) from a log written before the change still decodes aligned."""
    ns = {"a": np.arange(5, dtype=np.int8), "b": np.arange(7.0)}

    out: dict[str, Any] = {}

    async def go() -> None:
        result = await ObjectCodec(None).encode(ns, ["a", "b"])
        old = []
        for group in result.groups:
            offsets, _ = layout(group.sizes)
            assert group.inline is not None
            packed = b"".join(group.inline[o : o + n] for o, n in zip(offsets, group.sizes, strict=True))
            record = group.to_dict() | {"format": "tandem-pickle5/1", "inline": packed}
            old.append(EncodedGroup.from_dict(record))
        out.update(await decode_all(ObjectCodec(None), old, {}))

    asyncio.run(go())
    assert out["a"].tolist() == list(range(5)) and out["b"].tolist() == list(np.arange(7.0))
    assert all(arr.ctypes.data % 64 == 0 for arr in arrays(out).values())


ENCODE_IN_A_FRESH_INTERPRETER = """
import asyncio, json, sys
import numpy as np
from kernel_replica.object_codec import ObjectCodec
assert "numpy.rec" not in sys.modules  # np.recarray's home module, loaded lazily
data = np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "i8"), ("b", "f8")])
result = asyncio.run(ObjectCodec(None).encode({"r": data.view(np.recarray)}, ["r"]))
print(json.dumps([{**g.to_dict(), "inline": g.inline.hex()} for g in result.groups]))
"""


def test_a_class_whose_module_is_not_imported_yet_is_pickled_by_reference() -> None:
    """cloudpickle pickles a class by value when its module is not in sys.modules; a copy of
    np.recarray is another class (isinstance fails, its methods' super() raises)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", ENCODE_IN_A_FRESH_INTERPRETER],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    records = [{**g, "inline": bytes.fromhex(g["inline"])} for g in json.loads(done.stdout)]
    out: dict[str, Any] = {}

    async def go() -> None:
        out.update(await decode_all(ObjectCodec(None), [EncodedGroup.from_dict(g) for g in records], {}))

    asyncio.run(go())
    assert type(out["r"]) is np.recarray
    assert out["r"][1].b == 4.0 and out["r"].a.tolist() == [1, 3]


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["bind", "refresh", "forget"]), st.integers(0, 4), st.sets(st.integers(0, 5))
        ),
        max_size=25,
    )
)
def test_the_sharing_index_kept_across_records_equals_one_built_from_scratch(
    steps: list[tuple[str, int, set[int]]],
) -> None:
    """Names are bound to lists holding some of six shared lists; after any sequence of
    (re)bindings, refreshes and forgets, ``sharing`` is what the recorded reaches say."""
    pool = [[i] for i in range(6)]
    ns: dict[str, Any] = {}
    codec = ObjectCodec(None)
    for op, n, members in steps:
        name = f"n{n}"
        if op == "bind":
            ns[name] = [pool[i] for i in sorted(members)]
            codec.refresh(ns, [name])
        elif op == "refresh":
            codec.refresh(ns, [name])
        else:
            codec.forget([name])
        reach = codec._reach  # the recorded identities, the index's source
        expected = {a: {b for b in reach if b != a and reach[a] & reach[b]} for a in reach}
        assert codec.sharing() == expected
