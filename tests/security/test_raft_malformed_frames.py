"""One malformed frame on the Raft port (a bad snapshot) put a replica's Raft into ``raft.fatal``
while the scheduler still reported it alive; two such frames made every cell fail. Now whatever a
peer sends is vetted at the transport: a frame that does not decode, lies about its sender, or
carries a snapshot that could not be restored is dropped and counted, and a committed entry whose
content does not decode is skipped (alike on every replica) and counted.

The sender here is authenticated (a valid certificate for member r2 of the kernel: a buggy or
compromised member), so its frames do reach the decoder; three real replica processes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgpack
import pytest
from _cluster import eventually
from _raft_attack import replica_snapshot, send_over_tls, snapshot_message
from test_replica_group import KERNEL_ID, REPLICAS, Cluster

from shared.raft.codec import encode_message
from shared.raft.driver import SNAPSHOT_ENVELOPE_VERSION
from shared.raft.types import Entry, Message, MessageType

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SENDER = "r2"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("malformed"))
    try:
        assert c.run("n = 41", "r1")["r1"]["content"]["status"] == "ok"
        yield c
    finally:
        c.close()


def _envelope(app: bytes) -> bytes:
    return msgpack.packb([SNAPSHOT_ENVELOPE_VERSION, {}, app], use_bin_type=True)


def garbage_frames(to: str) -> list[bytes]:
    """Frames that must each be dropped and counted: undecodable, lying, misaddressed, and
    well-formed InstallSnapshots whose snapshot could not be restored."""
    heartbeat = Message(MessageType.HEARTBEAT, to, SENDER, 1)
    bad_book = msgpack.packb({"v": 1, "book": {"voters": "r1"}, "ns": b""}, use_bin_type=True)
    return [
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        os.urandom(64),
        b"",
        encode_message(Message(MessageType.HEARTBEAT, to, "r3", 1)),  # frm is not the sender
        encode_message(Message(MessageType.HEARTBEAT, "someone-else", SENDER, 1)),
        encode_message(snapshot_message(to, SENDER, b"not a snapshot envelope")),
        encode_message(snapshot_message(to, SENDER, _envelope(b"\x93not msgpack"))),
        encode_message(snapshot_message(to, SENDER, _envelope(bad_book))),
        encode_message(snapshot_message(to, SENDER, _envelope(replica_snapshot({"x": ["g", 7]})))),
        encode_message(heartbeat)[:-3],  # truncated
    ]


def test_garbage_from_an_authenticated_peer_is_dropped_and_counted_and_raft_stays_healthy(
    cluster: Cluster,
) -> None:
    sender = cluster.raft_ca.issue(KERNEL_ID, SENDER)
    before = {rid: cluster.scheduler.status(rid) for rid in REPLICAS}
    for rid in REPLICAS:  # every replica at once: formerly two of these frames stopped the kernel
        frames = garbage_frames(rid)
        address = cluster.scheduler.raft_addresses[rid]
        # in the clear after the handshake, as members on one machine talk, and encrypted (r2)
        assert not send_over_tls(address, sender, SENDER, frames, linger=0.5, clear=rid != "r2")
        assert eventually(
            lambda rid=rid, frames=frames: (
                cluster.scheduler.status(rid)["malformed_frames"]
                >= before[rid]["malformed_frames"] + len(frames)
            )
        ), cluster.scheduler.status(rid)
    for rid in REPLICAS:
        status = cluster.scheduler.status(rid)
        assert status["running"] and status["term"] < 10_000, status  # no forged snapshot got in
        assert status["refused_connections"] == before[rid]["refused_connections"]
    for executor in REPLICAS:
        replies = cluster.run("n += 1; n", executor)
        assert all(r["content"]["status"] == "ok" for r in replies.values()), replies
    assert cluster.run("n", "r1")["r1"]["content"]["status"] == "ok"
    assert _result(cluster, "n") == "44"


def test_a_committed_entry_that_does_not_decode_is_skipped_by_every_replica(cluster: Cluster) -> None:
    sender = cluster.raft_ca.issue(KERNEL_ID, SENDER)
    before = {rid: cluster.scheduler.status(rid) for rid in REPLICAS}
    leader = before["r1"]["leader"]
    assert leader in REPLICAS
    junk = Entry(0, 1, data=b"\xc1 not a log entry", proposal_id="junk-1")
    proposal = Message(MessageType.PROPOSE, leader, SENDER, 0, entries=(junk,))
    send_over_tls(
        cluster.scheduler.raft_addresses[leader], sender, SENDER, [encode_message(proposal)], linger=0.5
    )
    for rid in REPLICAS:
        assert eventually(
            lambda rid=rid: (
                cluster.scheduler.status(rid)["skipped_entries"] == before[rid]["skipped_entries"] + 1
            )
        ), cluster.scheduler.status(rid)
        assert cluster.scheduler.status(rid)["running"]
    replies = cluster.run("n += 1; n", "r3")
    assert all(r["content"]["status"] == "ok" for r in replies.values()), replies


def _result(cluster: Cluster, expression: str) -> str:
    msg = cluster.send_cell(expression, "r1")
    cluster.replies(msg)
    for m in cluster.iopub("r1", msg["header"]["msg_id"]):
        if m["msg_type"] == "execute_result":
            return str(m["content"]["data"]["text/plain"])
    raise AssertionError(f"no result for {expression!r}")
