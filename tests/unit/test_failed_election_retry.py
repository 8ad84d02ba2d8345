"""A GPU cell whose executor could not get the GPUs is migrated and sent again as a new election
round (NotebookOS §3.2.3) instead of its NoExecutorAvailable reaching the client: the router's
half (pure), the election round keys, and the scheduler shell's wiring on top of them."""

from __future__ import annotations

import asyncio
from typing import Any

from jupyter_client.session import Session
from structlog.testing import capture_logs

from services.global_scheduler.cluster_state import RUNNING, KernelRecord, ReplicaRecord
from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.service import GlobalScheduler
from shared import messages
from shared.cluster_core.moves import MAX_ELECTION_ROUNDS
from shared.config import load_config
from shared.election_round import ROUND_FIELD, election_key, round_of, split_election_key
from shared.envelope import Envelope
from shared.jupyter_wire import DELIMITER
from shared.policies.executor_choice import ExecutorChoice
from shared.resources import Resources

KEY = b"secret-key"
LIVE = ["r1", "r2", "r3"]


def session() -> Session:
    return Session(key=KEY, signature_scheme="hmac-sha256")


def parse(frames: list[bytes]) -> dict[str, Any]:
    return session().deserialize(frames, content=True)  # raises on a bad signature


def choose(executor: str | None) -> ExecutorChoice:
    return ExecutorChoice(executor, tuple(r for r in LIVE if r != executor), {})


def execute_request(s: Session) -> tuple[str, list[bytes], dict[str, Any]]:
    msg = s.msg("execute_request", {"code": "train()"})
    wire = s.serialize(msg)
    return msg["header"]["msg_id"], wire[wire.index(DELIMITER) + 1 :], msg["header"]


def answer(
    s: Session, parent: dict[str, Any], msg_type: str, content: dict[str, Any], tandem: dict | None = None
) -> list[bytes]:
    """What a replica sends for ``parent`` (the request header it received, echoed back)."""
    metadata = {"tandem": tandem} if tandem is not None else {}
    wire = s.serialize(s.msg(msg_type, content, parent=parent, metadata=metadata))
    return wire[wire.index(DELIMITER) + 1 :]


NO_EXECUTOR = {"status": "error", "ename": "NoExecutorAvailable", "evalue": "", "traceback": []}


async def stop(gs: GlobalScheduler) -> None:
    """The scheduler's background tasks (migration retries) cancelled, its sockets closed."""
    for task in list(gs._tasks):
        task.cancel()
    await asyncio.gather(*gs._tasks, return_exceptions=True)
    gs._ctx.destroy(linger=0)


def test_election_keys_of_later_rounds_map_back_to_the_msg_id_and_round_zero_is_the_msg_id() -> None:
    assert election_key("abc", 0) == "abc" and split_election_key("abc") == ("abc", 0)
    assert split_election_key(election_key("abc_1:2", 2)) == ("abc_1:2", 2)
    assert round_of({ROUND_FIELD: 3}) == 3
    assert round_of({}) == round_of({ROUND_FIELD: "1"}) == round_of({ROUND_FIELD: True}) == 0


def test_a_gpu_cell_without_executor_is_sent_again_as_the_next_round_and_the_client_sees_one_answer() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    router.migrate_without_executor = True
    msg_id, frames, header = execute_request(s)
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    to_client: list[tuple[str, list[bytes]]] = []
    to_client += router.on_replica_message(
        "r2", "iopub", answer(s, header, "status", {"execution_state": "busy"})
    ).forwards
    refused = router.on_replica_message(
        "r2",
        "shell",
        answer(s, header, "execute_reply", NO_EXECUTOR, {"role": "executor", "no_executor": True}),
    )
    assert refused.no_executor == [msg_id] and refused.forwards == []  # held back, not passed on
    assert router.retry(msg_id) == (frames, 1, True)
    assert router.retry(msg_id) is None  # the reply and the election_failed event both report it

    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r3"))
    sent = {replica: parse(f)["header"] for replica, _, f in routed.to_replicas}
    assert {h["msg_id"] for h in sent.values()} == {msg_id}
    assert all(h[ROUND_FIELD] == 1 for h in sent.values())
    assert list(sent) == ["r3"] and sent["r3"]["msg_type"] == "execute_request"
    round_one = sent["r3"]
    # the failed round's idle comes late: dropped; the new round's busy: the client saw one already
    late_idle = answer(s, header, "status", {"execution_state": "idle"})
    assert router.on_replica_message("r2", "iopub", late_idle).forwards == []
    busy = answer(s, round_one, "status", {"execution_state": "busy"})
    assert router.on_replica_message("r3", "iopub", busy).forwards == []
    router.on_elected("r3", msg_id)
    reply = answer(
        s, round_one, "execute_reply", {"status": "ok", "execution_count": 1}, {"role": "executor"}
    )
    idle = answer(s, round_one, "status", {"execution_state": "idle"})
    to_client += router.on_replica_message("r3", "shell", reply).forwards
    done = router.on_replica_message("r3", "iopub", idle)
    to_client += done.forwards
    assert done.finished == [msg_id]
    kinds = [parse(f)["header"]["msg_type"] for _, f in to_client]
    assert kinds == ["status", "execute_reply", "status"]
    assert [parse(f)["content"].get("status") for _, f in to_client][1] == "ok"
    assert all(parse(f)["parent_header"]["msg_id"] == msg_id for _, f in to_client)


def test_a_round_a_client_put_in_its_header_is_not_passed_to_the_replicas() -> None:
    s = session()
    msg = s.msg("execute_request", {"code": "1"})
    msg["header"][ROUND_FIELD] = 5
    wire = s.serialize(msg)
    routed = KernelRouter("k", KEY).route_request(
        "shell", wire[wire.index(DELIMITER) + 1 :], live=LIVE, choose=lambda: choose("r1")
    )
    assert all(ROUND_FIELD not in parse(f)["header"] for _, _, f in routed.to_replicas)


def test_a_cell_that_needs_no_gpus_gets_its_no_executor_reply_as_before() -> None:
    s = session()
    router = KernelRouter("k", KEY)  # migrate_without_executor stays False for a 0-GPU kernel
    _msg_id, frames, header = execute_request(s)
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    reply = answer(s, header, "execute_reply", NO_EXECUTOR, {"role": "standby", "no_executor": True})
    merged = router.on_replica_message("r2", "shell", reply)
    assert merged.no_executor == [] and merged.forwards == [("shell", reply)]


def test_a_cell_sent_again_to_a_kernel_that_died_is_failed_without_a_second_busy() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    router.migrate_without_executor = True
    msg_id, frames, header = execute_request(s)
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    router.on_replica_message("r2", "iopub", answer(s, header, "status", {"execution_state": "busy"}))
    assert router.retry(msg_id) is not None
    router.dead_reason = "2 of 3 replicas died"
    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r3"))
    kinds = [parse(f)["header"]["msg_type"] for _, f in routed.to_client]
    assert kinds == ["error", "execute_reply", "status"]  # the error, its reply and idle; no busy


# ---- the scheduler shell on top (no sockets: what it would send is collected) ---------------


def scheduler_with_gpu_kernel(gpus: int) -> tuple[GlobalScheduler, KernelRecord, list[Envelope]]:
    gs = GlobalScheduler(load_config())
    sent: list[Envelope] = []
    gs._server.send = lambda identity, env: sent.append(env)  # type: ignore[method-assign]
    kernel = KernelRecord("k", KEY.decode(), "hmac-sha256", Resources(gpus=gpus), KernelRouter("k", KEY))
    kernel.router.migrate_without_executor = gpus > 0
    kernel.state = RUNNING
    for n, replica_id in enumerate(LIVE):
        kernel.replicas[replica_id] = ReplicaRecord(replica_id, f"host-{n}", started=True)
    gs.state.kernels["k"] = kernel
    return gs, kernel, sent


def failed_election(gs: GlobalScheduler, msg_id: str, replica_id: str = "r2") -> list[dict[str, Any]]:
    body = {"kernel_id": "k", "replica_id": replica_id, "event": "election_failed", "msg_id": msg_id}
    with capture_logs() as logs:
        gs._on_replica_event(b"host-1", Envelope(messages.REPLICA_EVENT, body))
    return logs


def test_a_failed_election_of_a_gpu_cell_holds_it_for_migration_and_says_nothing_to_the_client() -> None:
    async def scenario() -> None:
        gs, kernel, sent = scheduler_with_gpu_kernel(gpus=1)
        msg_id, frames, _ = execute_request(session())
        kernel.router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
        logs = failed_election(gs, msg_id)
        assert kernel.held == [frames] and kernel.router.round_of(msg_id) == 1
        assert [e for e in sent if e.type == messages.JUPYTER_REPLY] == []
        assert "cell_without_executor" in [entry["event"] for entry in logs]
        logs = failed_election(gs, msg_id, "r3")  # another replica's report of the same round: no-op
        assert [entry["event"] for entry in logs] == ["earlier_round_event_ignored"]
        assert kernel.held == [frames] and kernel.router.round_of(msg_id) == 1
        await stop(gs)

    asyncio.run(scenario())


def test_a_cell_whose_elections_keep_failing_is_answered_with_one_clear_error() -> None:
    async def scenario() -> None:
        gs, kernel, sent = scheduler_with_gpu_kernel(gpus=1)
        msg_id, frames, _ = execute_request(session())
        for round_ in range(MAX_ELECTION_ROUNDS + 1):
            kernel.held = None
            kernel.router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
            failed_election(gs, election_key(msg_id, round_))
        await asyncio.sleep(0)  # the gateway outbox sends a loop turn's forwards at the turn's end
        replies = [
            frames
            for e in sent
            if e.type == messages.JUPYTER_REPLY
            for _, frames in messages.jupyter_messages(e.body)
        ]
        kinds = [parse(f)["header"]["msg_type"] for f in replies]
        assert kinds == ["status", "error", "execute_reply", "status"]
        evalue = parse(replies[2])["content"]["evalue"]
        assert f"{MAX_ELECTION_ROUNDS + 1} elections failed" in evalue
        await stop(gs)

    asyncio.run(scenario())


def test_a_failed_election_of_a_cell_without_gpus_is_answered_as_before() -> None:
    gs, kernel, _sent = scheduler_with_gpu_kernel(gpus=0)
    msg_id, frames, _ = execute_request(session())
    kernel.router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    failed_election(gs, msg_id)
    assert kernel.held is None and kernel.router.round_of(msg_id) == 0
    gs._ctx.destroy(linger=0)
