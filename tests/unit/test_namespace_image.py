"""A hibernated kernel's namespace image (kernel_replica/raft_bridge.py): what a resumed replica
loads before its Raft group starts. A good image rebuilds the replicated namespace and numbers on;
anything else fails the resume with the reason (the kernel stays hibernated, its image kept)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kernel_replica.raft_bridge import IMAGE_VERSION, ReplicaCore, ReplicaSettings
from kernel_replica.state_sync import ReplicatedNamespace, open_replica_datastore
from shared.config import load_config
from shared.rpc import RpcError


def _core(tmp_path: Path, posted: list[tuple[Any, ...]]) -> ReplicaCore:
    config = load_config(overrides={"cluster.state_dir": str(tmp_path)})
    return ReplicaCore(
        kernel_id="k1",
        replica_id="r1-1",
        data_dir=tmp_path / "r1-1",
        raft_address="tcp://127.0.0.1:0",
        scheduler_address="tcp://127.0.0.1:9",
        settings=ReplicaSettings(store_config=config),
        post_to_kernel=lambda fn, *args: posted.append((fn.__name__, *args)),
    )


async def _put(tmp_path: Path, data: bytes) -> dict[str, Any]:
    store = await open_replica_datastore(load_config(overrides={"cluster.state_dir": str(tmp_path)}))
    try:
        return (await store.put(data)).to_dict()
    finally:
        await store.close()


def test_an_image_rebuilds_the_namespace_and_the_count(tmp_path: Path) -> None:
    async def scenario() -> None:
        saved = ReplicatedNamespace()
        image = {"v": IMAGE_VERSION, "ns": saved.to_snapshot(), "count": 7}
        ref = await _put(tmp_path, msgpack.packb(image))
        posted: list[tuple[Any, ...]] = []
        core = _core(tmp_path, posted)

        def resume_count(count: int) -> None: ...

        def load_namespace(contents: Any) -> None: ...

        core.on_execution_count, core.on_namespace_restored = resume_count, load_namespace
        try:
            await core._restore_image(ref)
        finally:
            await core.stop()
        # on the kernel's thread: the count, then the namespace to load (imports, groups, GPU)
        assert posted == [
            ("resume_count", 7),
            ("load_namespace", ([], [], (), {}, [], None, [])),
        ]  # no comms, none gone, no outputs
        assert core.namespace.to_snapshot() == saved.to_snapshot()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "data",
    [
        b"not msgpack \xc1",
        msgpack.packb({"v": 99, "ns": b"", "count": 1}),
        msgpack.packb({"v": IMAGE_VERSION, "ns": b"\x01", "count": 1}),
    ],
    ids=["garbage", "other version", "bad namespace"],
)
def test_a_bad_image_fails_the_resume_with_its_reason(tmp_path: Path, data: bytes) -> None:
    async def scenario() -> None:
        ref = await _put(tmp_path, data)
        core = _core(tmp_path, [])
        try:
            with pytest.raises(RpcError, match="namespace image unusable") as caught:
                await core._restore_image(ref)
            assert caught.value.code == "start_failed"
        finally:
            await core.stop()

    asyncio.run(scenario())


def test_no_image_before_the_group_is_configured(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = _core(tmp_path, [])
        try:
            with pytest.raises(RpcError, match="not configured"):
                await core.hibernate_image()
        finally:
            await core.stop()

    asyncio.run(scenario())


def _namespace(*aliases: str) -> bytes:
    """A replicated namespace of import statements only (nothing to unpickle)."""
    return msgpack.packb(
        {
            "fps": {a: b"fp-" + a.encode() for a in aliases},
            "records": {a: ["i", f"import os as {a}"] for a in aliases},
            "groups": [],
        }
    )


def test_a_raft_snapshot_after_the_image_deletes_what_the_group_no_longer_has(tmp_path: Path) -> None:
    from kernel_replica.election import ElectionBook
    from kernel_replica.raft_bridge import SNAPSHOT_VERSION

    async def scenario() -> None:
        posted: list[tuple[Any, ...]] = []
        core = _core(tmp_path, posted)
        try:
            core.namespace.restore(_namespace("kept", "deleted_since"))  # the image, loaded first
            snapshot = {"v": SNAPSHOT_VERSION, "book": ElectionBook().to_snapshot(), "ns": _namespace("kept")}
            core._restore_snapshot(msgpack.packb(snapshot))
        finally:
            await core.stop()
        imports, _groups, _gpu_resident, _comms, gone, _process, _outputs = posted[0][1]
        assert imports == [("kept", "import os as kept")] and gone == ["deleted_since"]

    asyncio.run(scenario())


def test_an_image_names_the_top_level_modules_its_imports_need() -> None:
    """What the runtime template imports before forking a resumed kernel's replicas."""
    from kernel_replica.state_sync import StatePlan

    plan = StatePlan(
        imports=[
            ("np", "import numpy as np"),
            ("nn", "from torch import nn"),
            ("path", "import os.path as path"),
            ("sibling", "from . import sibling"),  # relative: nothing installed to import
            ("broken", "import (("),
        ]
    )
    ns = ReplicatedNamespace()
    ns.apply(plan.state("m1", "r1"))
    assert ns.imported_modules() == ["numpy", "os", "torch"]
