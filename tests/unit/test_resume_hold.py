"""A request for a hibernated kernel is held by the scheduler while it resumes; a resume that
cannot happen (no host for its replicas) answers the held request with an error reply naming why,
rather than leaving the client waiting, and the kernel stays hibernated for its next request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.session import Session

from services.global_scheduler import service as scheduler_service
from services.global_scheduler.cluster_state import KernelRecord
from services.global_scheduler.jupyter_router import KernelRouter
from shared import messages
from shared.cluster_core.lifecycle import HIBERNATED
from shared.config import load_config
from shared.envelope import Envelope
from shared.jupyter_wire import DELIMITER
from shared.resources import Resources

KEY = b"secret-key"


def test_a_held_request_gets_an_error_when_no_host_can_resume_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scheduler_service, "RESUME_RETRY_S", 0.01)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    gs = scheduler_service.GlobalScheduler(load_config(overrides={"cluster.state_dir": str(tmp_path)}))
    sent: list[Envelope] = []
    gs._server.send = lambda identity, env: sent.append(env)  # type: ignore[method-assign]
    router = KernelRouter("k1", KEY, "hmac-sha256", quorum=2)
    kernel = KernelRecord("k1", KEY.decode(), "hmac-sha256", Resources(gpus=0), router, state=HIBERNATED)
    kernel.image, kernel.generation = {"key": "x"}, 1
    gs.state.kernels["k1"] = kernel
    session = Session(key=KEY, signature_scheme="hmac-sha256")
    wire = session.serialize(session.msg("execute_request", {"code": "x + 1"}))
    frames = wire[wire.index(DELIMITER) + 1 :]
    body: dict[str, Any] = {"kernel_id": "k1", "channel": "shell", "frames": frames}
    try:
        gs._on_jupyter_request(b"gateway", Envelope(messages.JUPYTER_REQUEST, body))
        assert gs._held_for_resume["k1"] and "k1" in gs._resumes  # held, and a resume under way
        loop.run_until_complete(asyncio.wait_for(asyncio.shield(gs._resumes["k1"]), 10))
        replies = [
            session.deserialize(f, content=True)
            for e in sent
            if e.type == messages.JUPYTER_REPLY
            for _channel, f in messages.jupyter_messages(e.body)
        ]
        content = next(m["content"] for m in replies if m["header"]["msg_type"] == "execute_reply")
        assert content["status"] == "error" and content["ename"] == "KernelDead"
        assert "resume failed 3 times" in content["evalue"] and "cannot place" in content["evalue"]
        assert kernel.state == HIBERNATED and "k1" not in gs._held_for_resume
    finally:
        gs._server._sock.close(linger=0)
        gs._ctx.destroy(linger=0)
        loop.close()
