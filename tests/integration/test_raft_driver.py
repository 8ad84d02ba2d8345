"""RaftPeer on real sockets (loopback; the TCP transport unless a test names ZMQ) and real fsync'd
storage (tmp dirs).

Most tests run three peers in one event loop; one runs them as separate OS processes and kills the
leader with SIGKILL. Every test has a hard timeout and stops what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgpack
import pytest
import structlog
import uvloop
import zmq
import zmq.asyncio

from shared.raft.codec import encode_message
from shared.raft.core import RaftNode
from shared.raft.driver import (
    NotLeader,
    NotRunning,
    PeerConfig,
    ProposalDropped,
    ProposalTimeout,
    RaftPeer,
)
from shared.raft.tcp_transport import frame, hello_frame
from shared.raft.transport import TRANSPORT_KINDS, open_transport
from shared.raft.types import (
    ConfChange,
    ConfState,
    Entry,
    Message,
    MessageType,
    RaftConfig,
    RestoredState,
    Role,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TICK = 0.01  # 10 ms ticks: elections in 100-200 ms keep the tests quick


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    """Run a test body on uvloop with a deadline, then check it left no task behind."""

    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout)
        # A task cancelled by a synchronous close (a Raft link's reconnect loop) unwinds over the
        # next loop turns: that is not a leak, one that is still running a second later is.
        unwinding = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t.cancelling()]
        if unwinding:
            await asyncio.wait(unwinding, timeout=1.0)
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not leftover, f"tasks leaked: {leftover}"

    uvloop.run(bounded())


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class KV:
    """A tiny deterministic state machine: the list of applied payloads."""

    def __init__(self) -> None:
        self.log: list[bytes] = []
        self.voters: tuple[str, ...] = ()  # as told by on_conf_change
        self.voters_at_apply: list[tuple[str, ...]] = []

    def apply(self, entry: Entry) -> None:
        self.log.append(entry.data)
        self.voters_at_apply.append(self.voters)

    def conf_changed(self, change: ConfChange | None, conf: ConfState) -> None:
        self.voters = tuple(sorted(conf.voters))

    def dump(self) -> bytes:
        return msgpack.packb(self.log)

    def load(self, data: bytes) -> None:
        self.log = list(msgpack.unpackb(data)) if data else []


class Group:
    """Peers in this event loop, restartable from their directories."""

    def __init__(self, tmp: Path, ids: list[str], **cfg: Any) -> None:
        self.tmp = tmp
        self.addresses = {i: free_address() for i in ids}
        self.bootstrap = tuple(ids)
        self.cfg = cfg
        self.peers: dict[str, RaftPeer] = {}
        self.kv: dict[str, KV] = {}

    def config(self, nid: str, *, bootstrap: bool = True, **over: Any) -> PeerConfig:
        opts = {"tick_interval": TICK, "seed": hash(nid) & 0xFFFF, **self.cfg, **over}
        return PeerConfig(
            nid,
            self.addresses[nid],
            self.tmp / nid,
            peers={k: v for k, v in self.addresses.items() if k != nid},
            bootstrap_voters=self.bootstrap if bootstrap else (),
            **opts,
        )

    async def start(self, nid: str, **kw: Any) -> RaftPeer:
        kv = self.kv[nid] = KV()
        peer = RaftPeer(
            self.config(nid, **kw),
            on_apply=kv.apply,
            take_snapshot=kv.dump,
            restore_snapshot=kv.load,
            on_conf_change=kv.conf_changed,
        )
        await peer.start()
        self.peers[nid] = peer
        return peer

    async def stop(self, nid: str) -> None:
        await self.peers.pop(nid).stop()

    async def stop_all(self) -> None:
        for nid in list(self.peers):
            await self.stop(nid)

    async def leader(self, timeout: float = 5.0) -> RaftPeer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leaders = [p for p in self.peers.values() if p.status().role == Role.LEADER]
            if len(leaders) == 1 and all(
                p.status().leader == leaders[0].node_id for p in self.peers.values()
            ):
                return leaders[0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no agreed leader: {[p.status() for p in self.peers.values()]}")


@contextlib.asynccontextmanager
async def group(tmp: Path, ids: list[str] | None = None, **cfg: Any) -> AsyncIterator[Group]:
    g = Group(tmp, ids or ["a", "b", "c"], **cfg)
    try:
        for nid in g.addresses:
            await g.start(nid)
        yield g
    finally:
        await g.stop_all()


async def eventually(check: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def snapshot_indexes(directory: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1], 16) for p in directory.glob("snap-*.snap"))


async def gather(*aws: Awaitable[int]) -> list[int]:
    return list(await asyncio.gather(*aws))


# --------------------------------------------------------------------------------------------- tests


def test_core_counts_leader_entries_only_once_persisted() -> None:
    """The driver sends a leader's appends before its own fsync; that is safe only because of this."""
    node = RaftNode("a", restored=RestoredState(), rand=random.Random(1), bootstrap_voters=("a",))
    node.advance(node.ready())  # bootstrap snapshot
    for _ in range(40):
        node.tick()
        if node.has_ready():
            node.advance(node.ready())
    assert node.role == Role.LEADER
    node.propose(b"x", "p1")
    rd = node.ready()
    assert [e.proposal_id for e in rd.entries] == ["p1"]
    assert "p1" not in [e.proposal_id for e in rd.committed_entries]  # not durable yet: not committed
    node.advance(rd)
    assert "p1" in [e.proposal_id for e in node.ready().committed_entries]


def test_three_peers_elect_exactly_one_leader(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path) as g:
            leader = await g.leader()
            for p in g.peers.values():
                assert await p.wait_for_leader(5) == leader.node_id
            st = leader.status()
            assert st.voters and sorted(st.voters) == ["a", "b", "c"]
            assert st.members == g.addresses

    run(main())


def test_proposals_from_leader_and_follower_apply_everywhere_in_the_same_order(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path) as g:
            leader = await g.leader()
            follower = next(p for p in g.peers.values() if p is not leader)
            i1 = await leader.propose(b"from-leader")
            i2 = await follower.propose(b"from-follower")
            assert i2 > i1
            more = await gather(
                *(g.peers[n].propose(f"{n}-{k}".encode()) for n in g.peers for k in range(20))
            )
            assert len(set(more)) == 60
            await eventually(lambda: all(len(kv.log) == 62 for kv in g.kv.values()), what="all applied")
            logs = [kv.log for kv in g.kv.values()]
            assert logs[0] == logs[1] == logs[2]
            assert logs[0][:2] == [b"from-leader", b"from-follower"]

    run(main())


def test_propose_before_start_or_after_stop_raises_not_running(tmp_path: Path) -> None:
    async def main() -> None:
        g = Group(tmp_path, ["a", "b", "c"])
        peer = RaftPeer(g.config("a"))
        with pytest.raises(NotRunning):
            await peer.propose(b"x")
        await peer.start()
        await peer.stop()
        with pytest.raises(NotRunning):
            await peer.propose(b"x")

    run(main())


def test_proposal_without_quorum_fails_instead_of_hanging(tmp_path: Path) -> None:
    async def main() -> None:
        g = Group(tmp_path, ["a", "b", "c"])
        lonely = await g.start("a")  # b and c never start: no leader can ever be elected
        try:
            with pytest.raises((ProposalDropped, ProposalTimeout)):
                await lonely.propose(b"x", timeout=0.5)
        finally:
            await g.stop_all()

    run(main())


def test_killed_member_restarts_from_disk_and_catches_up(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path) as g:
            leader = await g.leader()
            victim = next(n for n in g.peers if n != leader.node_id)
            for k in range(10):
                await leader.propose(f"before-{k}".encode())
            await eventually(lambda: len(g.kv[victim].log) == 10, what="victim applied")
            await g.stop(victim)
            for k in range(10):
                await leader.propose(f"during-{k}".encode())

            restarted = await g.start(victim)  # fresh object, fresh KV: all state comes from disk
            st = restarted.status()
            assert st.term >= 1 and st.last_index >= 10
            await eventually(lambda: len(g.kv[victim].log) == 20, what="restarted member caught up")
            assert g.kv[victim].log == g.kv[leader.node_id].log

    run(main())


def test_restarted_group_keeps_committed_entries_and_elects_again(tmp_path: Path) -> None:
    async def main() -> None:
        g = Group(tmp_path, ["a", "b", "c"])
        try:
            for nid in g.addresses:
                await g.start(nid)
            leader = await g.leader()
            for k in range(5):
                await leader.propose(f"x{k}".encode())
            await g.stop_all()
            for nid in g.addresses:
                await g.start(nid)
            leader = await g.leader()
            await leader.propose(b"after")
            await eventually(lambda: all(len(kv.log) == 6 for kv in g.kv.values()), what="replayed")
            assert g.kv["a"].log == [b"x0", b"x1", b"x2", b"x3", b"x4", b"after"]
        finally:
            await g.stop_all()

    run(main())


def test_member_replaced_by_add_learner_promote_remove(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path) as g:
            leader = await g.leader()
            for k in range(5):
                await leader.propose(f"e{k}".encode())
            g.addresses["d"] = free_address()
            newcomer = await g.start("d", bootstrap=False)
            await leader.add_learner("d", g.addresses["d"])
            await eventually(lambda: len(g.kv["d"].log) == 5, what="learner caught up")
            assert newcomer.status().role == Role.LEARNER
            # it joined through the bootstrap snapshot, which told it the voters before any entry
            assert g.kv["d"].voters_at_apply == [("a", "b", "c")] * 5
            await leader.promote("d")
            leaving = next(n for n in "abc" if n != leader.node_id)
            await leader.remove(leaving)
            await g.stop(leaving)
            st = leader.status()
            assert sorted(st.voters) == sorted({"a", "b", "c", "d"} - {leaving})
            assert st.learners == ()
            assert st.members["d"] == g.addresses["d"]
            # The new configuration commits with the new member: stop the other old follower too.
            other = next(n for n in g.peers if n not in (leader.node_id, "d"))
            await g.stop(other)
            await leader.propose(b"needs-d")
            await eventually(lambda: g.kv["d"].log[-1:] == [b"needs-d"], what="d applied")

    run(main())


def test_new_member_catches_up_through_a_snapshot(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path, snapshot_every=20) as g:
            leader = await g.leader()
            for k in range(50):
                await leader.propose(f"s{k}".encode())
            await eventually(lambda: snapshot_indexes(tmp_path / leader.node_id) >= [40], what="snapshot")
            g.addresses["d"] = free_address()
            await g.start("d", bootstrap=False)
            await leader.add_learner("d", g.addresses["d"])
            await leader.propose(b"after-join")
            await eventually(lambda: len(g.kv["d"].log) == 51, what="d caught up")
            assert g.kv["d"].log == g.kv[leader.node_id].log
            assert snapshot_indexes(tmp_path / "d")[0] >= 40, "d should have installed the leader's snapshot"
            # And it survives its own restart from that snapshot.
            await g.stop("d")
            await g.start("d", bootstrap=False)
            await eventually(lambda: len(g.kv["d"].log) == 51, what="d restored from disk")

    run(main())


def test_async_apply_callback_is_awaited_in_log_order(tmp_path: Path) -> None:
    async def main() -> None:
        seen: list[bytes] = []

        async def slow_apply(entry: Entry) -> None:
            await asyncio.sleep(0.001 if entry.data.endswith(b"0") else 0)
            seen.append(entry.data)

        g = Group(tmp_path, ["a"])
        peer = RaftPeer(g.config("a"), on_apply=slow_apply)
        await peer.start()
        try:
            await peer.wait_for_leader()
            indexes = await gather(*(peer.propose(f"v{k}".encode()) for k in range(30)))
            assert indexes == sorted(indexes)
            assert seen == [f"v{k}".encode() for k in range(30)]
        finally:
            await peer.stop()

    run(main())


def test_failing_apply_callback_stops_the_peer_and_fails_waiters(tmp_path: Path) -> None:
    async def main() -> None:
        def broken(entry: Entry) -> None:
            raise RuntimeError("application bug")

        g = Group(tmp_path, ["a"])
        peer = RaftPeer(g.config("a"), on_apply=broken)
        await peer.start()
        try:
            await peer.wait_for_leader()
            with pytest.raises(NotRunning, match="application bug"):
                await peer.propose(b"x")
            assert not peer.status().running
            with pytest.raises(NotRunning):
                await peer.wait_for_leader(timeout=5)
        finally:
            await peer.stop()

    run(main())


def test_leadership_transfer_moves_the_leader(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path) as g:
            leader = await g.leader()
            await leader.propose(b"x")
            target = next(n for n in g.peers if n != leader.node_id)
            await eventually(lambda: g.peers[target].status().applied >= leader.status().applied)
            with pytest.raises(NotLeader):
                await g.peers[target].transfer_leadership(target)
            await leader.transfer_leadership(target, timeout=5)
            assert (await g.leader()).node_id == target
            assert await g.peers[target].propose(b"y") > 0

    run(main())


async def _send_garbage_over_zmq(address: str) -> None:
    ctx = zmq.asyncio.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.setsockopt(zmq.IDENTITY, b"b")  # claims to be a member
    evil.connect(address)
    try:
        await asyncio.sleep(0.05)
        for payload in (b"\xc1", msgpack.packb([1, 2, 3]), os.urandom(64), b""):
            await evil.send(payload)
        await evil.send_multipart([b"x", b"y"])
        await asyncio.sleep(0.2)
    finally:
        evil.close(0)
        ctx.destroy(linger=0)


async def _send_garbage_over_tcp(address: str) -> None:
    """Bad frames after a good hello (dropped, the connection stays), then a bad hello and an
    oversized frame (each closes its connection)."""
    host, port = address[len("tcp://") :].rsplit(":", 1)
    _reader, writer = await asyncio.open_connection(host, int(port))
    lying = encode_message(Message(MessageType.HEARTBEAT, "a", "c", 1))  # frm "c" on b's connection
    writer.write(hello_frame("b"))
    for payload in (b"\xc1", msgpack.packb([1, 2, 3]), os.urandom(64), b"", lying):
        writer.write(frame(payload))
    writer.write(frame(encode_message(Message(MessageType.HEARTBEAT, "someone-else", "b", 1))))
    writer.write(hello_frame("b"))  # too late: only the first frame of a connection is the hello
    await writer.drain()
    for opening in (frame(b"not a hello"), b"\xff\xff\xff\xff"):
        r, w = await asyncio.open_connection(host, int(port))
        w.write(opening)
        assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the peer
        w.close()
    writer.close()


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_malformed_frames_are_ignored_with_a_log_line(tmp_path: Path, kind: str) -> None:
    async def main() -> None:
        async with group(tmp_path, transport_kind=kind) as g:
            leader = await g.leader()
            target = g.peers["a"]
            stats = target.transport_stats
            assert stats is not None
            with structlog.testing.capture_logs() as logs:
                if kind == "zmq":
                    await _send_garbage_over_zmq(g.addresses["a"])
                else:
                    await _send_garbage_over_tcp(g.addresses["a"])
                await eventually(
                    lambda: stats.malformed >= (5 if kind == "zmq" else 9), what="frames rejected"
                )
            assert any(e["event"] == "raft.transport.malformed_frame" for e in logs)
            assert target.status().running
            assert await leader.propose(b"still-fine") > 0

    run(main())


@pytest.mark.parametrize("kind", TRANSPORT_KINDS)
def test_transport_drops_and_counts_instead_of_blocking_when_a_peer_is_down(kind: str) -> None:
    async def main() -> None:
        t = open_transport(kind, "a", "tcp://127.0.0.1:0", lambda _msgs: None)
        await t.start()
        try:
            t.set_peer("b", free_address())  # nothing listens there
            await asyncio.sleep(0.05)
            started = time.monotonic()
            for i in range(10_000):
                t.send(Message(MessageType.HEARTBEAT, "b", "a", 1, commit=i))
            assert time.monotonic() - started < 2.0
            assert t.stats.dropped_full == 10_000 and t.stats.sent == 0
            t.remove_peer("b")
            assert not t.send(Message(MessageType.HEARTBEAT, "b", "a", 1))
            assert t.stats.dropped_unknown_peer == 1
        finally:
            t.close()
            await asyncio.sleep(0)  # let cancelled connection tasks finish

    run(main())


def test_tcp_transport_delivers_in_order_and_reaches_a_restarted_peer_again() -> None:
    async def main() -> None:
        got: list[int] = []
        a = open_transport("tcp", "a", "tcp://127.0.0.1:0", lambda _msgs: None)
        b = open_transport("tcp", "b", "tcp://127.0.0.1:0", lambda msgs: got.extend(m.commit for m in msgs))
        await a.start()
        address = await b.start()
        try:
            a.set_peer("b", address)
            await eventually(
                lambda: a.send(Message(MessageType.HEARTBEAT, "b", "a", 1, commit=0)), what="link"
            )
            for i in range(1, 2001):
                assert a.send(Message(MessageType.HEARTBEAT, "b", "a", 1, commit=i))
            await eventually(lambda: len(got) == 2001, what="all delivered")
            assert got == list(range(2001))
            b.close()
            await eventually(
                lambda: not a.send(Message(MessageType.HEARTBEAT, "b", "a", 1)), what="link down"
            )
            got.clear()
            b = open_transport("tcp", "b", address, lambda msgs: got.extend(m.commit for m in msgs))
            await b.start()
            await eventually(
                lambda: a.send(Message(MessageType.HEARTBEAT, "b", "a", 1, commit=7)) and bool(got),
                what="reconnected",
            )
            assert a.stats.malformed == b.stats.malformed == 0
        finally:
            a.close()
            b.close()
            await asyncio.sleep(0)

    run(main())


# ------------------------------------------------------------------------- separate OS processes


async def propose_retrying(peer: RaftPeer, data: bytes) -> int | str:
    """What an at-least-once client does: retry until applied (an election may drop or strand it).

    A proposal forwarded to a leader that is deposed before replicating it cannot be reported as
    dropped by anyone (it may still commit from another copy), so it times out; retrying may then
    apply it twice, which the test allows for.
    """
    deadline = time.monotonic() + 15
    while True:
        try:
            return await peer.propose(data, timeout=2)
        except (ProposalDropped, ProposalTimeout) as exc:
            if time.monotonic() > deadline:
                return repr(exc)
            await asyncio.sleep(0.05)
        except Exception as exc:
            return repr(exc)


def _process_node(nid: str, addresses: dict[str, str], data_dir: str, conn: Any) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

    async def main() -> None:
        cfg = PeerConfig(
            nid,
            addresses[nid],
            data_dir,
            peers={k: v for k, v in addresses.items() if k != nid},
            bootstrap_voters=tuple(sorted(addresses)),
            tick_interval=0.02,  # the default: spawned processes on a busy machine stall now and then
        )
        applied: list[bytes] = []
        peer = RaftPeer(cfg, on_apply=lambda e: applied.append(e.data))
        await peer.start()
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Any] = asyncio.Queue()

        def on_command() -> None:
            try:
                inbox.put_nowait(conn.recv())
            except (EOFError, OSError):  # the parent died: stop rather than spin on a dead pipe
                loop.remove_reader(conn.fileno())
                inbox.put_nowait(("stop",))

        loop.add_reader(conn.fileno(), on_command)
        try:
            while True:
                cmd, *args = await inbox.get()
                if cmd == "status":
                    st = peer.status()
                    conn.send((st.leader, int(st.role), list(applied)))
                elif cmd == "propose":
                    conn.send(await propose_retrying(peer, args[0]))
                elif cmd == "stop":
                    break
        finally:
            loop.remove_reader(conn.fileno())
            await peer.stop()

    uvloop.run(main())


class ProcessGroup:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.addresses = {n: free_address() for n in ("p1", "p2", "p3")}
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, Any] = {}
        self.conns: dict[str, Any] = {}

    def start(self, nid: str) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_process_node, args=(nid, self.addresses, str(self.tmp / nid), child), daemon=True
        )
        proc.start()
        self.procs[nid], self.conns[nid] = proc, parent

    def call(self, nid: str, *cmd: Any, timeout: float = 20) -> Any:
        self.conns[nid].send(cmd)
        if not self.conns[nid].poll(timeout):
            raise TimeoutError(f"{nid}: no answer to {cmd[0]}")
        return self.conns[nid].recv()

    def kill(self, nid: str) -> None:
        proc = self.procs.pop(nid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        self.conns.pop(nid).close()

    def leader(self, among: list[str], timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            views = {n: self.call(n, "status") for n in among}
            leaders = {v[0] for v in views.values()}
            if len(leaders) == 1 and None not in leaders:
                (lead,) = leaders
                if lead in views and views[lead][1] == int(Role.LEADER):
                    return lead
            time.sleep(0.02)
        raise AssertionError("no leader among separate processes")

    def close(self) -> None:
        for nid in list(self.procs):
            with contextlib.suppress(Exception):
                self.conns[nid].send(("stop",))
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)


def test_separate_processes_survive_sigkill_of_the_leader(tmp_path: Path) -> None:
    pg = ProcessGroup(tmp_path)
    try:
        for nid in pg.addresses:
            pg.start(nid)
        leader = pg.leader(list(pg.addresses))
        assert isinstance(r := pg.call(leader, "propose", b"one"), int), r
        follower = next(n for n in pg.addresses if n != leader)
        assert isinstance(r := pg.call(follower, "propose", b"two"), int), r

        pg.kill(leader)
        survivors = [n for n in pg.addresses if n != leader]
        new_leader = pg.leader(survivors)
        assert new_leader != leader
        assert isinstance(r := pg.call(survivors[0], "propose", b"three"), int), r

        pg.start(leader)  # comes back from its directory and catches up
        deadline = time.monotonic() + 20
        while True:
            restarted, survivor = pg.call(leader, "status")[2], pg.call(survivors[0], "status")[2]
            if restarted == survivor and {b"one", b"two", b"three"} <= set(restarted):
                break
            assert time.monotonic() < deadline, (restarted, survivor)
            time.sleep(0.05)
        assert restarted[0] == b"one"
    finally:
        pg.close()


def test_raft_config_is_passed_to_the_core(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path, raft=RaftConfig(election_ticks=5)) as g:
            await g.leader()

    run(main())


# lazy commits (notices), a heartbeat every second
LAZY_SLOW_BEATS = RaftConfig(election_ticks=200, heartbeat_ticks=100, eager_commit=False)


async def warmed_up_leader(g: Group) -> RaftPeer:
    """The agreed leader, once a first entry is applied everywhere."""
    leader = await g.leader(timeout=15.0)
    await leader.propose(b"warm-up")
    await eventually(lambda: all(len(kv.log) == 1 for kv in g.kv.values()), what="warm-up applied")
    return leader


def test_followers_apply_a_commit_within_the_notice_delay_not_the_next_heartbeat(tmp_path: Path) -> None:
    """Issue #21: with eager_commit off, followers learned a commit only from the next heartbeat."""

    async def main() -> None:
        # heartbeats every 100 ticks (1 s): only the commit notice can explain an apply within
        # a fraction of that
        async with group(tmp_path, raft=LAZY_SLOW_BEATS, commit_notice_delay=0.001) as g:
            leader = await warmed_up_leader(g)
            await leader.propose(b"state")
            await eventually(lambda: all(len(kv.log) == 2 for kv in g.kv.values()), 0.6, "all applied")

    run(main())


def test_held_commit_notices_wait_for_the_leaders_next_proposal_which_tells_both_commits(
    tmp_path: Path,
) -> None:
    """An executor that leads holds the notice of its LEAD's commit: the DONE it proposes next
    carries it (one append per follower instead of two)."""

    async def main() -> None:
        async with group(tmp_path, raft=LAZY_SLOW_BEATS, commit_notice_delay=0.05) as g:
            leader = await warmed_up_leader(g)
            await leader.propose(b"lead")
            leader.hold_commit_notices(5.0)  # before the 50 ms notice goes out
            await asyncio.sleep(0.3)
            assert sorted(len(kv.log) for kv in g.kv.values()) == [1, 1, 2]  # only the leader applied
            await leader.propose(b"done")  # releases the hold: its append carries "lead"'s commit
            await eventually(lambda: all(len(kv.log) == 3 for kv in g.kv.values()), 0.6, "all applied")

    run(main())


def test_a_hold_on_commit_notices_ends_by_itself(tmp_path: Path) -> None:
    async def main() -> None:
        async with group(tmp_path, raft=LAZY_SLOW_BEATS, commit_notice_delay=0.05) as g:
            leader = await warmed_up_leader(g)
            await leader.propose(b"lead")
            leader.hold_commit_notices(0.3)
            await asyncio.sleep(0.15)
            assert sorted(len(kv.log) for kv in g.kv.values()) == [1, 1, 2]
            await eventually(
                lambda: all(len(kv.log) == 2 for kv in g.kv.values()), 0.6, "told after the hold"
            )

    run(main())
