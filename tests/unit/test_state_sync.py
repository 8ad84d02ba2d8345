"""AST-guided state replication: what the executor sends, what standbys and snapshots rebuild."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
import structlog
import torch

from kernel_replica import log_entries
from kernel_replica.cell_analysis import FunctionFacts, analyse_cell, update_registry
from kernel_replica.log_entries import LogEntryError, State
from kernel_replica.object_codec import ObjectCodec
from kernel_replica.state_sync import (
    ReplicatedNamespace,
    apply_state,
    complete_state,
    datastore_config,
    plan_state,
    replicable_names,
)
from shared.config import load_config
from shared.datastore.local_backend import LocalStore


class Executor:
    """One replica's side of the path: run cells, plan STATE, keep the replicated record."""

    def __init__(self, codec: ObjectCodec, replicated: ReplicatedNamespace) -> None:
        self.ns: dict[str, Any] = {"__name__": "__main__"}
        self.codec = codec
        self.registry: dict[str, FunctionFacts] = {}
        self.replicated = replicated

    def run(self, code: str, msg_id: str = "m") -> State:
        exec(code, self.ns)
        effects = analyse_cell(code, self.registry)
        update_registry(self.registry, effects)
        plan = asyncio.run(plan_state(effects, self.ns, self.replicated.digests(), self.codec))
        state = log_entries.decode(log_entries.encode(plan.state(msg_id, "r1")))
        assert isinstance(state, State)
        self.replicated.apply(state)
        return state


def standby_apply(ns: dict[str, Any], codec: ObjectCodec, state: State) -> None:
    groups = [(g, None) for g in state.groups]
    assert asyncio.run(apply_state(ns, codec, state.imports, groups, state.deleted)) == []


def test_only_user_names_are_replicated() -> None:
    ns = {"x": 1, "_": 2, "_i1": "", "__builtins__": None, "In": [], "Out": {}, "get_ipython": None, "h": 3}
    assert replicable_names(ns, hidden=["h"]) == ["x"]
    assert replicable_names(ns | {"": 4, "y": 5}, hidden={"h": None}) == ["x", "y"]  # IPython's dict


def test_only_changed_names_travel_and_imports_are_replayed() -> None:
    replicated = ReplicatedNamespace()
    ex = Executor(ObjectCodec(None), replicated)
    standby: dict[str, Any] = {"__name__": "__main__"}
    state = ex.run("import math\nx = 1\nbig = list(range(10))")
    assert state.imports == (("math", "import math"),)
    assert sorted(n for g in state.groups for n in g["names"]) == ["big", "x"]
    standby_apply(standby, ex.codec, state)
    assert standby["math"].pi > 3 and standby["x"] == 1
    state = ex.run("y = x + 1")  # big is not re-sent
    assert [n for g in state.groups for n in g["names"]] == ["y"]
    standby_apply(standby, ex.codec, state)
    standby_apply(standby, ex.codec, ex.run("def grow():\n    big.append(len(big))"))
    state = ex.run("grow()")  # grow itself did not change (the globals it uses did)
    assert [n for g in state.groups for n in g["names"]] == ["big"]
    standby_apply(standby, ex.codec, state)
    standby_apply(standby, ex.codec, ex.run("big.pop()"))
    state = ex.run("big.append(10)\ndel x")
    assert [n for g in state.groups for n in g["names"]] == ["big"] and state.deleted == ("x",)
    standby_apply(standby, ex.codec, state)
    assert standby["big"][-1] == 10 and "x" not in standby and standby["y"] == 2
    assert not ex.run("z = 0\ndel z").groups


def test_functions_use_the_standby_namespace_as_globals() -> None:
    ex = Executor(ObjectCodec(None), ReplicatedNamespace())
    standby: dict[str, Any] = {"__name__": "__main__"}
    standby_apply(standby, ex.codec, ex.run("n = 0\ndef bump():\n    global n\n    n += 1"))
    exec("bump()", standby)
    assert standby["n"] == 1


def test_shared_references_stay_shared_and_large_groups_go_to_the_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    ex = Executor(ObjectCodec(store, large_object_bytes=1024), ReplicatedNamespace())
    code = "import torch\nmodel = torch.nn.Linear(64, 64)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)"
    ex.ns["torch"] = torch
    state = ex.run(code)
    (group,) = state.groups
    assert sorted(group["names"]) == ["model", "opt"] and group["pointer"] is not None
    standby: dict[str, Any] = {"__name__": "__main__"}
    standby_apply(standby, ObjectCodec(store), state)
    assert standby["opt"].param_groups[0]["params"][0] is standby["model"].weight
    # a step through the optimizer changes the model: both travel again, together
    state = ex.run("model(torch.ones(1, 64)).sum().backward()\nopt.step()")
    assert sorted(n for g in state.groups for n in g["names"]) == ["model", "opt"]
    standby_apply(standby, ObjectCodec(store), state)
    assert torch.equal(standby["model"].weight, ex.ns["model"].weight)


def test_unpicklable_names_are_skipped_with_a_reason() -> None:
    ex = Executor(ObjectCodec(None), ReplicatedNamespace())
    state = ex.run("import threading\nlock = threading.Lock()\ny = 2")
    assert "lock" in state.skipped and "lock" not in state.digests
    assert [n for g in state.groups for n in g["names"]] == ["y"]


def test_snapshot_keeps_the_latest_record_per_name() -> None:
    source = ReplicatedNamespace()
    ex = Executor(ObjectCodec(None), source)
    ex.run("import math\na = [1]\nb = 2")
    ex.run("a = [3]")
    ex.run("del b")
    restored = ReplicatedNamespace()
    restored.restore(source.to_snapshot())
    assert restored.digests() == source.digests()
    imports, groups = restored.contents()
    assert imports == [("math", "import math")] and [names for _, names in groups] == [["a"]]
    ns: dict[str, Any] = {"__name__": "__main__"}
    assert asyncio.run(apply_state(ns, ObjectCodec(None), imports, groups)) == []
    assert ns["a"] == [3] and "b" not in ns and ns["math"].pi > 3


def test_snapshot_keeps_what_the_last_executor_holds_for_the_gpu() -> None:
    ex = Executor(ObjectCodec(None), ReplicatedNamespace())
    source = ReplicatedNamespace()  # a standby's record, applying the executor's STATEs
    resident = (("model", (), "module"), ("batches", ("train", 0), "tensor"))
    source.apply(dataclasses.replace(ex.run("a = 1"), gpu_resident=resident))
    source.apply(ex.run("b = 2"))  # a STATE without the list: nothing is resident any more
    assert source.gpu_resident() == ()
    source.apply(dataclasses.replace(ex.run("c = 3"), gpu_resident=resident))
    restored = ReplicatedNamespace()
    restored.restore(source.to_snapshot())
    assert restored.gpu_resident() == resident
    with pytest.raises(LogEntryError, match="namespace snapshot 'gr'"):
        restored.restore(
            msgpack.packb({"fps": {}, "records": {}, "groups": [], "gr": [["x", [1.5], "tensor"]]})
        )


def test_a_group_that_cannot_be_decoded_is_reported_and_the_rest_applied() -> None:
    ns: dict[str, Any] = {"keep": 1, "gone": 2}
    bad = {"format": "tandem-pickle5/1", "names": ["bad"], "sizes": [3], "inline": b"xyz", "pointer": None}
    failures = asyncio.run(apply_state(ns, ObjectCodec(None), [], [(bad, None)], ["gone"]))
    assert len(failures) == 1 and "bad" in failures[0] and ns == {"keep": 1}


def test_relative_local_store_paths_resolve_under_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANDEM_STATE_DIR", raising=False)  # the environment would win over the key
    cfg = load_config(overrides={"datastore.path": "objs", "cluster.state_dir": str(tmp_path)})
    assert datastore_config(cfg).get("datastore.path") == str(tmp_path / "objs")


def test_write_behind_copies_large_groups_aside_and_writes_them_before_the_state(tmp_path: Path) -> None:
    """The executor's next cell may change an array while its previous value is being written:
    the store gets the value as it was at the end of the cell, and only then the STATE a pointer."""
    store = LocalStore(tmp_path, fsync=False)
    codec = ObjectCodec(store, large_object_bytes=1024)
    ns: dict[str, Any] = {"__name__": "__main__"}
    code = "import numpy as np\narr = np.arange(10_000, dtype=np.float64)\nsmall = [1, 2]"
    exec(code, ns)
    plan = asyncio.run(plan_state(analyse_cell(code, {}), ns, {}, codec, defer_large=True))
    (index,) = plan.deferred
    assert plan.groups[index]["names"] == ["arr"] and plan.groups[index]["pointer"] is None
    assert [g["inline"] is not None for g in plan.groups] == [i != index for i in range(len(plan.groups))]
    ns["arr"][:] = -1.0  # the next cell, before the write
    state = asyncio.run(complete_state(plan.state("m", "r1"), plan.deferred, store, structlog.get_logger()))
    assert state.groups[index]["pointer"] is not None and state.digests == plan.fingerprints
    standby: dict[str, Any] = {"__name__": "__main__"}
    standby_apply(standby, ObjectCodec(store), state)
    assert standby["arr"][-1] == 9_999.0 and standby["small"] == [1, 2]


class _FailingStore(LocalStore):
    async def put_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")


def test_a_failed_write_behind_leaves_its_names_out_of_the_state(tmp_path: Path) -> None:
    codec = ObjectCodec(LocalStore(tmp_path, fsync=False), large_object_bytes=1024)
    ns: dict[str, Any] = {"__name__": "__main__"}
    code = "import numpy as np\nbig = np.zeros(10_000)\nn = 3"
    exec(code, ns)
    plan = asyncio.run(plan_state(analyse_cell(code, {}), ns, {}, codec, defer_large=True))
    failing = _FailingStore(tmp_path / "other", fsync=False)
    state = asyncio.run(complete_state(plan.state("m", "r1"), plan.deferred, failing, structlog.get_logger()))
    assert [g["names"] for g in state.groups] == [["n"]]
    assert "big" not in state.digests and "n" in state.digests  # the next executor sends big again
    assert "disk full" in state.unstored["big"] and "big" not in state.skipped


def test_star_imports_are_replayed_not_pickled() -> None:
    ex = Executor(ObjectCodec(None), ReplicatedNamespace())
    state = ex.run("from math import *\nx = sqrt(16)")
    assert [g["names"] for g in state.groups] == [["x"]]
    assert ("pi", "from math import *") in state.imports
    standby: dict[str, Any] = {"__name__": "__main__"}
    standby_apply(standby, ObjectCodec(None), state)
    assert standby["x"] == 4.0 and standby["floor"](2.5) == 2
    # a star-imported name rebound later travels as a value, like any other
    state = ex.run("pi = 3")
    assert [g["names"] for g in state.groups] == [["pi"]]


def test_an_object_taken_from_a_module_is_the_modules_own_on_the_standby() -> None:
    """``from os import environ`` then ``environ["X"] = "1"`` on the next executor: a pickled
    copy took the change and the process environment did not (nor did ``rcParams`` copies reach
    matplotlib's plots). While the name holds the module's very object, the standbys replay the
    import; a name rebound to something else travels as a value."""
    import json.decoder

    ex = Executor(ObjectCodec(None), ReplicatedNamespace())
    state = ex.run("from os import environ\nfrom json.decoder import scanstring as scan\nfrom math import pi")
    assert not state.groups
    assert dict(state.imports) == {
        "environ": "from os import environ",
        "scan": "from json.decoder import scanstring as scan",
        "pi": "from math import pi",
    }
    standby: dict[str, Any] = {"__name__": "__main__"}
    standby_apply(standby, ObjectCodec(None), state)
    assert standby["environ"] is os.environ and standby["scan"] is json.decoder.scanstring
    assert not ex.run("environ['TANDEM_TEST_UNUSED'] = '1'\ndel environ['TANDEM_TEST_UNUSED']").groups
    state = ex.run("environ = dict(environ)")  # no longer the module's: a value like any other
    assert [g["names"] for g in state.groups] == [["environ"]]
    standby_apply(standby, ObjectCodec(None), state)
    assert type(standby["environ"]) is dict and standby["environ"] == dict(os.environ)


def test_relative_imports_are_replayed_as_absolute_ones() -> None:
    """A standby has no ``__package__`` (private names do not travel): the executor resolves it."""
    ex = Executor(ObjectCodec(None), ReplicatedNamespace())
    ex.ns["__package__"] = "json"
    state = ex.run("from .decoder import JSONDecoder as Decoder\nfrom . import scanner")
    assert dict(state.imports) == {
        "Decoder": "from json.decoder import JSONDecoder as Decoder",
        "scanner": "from json import scanner",
    }
    standby: dict[str, Any] = {"__name__": "__main__"}
    standby_apply(standby, ObjectCodec(None), state)
    assert standby["Decoder"] is ex.ns["Decoder"] and standby["scanner"] is ex.ns["scanner"]
