"""The local GPU ledger: exclusive, idempotent per (kernel, replica, msg_id), never leaks."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.local_scheduler.gpu_ledger import GpuLedger, LedgerError


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
        st.sampled_from(["commit", "release", "exit"]),
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
        else:
            ledger.release_replica(kernel, replica)
        held = [d for c in ledger.commits() for d in c.device_ids]
        assert len(held) == len(set(held))
        assert len(held) + ledger.free_count == 4
