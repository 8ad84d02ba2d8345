"""The local scheduler's upstream queue: a cell's busy and execute_input, and its reply and idle,
cross each hop together; nothing is reordered, lost, or held longer than the pair wait."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from services.local_scheduler.upstream_queue import UpstreamQueue
from shared import messages
from shared.envelope import Envelope

WAIT = 0.002
R1, R2 = ("k1", "r1"), ("k2", "r1")


def message(
    msg_type: str, parent: str, *, parent_type: str = "execute_request", content: dict | None = None
) -> list[bytes]:
    return [
        b"sig",
        json.dumps({"msg_id": f"{msg_type}-{parent}", "msg_type": msg_type}).encode(),
        json.dumps({"msg_id": parent, "msg_type": parent_type}).encode(),
        b"{}",
        json.dumps(content or {}).encode(),
    ]


def busy(parent: str, parent_type: str = "execute_request") -> list[bytes]:
    return message("status", parent, parent_type=parent_type, content={"execution_state": "busy"})


def idle(parent: str) -> list[bytes]:
    return message("status", parent, content={"execution_state": "idle"})


def elected() -> Envelope:
    return Envelope(messages.REPLICA_EVENT, {"kernel_id": "k1", "replica_id": "r1", "event": "elected"})


def test_a_cells_busy_waits_for_its_execute_input_and_the_elected_event_goes_between() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "iopub", busy("c1"), now=0.0)
    queue.event(elected())
    assert queue.due() == WAIT and queue.take(0.001) == []
    queue.jupyter(R1, "iopub", message("execute_input", "c1"), now=0.0015)
    assert queue.due() == -math.inf
    out = queue.take(0.0015)
    assert [type(item).__name__ for item in out] == ["tuple", "Envelope", "tuple"]
    assert len(queue) == 0 and queue.due() is None


def test_a_reply_waits_for_its_idle() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "shell", message("execute_reply", "c1"), now=1.0)
    assert queue.take(1.001) == []
    queue.jupyter(R1, "iopub", idle("c1"), now=1.0012)
    assert [channel for _, channel, _ in queue.take(1.0012)] == ["shell", "iopub"]  # type: ignore[misc]


def test_a_hold_ends_after_the_pair_wait_and_nothing_is_lost() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "shell", message("execute_reply", "c1"), now=0.0)
    queue.jupyter(R2, "iopub", message("stream", "c9"), now=0.001)
    assert queue.due() == WAIT
    assert queue.take(WAIT - 1e-6) == []
    assert len(queue.take(WAIT)) == 2
    queue.jupyter(R1, "iopub", idle("c1"), now=0.003)  # too late for its reply: goes alone, at once
    assert queue.due() == -math.inf and len(queue.take(0.003)) == 1


def test_messages_queued_before_a_held_busy_go_at_once() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R2, "iopub", message("stream", "c9"), now=0.0)
    queue.jupyter(R1, "iopub", busy("c1"), now=0.0)
    assert queue.due() == -math.inf
    assert [key for key, _, _ in queue.take(0.0)] == [R2]  # type: ignore[misc]
    assert queue.due() == WAIT


def test_another_replicas_message_does_not_end_a_hold() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "iopub", busy("c1"), now=0.0)
    queue.jupyter(R2, "iopub", message("execute_input", "c1"), now=0.0)
    assert queue.take(0.001) == []


def test_the_busy_of_a_request_other_than_execute_does_not_wait() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "iopub", busy("k", parent_type="kernel_info_request"), now=0.0)
    assert queue.due() == -math.inf


def test_a_reply_whose_idle_came_first_does_not_wait() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "iopub", idle("c1"), now=0.0)
    queue.jupyter(R1, "shell", message("execute_reply", "c1"), now=0.0)
    assert queue.due() == -math.inf


def test_a_zero_wait_never_holds() -> None:
    queue = UpstreamQueue(0.0)
    queue.jupyter(R1, "iopub", busy("c1"), now=0.0)
    queue.jupyter(R1, "shell", message("execute_reply", "c1"), now=0.0)
    assert queue.due() == -math.inf and len(queue.take(0.0)) == 2


def test_a_gone_replica_holds_nothing_back() -> None:
    queue = UpstreamQueue(WAIT)
    queue.jupyter(R1, "shell", message("execute_reply", "c1"), now=0.0)
    queue.forget(R1)
    assert len(queue.take(0.0)) == 1


def test_malformed_frames_pass_through_without_holding() -> None:
    queue = UpstreamQueue(WAIT)
    for frames in (
        [b"sig", b"{not json", b"", b"", b""],
        [b"sig", b'"status"', b"[]", b"{}", b"\xff"],
        [b"x"],
    ):
        queue.jupyter(R1, "iopub", frames, now=0.0)
        queue.jupyter(R1, "shell", [b"sig", b'{"msg_type": "execute_reply"}', b"null", b"", b""], now=0.0)
    assert queue.due() == -math.inf and len(queue.take(0.0)) == 6


arrivals = st.lists(
    st.tuples(
        st.sampled_from([R1, R2]),
        st.sampled_from(["busy", "input", "stream", "reply", "idle", "info_busy", "event"]),
        st.sampled_from(["c1", "c2"]),
        st.floats(min_value=0.0, max_value=0.003),  # time since the previous arrival
        st.floats(min_value=0.0, max_value=0.004),  # when, after it, the shell next takes
    ),
    max_size=30,
)


@given(arrivals)
def test_everything_goes_in_arrival_order_and_no_later_than_the_wait_after_it_came(steps: list) -> None:
    queue = UpstreamQueue(WAIT)
    kinds = {
        "busy": ("iopub", busy),
        "input": ("iopub", lambda p: message("execute_input", p)),
        "stream": ("iopub", lambda p: message("stream", p)),
        "reply": ("shell", lambda p: message("execute_reply", p)),
        "idle": ("iopub", idle),
        "info_busy": ("iopub", lambda p: busy(p, "kernel_info_request")),
    }
    now, sent, arrived_at, taken_at, takes = 0.0, [], {}, {}, []
    for n, (key, kind, parent, gap, take_after) in enumerate(steps):
        now += gap
        if kind == "event":
            queue.event(Envelope(messages.REPLICA_EVENT, {"n": n}))
        else:
            channel, make = kinds[kind]
            frames = [*make(parent), str(n).encode()]
            queue.jupyter(key, channel, frames, now)
        arrived_at[n] = now
        sent.append(n)
        now += take_after  # the shell's next flush
        takes.append(now)
        for out in queue.take(now):
            taken_at[number(out)] = now
    for out in queue.take(math.inf):
        taken_at[number(out)] = math.inf
    assert list(taken_at) == sent  # every one, once, in order
    for n in sent:  # a flush at least WAIT after it came sends it
        first_late_take = min((t for t in takes if t >= arrived_at[n] + WAIT), default=math.inf)
        assert taken_at[n] <= first_late_take


def number(item: object) -> int:
    return item.body["n"] if isinstance(item, Envelope) else int(item[2][-1])  # type: ignore[index]
