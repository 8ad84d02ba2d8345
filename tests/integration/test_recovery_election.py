"""A cell whose designated executor vanished before it could LEAD still runs, exactly once.

Three real replica processes over real Raft (the harness of test_replica_group.py plays the
schedulers): the cell reaches only the two quiet yielders, as when the designated replica dies just
as the scheduler sends it. After ``election_wait_s`` of silence the first of them binds GPUs on its
host and proposes LEAD itself, then answers the client as the executor.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_replica_group import Cluster

pytestmark = pytest.mark.integration

QUIET_FIELD = "tandem_quiet"  # services.global_scheduler.jupyter_router.QUIET_FIELD


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = Cluster(tmp_path_factory.mktemp("recovery-election"))
    try:
        yield group
    finally:
        group.close()


def shell_reply(group: Cluster, rid: str, msg_id: str, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    with contextlib.suppress(queue.Empty):
        while (remaining := deadline - time.monotonic()) > 0:
            reply = group.clients[rid].get_shell_msg(timeout=remaining)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply
    return None


def test_a_quiet_yielder_runs_the_cell_when_the_designated_replica_stays_silent(replicas: Cluster) -> None:
    replies = replicas.run("base = 1", "r1")
    assert all(r["content"]["status"] == "ok" for r in replies.values())
    msg = replicas.clients["r2"].session.msg(
        "execute_request",
        {"code": "base += 1\nprint(base)", "silent": False, "store_history": True,
         "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
    )  # fmt: skip
    msg_id = msg["header"]["msg_id"]
    for rid in ("r2", "r3"):  # r1 was designated; it never gets the cell
        quiet = copy.deepcopy(msg)
        quiet["header"]["msg_type"] = "yield_request"
        quiet["header"][QUIET_FIELD] = True
        replicas.clients[rid].shell_channel.send(quiet)

    reply = shell_reply(replicas, "r2", msg_id, timeout=30)
    assert reply is not None, "the stand-in never answered"
    assert reply["content"]["status"] == "ok", reply["content"]
    assert reply["metadata"]["tandem"]["role"] == "executor"
    assert reply["parent_header"]["msg_type"] == "execute_request"  # what the client sent
    outputs = replicas.iopub("r2", msg_id)
    assert [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"] == ["2\n"]
    states = [m["content"]["execution_state"] for m in outputs if m["msg_type"] == "status"]
    assert states.count("busy") == 1 and states.count("idle") == 1
    assert ("r2", msg_id) in replicas.scheduler.commits  # it bound GPUs on its host first
    assert shell_reply(replicas, "r3", msg_id, timeout=1.0) is None  # the other stays quiet

    # The designated replica gets the cell late: answered from the log, not run again.
    late = replicas.replies(replicas.send_cell("", "r1", msg=copy.deepcopy(msg), to=("r1",)), to=("r1",))
    assert late["r1"]["metadata"]["tandem"].get("replayed") is True
    check = replicas.run("print(base)", "r3")
    outputs = replicas.iopub("r3", check["r3"]["parent_header"]["msg_id"])
    assert [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"] == ["2\n"]
