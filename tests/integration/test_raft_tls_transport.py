"""RaftPeers whose links are mutual TLS (``PeerConfig.tls``), on real loopback sockets: a group
elects and commits as without TLS (its links in the clear after the handshake, or encrypted with
``encrypt_loopback``), an outbound link refuses a listener that is not the member it meant to
reach, and a peer that cannot go on calls ``on_fatal`` (the replica then exits)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_raft_driver import Group, eventually, run

from shared.raft.driver import NotRunning, RaftPeer
from shared.raft.tls import LinkTls, TlsSession
from shared.raft.tls_ca import ClusterCA
from shared.raft.types import Entry, Message, MessageType

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CA = ClusterCA.create()


def tls(member: str, group: str = "k", *, encrypt_loopback: bool = False) -> LinkTls:
    return LinkTls.from_identity(CA.issue(group, member), encrypt_loopback=encrypt_loopback)


def link_sessions(peer: RaftPeer) -> list[TlsSession]:
    """The TLS sessions of a peer's established links, outbound and inbound."""
    transport: Any = peer._transport
    outbound = [link.tls for link in transport._links.values() if link.tls is not None]
    return outbound + [inbound._tls for inbound in transport._inbound if inbound._tls is not None]


@pytest.mark.parametrize("encrypt_loopback", [False, True], ids=["loopback-clear", "loopback-encrypted"])
def test_a_tls_group_elects_commits_and_catches_a_restarted_member_up(
    tmp_path: Path, encrypt_loopback: bool
) -> None:
    async def main() -> None:
        g = Group(tmp_path, ["a", "b", "c"])
        try:
            for nid in g.addresses:
                await g.start(nid, tls=tls(nid, encrypt_loopback=encrypt_loopback))
            leader = await g.leader()
            assert await leader.propose(b"one") > 0
            follower = next(n for n in g.peers if n != leader.node_id)
            await g.stop(follower)
            assert await leader.propose(b"two") > 0
            # a new certificate, the same CA
            await g.start(follower, tls=tls(follower, encrypt_loopback=encrypt_loopback))
            assert await leader.propose(b"three") > 0
            await eventually(lambda: g.kv[follower].log == [b"one", b"two", b"three"], what="catch up")
            for peer in g.peers.values():
                stats = peer.transport_stats
                assert stats is not None and stats.refused == stats.malformed == 0
                sessions = link_sessions(peer)
                assert sessions and all(s.established for s in sessions)
                assert {s.plaintext for s in sessions} == {not encrypt_loopback}
        finally:
            await g.stop_all()

    run(main())


def test_an_outbound_link_refuses_a_listener_that_is_another_member(tmp_path: Path) -> None:
    async def main() -> None:
        g = Group(tmp_path, ["a", "c"])
        g.addresses["b"] = g.addresses["c"]  # "b" is said to listen where c does
        try:
            a = await g.start("a", tls=tls("a"))
            await g.start("c", tls=tls("c"))
            stats = a.transport_stats
            assert stats is not None
            await eventually(lambda: stats.refused > 0, what="a refusing c as b")
            assert not a._transport.send(Message(MessageType.HEARTBEAT, "b", "a", 1))  # type: ignore[union-attr]
        finally:
            await g.stop_all()

    run(main())


def test_a_peer_of_another_kernel_never_reaches_the_core(tmp_path: Path) -> None:
    async def main() -> None:
        g = Group(tmp_path, ["a", "b"])
        try:
            a = await g.start("a", tls=tls("a"))
            await g.start("b", tls=tls("b", group="other-kernel"))  # b speaks for another kernel
            stats = a.transport_stats
            assert stats is not None
            await eventually(lambda: stats.refused >= 2, what="both directions refused")
            assert stats.received == 0 and a.status().term <= 1
        finally:
            await g.stop_all()

    run(main())


def test_a_peer_that_cannot_apply_a_committed_entry_stops_and_calls_on_fatal(tmp_path: Path) -> None:
    async def main() -> None:
        failures: list[BaseException] = []

        def broken(entry: Entry) -> None:
            raise RuntimeError("state machine diverged")

        g = Group(tmp_path, ["a"])
        peer = RaftPeer(g.config("a", tls=tls("a")), on_apply=broken, on_fatal=failures.append)
        await peer.start()
        try:
            await peer.wait_for_leader()
            with pytest.raises(NotRunning, match="state machine diverged"):
                await peer.propose(b"x")
            await eventually(lambda: bool(failures), what="on_fatal")
            assert isinstance(failures[0], RuntimeError) and len(failures) == 1
            assert not peer.status().running
        finally:
            await peer.stop()
            await asyncio.sleep(0)

    run(main())


def test_a_tls_identity_must_be_this_node_s(tmp_path: Path) -> None:
    async def main() -> None:
        peer = RaftPeer(Group(tmp_path, ["a"]).config("a", tls=tls("b")))
        with pytest.raises(ValueError, match="member 'b'"):
            await peer.start()

    run(main())
