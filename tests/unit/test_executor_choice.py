"""At most one executor candidate; prefer hosts that can bind now, then the last executor, then the leader."""

from __future__ import annotations

from shared.policies.executor_choice import HostLedgerView, ReplicaView, choose_executor

REPLICAS = [ReplicaView("r1", "a"), ReplicaView("r2", "b"), ReplicaView("r3", "c")]


def hosts(**idle: int) -> dict[str, HostLedgerView]:
    return {h: HostLedgerView(h, n) for h, n in idle.items()}


def test_one_executor_and_the_rest_yield() -> None:
    choice = choose_executor(REPLICAS, hosts(a=8, b=8, c=8), gpus=1)
    assert choice.executor == "r1"
    assert choice.yielders == ("r2", "r3")


def test_prefers_the_raft_leader_among_hosts_that_can_bind() -> None:
    replicas = [
        ReplicaView("r1", "a", raft_role="follower"),
        ReplicaView("r2", "b", raft_role="leader"),
        ReplicaView("r3", "c"),
    ]
    assert choose_executor(replicas, hosts(a=8, b=8, c=8), gpus=1).executor == "r2"


def test_leader_without_free_gpus_is_passed_over() -> None:
    replicas = [ReplicaView("r1", "a"), ReplicaView("r2", "b", raft_role="leader"), ReplicaView("r3", "c")]
    choice = choose_executor(replicas, hosts(a=0, b=1, c=4), gpus=2)
    assert choice.executor == "r3"
    assert "needs 2 GPUs, 0 idle" in choice.reasons["r1"]


def test_last_executor_breaks_ties_when_no_leader_is_known() -> None:
    assert choose_executor(REPLICAS, hosts(a=8, b=8, c=8), gpus=1, last_executor="r3").executor == "r3"


def test_the_last_executor_keeps_the_cells_when_leadership_moves() -> None:
    """Its namespace and imports are warm; the new leader would first load them (a torch
    notebook's second cell waited ~1 s when leadership settled after its first cell ran)."""
    replicas = [ReplicaView("r1", "a", raft_role="leader"), ReplicaView("r2", "b"), ReplicaView("r3", "c")]
    assert choose_executor(replicas, hosts(a=8, b=8, c=8), gpus=1, last_executor="r3").executor == "r3"


def test_the_leader_runs_the_cell_when_the_last_executor_cannot() -> None:
    replicas = [ReplicaView("r1", "a", raft_role="leader"), ReplicaView("r2", "b"), ReplicaView("r3", "c")]
    assert choose_executor(replicas, hosts(a=8, b=8, c=0), gpus=1, last_executor="r3").executor == "r1"


def test_cordoned_and_dead_hosts_yield() -> None:
    views = {
        "a": HostLedgerView("a", 8, cordoned=True),
        "b": HostLedgerView("b", 8, alive=False),
        "c": HostLedgerView("c", 8),
    }
    choice = choose_executor(REPLICAS, views, gpus=1)
    assert choice.executor == "r3"
    assert choice.reasons["r1"] == "host cordoned"
    assert choice.reasons["r2"] == "host not alive"


def test_no_host_can_bind_means_everyone_yields() -> None:
    choice = choose_executor(REPLICAS, hosts(a=0, b=0, c=0), gpus=1)
    assert choice.executor is None
    assert choice.yielders == ("r1", "r2", "r3")


def test_dead_replicas_get_nothing() -> None:
    replicas = [ReplicaView("r1", "a", alive=False), ReplicaView("r2", "b"), ReplicaView("r3", "c")]
    choice = choose_executor(replicas, hosts(a=8, b=8, c=8), gpus=1)
    assert choice.executor == "r2"
    assert choice.yielders == ("r3",)


def test_zero_gpu_kernel_runs_on_a_fully_committed_host() -> None:
    assert choose_executor(REPLICAS, hosts(a=0, b=0, c=0), gpus=0).executor == "r1"


def test_unknown_host_yields() -> None:
    choice = choose_executor(REPLICAS, hosts(b=8), gpus=1)
    assert choice.executor == "r2"
    assert choice.reasons["r1"] == "host unknown"


def test_a_pinned_replica_beats_the_leader_and_the_last_executor() -> None:
    replicas = [ReplicaView("r1", "a", raft_role="leader"), ReplicaView("r2", "b"), ReplicaView("r3", "c")]
    choice = choose_executor(replicas, hosts(a=8, b=8, c=8), gpus=1, last_executor="r3", pinned="r2")
    assert choice.executor == "r2" and choice.yielders == ("r1", "r3")


def test_a_pinned_replica_whose_host_cannot_run_the_cell_is_passed_over() -> None:
    replicas = [ReplicaView("r1", "a", raft_role="leader"), ReplicaView("r2", "b"), ReplicaView("r3", "c")]
    assert choose_executor(replicas, hosts(a=8, b=0, c=8), gpus=1, pinned="r2").executor == "r1"
    dead = [ReplicaView("r1", "a"), ReplicaView("r2", "b", alive=False), ReplicaView("r3", "c")]
    assert (
        choose_executor(dead, hosts(a=8, b=8, c=8), gpus=0, last_executor="r3", pinned="r2").executor == "r3"
    )
