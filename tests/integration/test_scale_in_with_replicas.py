"""Scale-in of idle hosts that still hold replicas (NotebookOS §3.4.2) on a real embedded cluster.

`tandem up --hosts 3 --max-hosts 6 --gpus-per-host 2` with a subscription-ratio watermark of 0.34
(a host holds at most 2 subscribed GPUs). A two-GPU *filler* kernel fills the three initial hosts,
so the notebook's one-GPU kernel starts only after the autoscaler adds three hosts, one replica on
each. With nothing running, the cluster is over its target and those hosts are idle although they
hold the notebook's replicas:

1. while the filler runs, the policy picks one of them (the cluster ratio allows one release), but
   its replica has nowhere to go (the initial hosts are full, the others hold the kernel): the
   scale-in is abandoned with a ``scale_in_failed`` event and the host is uncordoned;
2. once the filler is shut down, the three added hosts are released, each after its replica moved
   to an initial host through the drain's membership change; the notebook keeps its variables.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import FAST_AUTOSCALING, WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import run, tandem_kernel

from shared import messages

pytestmark = pytest.mark.integration

INITIAL = ["host-0", "host-1", "host-2"]
ADDED = ["host-3", "host-4", "host-5"]
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    with running_cluster(
        tmp_path_factory.mktemp("scale-in-replicas"),
        "--hosts", "3", "--max-hosts", "6", "--gpus-per-host", "2", *FAST_AUTOSCALING,
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle


def alive_hosts(report: dict[str, Any]) -> list[str]:
    return sorted(h["id"] for h in report["hosts"] if h["alive"])


def replica_hosts(report: dict[str, Any], kernel_id: str) -> list[str]:
    kernel = next(k for k in report["kernels"] if k["id"] == kernel_id)
    return sorted(r["host"] for r in kernel["replicas"] if r["alive"])


def events(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in report["scale_events"] if e["kind"] == kind]


def test_idle_hosts_holding_replicas_are_released_after_their_replicas_migrate(
    cluster: ClusterHandle,
) -> None:
    filler = f"filler-{uuid.uuid4().hex[:8]}"
    body = {"kernel_id": filler, "key": uuid.uuid4().hex, "resources": {"gpus": 2}}
    placed = cluster.ask_scheduler(messages.KERNEL_START, body, timeout=WAIT_S)
    assert sorted(r["host"] for r in placed["replicas"]) == INITIAL

    with tandem_kernel() as (km, kc):  # one GPU: only fits on hosts the autoscaler adds
        kernel_id = km.kernel_id
        assert run(kc, "x = 6 * 7\nx", timeout=60).results == ["42"]
        grown = cluster.status()
        assert alive_hosts(grown) == INITIAL + ADDED
        assert replica_hosts(grown, kernel_id) == ADDED

        # 1. nowhere to move the replica: the release is abandoned and the host put back
        refused = cluster.wait_for_status(
            lambda s: bool(events(s, "scale_in_failed")), "a refused scale-in", WAIT_S
        )
        failed = events(refused, "scale_in_failed")[0]
        assert failed["hosts"] == ["host-3"] and "could not move" in failed["reason"], failed
        assert failed["migrations"] == [] and not events(refused, "scale_in")
        assert replica_hosts(refused, kernel_id) == ADDED
        assert not next(h for h in refused["hosts"] if h["id"] == "host-3")["cordoned"]
        assert run(kc, "x += 1\nx", timeout=60).results == ["43"]

        # 2. room on the initial hosts: the added hosts go, their replicas move there first
        cluster.ask_scheduler(messages.KERNEL_SHUTDOWN, {"kernel_id": filler}, timeout=30)
        shrunk = cluster.wait_for_status(
            lambda s: alive_hosts(s) == INITIAL, "scale-in to the initial hosts", WAIT_S
        )
        released = events(shrunk, "scale_in")
        assert sorted(h for e in released for h in e["hosts"]) == ADDED
        moves = [m for e in released for m in e["migrations"]]
        assert sorted(m["kernel"] for m in moves) == [kernel_id] * 3, released
        assert shrunk["cluster"]["scale_in_hosts"] == 3
        kernel = next(k for k in shrunk["kernels"] if k["id"] == kernel_id)
        assert replica_hosts(shrunk, kernel_id) == INITIAL
        assert kernel["migrations"] == 3 and kernel["last_migration"]["reason"] == "host released by scale-in"
        assert {r["id"] for r in kernel["replicas"]} == {m["to"] for m in moves}

        assert run(kc, "x + 1", timeout=60).results == ["44"]  # the namespace moved with the replicas
        assert run(kc, "y = x * 2\ny", timeout=60).results == ["86"]
