"""Routing decisions and the messages the scheduler signs itself, checked with jupyter_client."""

from __future__ import annotations

from jupyter_client.session import Session

from services.global_scheduler.jupyter_router import KernelRouter, reply_type_of
from shared.election_round import OUTCOME_FIELD
from shared.jupyter_wire import DELIMITER
from shared.policies.executor_choice import ExecutorChoice

KEY = b"secret-key"
LIVE = ["r1", "r2", "r3"]


def session() -> Session:
    return Session(key=KEY, signature_scheme="hmac-sha256")


def client_frames(s: Session, msg_type: str, content: dict | None = None) -> tuple[str, list[bytes]]:
    msg = s.msg(msg_type, content or {})
    wire = s.serialize(msg)
    return msg["header"]["msg_id"], wire[wire.index(DELIMITER) + 1 :]


def parse(_s: Session, frames: list[bytes]) -> dict:
    """Each replica has its own session; a fresh one avoids its duplicate-signature guard."""
    return session().deserialize(frames, content=True)  # raises on a bad signature


def choose(executor: str | None) -> ExecutorChoice:
    return ExecutorChoice(executor, tuple(r for r in LIVE if r != executor), {})


def reply_frames(
    s: Session, msg_type: str, parent_id: str, content: dict, metadata: dict | None = None
) -> list[bytes]:
    msg = s.msg(msg_type, content, parent={"msg_id": parent_id, "msg_type": "x"}, metadata=metadata or {})
    wire = s.serialize(msg)
    return wire[wire.index(DELIMITER) + 1 :]


def test_execute_goes_to_the_designated_executor_alone_and_only_it_answers() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x = 1"})
    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    assert routed.executor == "r2"
    assert routed.to_replicas == [("r2", "shell", frames)]  # the others learn the cell from Raft
    # a replica that answers anyway (an older one) is ignored; the executor's replies decide
    busy = reply_frames(s, "status", msg_id, {"execution_state": "busy"})
    assert router.on_replica_message("r1", "iopub", busy).forwards == []
    assert router.on_replica_message("r2", "iopub", busy).forwards == [("iopub", busy)]
    # answered from the log as a standby (a retry of a cell another replica ran): still the answer
    reply = reply_frames(
        s, "execute_reply", msg_id, {"status": "ok", "execution_count": 3}, {"tandem": {"role": "standby"}}
    )
    idle = reply_frames(s, "status", msg_id, {"execution_state": "idle"})
    assert router.on_replica_message("r2", "shell", reply).forwards == [("shell", reply)]
    assert router.on_replica_message("r2", "iopub", idle).finished == [msg_id]


def test_without_a_designated_executor_every_replica_gets_a_signed_yield_request() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x = 1"})
    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose(None))
    by_replica = {r: f for r, _, f in routed.to_replicas}
    for yielder in LIVE:
        msg = parse(s, by_replica[yielder])
        assert msg["header"]["msg_type"] == "yield_request"
        assert msg["header"]["msg_id"] == msg_id
        assert msg["content"]["code"] == "x = 1"


def test_a_cell_whose_designated_executor_died_before_starting_it_is_sent_again_once() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x = 1"})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"))
    busy = reply_frames(s, "status", msg_id, {"execution_state": "busy"})
    assert router.on_replica_message("r1", "iopub", busy).forwards == [("iopub", busy)]
    forwards, done, resend, ask = router.on_replica_lost("r1", "replica r1 exited (-9)", ["r2", "r3"])
    assert forwards == [] and done == [] and ask == []  # the client sees nothing yet: not lost
    assert resend == [(msg_id, frames)]
    routed = router.route_request("shell", frames, live=["r2", "r3"], choose=lambda: choose("r2"))
    ((target, _, sent),) = routed.to_replicas
    assert target == "r2" and parse(s, sent)["header"]["msg_id"] == msg_id
    # the dead candidate's late output is dropped; the new one's busy is not sent twice
    assert router.on_replica_message("r1", "iopub", busy).forwards == []
    answers = [
        (channel, reply_frames(s, kind, msg_id, content, {"tandem": {"role": "executor"}}))
        for channel, kind, content in (
            ("iopub", "status", {"execution_state": "busy"}),
            ("shell", "execute_reply", {"status": "ok", "execution_count": 1}),
            ("iopub", "status", {"execution_state": "idle"}),
        )
    ]
    for _, frames_ in answers:  # answers to the resent request carry its header (round field 0)
        frames_[2] = sent[1]
        frames_[0] = s.sign(frames_[1:5])
    forwarded = [f for ch, a in answers for _, f in router.on_replica_message("r2", ch, a).forwards]
    assert [parse(s, f)["header"]["msg_type"] for f in forwarded] == ["execute_reply", "status"]


def test_a_silent_designated_candidate_gets_the_others_asked_once() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x = 1"})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    assert router.ask_the_others(0.0, 3.0, LIVE) == []  # the clock starts: it could answer now
    assert router.ask_the_others(2.9, 3.0, LIVE) == []
    asked = router.ask_the_others(3.0, 3.0, LIVE)
    assert [r for r, _, _ in asked] == ["r1", "r3"]
    header = parse(s, asked[0][2])["header"]
    assert header["msg_type"] == "yield_request" and header["msg_id"] == msg_id
    assert header["tandem_silent_candidate"] == "r2"
    assert router.ask_the_others(10.0, 3.0, LIVE) == []  # once
    # a stand-in that leads answers for the kernel
    reply = reply_frames(
        s, "execute_reply", msg_id, {"status": "ok", "execution_count": 1}, {"tandem": {"role": "executor"}}
    )
    assert router.on_replica_message("r1", "shell", reply).forwards == [("shell", reply)]


def test_a_candidate_that_answered_is_not_silent() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "import time; time.sleep(60)"})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r2"))
    router.ask_the_others(0.0, 3.0, LIVE)
    busy = reply_frames(s, "status", msg_id, {"execution_state": "busy"})
    router.on_replica_message("r2", "iopub", busy)
    assert router.ask_the_others(60.0, 3.0, LIVE) == []


def test_all_yield_when_no_executor() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    _, frames = client_frames(s, "execute_request", {"code": "1"})
    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose(None))
    assert {parse(s, f)["header"]["msg_type"] for _, _, f in routed.to_replicas} == {"yield_request"}


def test_non_execute_requests_go_to_one_replica_and_pass_through() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "kernel_info_request")
    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"), single="r3")
    assert routed.to_replicas == [("r3", "shell", frames)]
    assert router.merger.responder_of(msg_id) == "r3"


def debug(s: Session, router: KernelRouter, command: str, single: str, live: list[str] = LIVE) -> str:
    """The replica one ``debug_request`` goes to."""
    _, frames = client_frames(s, "debug_request", {"type": "request", "seq": 1, "command": command})
    routed = router.route_request("control", frames, live=live, choose=lambda: choose("r1"), single=single)
    [(target, channel, _)] = routed.to_replicas
    assert channel == "control"
    return target


def test_a_debug_session_keeps_its_replica_until_disconnect() -> None:
    """debugpy's session (breakpoints, stopped threads) lives in one replica: once a front end
    initialized it there, its requests go there even when one-replica requests would go elsewhere,
    and the scheduler prefers that replica as the executor; disconnect ends the session."""
    s = session()
    router = KernelRouter("k", KEY)
    assert debug(s, router, "debugInfo", single="r2") == "r2"  # no session: a front end's probe
    assert router.debug_replica is None
    assert debug(s, router, "initialize", single="r2") == "r2"
    assert router.debug_replica == "r2"
    assert debug(s, router, "setBreakpoints", single="r3") == "r2"
    assert debug(s, router, "disconnect", single="r3") == "r2"
    assert router.debug_replica is None
    assert debug(s, router, "debugInfo", single="r3") == "r3"


def test_a_debug_session_ends_with_its_replica() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    debug(s, router, "initialize", single="r2")
    assert debug(s, router, "debugInfo", single="r3", live=["r1", "r3"]) == "r3"
    assert router.debug_replica is None


def test_a_cell_its_designated_replica_declined_is_withdrawn_to_be_routed_again() -> None:
    """A replica leaving the kernel (the log overruled its namespace) did nothing for the cell:
    the client hears nothing of it, and the scheduler gets the client's frames back."""
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x", "silent": False})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"))
    refusal = {"status": "error", "ename": "ReplicaUnavailable", "evalue": "leaving", "traceback": []}
    declined = reply_frames(
        s, "execute_reply", msg_id, refusal, {"tandem": {"role": "standby", "declined": True}}
    )
    merged = router.on_replica_message("r1", "shell", declined)
    assert merged.forwards == [] and merged.declined == [(msg_id, frames)]
    again = router.route_request("shell", frames, live=["r2", "r3"], choose=lambda: choose("r2"))
    assert [target for target, _, _ in again.to_replicas] == ["r2"]


def test_shutdown_is_broadcast_and_interrupt_goes_to_the_executor() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    _, exec_frames = client_frames(s, "execute_request", {"code": "import time; time.sleep(100)"})
    exec_id = router.route_request("shell", exec_frames, live=LIVE, choose=lambda: choose("r2")).msg_id
    router.on_elected("r2", exec_id)
    _, frames = client_frames(s, "interrupt_request")
    assert [
        r
        for r, _, _ in router.route_request(
            "control", frames, live=LIVE, choose=lambda: choose(None)
        ).to_replicas
    ] == ["r2"]
    _, frames = client_frames(s, "input_reply", {"value": "x"})
    assert [
        r
        for r, _, _ in router.route_request(
            "stdin", frames, live=LIVE, choose=lambda: choose(None)
        ).to_replicas
    ] == ["r2"]
    _, frames = client_frames(s, "shutdown_request", {"restart": False})
    assert [
        r
        for r, _, _ in router.route_request(
            "control", frames, live=LIVE, choose=lambda: choose(None)
        ).to_replicas
    ] == LIVE


def test_replica_messages_are_merged_by_parent_msg_id() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x"})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"))
    busy = reply_frames(s, "status", msg_id, {"execution_state": "busy"})
    assert router.on_replica_message("r1", "iopub", busy).forwards == [("iopub", busy)]
    reply = reply_frames(
        s, "execute_reply", msg_id, {"status": "ok", "execution_count": 7}, {"tandem": {"role": "executor"}}
    )
    idle = reply_frames(s, "status", msg_id, {"execution_state": "idle"})
    assert router.on_replica_message("r1", "shell", reply).forwards == [("shell", reply)]
    merged = router.on_replica_message("r1", "iopub", idle)
    assert merged.finished == [msg_id]
    assert router.execution_count == 7
    assert router.last_executor is None or router.last_executor == "r1"


def test_dead_kernel_answers_at_once_with_signed_error_reply_error_and_idle() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    router.dead_reason = "1 of 3 replicas alive"
    msg_id, frames = client_frames(s, "execute_request", {"code": "x"})
    routed = router.route_request("shell", frames, live=["r1"], choose=lambda: choose("r1"))
    assert routed.to_replicas == []
    msgs = [(ch, parse(s, f)) for ch, f in routed.to_client]
    assert [(ch, m["header"]["msg_type"]) for ch, m in msgs] == [
        ("iopub", "status"),
        ("iopub", "error"),
        ("shell", "execute_reply"),
        ("iopub", "status"),
    ]
    assert all(m["parent_header"]["msg_id"] == msg_id for _, m in msgs)
    assert msgs[2][1]["content"]["status"] == "error"
    assert msgs[2][1]["content"]["ename"] == "KernelDead"
    assert msgs[3][1]["content"]["execution_state"] == "idle"


def cell_started_on_r1() -> tuple[Session, KernelRouter, str]:
    """A cell ``x`` the scheduler designated r1 for, which took its GPUs and sent busy."""
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "execute_request", {"code": "x"})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"))
    router.on_replica_message("r1", "iopub", reply_frames(s, "status", msg_id, {"execution_state": "busy"}))
    router.on_elected("r1", msg_id)
    return s, router, msg_id


def test_losing_the_executor_mid_cell_asks_the_survivors_for_its_outcome_from_the_log() -> None:
    s, router, msg_id = cell_started_on_r1()
    forwards, done, resend, ask = router.on_replica_lost("r1", "replica r1 exited (-9)", ["r2", "r3"])
    assert forwards == [] and done == [] and resend == []  # it had started the cell: never run again
    assert sorted(r for r, _, _ in ask) == ["r2", "r3"]
    asked = parse(s, ask[0][2])
    assert asked["header"]["msg_type"] == "yield_request" and asked["header"]["msg_id"] == msg_id
    assert asked["header"][OUTCOME_FIELD] == "r1" and asked["content"]["code"] == "x"
    # the first survivor to answer (from the log) is the answer; busy was already sent
    answers = {
        r: [
            ("iopub", reply_frames(s, "status", msg_id, {"execution_state": "busy"})),
            ("shell", reply_frames(s, "execute_reply", msg_id, {"status": "error", "ename": "ExecutorLost",
                                                                "execution_count": 1},
                                   {"tandem": {"role": "standby"}})),
            ("iopub", reply_frames(s, "status", msg_id, {"execution_state": "idle"})),
        ]
        for r in ("r3", "r2")
    }  # fmt: skip
    forwarded = [f for ch, a in answers["r3"] for f in router.on_replica_message("r3", ch, a).forwards]
    assert [f for _, f in forwarded] == [answers["r3"][1][1], answers["r3"][2][1]]
    assert [f for ch, a in answers["r2"] for f in router.on_replica_message("r2", ch, a).forwards] == []
    assert not router.merger.is_pending(msg_id)


def test_losing_the_executor_without_a_quorum_left_fails_only_what_is_missing() -> None:
    s, router, msg_id = cell_started_on_r1()
    forwards, done, resend, ask = router.on_replica_lost("r1", "replica r1 exited (-9)", ["r2"])
    assert done == [msg_id] and resend == [] and ask == []  # one survivor cannot commit an outcome
    assert [parse(s, f)["header"]["msg_type"] for _, f in forwards] == ["error", "execute_reply", "status"]
    reply = parse(s, forwards[1][1])
    assert (
        reply["content"]["ename"] == "ReplicaLost"
        and "may still have been kept" in reply["content"]["evalue"]
    )


def test_a_client_cannot_set_the_outcome_field_itself() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg = s.msg("execute_request", {"code": "x"})
    msg["header"][OUTCOME_FIELD] = "r2"
    wire = s.serialize(msg)
    frames = wire[wire.index(DELIMITER) + 1 :]
    routed = router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"))
    ((_, _, sent),) = routed.to_replicas
    assert OUTCOME_FIELD not in parse(s, sent)["header"]
    router.on_elected("r1", msg["header"]["msg_id"])
    _forwards, _done, _resend, ask = router.on_replica_lost("r1", "replica r1 exited (-9)", ["r2", "r3"])
    assert all(parse(s, f)["header"][OUTCOME_FIELD] == "r1" for _, _, f in ask)


def test_timeout_synthesizes_a_reply_of_the_right_type() -> None:
    s = session()
    router = KernelRouter("k", KEY)
    msg_id, frames = client_frames(s, "complete_request", {"code": "x.", "cursor_pos": 2})
    router.route_request("shell", frames, live=LIVE, choose=lambda: choose("r1"))
    assert router.expire(0.0, 5.0) == ([], [])
    forwards, done = router.expire(6.0, 5.0)
    assert done == [msg_id]
    types = [(ch, parse(s, f)["header"]["msg_type"]) for ch, f in forwards]
    assert types == [("iopub", "status"), ("shell", "complete_reply"), ("iopub", "status")]


def test_bad_header_is_dropped_with_a_reason() -> None:
    router = KernelRouter("k", KEY)
    routed = router.route_request(
        "shell", [b"", b"not json", b"{}", b"{}", b"{}"], live=LIVE, choose=lambda: choose("r1")
    )
    assert routed.problem and routed.to_replicas == []


def test_reply_type_of() -> None:
    assert reply_type_of("execute_request") == "execute_reply"
    assert reply_type_of("comm_info_request") == "comm_info_reply"


def test_fast_header_reads_agree_with_json_and_fall_back() -> None:
    from services.global_scheduler.jupyter_router import header_msg_type, parent_msg_id

    s = session()
    msg = s.msg("status", {"execution_state": "busy"}, parent=s.msg("execute_request", {})["header"])
    wire = s.serialize(msg)
    frames = wire[wire.index(DELIMITER) + 1 :]
    assert header_msg_type(frames[1]) == "status"
    assert parent_msg_id(frames[2]) == msg["parent_header"]["msg_id"]
    assert header_msg_type(b'{"msg_id":"a","msg_type":"stream"}') == "stream"  # compact JSON
    assert parent_msg_id(b'{"msg_id":"p1"}') == "p1"
    assert parent_msg_id(b'{"msg_id": "we\\"ird"}') == 'we"ird'  # escaped quote: parsed properly
    assert parent_msg_id(b"{}") is None
    assert header_msg_type(b'{"msg_id": "x"}') == ""
