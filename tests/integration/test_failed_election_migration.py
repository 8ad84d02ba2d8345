"""A GPU cell whose election fails although the scheduler designated an executor goes through
migration and runs as a new election round (NotebookOS §3.2.3), instead of the client getting
``NoExecutorAvailable``.

Three one-GPU hosts; kernels B and C hold the GPUs of two of kernel A's hosts with cells that run
until a flag file appears (steered there with cordons, see test_migration.py). A's replica on
the third host, a Raft follower, is stopped (SIGSTOP): the scheduler designates it (its host is
the only free one) and its local scheduler binds the GPU for it, but it never answers. After
``scheduler.candidate_silence_s`` the scheduler asks the other replicas too; they cannot bind on
their busy hosts, so they yield, and for the silent candidate: the election fails. The
cell is held while A's own binding is still on the stopped replica's host; once that replica is
resumed it gives the binding back (the failed round is over for it) and the cell runs there as
round 1. Nothing depends on timing: each step waits for the state that allows the next.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import run, tandem_kernel
from _signals import signal_ours
from test_migration import (
    FAST_HEARTBEAT,
    Notebook,
    cluster_status,
    kernel_view,
    occupy,
    run_counted,
    settle,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def three_hosts(tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path) -> Iterator[ClusterHandle]:
    with running_cluster(
        tmp_path_factory.mktemp("tandem-failed-election"),
        "--hosts", "3", "--gpus-per-host", "1",
        # the scheduler waits candidate_silence_s for the stopped candidate before asking the
        # others; the request deadline must not end the cell first
        "--set", "scheduler.request_timeout_s=60",
        "--set", "scheduler.candidate_silence_s=1.0",  # default 3 s: the stopped candidate's wait
        *FAST_HEARTBEAT,
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle


def test_a_failed_election_of_a_designated_cell_is_migrated_and_runs_once(
    three_hosts: ClusterHandle, tmp_path: Path
) -> None:
    cluster = three_hosts
    with tandem_kernel() as a, tandem_kernel() as b, tandem_kernel() as c:
        books: list[Notebook] = [a, b, c]
        for n, (_km, kc) in enumerate(books):
            settle(cluster)
            assert run(kc, f"value = {n}", timeout=60).status == "ok"
        a_km, a_kc = a
        view = wait_for(
            lambda: (
                (v := kernel_view(cluster, a_km.kernel_id))
                and any(r["role"] == "leader" for r in v["replicas"])
                and v
            ),
            "A's Raft leader known",
        )
        follower = next(r for r in view["replicas"] if r["role"] != "leader")
        stopped_host, pid = follower["host"], int(follower["pid"])
        busy = sorted(r["host"] for r in view["replicas"] if r["host"] != stopped_host)
        settle(cluster)
        others = occupy(cluster, [b, c], busy, tmp_path / "release")
        assert signal_ours(pid, signal.SIGSTOP)
        resumed = False
        try:
            outcome: dict[str, object] = {}

            def cell() -> None:
                outcome["cell"] = run_counted(a_kc, "value += 10\nprint(value)", timeout=120)

            worker = threading.Thread(target=cell, daemon=True)
            worker.start()
            wait_for(
                lambda: kernel_view(cluster, a_km.kernel_id)["held_requests"] >= 1,
                "the cell held after its failed election",
            )
            signal_ours(pid, signal.SIGCONT)
            resumed = True
            worker.join(timeout=120)
            assert "cell" in outcome, "the cell did not finish"
            result, seen = outcome["cell"]  # type: ignore[misc]
            assert result.status == "ok", result.reply["content"]
            assert result.stdout.split() == ["10"]  # ran once, on the namespace it had
            assert seen == {"execute_reply": 1, "busy": 1, "idle": 1}, seen
            assert result.tandem["role"] == "executor"
        finally:
            if not resumed:
                signal_ours(pid, signal.SIGCONT)
            results = [c.release() for c in others]
        assert all(r.status == "ok" for r in results), [r.reply["content"] for r in results]
        report = cluster_status(cluster)
        cells = [c for c in report["cells"] if c["kernel_id"] == a_km.kernel_id]
        assert cells[-1]["immediate"] is False and cells[-1]["executor"] == follower["id"]
