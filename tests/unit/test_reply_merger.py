"""The merged stream a client sees must be exactly what one ipykernel sends."""

from __future__ import annotations

from services.global_scheduler.reply_merger import Incoming, Merged, ReplyMerger

TARGETS = {"r1", "r2", "r3"}


def frame(replica: str, kind: str, parent: str = "m1", *, role: str | None = None) -> Incoming:
    """kind: busy | idle | stream | execute_input | reply | input_request | control_reply"""
    tag = [f"{replica}:{kind}".encode()]
    if kind in ("busy", "idle"):
        return Incoming(replica, "iopub", "status", parent, tag, execution_state=kind)
    if kind == "reply":
        return Incoming(replica, "shell", "execute_reply", parent, tag, role=role)
    if kind == "control_reply":
        return Incoming(replica, "control", "shutdown_reply", parent, tag)
    if kind == "input_request":
        return Incoming(replica, "stdin", "input_request", parent, tag)
    return Incoming(replica, "iopub", kind, parent, tag)


def seen(*results: Merged) -> list[str]:
    return [f[1][0].decode() for r in results for f in r.forwards]


def replica_stream(replica: str, role: str) -> list[Incoming]:
    out = [frame(replica, "busy"), frame(replica, "execute_input")]
    if role == "executor":
        out.append(frame(replica, "stream"))
    out += [frame(replica, "reply", role=role), frame(replica, "idle")]
    return out


def test_elected_executor_known_before_output_gives_a_single_kernel_stream() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    results = [m.on_frame(frame("r2", "busy")), m.on_frame(frame("r1", "busy")), m.set_responder("m1", "r1")]
    for replica, role in (("r1", "executor"), ("r3", "standby"), ("r2", "standby")):
        results += [m.on_frame(f) for f in replica_stream(replica, role)[1:]]
    assert seen(*results) == ["r2:busy", "r1:execute_input", "r1:stream", "r1:reply", "r1:idle"]
    assert any(r.finished == ["m1"] for r in results)
    assert not m.is_pending("m1")


def test_frames_before_the_role_is_known_are_held_then_released_in_order() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    results = [
        m.on_frame(f)
        for f in [frame("r3", "busy"), frame("r3", "execute_input"), frame("r1", "execute_input")]
    ]
    assert seen(*results) == ["r3:busy"]
    results.append(m.set_responder("m1", "r3"))
    assert seen(*results) == ["r3:busy", "r3:execute_input"]
    assert seen(m.on_frame(frame("r1", "stream"))) == []


def test_execute_reply_role_executor_names_the_responder_without_an_event() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    results = [m.on_frame(f) for f in replica_stream("r2", "standby")]
    results += [m.on_frame(f) for f in replica_stream("r1", "executor")]
    assert seen(*results) == ["r2:busy", "r1:execute_input", "r1:stream", "r1:reply", "r1:idle"]


def test_failed_election_first_replier_answers() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    results = [m.on_frame(frame("r1", "busy")), m.on_frame(frame("r2", "busy"))]
    results.append(m.on_frame(frame("r2", "reply", role="standby")))
    results.append(m.election_failed("m1"))
    results += [
        m.on_frame(frame("r1", "reply")),
        m.on_frame(frame("r2", "idle")),
        m.on_frame(frame("r1", "idle")),
    ]
    assert seen(*results) == ["r1:busy", "r2:reply", "r2:idle"]
    assert not m.is_pending("m1")


def test_all_targets_replied_without_executor_first_replier_wins() -> None:
    """A msg_id already DONE in the Raft log is answered from the log by every replica."""
    m = ReplyMerger()
    m.open("m1", TARGETS)
    results = []
    for replica in ("r3", "r1", "r2"):
        results += [m.on_frame(frame(replica, "busy")), m.on_frame(frame(replica, "reply", role="standby"))]
    assert seen(*results) == ["r3:busy", "r3:reply"]
    assert seen(m.on_frame(frame("r3", "idle"))) == ["r3:idle"]


def test_single_target_request_forwards_directly() -> None:
    m = ReplyMerger()
    m.open("k1", {"r2"}, responder="r2")
    out = [
        m.on_frame(frame("r2", "busy", "k1")),
        m.on_frame(frame("r2", "reply", "k1")),
        m.on_frame(frame("r2", "idle", "k1")),
    ]
    assert seen(*out) == ["r2:busy", "r2:reply", "r2:idle"]
    assert out[-1].finished == ["k1"]


def test_broadcast_first_reply_wins() -> None:
    m = ReplyMerger()
    m.open("s1", TARGETS, reply_channel="control", first_reply_wins=True)
    out = [
        m.on_frame(frame("r1", "busy", "s1")),
        m.on_frame(frame("r2", "control_reply", "s1")),
        m.on_frame(frame("r1", "control_reply", "s1")),
        m.on_frame(frame("r2", "idle", "s1")),
    ]
    assert seen(*out) == ["r1:busy", "r2:control_reply", "r2:idle"]


def test_unknown_parent_and_foreign_replicas_are_dropped() -> None:
    m = ReplyMerger()
    m.open("m1", {"r1", "r2"})
    assert seen(m.on_frame(frame("r1", "stream", "nope"))) == []
    assert seen(m.on_frame(frame("r9", "busy"))) == []
    assert seen(m.on_frame(Incoming("r1", "iopub", "status", None, [b"x"], execution_state="starting"))) == []
    assert m.dropped == 3


def test_late_output_from_the_responder_of_a_finished_request_still_flows() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    m.set_responder("m1", "r1")
    for f in replica_stream("r1", "executor"):
        m.on_frame(f)
    assert seen(m.on_frame(frame("r1", "stream"))) == ["r1:stream"]
    assert seen(m.on_frame(frame("r2", "stream"))) == []
    assert seen(m.on_frame(frame("r1", "busy"))) == []


def test_stdin_input_request_from_the_executor_reaches_the_client() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    m.set_responder("m1", "r2")
    assert seen(m.on_frame(frame("r2", "input_request"))) == ["r2:input_request"]
    assert seen(m.on_frame(frame("r1", "input_request"))) == []


def test_losing_the_responder_fails_the_request_with_what_was_already_sent() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS, context={"msg_type": "execute_request"})
    m.on_frame(frame("r1", "busy"))
    m.set_responder("m1", "r1")
    _merged, failed = m.replica_lost("r1")
    assert [f.msg_id for f in failed] == ["m1"]
    assert failed[0].busy_sent and not failed[0].reply_sent and not failed[0].idle_sent
    assert failed[0].context == {"msg_type": "execute_request"}
    assert not m.is_pending("m1")


def test_losing_a_standby_lets_the_remaining_repliers_decide() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    m.on_frame(frame("r1", "reply", role="standby"))
    m.on_frame(frame("r2", "reply", role="standby"))
    merged, failed = m.replica_lost("r3")
    assert failed == []
    assert seen(merged) == ["r1:reply"]


def test_losing_every_target_fails() -> None:
    m = ReplyMerger()
    m.open("k", {"r1"}, responder="r1")
    _, failed = m.replica_lost("r1")
    assert [f.msg_id for f in failed] == ["k"]


def test_deadline_only_runs_for_the_head_of_the_serial_queue() -> None:
    m = ReplyMerger()
    m.open("long", TARGETS)
    m.open("queued", TARGETS)
    m.open("ctl", {"r1"}, responder="r1", reply_channel="control", serial=False)
    assert m.expired(0.0, 10) == []  # arms "long" and "ctl"
    m.set_responder("long", "r1")  # progress: a long cell is not a hang
    assert [f.msg_id for f in m.expired(11.0, 10)] == ["ctl"]
    assert m.expired(100.0, 10) == []  # "queued" still waits behind "long"
    for f in replica_stream("r1", "executor")[1:]:
        m.on_frame(Incoming(f.replica_id, f.channel, f.msg_type, "long", f.frames, f.execution_state, f.role))
    assert not m.is_pending("long")
    assert m.expired(200.0, 10) == []  # arms "queued" now
    assert [f.msg_id for f in m.expired(210.0, 10)] == ["queued"]


def test_fail_all_returns_every_pending_request() -> None:
    m = ReplyMerger()
    m.open("a", TARGETS)
    m.open("b", {"r1"}, responder="r1")
    assert sorted(f.msg_id for f in m.fail_all()) == ["a", "b"]
    assert m.pending_ids() == []


def test_duplicate_reply_or_idle_from_the_responder_is_not_forwarded_twice() -> None:
    m = ReplyMerger()
    m.open("m1", TARGETS)
    m.set_responder("m1", "r1")
    assert seen(m.on_frame(frame("r1", "reply"))) == ["r1:reply"]
    assert seen(m.on_frame(frame("r1", "reply"))) == []


def test_elected_event_for_a_non_target_is_ignored() -> None:
    m = ReplyMerger()
    m.open("m1", {"r1", "r2"})
    m.set_responder("m1", "r7")
    assert m.responder_of("m1") is None


def test_an_execute_idle_that_overtakes_its_reply_is_forwarded_after_it() -> None:
    m = ReplyMerger()
    m.open("m1", {"r1"}, responder="r1", context={"msg_type": "execute_request"})
    results = [m.on_frame(frame("r1", kind)) for kind in ("busy", "idle")]
    assert seen(*results) == ["r1:busy"]
    last = m.on_frame(frame("r1", "reply", role="executor"))
    assert seen(last) == ["r1:reply", "r1:idle"] and last.finished == ["m1"]


def test_an_idle_without_a_reply_to_wait_for_is_forwarded_at_once() -> None:
    m = ReplyMerger()
    m.open("m1", {"r1"}, responder="r1", context={"msg_type": "comm_msg"})
    assert seen(m.on_frame(frame("r1", "busy")), m.on_frame(frame("r1", "idle"))) == ["r1:busy", "r1:idle"]


def test_a_held_idle_is_not_counted_as_sent_when_the_request_fails() -> None:
    m = ReplyMerger()
    m.open("m1", {"r1"}, responder="r1", context={"msg_type": "execute_request"})
    m.on_frame(frame("r1", "busy"))
    m.on_frame(frame("r1", "idle"))
    _merged, failed = m.replica_lost("r1")
    assert failed[0].busy_sent and not failed[0].reply_sent and not failed[0].idle_sent
