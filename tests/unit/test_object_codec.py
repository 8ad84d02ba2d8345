"""Object codec: round trips inline and through a LocalStore, shared references, skipped objects."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kernel_replica.object_codec import EncodedGroup, ObjectCodec, decode_all
from shared.datastore.local_backend import LocalStore

NOTEBOOK = """
import math
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm(self):
        return math.hypot(self.x, self.y)
def make_counter():
    count = 0
    def inc():
        nonlocal count
        count += 1
        return count
    return inc
def bump():
    global total
    total += 1
total = 0
p = Point(3, 4)
inc = make_counter()
inc()
square = lambda v: v * v
"""


def notebook_namespace() -> dict[str, Any]:
    """Names defined the way a notebook defines them (module ``__main__``: pickled by value)."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(NOTEBOOK, "<cell>", "exec"), ns)
    return ns


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    yield LocalStore(tmp_path / "store", fsync=False)


def roundtrip(
    codec: ObjectCodec, ns: dict[str, Any], names: list[str], target: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[EncodedGroup]]:
    async def go() -> tuple[dict[str, Any], list[EncodedGroup]]:
        result = await codec.encode(ns, names)
        # through the Raft log's form: plain dicts
        groups = [EncodedGroup.from_dict(g.to_dict()) for g in result.groups]
        return await decode_all(codec, groups, target), groups

    return asyncio.run(go())


def test_plain_values_round_trip_inline() -> None:
    ns: dict[str, Any] = {"i": 7, "s": "héllo", "l": [1, [2, 3]], "d": {"a": (1, 2)}, "n": None, "f": 1.5}
    out, groups = roundtrip(ObjectCodec(None), ns, list(ns))
    assert out == ns
    assert all(g.inline is not None and g.pointer is None for g in groups)
    assert len(groups) == len(ns)  # nothing shared: one group per name


def test_notebook_functions_classes_and_instances(store: LocalStore) -> None:
    ns = notebook_namespace()
    names = ["math", "Point", "p", "inc", "square", "make_counter", "bump", "total"]  # modules by name
    target: dict[str, Any] = {"__name__": "__main__"}
    out, _ = roundtrip(ObjectCodec(store), ns, names, target)
    target.update(out)
    assert target["p"].norm() == 5.0 and isinstance(target["p"], target["Point"])
    assert target["inc"]() == 2  # the closure's state travelled
    assert target["square"](4) == 16
    target["bump"]()  # functions see the standby's namespace, not a private copy of it
    assert target["total"] == 1


def test_shared_references_survive_in_one_group() -> None:
    shared = [1, 2]
    ns: dict[str, Any] = {"a": {"p": shared}, "b": {"q": shared}, "c": [0]}
    out, groups = roundtrip(ObjectCodec(None), ns, ["a", "b", "c"])
    assert sorted(g.names for g in groups) == [("a", "b"), ("c",)]
    out["a"]["p"].append(3)
    assert out["b"]["q"] == [1, 2, 3]


def test_changed_name_pulls_in_an_unchanged_sharer() -> None:
    ns: dict[str, Any] = {"rows": [[1], [2]], "other": 5}
    codec = ObjectCodec(None)
    roundtrip(codec, ns, ["rows", "other"])
    ns["first"] = ns["rows"][0]  # a later cell: first = rows[0]
    out, groups = roundtrip(codec, ns, ["first"])
    assert [g.names for g in groups] == [("first", "rows")]
    out["first"].append(9)
    assert out["rows"][0] == [1, 9]
    assert codec.sharing()["first"] == {"rows"}


def test_numpy_arrays_and_views(store: LocalStore) -> None:
    big = np.arange(300_000, dtype=np.float64)  # 2.4 MB: through the store
    ns: dict[str, Any] = {"big": big, "view": big[10:20:2], "small": np.eye(3, dtype=np.float32)}
    out, groups = roundtrip(ObjectCodec(store, large_object_bytes=1 << 20), ns, list(ns))
    by_names = {g.names: g for g in groups}
    assert by_names[("big", "view")].pointer is not None and by_names[("small",)].inline is not None
    np.testing.assert_array_equal(out["big"], big)
    np.testing.assert_array_equal(out["view"], big[10:20:2])
    np.testing.assert_array_equal(out["small"], np.eye(3))
    assert out["big"].flags.writeable and out["small"].flags.writeable
    out["view"][0] = -1  # still a view of big
    assert out["big"][10] == -1


def test_torch_tensor_views_share_storage() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    ns: dict[str, Any] = {"t": t, "col": t[:, 1], "tt": t.T}
    out, groups = roundtrip(ObjectCodec(None), ns, list(ns))
    assert len(groups) == 1
    assert torch.equal(out["col"], t[:, 1]) and torch.equal(out["tt"], t.T)
    out["col"][0] = 100.0
    assert out["t"][0, 1] == 100.0 and out["tt"][1, 0] == 100.0


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_model_and_adam_keep_training_after_decode(store: LocalStore) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    for _ in range(3):
        _train_step(model, opt, x, y)
    ns: dict[str, Any] = {"model": model, "opt": opt, "x": x, "y": y}
    out, groups = roundtrip(ObjectCodec(store, large_object_bytes=64 * 1024), ns, ["model", "opt"])
    assert [g.names for g in groups] == [("model", "opt")] and groups[0].pointer is not None
    m2, o2 = out["model"], out["opt"]
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), m2.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2)
    s1, s2 = opt.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for key, state in s1["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(s2["state"][key][field]))
    params = list(m2.parameters())
    assert all(any(p is q for q in params) for p in o2.param_groups[0]["params"])
    before = [p.detach().clone() for p in params]
    for _ in range(2):  # training continues identically on both sides
        _train_step(model, opt, x, y)
        _train_step(m2, o2, x, y)
    assert any(not torch.equal(a, b) for a, b in zip(before, m2.parameters(), strict=True))
    for p1, p2 in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)


def test_large_pickle_without_buffers_goes_to_the_store(store: LocalStore) -> None:
    ns: dict[str, Any] = {"rows": [float(i) for i in range(200_000)]}
    out, groups = roundtrip(ObjectCodec(store), ns, ["rows"])
    assert groups[0].pointer is not None and groups[0].sizes == (groups[0].nbytes,)
    assert out["rows"] == ns["rows"]


def test_unserializable_objects_are_skipped_with_reasons(tmp_path: Path) -> None:
    def gen() -> Iterator[int]:
        yield 1

    sock = socket.socket()
    with open(tmp_path / "f.txt", "w") as fh:
        ns: dict[str, Any] = {"fh": fh, "sock": sock, "g": gen(), "lock": threading.Lock(), "ok": 1}
        result = asyncio.run(ObjectCodec(None).encode(ns, list(ns)))
    sock.close()
    reasons = {s.name: s.reason for s in result.skipped}
    assert set(reasons) == {"fh", "sock", "g", "lock"}
    assert "TextIOWrapper" in reasons["fh"] and "socket" in reasons["sock"]
    assert "generator" in reasons["g"] and "lock" in reasons["lock"]
    assert result.names == ["ok"]


def test_forget_and_missing_names() -> None:
    codec = ObjectCodec(None)
    ns: dict[str, Any] = {"a": [1]}
    result = asyncio.run(codec.encode(ns, ["a", "not_there"]))
    assert result.names == ["a"]
    codec.forget(["a"])
    assert codec.sharing() == {}


def test_record_validation() -> None:
    with pytest.raises(ValueError):
        EncodedGroup.from_dict({"format": "other", "names": [], "sizes": []})
    with pytest.raises(ValueError):
        EncodedGroup.from_dict(
            {"format": "tandem-pickle5/1", "names": ["a"], "sizes": [1], "pointer": {"x": 1}}
        )


def test_deferred_groups_are_private_copies_of_their_payload(store: LocalStore) -> None:
    codec = ObjectCodec(store, large_object_bytes=1024)
    ns = {"arr": np.arange(4096, dtype=np.int64), "tiny": 1}
    result = asyncio.run(codec.encode(ns, ["arr", "tiny"], defer_large=True))
    by_name = {g.names: i for i, g in enumerate(result.groups)}
    index = by_name[("arr",)]
    assert list(result.deferred) == [index]
    group = result.groups[index]
    assert group.pointer is None and group.inline is None
    payload = result.deferred[index]
    assert payload.nbytes == group.nbytes
    ns["arr"][:] = 0  # the copy is the value at encode time, not a view of the live array
    ref = asyncio.run(store.put(payload))
    decoded = asyncio.run(codec.decode(EncodedGroup(group.names, group.sizes, pointer=ref.to_dict())))
    assert decoded["arr"][-1] == 4095 and decoded["arr"].flags.writeable


def test_groups_beyond_the_copy_aside_limit_are_streamed_to_the_store_at_once(store: LocalStore) -> None:
    codec = ObjectCodec(store, large_object_bytes=1024)
    ns = {"a": np.arange(4096, dtype=np.int64), "b": np.arange(8192, dtype=np.int64)}
    result = asyncio.run(codec.encode(ns, ["a", "b"], defer_large=True, defer_max_bytes=40_000))
    by_name = {g.names: g for g in result.groups}
    deferred = {result.groups[i].names for i in result.deferred}
    assert deferred == {("a",)}  # 32 KiB fits the limit; b's 64 KiB would double too much memory
    assert by_name[("b",)].pointer is not None
