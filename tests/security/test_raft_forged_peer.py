"""Code ran in a replica from its Raft port: a forged hello plus one InstallSnapshot frame reached
``exec`` (the namespace's import replay) and ``pickle.loads``. Now every Raft link is mutual TLS
under the cluster's Raft CA, bound to the member id: a peer that is not a member of the same
kernel's group is refused before anything it sent is decoded.

Each test plays one attacker against three real replica processes (the fake local scheduler of
``test_replica_group``), then checks that the payload never ran (no marker file), that the replica
counted a refused connection and decoded nothing (no malformed frame either), and that the
kernel still runs cells with its namespace intact. The last test runs the same forged snapshot
against replicas with authentication turned off: the marker appears, so the payload is live."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _cluster import eventually
from _raft_attack import forged_snapshot, send_in_the_clear, send_over_tls
from test_replica_group import KERNEL_ID, Cluster

from shared.raft.tls_ca import ClusterCA

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TARGET = "r1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("forged-peer"))
    try:
        assert c.run("secret = 42", "r2")["r2"]["content"]["status"] == "ok"
        yield c
    finally:
        c.close()


def _refused_and_nothing_ran(cluster: Cluster, before: dict[str, object], marker: Path) -> None:
    assert eventually(
        lambda: cluster.scheduler.status(TARGET)["refused_connections"] > before["refused_connections"]
    ), "the replica did not count the refused connection"
    after = cluster.scheduler.status(TARGET)
    assert after["malformed_frames"] == before["malformed_frames"], "a frame of the attacker was decoded"
    assert after["running"] and after["term"] < 10_000, after  # the forged term never reached Raft
    time.sleep(0.3)  # an exec would run right after the snapshot's restore
    assert not marker.exists(), "the forged snapshot's code ran"
    reply = cluster.run("secret + 1", TARGET)[TARGET]
    assert reply["content"]["status"] == "ok", reply["content"]


def _attack(cluster: Cluster, tmp_path: Path, send: Callable[[str, bytes], bool]) -> None:
    marker = tmp_path / "pwned"
    before = cluster.scheduler.status(TARGET)
    assert send(cluster.scheduler.raft_addresses[TARGET], forged_snapshot(TARGET, "r2", marker))
    _refused_and_nothing_ran(cluster, before, marker)


def test_a_plain_tcp_client_with_a_forged_hello_is_refused_before_decoding(
    cluster: Cluster, tmp_path: Path
) -> None:
    _attack(cluster, tmp_path, lambda address, frame: send_in_the_clear(address, "r2", [frame]))


# ``clear``: the attacker also offers the loopback links' clear after the handshake (these
# replicas talk over loopback), then sends its frames unencrypted, as a member would
CLEAR = pytest.mark.parametrize("clear", [False, True], ids=["encrypted", "clear-after-handshake"])


@CLEAR
def test_a_tls_client_without_a_certificate_is_refused(cluster: Cluster, tmp_path: Path, clear: bool) -> None:
    _attack(
        cluster, tmp_path, lambda address, frame: send_over_tls(address, None, "r2", [frame], clear=clear)
    )


@CLEAR
def test_a_certificate_from_another_ca_is_refused(cluster: Cluster, tmp_path: Path, clear: bool) -> None:
    impostor = ClusterCA.create().issue(KERNEL_ID, "r2")  # the right names, the wrong CA
    _attack(
        cluster, tmp_path, lambda address, frame: send_over_tls(address, impostor, "r2", [frame], clear=clear)
    )


@CLEAR
def test_a_member_of_another_kernel_is_refused(cluster: Cluster, tmp_path: Path, clear: bool) -> None:
    neighbour = cluster.raft_ca.issue("another-kernel", "r2")  # the cluster's CA, another group
    _attack(
        cluster,
        tmp_path,
        lambda address, frame: send_over_tls(address, neighbour, "r2", [frame], clear=clear),
    )


@CLEAR
def test_a_valid_certificate_claiming_another_member_id_is_refused(
    cluster: Cluster, tmp_path: Path, clear: bool
) -> None:
    outsider = cluster.raft_ca.issue(KERNEL_ID, "r9")  # this kernel, but not r2
    _attack(
        cluster, tmp_path, lambda address, frame: send_over_tls(address, outsider, "r2", [frame], clear=clear)
    )


def test_the_forged_snapshot_runs_its_code_when_authentication_is_off(tmp_path: Path) -> None:
    """The payload the tests above send is live: with ``raft.tls = false`` (a trusted network
    only) the same forged InstallSnapshot is installed and its code runs."""
    marker = tmp_path / "pwned"
    (tmp_path / "replicas").mkdir()
    unsafe = Cluster(tmp_path / "replicas", config={"raft": {"tls": False}})
    try:
        address = unsafe.scheduler.raft_addresses[TARGET]
        send_in_the_clear(address, "r2", [forged_snapshot(TARGET, "r2", marker)])
        assert eventually(marker.exists, timeout=10), "the forged snapshot's code did not run"
    finally:
        unsafe.close()
