"""The standby's background loads of large objects (kernel_replica/lazy_load.py): ordering and
selection in the pure ``PendingLoads`` core, ``names_to_load``'s choice of what a cell needs, and
the loader on a real local store."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_replica.cell_analysis import analyse_cell, identifier_before, names_to_load
from kernel_replica.lazy_load import LazyLoader, LoopLag, PendingLoads
from kernel_replica.object_codec import ObjectCodec
from kernel_replica.state_sync import apply_state, not_loaded_reason
from shared.datastore import DataStore, ObjectRef
from shared.datastore.local_backend import LocalStore

NAMES = ["a", "b", "c", "d"]


def _group(*names: str) -> dict[str, Any]:
    return {"names": list(names), "sizes": [10], "image": {}}


def test_a_later_entry_supersedes_a_name_still_loading_and_a_load_left_wanting_nothing_goes() -> None:
    pending = PendingLoads()
    first = pending.add(_group("a", "b"), ["a", "b"])
    second = pending.add(_group("b"), ["b"])  # a later large group for b
    assert first is not None and second is not None
    assert first.names == {"a"} and second.names == {"b"}
    pending.supersede(["a"])  # a small group or an import applied at once
    assert not pending.pending(first)
    assert pending.names() == {"b"}
    assert pending.next() is second
    assert pending.finish(second) == {"b"}
    assert not pending


def test_a_read_that_ends_after_its_names_were_superseded_takes_nothing() -> None:
    pending = PendingLoads()
    load = pending.add(_group("a"), ["a"])
    assert load is not None and pending.next() is load  # being read
    pending.supersede(["a"])  # deleted by a later entry meanwhile
    assert pending.finish(load) == frozenset()


def test_demanded_loads_go_first_in_log_order_and_none_demands_everything() -> None:
    pending = PendingLoads()
    a = pending.add(_group("a"), ["a"])
    b = pending.add(_group("b"), ["b"])
    c = pending.add(_group("c"), ["c"])
    assert pending.next() is a
    assert pending.demand(["c", "zzz"]) == [c]
    assert pending.next() is c
    assert pending.demand(None) == [a, b, c]
    assert pending.next() is a


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("large"), st.lists(st.sampled_from(NAMES), min_size=1, unique=True)),
            st.tuples(st.just("now"), st.lists(st.sampled_from(NAMES), min_size=1, unique=True)),
            st.tuples(st.just("finish"), st.just([])),
        ),
        max_size=30,
    )
)
def test_every_name_ends_with_the_value_of_the_last_entry_that_bound_it(
    steps: list[tuple[str, list[str]]],
) -> None:
    """Entries applied in log order (large groups pending, the rest at once), reads finishing in
    any order the core picks: the namespace ends as if every entry had been read at once."""
    pending = PendingLoads()
    namespace: dict[str, int] = {}
    expected: dict[str, int] = {}
    for seq, (kind, names) in enumerate(steps):
        if kind == "large":
            pending.add(_group(*names), names, str(seq))
            for name in names:
                namespace.pop(name, None)  # never a stale value while the newer one loads
                expected[name] = seq
        elif kind == "now":
            pending.supersede(names)
            for name in names:
                namespace[name] = expected[name] = seq
        else:
            load = pending.next()
            if load is not None:
                for name in pending.finish(load):
                    namespace[name] = int(load.msg_id)
        for name in pending.names():
            assert name not in namespace
    while (load := pending.next()) is not None:
        for name in pending.finish(load):
            namespace[name] = int(load.msg_id)
    assert namespace == expected


def test_a_cell_waits_for_the_loading_names_it_mentions_or_reaches_through_notebook_code() -> None:
    namespace: dict[str, Any] = {"x": 1}
    exec("def total():\n    return big.sum() + x\n", namespace)
    loading = {"big", "other"}

    def needed(code: str) -> set[str] | None:
        return names_to_load(analyse_cell(code), code, namespace, loading)

    assert needed("x += 1") == set()
    assert needed("print(big[0])") == {"big"}
    assert needed("%timeit other.sum()") == {"other"}  # a name inside a magic's text
    assert needed("y = total()") == {"big"}  # through the function's globals
    assert needed("exec('big')") is None  # cannot tell: everything first


def test_a_cell_that_lists_the_namespace_waits_for_every_loading_name() -> None:
    """``%who`` or ``dir()`` right after an executor change must list the names still loading."""
    loading = {"big", "other"}

    def needed(code: str) -> set[str] | None:
        return names_to_load(analyse_cell(code), code, {"x": 1}, loading)

    for code in ("%who", "%whos", "names = %who_ls", "print(dir())", "%time dir()"):
        assert needed(code) is None, code
    assert needed("dir(x)") == set()  # a listing of one object's attributes needs only that object
    assert not analyse_cell("%who").unknown  # still changes nothing: no check of every name after it


def test_a_completion_knows_the_identifier_it_completes_but_not_an_attribute() -> None:
    assert identifier_before("x = lis", 7) == "lis"  # a global name begun: loading ones must be there
    assert identifier_before("print(big.sh", 12) == ""  # an attribute of big (big itself is mentioned)
    assert identifier_before("y = ab + 1", 6) == "ab"
    assert identifier_before("y = 1 ", 6) == ""
    assert identifier_before("", 0) == ""


def test_the_loop_lag_probe_sees_a_blocked_loop() -> None:
    async def main() -> float:
        lag = LoopLag(asyncio.get_running_loop(), interval_s=0.005)
        lag.start()
        time.sleep(0.2)  # the loop's thread busy before the loop turns again
        await asyncio.sleep(0.03)
        return lag.stop()

    assert 150 <= asyncio.run(main()) < 1000


def test_a_standby_takes_the_latest_large_value_on_demand_and_names_a_value_it_cannot_read(
    tmp_path: Path,
) -> None:
    """``apply_state`` with a ``LazyLoader`` on a real local store: a small name lands at once, a
    large one only when read (the later entry's value, never the superseded one), and a read that
    fails leaves the name out of the namespace and in ``not_loaded`` with the store's reason."""
    root = tmp_path / "store"

    async def open_store() -> DataStore:
        return LocalStore(root, fsync=False)

    async def main() -> None:
        store = await open_store()
        writer = ObjectCodec(store, large_object_bytes=1024)
        first = await writer.encode({"big": np.arange(20_000.0), "small": [1, 2]}, ["big", "small"])
        second = await ObjectCodec(store, large_object_bytes=1024).encode(
            {"big": np.arange(20_000.0) * 2}, ["big"]
        )
        third = await ObjectCodec(store, large_object_bytes=1024).encode({"big": np.ones(30_000)}, ["big"])
        standby: dict[str, Any] = {"__name__": "__main__", "big": "stale"}
        not_loaded: dict[str, str] = {}
        read: list[tuple[frozenset[str], BaseException | None]] = []

        def take(load: Any, names: frozenset[str], values: Any, error: BaseException | None) -> None:
            read.append((names, error))
            if values is None:
                not_loaded.update(dict.fromkeys(names, not_loaded_reason(error or RuntimeError())))
            else:
                standby.update({name: values[name] for name in names})

        loader = LazyLoader(open_store, take, lambda: standby)
        try:
            for result in (first, second):
                groups = [(group.to_dict(), None) for group in result.groups]
                await apply_state(standby, ObjectCodec(None), [], groups, (), not_loaded, loader)
                assert "big" not in standby  # never the stale value while the newer one loads
            assert standby["small"] == [1, 2]
            await loader.demand(["big"])
            assert np.array_equal(standby["big"], np.arange(20_000.0) * 2)
            assert frozenset({"big"}) in {names for names, _ in read}
            assert all(names in (frozenset(), frozenset({"big"})) for names, _ in read)
            pointer = ObjectRef.from_dict(third.groups[0].pointer or {})
            await store.delete(pointer)
            groups = [(group.to_dict(), None) for group in third.groups]
            await apply_state(standby, ObjectCodec(None), [], groups, (), not_loaded, loader)
            await loader.demand(None)
            assert "big" not in standby and "could not be loaded here" in not_loaded["big"]
            assert isinstance(read[-1][1], Exception)
        finally:
            loader.close()
            await store.close()

    asyncio.run(main())


def test_a_store_that_does_not_open_names_the_values_and_leaves_no_thread_behind(tmp_path: Path) -> None:
    async def unreachable() -> DataStore:
        raise ConnectionRefusedError("store down")

    async def main() -> None:
        store = LocalStore(tmp_path / "store", fsync=False)
        encoded = await ObjectCodec(store, large_object_bytes=1024).encode(
            {"big": np.arange(20_000.0)}, ["big"]
        )
        failed: dict[str, str] = {}

        def take(load: Any, names: frozenset[str], values: Any, error: BaseException | None) -> None:
            assert values is None and error is not None
            failed.update(dict.fromkeys(names, not_loaded_reason(error)))

        loader = LazyLoader(unreachable, take, dict)
        threads = {t.name for t in threading.enumerate()}
        try:
            for _ in range(3):  # each attempt opens the store again
                loader.add(encoded.groups[0].to_dict(), ["big"])
                await loader.demand(["big"])
                assert "store down" in failed.pop("big")
        finally:
            loader.close()
            await store.close()
        assert [t.name for t in threading.enumerate() if t.name == "checkpoint-store"] == [
            name for name in threads if name == "checkpoint-store"
        ]

    asyncio.run(main())
