"""The global scheduler's cluster model and its in-process handlers (sockets replaced by a list)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.session import Session

from services.global_scheduler.cluster_state import (
    RUNNING,
    STOPPING,
    ClusterState,
    KernelRecord,
    ReplicaRecord,
)
from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.service import GlobalScheduler
from shared import messages
from shared.config import load_config
from shared.envelope import Envelope
from shared.jupyter_wire import DELIMITER
from shared.resources import Resources

HOST_CAP = Resources(64_000, 262_144, 4, 160)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self) -> None:
        self.clock = Clock()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.gs = GlobalScheduler(
            load_config(overrides={"scheduler.heartbeat_timeout_s": 5.0, "scheduler.request_timeout_s": 3.0}),
            clock=self.clock,
        )
        self.sent: list[tuple[bytes, Envelope]] = []
        self.gs._server.send = lambda identity, env: self.sent.append((identity, env))  # type: ignore[method-assign]
        self.key = uuid.uuid4().hex
        self.session = Session(key=self.key.encode())

    def close(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.gs._server._sock.close(linger=0)  # an open socket would block the context's term()
        self.gs._ctx.destroy(linger=0)
        self.loop.close()

    def handle(self, identity: bytes, msg_type: str, body: dict[str, Any]) -> Any:
        return self.gs._handle(identity, Envelope(msg_type, body))

    def register(self, *hosts: str) -> None:
        for host in hosts:
            answer = self.handle(
                host.encode(),
                messages.HOST_REGISTER,
                {"host_id": host, "resources": HOST_CAP.to_dict(), "gpu_kind": "virtual"},
            )
            assert answer.type == messages.REPLY

    def add_kernel(self, kernel_id: str = "k", gpus: int = 1) -> KernelRecord:
        kernel = KernelRecord(
            kernel_id,
            self.key,
            "hmac-sha256",
            Resources(gpus=gpus),
            KernelRouter(kernel_id, self.key.encode()),
        )
        kernel.state = RUNNING
        for n, host in enumerate(("h1", "h2", "h3"), start=1):
            kernel.replicas[f"r{n}"] = ReplicaRecord(f"r{n}", host, pid=100 + n, started=True)
        self.gs.state.kernels[kernel_id] = kernel
        return kernel

    def frames(
        self, msg_type: str, content: dict[str, Any], parent: dict[str, Any] | None = None, **kw: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        msg = self.session.msg(msg_type, content, parent=parent, **kw)
        wire = self.session.serialize(msg)
        return msg["header"], wire[wire.index(DELIMITER) + 1 :]

    def elected(self, replica: Any, msg_id: str, gpus: list[int], kernel_id: str = "k") -> None:
        """The replica's host reports it bound ``gpus`` for the cell (``replica.event elected``)."""
        body = {
            "kernel_id": kernel_id,
            "replica_id": replica.replica_id,
            "event": "elected",
            "msg_id": msg_id,
        }
        self.handle(replica.host_id.encode(), messages.REPLICA_EVENT, body | {"detail": {"gpus": gpus}})

    def answer_cell(self, kernel: KernelRecord, header: dict[str, Any], executor: Any) -> None:
        """Every replica's busy, execute_reply and idle for the cell, ``executor`` replying as such."""
        for replica in kernel.replicas.values():
            role = "executor" if replica is executor else "standby"
            for msg_type, content, channel in (
                ("status", {"execution_state": "busy"}, "iopub"),
                ("execute_reply", {"status": "ok", "execution_count": 1}, "shell"),
                ("status", {"execution_state": "idle"}, "iopub"),
            ):
                _, out = self.frames(msg_type, content, parent=header, metadata={"tandem": {"role": role}})
                self.handle(
                    replica.host_id.encode(),
                    messages.JUPYTER_REPLY,
                    {
                        "kernel_id": kernel.kernel_id,
                        "replica_id": replica.replica_id,
                        "channel": channel,
                        "frames": out,
                    },
                )

    def to_gateway(self) -> list[tuple[str, str]]:
        out = []
        for identity, env in self.sent:
            if identity != b"gateway":
                continue
            if env.type == messages.KERNEL_DEAD:
                out.append(("kernel.dead", env.body["reason"]))
                continue
            for channel, frames in messages.jupyter_messages(env.body):
                msg = Session(key=self.key.encode()).deserialize(frames)
                kind = msg["msg_type"]
                if kind == "status":
                    kind = msg["content"]["execution_state"]
                out.append((channel, kind))
        self.sent.clear()
        return out


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    harness.register("h1", "h2", "h3")
    yield harness
    harness.close()


def test_execute_reserves_the_executor_gpus_then_commit_then_release(h: Harness) -> None:
    kernel = h.add_kernel(gpus=2)
    header, frames = h.frames("execute_request", {"code": "x"})
    h.handle(b"gateway", messages.JUPYTER_REQUEST, {"kernel_id": "k", "channel": "shell", "frames": frames})
    to_hosts = {identity: env.body for identity, env in h.sent}
    assert len(to_hosts) == 1  # only the designated executor gets the cell; the others learn it from Raft
    (executor_identity,) = to_hosts
    assert to_hosts[executor_identity]["frames"] is frames
    executor_host = executor_identity.decode()
    assert h.gs.state.hosts[executor_host].committed_gpus == 2
    h.sent.clear()

    executor = next(r for r in kernel.replicas.values() if r.host_id == executor_host)
    msg_id = header["msg_id"]
    h.elected(executor, msg_id, [0, 1])
    ledger = h.gs.state.hosts[executor_host].ledger
    assert ledger.snapshot() == {f"k/{msg_id}": [0, 1]}
    assert ledger.tentative() == {}
    h.answer_cell(kernel, header, executor)
    assert h.to_gateway() == [("iopub", "busy"), ("shell", "execute_reply"), ("iopub", "idle")]
    assert h.gs.state.hosts[executor_host].committed_gpus == 0
    assert kernel.router.last_executor == executor.replica_id

    # the executor's step times come later, batched; a malformed entry is dropped alone
    batch = [{"msg_id": msg_id, "run_ms": 1.5, "replied_ms": 2.0}, {"run_ms": 1.0}]
    h.handle(
        executor_host.encode(),
        messages.REPLICA_EVENT,
        {
            "kernel_id": "k",
            "replica_id": executor.replica_id,
            "event": "cell_timings",
            "msg_id": None,
            "detail": {"cells": batch},
        },
    )
    cell = next(c for c in h.gs.metrics.recent_cells(50) if c["msg_id"] == msg_id)
    assert cell["replica_steps_ms"]["run_ms"] == 1.5


def test_an_elected_event_that_comes_after_the_reply_commits_nothing_and_still_names_the_executor(
    h: Harness,
) -> None:
    """The executor announces itself on its scheduler link and replies on its Jupyter socket; the
    local scheduler reads both, in either order. A late ``elected`` recorded a commit for a cell
    already over: its host looked busy until the next heartbeat (a scale-in passed it over), and
    the cell's record had no executor."""
    kernel = h.add_kernel(gpus=1)
    header, frames = h.frames("execute_request", {"code": "x"})
    h.handle(b"gateway", messages.JUPYTER_REQUEST, {"kernel_id": "k", "channel": "shell", "frames": frames})
    ((executor_identity, _),) = h.sent
    executor_host = executor_identity.decode()
    executor = next(r for r in kernel.replicas.values() if r.host_id == executor_host)
    h.answer_cell(kernel, header, executor)
    assert ("shell", "execute_reply") in h.to_gateway()
    h.elected(executor, header["msg_id"], [0])
    assert h.gs.state.hosts[executor_host].committed_gpus == 0
    assert h.gs.state.hosts[executor_host].ledger.snapshot() == {}
    cell = next(c for c in h.gs.metrics.recent_cells(50) if c["msg_id"] == header["msg_id"])
    assert (cell["executor"], cell["host"]) == (executor.replica_id, executor_host)
    assert kernel.router.last_executor == executor.replica_id


def test_host_silence_kills_its_replicas_and_two_losses_kill_the_kernel(h: Harness) -> None:
    h.add_kernel()
    _, frames = h.frames("execute_request", {"code": "x"})
    h.handle(b"gateway", messages.JUPYTER_REQUEST, {"kernel_id": "k", "channel": "shell", "frames": frames})
    h.sent.clear()
    h.clock.now += 3
    for host in ("h1",):
        h.handle(host.encode(), messages.HOST_HEARTBEAT, {"host_id": host})
    h.clock.now += 3  # h2, h3 silent for 6 s > 5 s
    h.gs._check_hosts()
    assert [x.alive for x in h.gs.state.hosts.values()] == [True, False, False]
    out = h.to_gateway()
    assert out[:4] == [("iopub", "busy"), ("iopub", "error"), ("shell", "execute_reply"), ("iopub", "idle")]
    assert out[-1][0] == "kernel.dead"
    status = h.handle(b"cli", messages.KERNEL_STATUS, {"kernel_id": "k"})
    assert status.body["state"] == "dead" and status.body["alive"] is False
    # a silent host must register again: its heartbeat is refused
    answer = h.handle(b"h2", messages.HOST_HEARTBEAT, {"host_id": "h2"})
    assert answer.type == messages.ERROR and answer.body["code"] == "unknown_host"


def test_one_replica_exit_keeps_the_kernel_alive(h: Harness) -> None:
    h.add_kernel()
    h.handle(
        b"h1",
        messages.REPLICA_EVENT,
        {"kernel_id": "k", "replica_id": "r1", "event": "exited", "detail": {"returncode": -9}},
    )
    status = h.handle(b"cli", messages.KERNEL_STATUS, {"kernel_id": "k"}).body
    assert status["alive"] and status["state"] == "running"
    assert [r["alive"] for r in status["replicas"]] == [False, True, True]
    assert h.to_gateway() == []


def test_deadline_fails_an_unanswered_request(h: Harness) -> None:
    h.add_kernel()
    _, frames = h.frames("execute_request", {"code": "x"})
    h.handle(b"gateway", messages.JUPYTER_REQUEST, {"kernel_id": "k", "channel": "shell", "frames": frames})
    h.sent.clear()
    h.gs._check_deadlines()  # arms
    h.clock.now += 2
    h.gs._check_deadlines()
    assert h.to_gateway() == []
    h.clock.now += 2
    h.gs._check_deadlines()
    assert h.to_gateway() == [
        ("iopub", "busy"),
        ("iopub", "error"),
        ("shell", "execute_reply"),
        ("iopub", "idle"),
    ]


def test_raft_role_events_steer_the_executor_choice(h: Harness) -> None:
    kernel = h.add_kernel()
    h.handle(
        b"h3",
        messages.REPLICA_EVENT,
        {"kernel_id": "k", "replica_id": "r3", "event": "raft_role", "detail": {"role": "LEADER"}},
    )
    assert kernel.replicas["r3"].role == "leader"
    _, frames = h.frames("execute_request", {"code": "x"})
    h.handle(b"gateway", messages.JUPYTER_REQUEST, {"kernel_id": "k", "channel": "shell", "frames": frames})
    assert next(identity for identity, env in h.sent if env.body["frames"] is frames) == b"h3"


def test_register_from_a_wrong_identity_is_refused(h: Harness) -> None:
    answer = h.handle(
        b"evil", messages.HOST_REGISTER, {"host_id": "h1", "resources": {}, "gpu_kind": "virtual"}
    )
    assert answer.type == messages.ERROR


def test_restarted_scheduler_adopts_kernels_from_host_reports(h: Harness) -> None:
    for host, rid in (("h1", "r1"), ("h2", "r2")):
        report = {
            "kernel_id": "adopted",
            "replica_id": rid,
            "pid": 7,
            "raft_address": "tcp://x:1",
            "role": "follower",
            "key": h.key,
            "signature_scheme": "hmac-sha256",
            "resources": {"gpus": 1},
        }
        h.handle(
            host.encode(),
            messages.HOST_REGISTER,
            {"host_id": host, "resources": HOST_CAP.to_dict(), "gpu_kind": "virtual", "replicas": [report]},
        )
    status = h.handle(b"cli", messages.KERNEL_STATUS, {"kernel_id": "adopted"}).body
    assert status["state"] == "running" and status["alive"]
    assert [(r["id"], r["host"]) for r in status["replicas"]] == [("r1", "h1"), ("r2", "h2")]


def test_cluster_status_shape() -> None:
    state = ClusterState()
    state.register_host("h1", HOST_CAP, "virtual", "", 0.0)
    status = state.cluster_status()
    assert status["hosts"][0].keys() >= {"id", "gpus", "committed", "subscribed", "cordoned", "alive"}
    assert status["kernels"] == []


def test_outbound_request_answered_timed_out_or_failed_with_its_peer() -> None:
    from shared.rpc import OutboundRequests, RpcError, RpcTimeout

    class FakeServer:
        def __init__(self) -> None:
            self.sent: list[tuple[bytes, Envelope]] = []

        def send(self, identity: bytes, env: Envelope) -> None:
            self.sent.append((identity, env))

    async def scenario() -> None:
        server = FakeServer()
        out = OutboundRequests(server)  # type: ignore[arg-type]
        task = asyncio.ensure_future(out.request(b"h1", Envelope(messages.REPLICA_STOP, {}), timeout=5))
        await asyncio.sleep(0)
        assert out.on_answer(server.sent[0][1].reply({"returncode": 0}))
        assert (await task).body == {"returncode": 0}
        with pytest.raises(RpcTimeout):
            await out.request(b"h1", Envelope(messages.REPLICA_STOP, {}), timeout=0.01)
        task = asyncio.ensure_future(out.request(b"h2", Envelope(messages.REPLICA_START, {}), timeout=5))
        await asyncio.sleep(0)
        assert out.fail_peer(b"h2", "host h2 silent") == 1
        with pytest.raises(RpcError, match="silent"):
            await task
        assert not out.on_answer(Envelope(messages.REPLY, {}, id="nobody"))

    asyncio.run(scenario())


def test_status_leaves_stopped_kernels_out_unless_all_and_keeps_only_the_latest(h: Harness) -> None:
    h.gs._stopped_kept = 2
    kernels = [h.add_kernel(f"k{n}") for n in range(4)]
    for kernel in kernels[:3]:
        kernel.state = STOPPING  # a shutdown under way, as kernel.shutdown leaves it
        h.gs._mark_stopped(kernel)
    shown = h.handle(b"operator", messages.CLUSTER_STATUS, {}).body["kernels"]
    assert [k["id"] for k in shown] == ["k3"]
    everything = h.handle(b"operator", messages.CLUSTER_STATUS, {"all": True}).body["kernels"]
    assert {k["id"]: k["state"] for k in everything} == {"k1": "stopped", "k2": "stopped", "k3": "running"}


def test_a_hosts_reported_warm_runtimes_make_placement_prefer_it_among_equals() -> None:
    """The live driver of WarmRuntimeScore: a heartbeat's pool re-indexes the host, and the
    scheduler's index (the simulator's class) picks it over an equal host without one."""
    from shared.policies.placement import PlacementRequest

    harness = Harness()
    try:
        harness.register("h1", "h2", "h3", "h4")
        request = PlacementRequest("k", Resources(gpus=1), replicas=3)
        assert harness.gs.state.placement_index().place(request).hosts == ("h1", "h2", "h3")
        pool = {"warm": 1, "starting": 0, "target": 1, "taken": 0, "misses": 0}
        harness.handle(b"h4", messages.HOST_HEARTBEAT, {"host_id": "h4", "pool": pool})
        assert harness.gs.state.hosts["h4"].warm_runtimes == 1
        assert harness.gs.state.placement_index().place(request).hosts == ("h4", "h1", "h2")
        harness.handle(b"h4", messages.HOST_HEARTBEAT, {"host_id": "h4", "pool": pool | {"warm": 0}})
        assert harness.gs.state.placement_index().place(request).hosts == ("h1", "h2", "h3")
    finally:
        harness.close()
