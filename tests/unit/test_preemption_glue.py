"""The live preemption glue: the ledger's revoke / resume and its one-owner invariant, leases in
the global mirror, FitGpp choosing executor and victims as one decision, and a host revoking a
real job's lease for a cell (pause at a step boundary, resume on its own GPUs afterwards)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.local_scheduler.batch_jobs import BatchJobs
from shared.cluster_core.gpu_ledger import GpuLedger, LedgerError, LedgerInvariantError
from shared.policies.executor_choice import HostLedgerView, ReplicaView, choose_executor
from shared.policies.preemption import DEFAULT_GRACE_PERIOD_S, LeasedJob, gpu_candidate
from tests.unit.test_batch_jobs_host import grant, stat_fields, until

# ---- the ledger ------------------------------------------------------------------------------


def test_revoke_suspends_the_victims_leases_and_commits_their_gpus_to_the_cell_in_one_step() -> None:
    ledger = GpuLedger(range(4))
    ledger.lease("j1", 2, 100.0)
    ledger.lease("j2", 2, 100.0)
    commit, suspended = ledger.revoke("k", "r1", "m1", 2, ["j2"])
    assert commit.device_ids == (2, 3)
    assert [lease.job_id for lease in suspended] == ["j2"]
    assert ledger.leased_snapshot() == {"j1": [0, 1]}
    assert ledger.snapshot() == {"k/m1": [2, 3]}
    assert set(ledger.suspended()) == {"j2"}


def test_revoke_takes_idle_gpus_before_the_victims() -> None:
    ledger = GpuLedger(range(3))
    ledger.lease("j1", 2, 100.0)
    commit, _ = ledger.revoke("k", "r1", "m1", 2, ["j1"])
    assert 2 in commit.device_ids and len(commit.device_ids) == 2
    assert ledger.idle_count == 1


def test_a_revoke_that_cannot_free_enough_changes_nothing() -> None:
    ledger = GpuLedger(range(2))
    ledger.lease("j1", 1, 100.0)
    ledger.commit("other", "r", "m", 1)
    with pytest.raises(LedgerError):
        ledger.revoke("k", "r1", "m1", 2, ["j1"])
    assert ledger.leased_snapshot() == {"j1": [0]} and not ledger.suspended()


def test_a_suspended_lease_resumes_on_its_own_devices_only_once_the_cell_released_them() -> None:
    ledger = GpuLedger(range(2))
    ledger.lease("j1", 2, 100.0)
    ledger.revoke("k", "r1", "m1", 1, ["j1"])
    with pytest.raises(LedgerError):
        ledger.resume_lease("j1", 200.0)  # device 0 still bound to the cell
    ledger.release("k", "r1", "m1")
    assert ledger.resume_lease("j1", 200.0) == (0, 1)
    assert ledger.leases()[0].expires_at == 200.0 and not ledger.suspended()


def test_the_invariant_check_refuses_a_gpu_bound_to_a_cell_and_a_job_at_once() -> None:
    ledger = GpuLedger(range(2))
    ledger.lease("j1", 1, 100.0)
    ledger.commit("k", "r", "m", 1)
    ledger._commits[("k", "r", "m")] = type(ledger.commits()[0])("k", "r", "m", (0,))  # corrupt it
    with pytest.raises(LedgerInvariantError, match="GPU 0"):
        ledger.check_invariant()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["lease", "commit", "revoke", "release", "end", "resume", "mirror"]),
        st.integers(0, 3),
        st.integers(1, 3),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_no_sequence_of_operations_shows_a_gpu_bound_to_a_cell_and_a_job(
    ops: list[tuple[str, int, int]],
) -> None:
    ledger = GpuLedger(range(4))  # every change runs check_invariant: a violation raises here
    mirror = GpuLedger(range(4))
    for op, i, n in ops:
        try:
            if op == "lease":
                ledger.lease(f"j{i}", n, 100.0)
            elif op == "commit":
                ledger.commit("k", f"r{i}", f"m{i}", n)
            elif op == "revoke":
                ledger.revoke("k", f"r{i}", f"m{i}", n, [lease.job_id for lease in ledger.leases()][:2])
            elif op == "release":
                ledger.release_replica("k", f"r{i}")
            elif op == "end":
                ledger.end_lease(f"j{i}")
            elif op == "resume" and f"j{i}" in ledger.suspended():
                ledger.resume_lease(f"j{i}", 100.0)
            elif op == "mirror":
                mirror.mirror(ledger.snapshot(), ledger.leased_snapshot())
                assert mirror.leased_count == ledger.leased_count
                assert mirror.idle_count == ledger.idle_count
        except LedgerError:
            pass
        cells = {d for c in ledger.commits() for d in c.device_ids}
        jobs = {d for lease in ledger.leases() for d in lease.device_ids}
        assert not cells & jobs


def test_the_mirror_counts_reported_leases_as_neither_idle_nor_committed() -> None:
    mirror = GpuLedger(range(4))
    mirror.mirror({"k/m": [0]}, {"j1": [1, 2]})
    assert (mirror.idle_count, mirror.committed_count, mirror.leased_count) == (1, 1, 2)
    mirror.mirror({}, {})
    assert mirror.idle_count == 4


# ---- one decision: executor and victims ---------------------------------------------------------


def test_leased_job_round_trips_the_heartbeat_wire_form() -> None:
    job = LeasedJob("j", (1, 2), 0.25, 1)
    assert LeasedJob.from_wire(job.to_wire()) == job
    assert gpu_candidate("h", 4, 0, [LeasedJob("j", (0,))]).jobs[0].grace_period_s == DEFAULT_GRACE_PERIOD_S


def _views(**leased: tuple[LeasedJob, ...]) -> dict[str, HostLedgerView]:
    return {h: HostLedgerView(h, 0, total_gpus=2, leased=jobs) for h, jobs in leased.items()}


def test_with_idle_gpus_on_a_replica_host_nothing_is_revoked() -> None:
    replicas = [ReplicaView("0", "a", raft_role="leader"), ReplicaView("1", "b")]
    hosts = {
        "a": HostLedgerView("a", 0, total_gpus=2, leased=(LeasedJob("j", (0, 1)),)),
        "b": HostLedgerView("b", 1),
    }
    choice = choose_executor(replicas, hosts, 1)
    assert choice.executor == "1" and choice.victims == ()


def test_all_gpus_leased_fitgpp_picks_the_host_whose_job_releases_fastest() -> None:
    replicas = [ReplicaView("0", "a", raft_role="leader"), ReplicaView("1", "b")]
    hosts = _views(a=(LeasedJob("slow", (0, 1), 30.0),), b=(LeasedJob("fast", (0, 1), 0.1),))
    choice = choose_executor(replicas, hosts, 1)
    assert choice.executor == "1"
    assert [(v.host_id, v.job_id) for v in choice.victims] == [("b", "fast")]
    assert "0" in choice.yielders


def test_a_multi_gpu_cell_revokes_several_jobs_on_one_host() -> None:
    replicas = [ReplicaView("0", "a")]
    hosts = _views(a=(LeasedJob("j1", (0,), 0.1), LeasedJob("j2", (1,), 0.2)))
    choice = choose_executor(replicas, hosts, 2)
    assert choice.executor == "0" and {v.job_id for v in choice.victims} == {"j1", "j2"}


def test_cordoned_hosts_and_hosts_without_leases_give_no_executor() -> None:
    replicas = [ReplicaView("0", "a"), ReplicaView("1", "b")]
    hosts = {
        "a": HostLedgerView("a", 0, cordoned=True, total_gpus=2, leased=(LeasedJob("j", (0, 1)),)),
        "b": HostLedgerView("b", 0, total_gpus=2),
    }
    assert choose_executor(replicas, hosts, 1).executor is None


# ---- a host revokes a real job's lease -------------------------------------------------------------


def stepping_job(tmp_path: Path) -> Path:
    """A job on the job-side API with 20 ms steps."""
    script = tmp_path / "train.py"
    script.write_text(
        "import time, tandem_job\n"
        "with tandem_job.session(total=100000) as job:\n"
        "    for step in job.steps():\n"
        "        time.sleep(0.02)\n"
    )
    return script


def test_a_cell_revokes_a_running_job_which_pauses_at_its_step_and_resumes_after_the_cell(
    tmp_path: Path,
) -> None:
    script = stepping_job(tmp_path)

    async def main() -> None:
        ledger = GpuLedger([0, 1])
        jobs = BatchJobs(ledger, host_id="h0", state_dir=tmp_path / "state", on_exit=lambda: None,
                         stop_grace_s=5.0, overdue_s=30.0, keep_paused_s=0.0, cell_reserve=0, pause_grace_s=2.0)  # fmt: skip
        try:
            await jobs.grant(grant("a.1", [sys.executable, str(script)], tmp_path, gpus=2))
            run = jobs.runs["a.1"]
            await until(lambda: (run.process.progress() or {}).get("iterations_done", 0) > 5)
            expires_before = run.expires_at
            assert expires_before is not None
            commit = jobs.revoke_for_cell("k", "r", "m", 1, victims=["a.1"])
            assert commit.device_ids and not ledger.leases() and ledger.committed_count == 1
            assert run.pausing is not None
            await asyncio.wait_for(run.pausing, 5.0)
            assert (run.process.progress() or {}).get("state") == "paused"
            assert run.grace_period_s is not None and run.grace_period_s < 1.0 and not run.process.frozen
            assert jobs.report()["jobs"][0]["suspended"] is True
            done_paused = run.process.progress()["iterations_done"]
            await asyncio.sleep(0.5)
            assert run.process.progress()["iterations_done"] == done_paused  # nothing runs while paused
            ledger.release("k", "r", "m")
            jobs.cells_released()
            assert ledger.leased_snapshot() == {"a.1": [0, 1]}  # its own devices back
            assert run.expires_at is not None and run.expires_at >= expires_before + 0.4  # clock stopped
            await until(lambda: (run.process.progress() or {}).get("iterations_done", 0) > done_paused + 5)
            assert jobs.leased_jobs()[0].preemptions == 1
        finally:
            await jobs.close()

    asyncio.run(main())


def test_without_leased_jobs_a_host_refuses_a_revocation(tmp_path: Path) -> None:
    async def main() -> None:
        jobs = BatchJobs(GpuLedger([0]), host_id="h0", state_dir=tmp_path, on_exit=lambda: None,
                         stop_grace_s=1.0, overdue_s=30.0, keep_paused_s=0.0, cell_reserve=0)  # fmt: skip
        with pytest.raises(LedgerError):
            jobs.revoke_for_cell("k", "r", "m", 2)
        await jobs.close()

    asyncio.run(main())


def _host(tmp_path: Path, gpus: int = 1) -> tuple[BatchJobs, GpuLedger]:
    ledger = GpuLedger(range(gpus))
    jobs = BatchJobs(ledger, host_id="h0", state_dir=tmp_path / "state", on_exit=lambda: None,
                     stop_grace_s=5.0, overdue_s=30.0, keep_paused_s=0.0, cell_reserve=0, pause_grace_s=1.0)  # fmt: skip
    return jobs, ledger


def test_a_job_without_the_api_is_frozen_for_the_cell_and_thawed_after(tmp_path: Path) -> None:
    async def main() -> None:
        jobs, ledger = _host(tmp_path)
        try:
            await jobs.grant(grant("a.1", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path))
            run = jobs.runs["a.1"]
            pid = run.process.pid
            assert pid is not None
            jobs.revoke_for_cell("k", "r", "m", 1)
            assert run.pausing is not None
            await asyncio.wait_for(run.pausing, 5.0)
            assert run.process.frozen
            await until(lambda: stat_fields(pid)[0] == "T", timeout=5.0)  # the signal lands
            ledger.release("k", "r", "m")
            jobs.cells_released()
            await until(lambda: stat_fields(pid)[0] != "T", timeout=5.0)
            assert ledger.leased_snapshot() == {"a.1": [0]} and not run.process.frozen
        finally:
            await jobs.close()

    asyncio.run(main())


def test_a_job_revoked_again_before_it_ran_a_step_counts_as_paused_without_sigstop(tmp_path: Path) -> None:
    script = stepping_job(tmp_path)

    async def main() -> None:
        jobs, ledger = _host(tmp_path)
        try:
            await jobs.grant(grant("a.1", [sys.executable, str(script)], tmp_path))
            run = jobs.runs["a.1"]
            await until(lambda: (run.process.progress() or {}).get("state") == "running")
            for cell in ("m1", "m2", "m3"):  # back-to-back cells: resumed and revoked at once
                jobs.revoke_for_cell("k", "r", cell, 1)
                assert run.pausing is not None
                await asyncio.wait_for(run.pausing, 5.0)
                assert run.grace_period_s is not None and run.grace_period_s < 0.9, run.grace_period_s
                assert not run.process.frozen
                ledger.release("k", "r", cell)
                jobs.cells_released()
            assert run.preemptions == 3
        finally:
            await jobs.close()

    asyncio.run(main())


def test_the_global_view_shows_reported_leases_as_revocable_not_idle() -> None:
    from services.global_scheduler.cluster_state import ClusterState
    from shared.resources import Resources

    state = ClusterState()
    state.register_host("h", Resources(gpus=2), "virtual", "", 0.0)
    state.heartbeat("h", {"k/m": [0]}, 1.0, leased=[LeasedJob("j", (1,), 0.2).to_wire()])
    view = state.ledger_views({"h"})["h"]
    assert view.idle_gpus == 0 and view.leased == (LeasedJob("j", (1,), 0.2),)
    state.heartbeat("h", {}, 2.0, leased=[])
    assert state.ledger_views({"h"})["h"].idle_gpus == 2


def test_a_malformed_lease_report_shows_the_gpus_idle_rather_than_stale_leases() -> None:
    from services.global_scheduler.cluster_state import ClusterState
    from shared.resources import Resources

    state = ClusterState()
    state.register_host("h", Resources(gpus=2), "virtual", "", 0.0)
    state.heartbeat("h", {}, 1.0, leased=[LeasedJob("j", (0, 1)).to_wire()])
    state.heartbeat("h", {}, 2.0, leased=[["bad"]])
    assert state.ledger_views({"h"})["h"].idle_gpus == 2


def test_a_lease_ending_while_a_cell_holds_its_gpus_leaves_the_job_paused_not_resumed(tmp_path: Path) -> None:
    async def main() -> None:
        jobs, ledger = _host(tmp_path)
        jobs.keep_paused_s = 60.0
        try:
            await jobs.grant(grant("a.1", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path))
            run = jobs.runs["a.1"]
            jobs.revoke_for_cell("k", "r", "m", 1)
            answer = await jobs.end("a.1", reason="expired")
            assert answer["outcome"] == "paused" and run.suspension is None and not ledger.suspended()
            ledger.release("k", "r", "m")
            jobs.cells_released()
            assert not ledger.leases() and ledger.idle_count == 1  # its lease is over: no resume
        finally:
            await jobs.close()

    asyncio.run(main())


def test_a_two_gpu_cell_revokes_two_one_gpu_jobs_and_both_resume(tmp_path: Path) -> None:
    async def main() -> None:
        jobs, ledger = _host(tmp_path, gpus=2)
        try:
            for job_id in ("a.1", "a.2"):
                await jobs.grant(
                    grant(job_id, [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
                )
            commit = jobs.revoke_for_cell("k", "r", "m", 2)
            assert commit.device_ids == (0, 1) and not ledger.leases()
            assert all(run.suspension is not None for run in jobs.runs.values())
            ledger.release("k", "r", "m")
            jobs.cells_released()
            assert ledger.leased_snapshot() == {"a.1": [0], "a.2": [1]}
        finally:
            await jobs.close()

    asyncio.run(main())
