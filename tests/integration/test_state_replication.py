"""A notebook's state survives an executor switch and replica restarts, with each data store backend.

One embedded cluster per backend (``local`` directory, ``s3`` on a moto server, ``redis`` on a real
redis-server). Every scenario's setup cells run on one executor; then its host is cordoned and
every scenario's check runs on another replica, which only has what replication gave it. Large
objects (a numpy array, a model with its optimizer) travel through the backend; the store test
reads the backend raw and recomputes every object's address and checksum. Then each replica of a
kernel is killed and restarted in place in turn, and must execute on the namespace it rebuilt.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import xxhash
from _cluster import WITHOUT_HTTP_API, ClusterHandle, start_cluster, stop_cluster
from _kernels import CellResult, run, tandem_kernel
from _signals import signal_ours
from blake3 import blake3
from datastore_fixtures import S3_ENV, redis_url, s3_endpoint  # noqa: F401 - fixtures
from jupyter_client import BlockingKernelClient

from shared import messages

pytestmark = pytest.mark.integration

BACKENDS = ("local", "s3", "redis")
SNAPSHOT_EVERY = 16


@dataclass(frozen=True)
class Scenario:
    """Cells run on the first executor, then a check on another replica and the output it must print."""

    name: str
    setup: tuple[str, ...]
    check: str
    expected: str


SCENARIOS = (
    Scenario("ints_and_strings", ("i = 41\ns = 'tandem'",), "i += 1\nprint(i, s.upper())", "42 TANDEM"),
    Scenario("list_mutated_in_place", ("xs = [1, 2]", "xs.append(3)\nxs[0] = 0"), "print(xs)", "[0, 2, 3]"),
    Scenario(
        "nested_dict",
        ("d = {'a': {'b': 1}}", "d['a']['c'] = 2\nd.setdefault('e', []).append(3)"),
        "print(sorted(d['a'].items()), d['e'])",
        "[('b', 1), ('c', 2)] [3]",
    ),
    Scenario(
        "functions_and_classes",
        (
            "class Point:\n    def __init__(self, x):\n        self.x = x\n\n"
            "    def double(self):\n        return Point(2 * self.x)\n\n\n"
            "def area(r):\n    return 3 * r * r\n\n\np = Point(3)",
        ),
        "print(p.double().x, isinstance(p.double(), Point), area(2))",
        "6 True 12",
    ),
    Scenario(
        "lambdas_and_closures",
        (
            "square = lambda v: v * v\n\n\ndef make_counter():\n    n = 0\n\n    def inc():\n"
            "        nonlocal n\n        n += 1\n        return n\n\n    return inc\n\n\n"
            "counter = make_counter()\ncounter()",
        ),
        "print(square(7), counter(), counter())",
        "49 2 3",
    ),
    Scenario(
        "functions_see_rebound_globals",
        ("scale = 1\n\n\ndef scaled(x):\n    return scale * x",),
        "scale = 10\nprint(scaled(2))",
        "20",
    ),
    Scenario(
        "modules_and_aliases",
        ("import math\nimport collections as co\nfrom os import path as osp",),
        "print(math.sqrt(16), co.Counter('aab')['a'], osp.join('a', 'b'))",
        "4.0 2 a/b",
    ),
    Scenario(
        "numpy_arrays_share_memory",  # 2.4 MB: through the data store
        (
            "import numpy as np\narr = np.arange(300_000, dtype=np.float64)\nhalf = arr[::2]\nsmall = np.ones(3)",
        ),
        "half[1] = -1.0\nprint(arr[2], arr.flags.writeable, small.sum())",
        "-1.0 True 3.0",
    ),
    Scenario(
        "torch_training_continues",
        (
            "import torch\n\ntorch.manual_seed(0)\nX = torch.randn(256, 3)\n"
            "y = X @ torch.tensor([[2.0], [-3.0], [0.5]]) + 1.0\n"
            "model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
            "optimizer = torch.optim.Adam(model.parameters(), lr=0.05)\n\n\ndef step():\n"
            "    optimizer.zero_grad()\n    loss = torch.nn.functional.mse_loss(model(X), y)\n"
            "    loss.backward()\n    optimizer.step()\n    return loss.item()\n\n\nfirst = step()",
        ),
        "bound = all(p is q for p, q in zip(model.parameters(), optimizer.param_groups[0]['params']))\n"
        "for _ in range(100):\n    last = step()\n"
        "print(bound, last < first / 10)",
        "True True",
    ),
    Scenario(
        "large_model_and_optimizer_state_intact",  # 2.9 MB with the momentum: through the data store
        (
            "import hashlib\nimport torch\n\nbig = torch.nn.Linear(600, 600)\n"
            "big_opt = torch.optim.SGD(big.parameters(), lr=0.01, momentum=0.9)\n"
            "big(torch.ones(2, 600)).sum().backward()\nbig_opt.step()\n\n\n"
            "def weights_digest(module, opt):\n    h = hashlib.sha256()\n"
            "    for t in module.state_dict().values():\n        h.update(t.numpy().tobytes())\n"
            "    for s in opt.state.values():\n        h.update(s['momentum_buffer'].numpy().tobytes())\n"
            "    return h.hexdigest()\n\n\nbig_digest = weights_digest(big, big_opt)",
        ),
        "bound = all(p is q for p, q in zip(big.parameters(), big_opt.param_groups[0]['params']))\n"
        "same = weights_digest(big, big_opt) == big_digest\nbig_opt.step()\n"
        "print(bound, same, len(big_opt.state), weights_digest(big, big_opt) != big_digest)",
        "True True 2 True",
    ),
    Scenario(
        "deleted_names_stay_deleted",
        ("gone = 1\nkept = 2", "del gone"),
        "print('gone' in dir(), kept)",
        "False 2",
    ),
)


# ---- clusters, one per backend ------------------------------------------------------------------


@dataclass
class BackendCluster:
    backend: str
    cluster: ClusterHandle
    settings: dict[str, str] = field(default_factory=dict)


def _write_config(path: Path, datastore: dict[str, str]) -> Path:
    lines = ["[datastore]", *(f"{key} = {json.dumps(value)}" for key, value in datastore.items())]
    # Snapshot often, so a restarted replica restores from a snapshot plus a log tail; and a
    # killed replica is restarted in place by the test, not replaced by a new member.
    lines += ["[raft]", f"snapshot_every = {SNAPSHOT_EVERY}"]
    lines += ["[scheduler]", "replace_dead_replicas = false"]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module", params=BACKENDS)
def backend_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[BackendCluster]:
    """A 3-host cluster whose replicas use ``backend`` (the local one: a directory in its state
    dir), made this process's provisioner target while the module runs."""
    backend = request.param
    env: dict[str, str] = {}
    if backend == "local":
        settings = {"backend": "local"}
    elif backend == "s3":
        settings = {
            "backend": "s3",
            "bucket": f"tandem-it-{uuid.uuid4().hex[:12]}",
            "endpoint_url": request.getfixturevalue("s3_endpoint"),
        }
        env = dict(S3_ENV)
    else:
        url = request.getfixturevalue("redis_url")
        settings = {"backend": "redis", "url": url}
        _redis_keys(url, flush=True)
    state_dir = tmp_path_factory.mktemp(f"tandem-{backend}")
    config = _write_config(state_dir.parent / f"{backend}.toml", settings)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():  # replicas inherit them through tandem up
            patch.setenv(name, value)
        cluster = start_cluster(state_dir, "--config", str(config), "--hosts", "3", *WITHOUT_HTTP_API)
        patch.setenv("TANDEM_STATE_DIR", str(state_dir))
        try:
            yield BackendCluster(backend, cluster, settings)
        finally:
            survivors = stop_cluster(cluster)
    assert not survivors, f"services survived tandem up's SIGTERM: {survivors}"


@dataclass
class SwitchedKernel:
    """A kernel whose scenarios were set up on ``first``'s executor, whose host is now cordoned."""

    kernel_id: str
    kc: BlockingKernelClient
    first: CellResult
    setup_failures: dict[str, str]


@pytest.fixture(scope="module")
def switched(backend_cluster: BackendCluster) -> Iterator[SwitchedKernel]:
    cluster = backend_cluster.cluster
    with tandem_kernel() as (km, kc):
        failures: dict[str, str] = {}
        last: CellResult | None = None
        for scenario in SCENARIOS:
            for cell in scenario.setup:
                last = run(kc, cell, timeout=90)
                if last.status != "ok":
                    failures[scenario.name] = str(last.errors or last.reply["content"])
        assert last is not None
        host = last.tandem.get("host_id")
        assert host, last.tandem
        assert cluster.cli("host", "cordon", host).returncode == 0
        try:
            yield SwitchedKernel(km.kernel_id, kc, last, failures)
        finally:
            assert cluster.cli("host", "uncordon", host).returncode == 0


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_state_survives_an_executor_switch(switched: SwitchedKernel, scenario: Scenario) -> None:
    assert scenario.name not in switched.setup_failures, switched.setup_failures[scenario.name]
    cell = run(switched.kc, scenario.check, timeout=60)
    assert cell.status == "ok", cell.errors
    assert cell.tandem.get("host_id") != switched.first.tandem.get("host_id"), "the executor did not change"
    assert cell.stdout.strip() == scenario.expected


# ---- what the backend holds ---------------------------------------------------------------------


def test_large_objects_are_in_the_backend_with_valid_checksums(
    backend_cluster: BackendCluster, switched: SwitchedKernel
) -> None:
    """Every stored object, read raw from the backend, hashes to its own address (BLAKE3) and to
    the read checksum recorded beside it (XXH3-128; the replicas verify it on every read)."""
    objects = _stored_objects(backend_cluster)
    assert len(objects) >= 2, (
        f"the array and the large model did not reach the {backend_cluster.backend} store"
    )
    for digest, (data, checksum) in objects.items():
        assert blake3(data).hexdigest() == digest, f"object {digest} does not hash to its address"
        if checksum is not None:
            assert xxhash.xxh3_128_hexdigest(data) == checksum, f"object {digest}: checksum mismatch"


def _stored_objects(bc: BackendCluster) -> dict[str, tuple[bytes, str | None]]:
    """digest -> (content, recorded read checksum or None where the backend records none)."""
    if bc.backend == "local":
        root = bc.cluster.state_dir / "datastore" / "objects"
        return {path.name: (path.read_bytes(), None) for path in root.rglob("*") if path.is_file()}
    if bc.backend == "s3":
        return asyncio.run(_s3_objects(bc.settings["bucket"], bc.settings["endpoint_url"]))
    return _redis_keys(bc.settings["url"])


async def _s3_objects(bucket: str, endpoint: str) -> dict[str, tuple[bytes, str | None]]:
    from aiobotocore.session import get_session

    found: dict[str, tuple[bytes, str | None]] = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in S3_ENV.items():
            patch.setenv(name, value)
        async with get_session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1") as s3:
            listing = await s3.list_objects_v2(Bucket=bucket, Prefix="objects/")
            for item in listing.get("Contents", []):
                reply = await s3.get_object(Bucket=bucket, Key=item["Key"])
                async with reply["Body"] as body:
                    data = await body.read()
                found[item["Key"].rsplit("/", 1)[1]] = (data, reply["Metadata"].get("xxh3-128"))
    return found


def _redis_keys(url: str, *, flush: bool = False) -> dict[str, tuple[bytes, str | None]]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        if flush:
            client.flushdb()
            return {}
        found: dict[str, tuple[bytes, str | None]] = {}
        for key in client.scan_iter(match="tandem:obj:*"):
            digest = key.decode().rsplit(":", 1)[1]
            manifest: dict[str, Any] = json.loads(client.get(key))  # type: ignore[arg-type]
            chunks = [client.get(f"tandem:chunk:{digest}:{i}") for i in range(manifest["chunks"])]
            assert all(c is not None for c in chunks), f"object {digest} lacks chunks"
            found[digest] = (b"".join(chunks), manifest["checksum"])  # type: ignore[arg-type]
        return found
    finally:
        client.close()


# ---- restart in place ---------------------------------------------------------------------------

# On the scenarios' kernel, after their checks: what the restarted replicas must show.
RESTART_SETUP = """
history = []
weights = np.arange(200_000, dtype=np.float64)  # 1.6 MB: through the data store
doomed = 'deleted before any restart'
big_digest = weights_digest(big, big_opt)


def summary():
    scenarios = (i, s, xs, sorted(d['a']), p.double().x, square(3), 'gone' in dir(), float(arr[2]))
    return f"{history} {weights[:2].tolist()} {'doomed' in dir()} {weights_digest(big, big_opt) == big_digest} {scenarios}"
"""


def _status(cluster: ClusterHandle) -> dict[str, Any]:
    return cluster.ask_scheduler(messages.CLUSTER_STATUS, {}, timeout=10.0)


def _replicas(cluster: ClusterHandle, kernel_id: str) -> dict[str, dict[str, Any]]:
    kernel = next(k for k in _status(cluster)["kernels"] if k["id"] == kernel_id)
    return {r["id"]: r for r in kernel["replicas"]}


def _wait_for(predicate: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def test_replicas_restarted_one_at_a_time_lose_nothing(
    backend_cluster: BackendCluster, switched: SwitchedKernel
) -> None:
    """Each replica of the scenarios' kernel in turn: killed (-9), a cell runs without it,
    ``tandem replica restart`` brings back the same member, which must then run a cell on the
    namespace it rebuilt from its Raft storage (snapshot and log), the cells it missed, and the
    data store: every scenario's values, the large objects, deletions."""
    cluster, kc, kernel_id = backend_cluster.cluster, switched.kc, switched.kernel_id
    setup = run(kc, RESTART_SETUP, timeout=60)
    assert setup.status == "ok", setup.errors
    assert run(kc, "del doomed").status == "ok"
    # the scenarios' values as they are now (their checks, if they ran first, changed some)
    before = run(kc, "print(summary())").stdout.strip()
    scenarios = before[before.index(" (") + 1 :]
    replicas = _replicas(cluster, kernel_id)
    assert len(replicas) == 3 and len({r["host"] for r in replicas.values()}) == 3, replicas
    refused = cluster.cli("replica", "restart", kernel_id, "r9")
    assert refused.returncode == 1 and "no replica 'r9'" in refused.stderr, refused.stderr
    unknown = cluster.cli("replica", "restart", "no-such-kernel", "r1")
    assert unknown.returncode == 1 and "unknown kernel" in unknown.stderr, unknown.stderr
    for n, replica_id in enumerate(sorted(replicas), start=1):
        assert signal_ours(int(replicas[replica_id]["pid"]), signal.SIGKILL)
        _wait_for(
            lambda rid=replica_id: not _replicas(cluster, kernel_id)[rid]["alive"],  # type: ignore[misc]
            f"the scheduler saw {replica_id} exit",
        )
        missed = run(kc, f"history.append({replica_id!r})\nweights[0] += 1\nlen(history)")
        assert missed.status == "ok", missed.errors
        restart = cluster.cli("replica", "restart", kernel_id, replica_id, timeout=120)
        assert restart.returncode == 0, restart.stderr
        replicas = _replicas(cluster, kernel_id)
        assert replicas[replica_id]["alive"], replicas[replica_id]
        with cluster.only_host_open(replicas[replica_id]["host"]):
            cell = run(kc, "print(summary(), _)", timeout=60)  # and the output history
        assert cell.status == "ok", cell.errors
        assert cell.tandem.get("replica_id") == replica_id, cell.tandem
        log = (
            cluster.state_dir
            / "hosts"
            / replicas[replica_id]["host"]
            / kernel_id
            / replica_id
            / "replica.log"
        )
        assert "snapshot_restored" in log.read_text(errors="replace"), "not restored from its snapshot"
        done = [rid for rid in sorted(replicas)[:n]]
        assert cell.stdout.strip() == f"{done} [{float(n)}, 1.0] False True {scenarios} {n}"
