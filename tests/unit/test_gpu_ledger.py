"""The GPU ledger: each GPU idle, committed to a cell or leased to a job; exclusive, idempotent per
(kernel, replica, msg_id), never leaks; the global scheduler's mirror counts what the host reports."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.cluster_core.gpu_ledger import GpuLedger, Lease, LedgerError


def test_commit_binds_lowest_free_ids_and_release_returns_them() -> None:
    ledger = GpuLedger(range(4))
    assert ledger.commit("k1", "r1", "m1", 2).device_ids == (0, 1)
    assert ledger.commit("k2", "r1", "m9", 1).device_ids == (2,)
    assert ledger.free_count == 1
    assert ledger.release("k1", "r1", "m1") == (0, 1)
    assert ledger.commit("k3", "r2", "m2", 3).device_ids == (0, 1, 3)


def test_commit_is_idempotent_for_a_retry() -> None:
    ledger = GpuLedger(range(2))
    first = ledger.commit("k", "r1", "m", 1)
    assert ledger.commit("k", "r1", "m", 1) == first
    assert ledger.committed_count == 1


def test_commit_refused_when_not_enough_free() -> None:
    ledger = GpuLedger(range(2))
    ledger.commit("k1", "r1", "m", 2)
    with pytest.raises(LedgerError, match="needs 1 GPUs, 0 of 2 free"):
        ledger.commit("k2", "r1", "m", 1)


def test_zero_gpu_commit_succeeds_even_when_full() -> None:
    ledger = GpuLedger(range(1))
    ledger.commit("k1", "r1", "m", 1)
    assert ledger.commit("k2", "r1", "m", 0).device_ids == ()


def test_double_release_is_harmless() -> None:
    ledger = GpuLedger(range(2))
    ledger.commit("k", "r1", "m", 2)
    assert ledger.release("k", "r1", "m") == (0, 1)
    assert ledger.release("k", "r1", "m") == ()
    assert ledger.free_count == 2


def test_a_new_commit_by_the_same_replica_releases_its_stale_one() -> None:
    ledger = GpuLedger(range(2))
    ledger.commit("k", "r1", "m1", 2)
    assert ledger.commit("k", "r1", "m2", 2).device_ids == (0, 1)
    assert ledger.release("k", "r1", "m1") == ()


def test_release_replica_on_exit_frees_everything_it_held() -> None:
    ledger = GpuLedger(range(3))
    ledger.commit("k", "r1", "m1", 2)
    ledger.commit("k", "r2", "m1", 1)
    assert ledger.release_replica("k", "r1") == (0, 1)
    assert ledger.free_count == 2


def test_holds_tells_whether_a_replica_has_a_cell_bound() -> None:
    ledger = GpuLedger(range(2))
    assert not ledger.holds("k", "r1")
    ledger.commit("k", "r1", "m1", 1)
    assert ledger.holds("k", "r1") and not ledger.holds("k", "r2") and not ledger.holds("k2", "r1")
    ledger.release("k", "r1", "m1")
    assert not ledger.holds("k", "r1")


def test_snapshot_is_the_heartbeat_committed_map() -> None:
    ledger = GpuLedger(range(3))
    ledger.commit("k", "r1", "m1", 2)
    assert ledger.snapshot() == {"k/m1": [0, 1]}


def test_negative_gpus_rejected() -> None:
    with pytest.raises(LedgerError):
        GpuLedger(range(1)).commit("k", "r", "m", -1)


ops = st.lists(
    st.tuples(
        st.sampled_from(["commit", "release", "exit", "lease", "end_lease", "expire"]),
        st.sampled_from(["k1", "k2"]),
        st.sampled_from(["r1", "r2", "r3"]),
        st.sampled_from(["m1", "m2"]),
        st.integers(0, 4),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_no_device_is_ever_held_twice_and_nothing_leaks(
    sequence: list[tuple[str, str, str, str, int]],
) -> None:
    ledger = GpuLedger(range(4))
    for op, kernel, replica, msg, n in sequence:
        if op == "commit":
            with contextlib.suppress(LedgerError):
                ledger.commit(kernel, replica, msg, n)
        elif op == "release":
            ledger.release(kernel, replica, msg)
        elif op == "exit":
            ledger.release_replica(kernel, replica)
        elif op == "lease":
            with contextlib.suppress(LedgerError):
                ledger.lease(kernel, n, expires_at=float(n))
        elif op == "end_lease":
            ledger.end_lease(kernel)
        else:
            ledger.expire_leases(now=2.0)
        committed = [d for c in ledger.commits() for d in c.device_ids]
        leased = [d for lease in ledger.leases() for d in lease.device_ids]
        held = committed + leased
        assert len(held) == len(set(held))  # no device in two states
        assert len(committed) == ledger.committed_count and len(leased) == ledger.leased_count
        assert sorted(set(range(4)) - set(held)) == list(ledger.idle_device_ids())
        assert len(held) + ledger.free_count == 4


def test_a_lease_takes_only_idle_devices_and_a_commit_never_takes_a_leased_one() -> None:
    ledger = GpuLedger(range(4))
    ledger.commit("k", "r1", "m", 1)
    assert ledger.lease("job", 2, expires_at=10.0) == (1, 2)
    assert ledger.leased_count == 2
    assert ledger.idle_device_ids() == (3,)
    with pytest.raises(LedgerError, match="needs 2 GPUs, 1 of 4 free"):
        ledger.commit("k2", "r1", "m", 2)
    with pytest.raises(LedgerError, match="needs 2 GPUs, 1 of 4 idle"):
        ledger.lease("job2", 2, expires_at=10.0)
    assert ledger.commit("k2", "r1", "m", 1).device_ids == (3,)


def test_end_lease_returns_the_devices_once() -> None:
    ledger = GpuLedger(range(2))
    ledger.lease("job", 2, expires_at=5.0)
    assert ledger.leases() == [Lease("job", (0, 1), 5.0)]
    assert ledger.end_lease("job") == (0, 1)
    assert ledger.end_lease("job") == ()
    assert ledger.idle_device_ids() == (0, 1) and ledger.leased_count == 0


def test_expire_leases_ends_those_due_by_now_only() -> None:
    ledger = GpuLedger(range(3))
    ledger.lease("early", 1, expires_at=5.0)
    ledger.lease("late", 1, expires_at=9.0)
    assert [lease.job_id for lease in ledger.expire_leases(5.0)] == ["early"]
    assert [lease.job_id for lease in ledger.leases()] == ["late"]
    assert ledger.idle_device_ids() == (0, 2)


def test_a_job_holds_one_lease_at_a_time() -> None:
    ledger = GpuLedger(range(3))
    ledger.lease("job", 1, expires_at=5.0)
    with pytest.raises(LedgerError, match="already holds a lease"):
        ledger.lease("job", 1, expires_at=5.0)


def test_the_mirror_counts_a_tentative_commit_and_its_confirmation_once() -> None:
    """The global scheduler's view: a reservation, then the host's report of the same cell."""
    ledger = GpuLedger(range(4))
    ledger.reserve("k", "m", 2)
    assert ledger.committed_count == 2 and ledger.idle_count == 2
    ledger.mirror({"k/m": [1, 2]})
    assert ledger.committed_count == 2
    ledger.mirror({"k/m": [1, 2], "k2/m": 1})
    assert ledger.committed_count == 3 and ledger.idle_count == 1
    ledger.forget("k", "m")
    assert ledger.committed_count == 1 and ledger.tentative() == {}


def test_a_recorded_election_takes_its_devices_from_a_stale_commit() -> None:
    ledger = GpuLedger(range(2))
    ledger.mirror({"old/m": [0, 1]})  # released on the host; the next heartbeat would say so
    ledger.record("k", "r1", "m", [1])
    assert {c.kernel_id: c.device_ids for c in ledger.commits()} == {"old": (0,), "k": (1,)}
    assert ledger.committed_count == 2
