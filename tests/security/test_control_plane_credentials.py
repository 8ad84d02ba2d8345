"""Anyone who reached the gateway or the scheduler could start and stop kernels, cordon and drain
hosts, register a fake host (which then received kernels' HMAC keys) and kill a kernel with
spoofed ``replica.event exited`` messages. Every service socket is CurveZMQ now: a peer needs a
key the cluster issued, and its key decides what it may send and for whom."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel

from shared import messages
from shared.envelope import Envelope
from shared.security import curve

pytestmark = pytest.mark.integration

SERVICES = ["gateway", "global-scheduler"]


def _answers(sock: Any, wait_s: float = 1.5) -> list[dict[str, Any]]:
    found = []
    while sock.poll(int(wait_s * 1000)):
        found.append(msgpack.unpackb(sock.recv()))
    return found


def _attempts(host_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (messages.KERNEL_START, {"kernel_id": "intruder-kernel", "key": "k", "resources": {}}),
        (messages.KERNEL_SHUTDOWN, {"kernel_id": "intruder-kernel"}),
        (messages.HOST_DRAIN, {"host_id": host_id}),
        (messages.HOST_CORDON, {"host_id": host_id}),
        (
            messages.HOST_REGISTER,
            {"host_id": "intruder", "resources": {"gpus": 8}, "gpu_kind": "virtual", "address": ""},
        ),
    ]


def _first_host(cluster: ClusterHandle) -> str:
    return str(cluster.status()["hosts"][0]["id"])


@pytest.mark.parametrize("service", SERVICES)
def test_a_peer_without_a_key_is_refused_at_the_handshake_and_logged(
    tandem_cluster: ClusterHandle, service: str
) -> None:
    host_id = _first_host(tandem_cluster)
    log_name = "gateway" if service == "gateway" else "global-scheduler"
    before = tandem_cluster.log_text(log_name).count("peer_refused")
    sock = tandem_cluster.dealer(service, principal=None)
    try:
        for verb, body in _attempts(host_id):
            sock.send(Envelope(verb, body).encode())
        assert _answers(sock) == []
    finally:
        sock.close()
    status = tandem_cluster.status()
    assert "intruder-kernel" not in [k["id"] for k in status["kernels"]]
    assert "intruder" not in [h["id"] for h in status["hosts"]]
    assert not any(h["cordoned"] for h in status["hosts"])
    assert tandem_cluster.log_text(log_name).count("peer_refused") > before
    assert "handshake failed" in tandem_cluster.log_text(log_name)


@pytest.mark.parametrize("service", SERVICES)
def test_a_key_the_cluster_did_not_issue_is_refused_by_name(
    tandem_cluster: ClusterHandle, service: str
) -> None:
    stranger = curve.new_keypair()
    server = curve.load(
        tandem_cluster.state_dir / "keys", curve.GATEWAY if service == "gateway" else curve.SCHEDULER
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    curve.ClientCurve(stranger, server.public).apply(sock)
    sock.connect(tandem_cluster.gateway if service == "gateway" else tandem_cluster.scheduler)
    try:
        sock.send(
            Envelope(messages.KERNEL_START, {"kernel_id": "stranger", "key": "k", "resources": {}}).encode()
        )
        assert _answers(sock) == []
    finally:
        sock.close()
    log_name = "gateway" if service == "gateway" else "global-scheduler"
    assert "key not issued by this cluster" in tandem_cluster.log_text(log_name)
    assert "stranger" not in [k["id"] for k in tandem_cluster.status()["kernels"]]


def test_the_operator_key_may_not_register_a_host(tandem_cluster: ClusterHandle) -> None:
    sock = tandem_cluster.dealer("global-scheduler", curve.OPERATOR, identity=b"intruder")
    try:
        body = {"host_id": "intruder", "resources": {"gpus": 8}, "gpu_kind": "virtual", "address": ""}
        sock.send(Envelope(messages.HOST_REGISTER, body).encode())
        (answer,) = _answers(sock)
    finally:
        sock.close()
    assert answer["body"]["code"] == "unauthorized"
    assert "operator may not send host.register" in answer["body"]["reason"]
    assert "intruder" not in [h["id"] for h in tandem_cluster.status()["hosts"]]


@pytest.fixture
def rogue_host(tandem_cluster: ClusterHandle) -> Iterator[Any]:
    """A host the operator did issue a key to, which then lies about who it is."""
    keys_dir = tandem_cluster.state_dir / "keys"
    principal = curve.host_principal("rogue")
    curve.issue(keys_dir, principal)
    sock = tandem_cluster.dealer("global-scheduler", principal, identity=b"rogue")
    try:
        yield sock
    finally:
        sock.close()
        for path in keys_dir.glob(f"{principal}.key*"):
            path.unlink()


def test_a_host_may_not_register_or_heartbeat_under_another_hosts_id(
    tandem_cluster: ClusterHandle, rogue_host: Any
) -> None:
    victim = _first_host(tandem_cluster)
    body = {"host_id": victim, "resources": {"gpus": 8}, "gpu_kind": "virtual", "address": ""}
    rogue_host.send(Envelope(messages.HOST_REGISTER, body).encode())
    rogue_host.send(Envelope(messages.HOST_HEARTBEAT, {"host_id": victim}).encode())
    answers = _answers(rogue_host)
    assert [a["body"]["code"] for a in answers] == ["unauthorized", "unauthorized"]
    assert all(f"may not speak for host '{victim}'" in a["body"]["reason"] for a in answers)
    assert "unauthorized" in tandem_cluster.log_text("global-scheduler")


@pytest.mark.parametrize("event", ["exited", "leaving", "exit"])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in_a_batch"])
def test_spoofed_replica_exits_from_another_host_do_not_kill_a_kernel(
    tandem_cluster: ClusterHandle, rogue_host: Any, batched: bool, event: str
) -> None:
    """Also inside a ``batch``: each item is authorised as if it had come alone. ``leaving``
    would make the scheduler stop sending the replicas cells, ``exit`` stop the kernel."""
    with tandem_kernel() as (km, kc):
        assert run(kc, "n = 41").status == "ok"
        status = tandem_cluster.status()
        (kernel,) = [k for k in status["kernels"] if k["id"] == km.kernel_id]
        spoofed = [
            Envelope(
                messages.REPLICA_EVENT,
                {"kernel_id": km.kernel_id, "replica_id": replica["id"], "event": event, "detail": {}},
            )
            for replica in kernel["replicas"][:2]
        ]
        if batched:
            rogue_host.send(Envelope(messages.BATCH, {"items": [env.encode() for env in spoofed]}).encode())
        else:
            for env in spoofed:
                rogue_host.send(env.encode())
        answers = _answers(rogue_host)
        assert [a["body"]["code"] for a in answers] == ["unauthorized", "unauthorized"]
        assert "which runs on" in answers[0]["body"]["reason"]
        time.sleep(0.5)
        assert run(kc, "print(n + 1)").stdout.strip() == "42"
        (kernel,) = [k for k in tandem_cluster.status()["kernels"] if k["id"] == km.kernel_id]
        assert all(r["alive"] for r in kernel["replicas"])
