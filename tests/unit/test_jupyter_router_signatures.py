"""The router forwards (and may re-sign) only what the kernel's key signed."""

from __future__ import annotations

import json

import pytest

from services.global_scheduler.jupyter_router import KernelRouter, Routed
from shared.election_round import ROUND_FIELD
from shared.jupyter_wire import Signer, json_part
from shared.policies.executor_choice import ExecutorChoice

KEY = b"kernel-key"


def _request(signer: Signer, **extra: object) -> list[bytes]:
    header = {
        "msg_id": "m1",
        "msg_type": "execute_request",
        "session": "s",
        "username": "u",
        "date": "",
        "version": "5.3",
        **extra,
    }
    parts = [json_part(header), b"{}", b"{}", json_part({"code": "1"})]
    return [signer.sign(parts), *parts]


def _route(frames: list[bytes]) -> Routed:
    router = KernelRouter("k1", KEY)
    return router.route_request(
        "shell", frames, live=["r1", "r2", "r3"], choose=lambda: ExecutorChoice("r1", ("r2", "r3"), {})
    )


def test_a_request_signed_with_another_key_is_dropped_with_a_reason() -> None:
    routed = _route(_request(Signer(b"attacker"), **{ROUND_FIELD: 3}))
    assert routed.to_replicas == []
    assert routed.problem is not None and "signature" in routed.problem


def test_an_unsigned_request_is_dropped() -> None:
    frames = _request(Signer(KEY))
    routed = _route([b"", *frames[1:]])
    assert routed.to_replicas == [] and routed.problem is not None


def test_a_request_signed_with_the_kernel_key_is_routed() -> None:
    routed = _route(_request(Signer(KEY)))
    assert routed.problem is None
    assert [r for r, _c, _f in routed.to_replicas] == ["r1"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{}", "lacks the field 'code'"),
        (b"[]", "must be a JSON object"),
        (b"not json", "not JSON"),
        (b'{"code": 7}', "'code' must be str"),
        (b'{"code": "1", "silent": "yes"}', "'silent' must be bool"),
    ],
)
def test_a_signed_request_a_kernel_cannot_answer_gets_an_error_reply_at_once(
    content: bytes, why: str
) -> None:
    signer = Signer(KEY)
    header = {
        "msg_id": "m1",
        "msg_type": "execute_request",
        "session": "s",
        "username": "u",
        "date": "",
        "version": "5.3",
    }
    parts = [json_part(header), b"{}", b"{}", content]
    routed = _route([signer.sign(parts), *parts])
    assert routed.to_replicas == []  # nothing forwarded, nothing reserved
    assert routed.problem is not None and why in routed.problem
    kinds = [(channel, json.loads(frames[1])["msg_type"]) for channel, frames in routed.to_client]
    assert kinds == [("iopub", "status"), ("iopub", "error"), ("shell", "execute_reply"), ("iopub", "status")]
    reply = json.loads(routed.to_client[2][1][4])
    assert reply["status"] == "error" and reply["ename"] == "BadRequest" and why in reply["evalue"]
    assert all(signer.verify(frames[0], frames[1:5]) for _c, frames in routed.to_client)
