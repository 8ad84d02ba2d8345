"""Only the designated executor is sent a cell; the other replicas follow it through the Raft log.

Three real replica processes over real Raft (the harness of test_replica_group.py plays the
schedulers). The global scheduler sends an execute_request to the designated replica alone; the
others learn the cell from its LEAD and DONE (which carries the code for their input history). When
the designated replica dies before it starts a cell, the scheduler sends the cell again to another
replica (``KernelRouter.on_replica_lost``): that one runs it, exactly once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
from test_replica_group import Cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    group = Cluster(tmp_path_factory.mktemp("recovery-election"))
    try:
        yield group
    finally:
        group.close()


def stdout(group: Cluster, rid: str, msg_id: str) -> list[str]:
    return [m["content"]["text"] for m in group.iopub(rid, msg_id) if m["msg_type"] == "stream"]


def test_replicas_not_sent_a_cell_follow_it_through_the_log(replicas: Cluster) -> None:
    first = replicas.run("base = 1", "r1", to=("r1",))["r1"]
    assert first["content"]["status"] == "ok"
    assert first["metadata"]["tandem"]["role"] == "executor"
    # r3 never saw that cell: its namespace, execution count and input history have it anyway
    check = replicas.run("print(base, In[-2])", "r3", to=("r3",))["r3"]
    assert check["content"]["status"] == "ok", check["content"]
    assert check["content"]["execution_count"] == first["content"]["execution_count"] + 1
    assert stdout(replicas, "r3", check["parent_header"]["msg_id"]) == ["1 base = 1\n"]


def test_a_cell_sent_again_after_its_designated_replica_vanished_runs_once(replicas: Cluster) -> None:
    assert replicas.run("base = 1", "r1", to=("r1",))["r1"]["content"]["status"] == "ok"
    # r1 was designated and died before the cell reached it: the scheduler sends it to r2 instead
    msg = replicas.send_cell("base += 1\nprint(base)", "r2", to=("r2",))
    msg_id = msg["header"]["msg_id"]
    reply = replicas.replies(msg, to=("r2",), timeout=30)["r2"]
    assert reply["content"]["status"] == "ok", reply["content"]
    assert reply["metadata"]["tandem"]["role"] == "executor"
    assert stdout(replicas, "r2", msg_id) == ["2\n"]

    # The designated replica gets the cell late after all: answered from the log, not run again.
    late = replicas.replies(replicas.send_cell("", "r1", msg=copy.deepcopy(msg), to=("r1",)), to=("r1",))
    assert late["r1"]["metadata"]["tandem"].get("replayed") is True
    assert late["r1"]["content"]["status"] == "ok"
    check = replicas.run("print(base)", "r3", to=("r3",))
    assert stdout(replicas, "r3", check["r3"]["parent_header"]["msg_id"]) == ["2\n"]
