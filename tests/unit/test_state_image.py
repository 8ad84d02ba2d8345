"""The kernel's large-object path through the checkpoint agent: the image a STATE entry points to
is bitwise the namespace at the cell's end, though the next cell writes it during the copy."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_replica import log_entries
from kernel_replica.lazy_load import LazyLoader
from kernel_replica.log_entries import State
from kernel_replica.object_codec import EncodedGroup, ObjectCodec, TornImage
from kernel_replica.state_image import ImageResult, StateImager
from kernel_replica.state_sync import ReplicatedNamespace, apply_state, complete_state
from shared.datastore.local_backend import LocalStore

PIECE = 64 * 1024


class Gate:
    """A pacer that holds the copier before piece ``at`` until the test lets it go."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.count = 0
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self) -> None:
        if self.count == self.at:
            self.reached.set()
            self.go.wait(10)
        self.count += 1


def _namespace(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = torch.nn.Linear(256, 128)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    t = torch.randn(600_000)  # 2.4 MB: 37 pieces
    return {"t": t, "v": t[1000:90_000], "a": rng.random(300_000), "model": model, "opt": opt}


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.nn.Module):
        return {k: v.clone() for k, v in value.state_dict().items()}
    if isinstance(value, torch.optim.Optimizer):
        return {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(value.state.values())}
    raise TypeError(type(value))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(
            torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    raise TypeError(type(a))


def _next_cell_ops(ns: dict[str, Any], rng: np.random.Generator) -> list[Callable[[], None]]:
    """Writes a next cell may make, in place: through the tensor, a view, ``out=``, ``.data``,
    an optimizer step, numpy."""
    n = ns["t"].numel()
    lo = int(rng.integers(0, n - 1000))

    def step() -> None:
        ns["model"](torch.randn(4, 256)).sum().backward()
        ns["opt"].step()

    return [
        lambda: ns["t"].mul_(2),
        lambda: ns["t"][lo : lo + 1000].fill_(7.0),
        lambda: ns["v"].add_(1),
        lambda: torch.add(ns["t"], 1, out=ns["t"]),
        lambda: ns["t"].data.neg_(),
        step,
        lambda: ns["a"].__imul__(3),
        lambda: ns["a"].__setitem__(slice(lo % 1000, lo % 1000 + 5000), 0.5),
    ]


@pytest.fixture
def store_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


def _imager(root: Path, **options: Any) -> StateImager:
    async def open_store() -> LocalStore:
        return LocalStore(root)

    return StateImager(open_store, kernel="k", **{"piece_bytes": PIECE, **options})


def _paths(store_dir: Path, **imager: Any) -> tuple[StateImager, ObjectCodec]:
    """An imager and an executor's codec over one local store (groups over 64 KiB are large)."""
    return _imager(store_dir, **imager), ObjectCodec(LocalStore(store_dir), large_object_bytes=64 * 1024)


async def _image_all(
    imager: StateImager, codec: ObjectCodec, ns: dict[str, Any], names: list[str]
) -> tuple[list[EncodedGroup], dict[int, Any]]:
    result = await codec.encode(ns, names, images=True)
    futures = {i: imager.begin(result.groups[i].names, views, 1) for i, views in result.images.items()}
    return result.groups, futures


async def _decoded(codec: ObjectCodec, groups: list[EncodedGroup], futures: dict[int, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for index, future in futures.items():
        image: ImageResult = await asyncio.wrap_future(future)
        group = EncodedGroup.from_dict({**groups[index].to_dict(), "image": image.ref.to_dict()})
        values.update(await codec.decode(group, {}))
    return values


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    hold=st.integers(0, 60),
    picks=st.lists(st.integers(0, 7), min_size=1, max_size=5),
)
def test_image_is_the_state_at_the_cells_end_though_the_next_cell_writes_it_during_the_copy(
    store_dir: Path, seed: int, hold: int, picks: list[int]
) -> None:
    async def trial() -> None:
        gate = Gate(hold)
        imager, codec = _paths(store_dir, pacer=gate)
        ns = _namespace(seed)
        want = {name: _snapshot(value) for name, value in ns.items()}
        try:
            groups, futures = await _image_all(imager, codec, ns, sorted(ns))
            await asyncio.to_thread(gate.reached.wait, 10)  # the copier is mid-way (or done)
            imager.before_user_code()  # the next cell starts
            ops = _next_cell_ops(ns, np.random.default_rng(seed))
            for pick in picks:
                ops[pick]()
            gate.go.set()
            got = await _decoded(codec, groups, futures)
        finally:
            gate.go.set()
            imager.close()
        for name in ("t", "v", "a"):
            assert _same(got[name], want[name]), name
        assert _same(_snapshot(got["model"]), want["model"])
        assert _same(_snapshot(got["opt"]), want["opt"])
        assert got["v"].untyped_storage().data_ptr() == got["t"].untyped_storage().data_ptr()

    asyncio.run(trial())


def test_a_torch_write_no_dispatcher_sees_makes_the_image_torn_not_wrong(store_dir: Path) -> None:
    async def trial() -> None:
        gate = Gate(0)
        imager, codec = _paths(store_dir, pacer=gate)
        ns = {"t": torch.randn(600_000)}
        try:
            _, futures = await _image_all(imager, codec, ns, ["t"])
            await asyncio.to_thread(gate.reached.wait, 10)
            imager.before_user_code()
            ns["t"].numpy()[-10:] = 5.0  # behind the dispatcher, before the copier got there
            gate.go.set()
            with pytest.raises(TornImage, match="could not see first"):
                await asyncio.wrap_future(futures[0])
        finally:
            gate.go.set()
            imager.close()

    asyncio.run(trial())


def test_unchanged_pieces_are_not_stored_again_and_the_guard_leaves_with_the_last_image(
    store_dir: Path,
) -> None:
    async def trial() -> None:
        imager, codec = _paths(store_dir, pack_bytes=2 * PIECE)  # 19 packs: reads run ahead of copies
        ns = {"t": torch.randn(600_000)}
        try:
            _, first = await _image_all(imager, codec, ns, ["t"])
            assert torch._C._len_torch_dispatch_stack() == 1  # the write guard, while it copies
            assert (await asyncio.wrap_future(first[0])).new_bytes >= ns["t"].nbytes
            ns["t"][0] += 1
            ns["t"][-1] += 1
            want = ns["t"].clone()
            groups, second = await _image_all(imager, codec, ns, ["t"])
            image = await asyncio.wrap_future(second[0])
            assert image.image_bytes > ns["t"].nbytes
            assert image.new_bytes <= 2 * PIECE  # two changed pieces (the pickle is unchanged)
            got = await _decoded(codec, groups, {0: second[0]})  # pieces from old and new packs
            assert torch.equal(got["t"], want)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if imager.in_flight() == 0:
                    break
            imager.settle()
            assert torch._C._len_torch_dispatch_stack() == 0
        finally:
            imager.close()

    asyncio.run(trial())


def test_state_carries_the_image_once_committed_and_a_failed_image_is_reported_unstored(
    store_dir: Path,
) -> None:
    async def trial() -> None:
        imager, codec = _paths(store_dir)
        ns = {"t": torch.randn(600_000), "a": np.arange(300_000.0)}
        try:
            groups, futures = await _image_all(imager, codec, ns, ["a", "t"])
            state = State("m", "r1", {"t": b"fp-t", "a": b"fp-a"}, groups=tuple(g.to_dict() for g in groups))
            by_name = {g.names[0]: i for i, g in enumerate(groups)}
            lost: concurrent.futures.Future[Any] = concurrent.futures.Future()
            lost.set_exception(OSError("disk full"))
            images = {by_name["t"]: futures[by_name["t"]], by_name["a"]: lost}
            done = await complete_state(state, {}, codec.store, structlog.get_logger(), images=images)
        finally:
            imager.close()
        assert [g["names"] for g in done.groups] == [["t"]] and done.groups[0]["image"]
        assert done.unstored == {"a": "data store write failed: OSError: disk full"}
        assert set(done.digests) == {"t"}
        standby: dict[str, Any] = {}
        failures = await apply_state(
            standby, ObjectCodec(LocalStore(store_dir)), [], [(done.groups[0], None)]
        )
        assert failures == [] and torch.equal(standby["t"], ns["t"])
        # a replica restored from a Raft snapshot (restart, migration) reads the same image
        entry = log_entries.decode(log_entries.encode(done))  # as the Raft log carries it
        assert isinstance(entry, State)
        log = ReplicatedNamespace()
        log.apply(entry)
        restored = ReplicatedNamespace()
        restored.restore(log.to_snapshot())
        imports, kept = restored.contents()
        fresh: dict[str, Any] = {}
        assert await apply_state(fresh, ObjectCodec(LocalStore(store_dir)), imports, kept) == []
        assert torch.equal(fresh["t"], ns["t"]) and set(fresh) == {"t"}

    asyncio.run(trial())


def test_only_the_numpy_groups_the_next_cell_may_change_are_cloned_before_it(store_dir: Path) -> None:
    async def trial() -> None:
        gate = Gate(0)
        imager, codec = _paths(store_dir, pacer=gate)
        ns = {"a": np.arange(300_000.0), "b": np.arange(300_000.0) + 1, "t": torch.randn(300_000)}
        want = {name: _snapshot(value) for name, value in ns.items()}
        try:
            groups, futures = await _image_all(imager, codec, ns, sorted(ns))
            await asyncio.to_thread(gate.reached.wait, 10)
            assert imager.untracked_in_flight()
            imager.before_user_code({"a"})  # the next cell may change 'a' only
            ns["a"] *= 2
            gate.go.set()
            got = await _decoded(codec, groups, futures)
            cloned = {
                groups[i].names[0]: (await asyncio.wrap_future(f)).cow_bytes for i, f in futures.items()
            }
        finally:
            gate.go.set()
            imager.close()
        assert cloned["a"] >= ns["a"].nbytes - PIECE and cloned["b"] == 0 and cloned["t"] == 0
        assert all(_same(got[name], want[name]) for name in ns)

    asyncio.run(trial())


def test_a_begin_past_the_images_in_flight_waits_for_the_oldest(store_dir: Path) -> None:
    async def trial() -> None:
        gate = Gate(0)
        imager, codec = _paths(store_dir, pacer=gate, max_in_flight=1)
        ns = {"t": torch.randn(300_000), "u": torch.randn(300_000)}
        try:
            first = await codec.encode(ns, ["t"], images=True)
            imager.begin(("t",), first.images[0], 1)
            await asyncio.to_thread(gate.reached.wait, 10)
            second = await codec.encode(ns, ["u"], images=True)
            threading.Timer(0.3, gate.go.set).start()
            started = time.perf_counter()
            alongside = imager.begin(("t",), first.images[0], 1)  # the same cell: no wait
            assert time.perf_counter() - started < 0.25
            later = imager.begin(("u",), second.images[0], 2)
            assert time.perf_counter() - started >= 0.25 and imager.in_flight() == 1
            await asyncio.wrap_future(later)
            await asyncio.wrap_future(alongside)
        finally:
            gate.go.set()
            imager.close()

    asyncio.run(trial())


@pytest.mark.parametrize("then", ["demand", "supersede"])
def test_a_demanded_image_is_read_before_the_one_being_read_which_is_read_again_after(
    store_dir: Path, then: str
) -> None:
    """A standby's loader (kernel_replica/lazy_load.py) reading ``t``'s image when a cell needs
    ``u`` gives ``t`` up between pieces, reads ``u``, then ``t`` again from the start: both
    bitwise the executor's. When a later entry supersedes ``t`` instead, its read stops there."""
    gate = Gate(at=5)

    async def open_store() -> LocalStore:
        return LocalStore(store_dir)

    async def main() -> None:
        imager, codec = _paths(store_dir)
        ns = {"t": torch.randn(600_000), "u": torch.randn(300_000)}
        groups, futures = await _image_all(imager, codec, ns, ["t", "u"])
        raw = {}
        for index, future in futures.items():
            image: ImageResult = await asyncio.wrap_future(future)
            raw[groups[index].names[0]] = {**groups[index].to_dict(), "image": image.ref.to_dict()}
        imager.close()
        standby: dict[str, Any] = {}
        order: list[list[str]] = []

        def take(load: Any, names: frozenset[str], values: Any, error: BaseException | None) -> None:
            assert error is None, error
            order.append(sorted(names))
            standby.update({name: values[name] for name in names})

        loader = LazyLoader(open_store, take, lambda: standby, pacer=gate)
        try:
            loader.add(raw["t"], ["t"])
            loader.add(raw["u"], ["u"])
            assert await asyncio.to_thread(gate.reached.wait, 10)  # t's read is at its 6th piece
            if then == "supersede":
                loader.supersede(["t"])
                gate.go.set()
                await loader.demand(None)
                assert order == [["u"]] and "t" not in standby
                assert gate.count < 37, gate.count  # t has 37 pieces: its read stopped at the 6th
                return
            wanted = asyncio.ensure_future(loader.demand(["u"]))
            await asyncio.sleep(0)
            gate.go.set()
            await wanted
            assert order == [["u"]] and "t" not in standby
            await loader.demand(None)
        finally:
            loader.close()
        assert order == [["u"], ["t"]]
        assert _same(standby["t"], ns["t"]) and _same(standby["u"], ns["u"])

    asyncio.run(main())
