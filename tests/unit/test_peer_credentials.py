"""The replica link's admission policy over ipc (shared/security/peer_credentials.py): only a
process the local scheduler spawned, still the same process, as the replica it was spawned as."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from shared.process_signals import ProcStat
from shared.security.peer_credentials import (
    Admit,
    Decision,
    PeerCredentials,
    Refuse,
    SpawnedPeers,
    Wait,
    parse_peer_address,
)

UID = 1000
PRINCIPAL = "replica.k1/r1"


LAUNCHER = 100  # the local scheduler's pid


def _started_at(ticks: int | None, parent: int = LAUNCHER) -> Callable[[int], ProcStat | None]:
    return lambda pid: None if ticks is None else ProcStat(pid, "S", parent, pid, pid, ticks)


def _spawned() -> SpawnedPeers:
    """A local scheduler's view with one replica spawned: pid 4242, started at tick 7."""
    peers = SpawnedPeers(UID, LAUNCHER)
    peers.allow(4242, PRINCIPAL, 7)
    return peers


def _decide(
    peers: SpawnedPeers, pid: int, *, uid: int = UID, started: int | None = 7, parent: int = LAUNCHER
) -> Decision:
    return peers.decide(f"localhost:{uid}:100:{pid}", _started_at(started, parent))


def test_an_ipc_peer_address_is_read_as_uid_gid_pid() -> None:
    assert parse_peer_address("localhost:1000:100:4242") == PeerCredentials(1000, 100, 4242)


@given(st.text())
def test_anything_but_ipc_credentials_is_not_read_as_a_peer(address: str) -> None:
    peer = parse_peer_address(address)
    if peer is not None:  # only <host>:<uid>:<gid>:<pid>, in ASCII decimal, pid > 0
        assert [int(part) for part in address.rsplit(":", 3)[1:]] == [peer.uid, peer.gid, peer.pid]
        assert address.rsplit(":", 3)[3].isascii() and peer.pid > 0


def test_a_tcp_peer_address_is_refused() -> None:
    decision = _spawned().decide("127.0.0.1", _started_at(7))
    assert isinstance(decision, Refuse) and "no peer credentials" in decision.reason


def test_the_spawned_pid_is_admitted_as_its_replica() -> None:
    assert _decide(_spawned(), 4242) == Admit(PRINCIPAL)


def test_another_pid_of_the_same_user_is_refused() -> None:
    decision = _decide(_spawned(), 4243)
    assert isinstance(decision, Refuse) and "pid 4243 is not a replica" in decision.reason


def test_the_spawned_pid_under_another_uid_is_refused() -> None:
    decision = _decide(_spawned(), 4242, uid=0)
    assert isinstance(decision, Refuse) and "uid 0" in decision.reason


def test_a_reused_pid_is_refused_by_its_start_time() -> None:
    decision = _decide(_spawned(), 4242, started=9)
    assert isinstance(decision, Refuse) and "pid reused" in decision.reason
    assert isinstance(_decide(_spawned(), 4242, started=None), Refuse)  # no such process now


def test_a_pid_is_refused_once_its_exit_was_seen() -> None:
    peers = _spawned()
    peers.forget(4242, PRINCIPAL)
    assert isinstance(_decide(peers, 4242), Refuse)


def test_the_exit_of_an_earlier_holder_of_the_pid_does_not_forget_the_new_one() -> None:
    peers = SpawnedPeers(UID, LAUNCHER)
    peers.allow(4242, "replica.k2/r3", 8)
    peers.forget(4242, PRINCIPAL)
    assert _decide(peers, 4242, started=8) == Admit("replica.k2/r3")


def test_an_unknown_child_of_a_launcher_waits_only_while_a_start_is_under_way() -> None:
    peers = SpawnedPeers(UID, LAUNCHER)
    peers.start_began()
    assert isinstance(_decide(peers, 4242), Wait)
    peers.allow(4242, PRINCIPAL, 7)
    assert _decide(peers, 4242) == Admit(PRINCIPAL)
    peers.start_ended()
    assert isinstance(_decide(peers, 4243), Refuse)


def test_a_process_no_launcher_started_is_refused_at_once_even_during_a_start() -> None:
    """A process a notebook cell started (its parent is the replica) does not hold up ZAP."""
    peers = _spawned()
    peers.start_began()
    assert isinstance(_decide(peers, 5000, parent=4242), Refuse)
    peers.add_launcher(4242)  # a runtime template's forks wait like the local scheduler's own
    assert isinstance(_decide(peers, 5000, parent=4242), Wait)
