"""The router forwards (and may re-sign) only what the kernel's key signed."""

from __future__ import annotations

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
