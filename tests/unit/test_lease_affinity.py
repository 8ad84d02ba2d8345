"""A round's equal leases are traded so that jobs stay where their processes are (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.arbiter import GpuSlot, Lease
from shared.arbiter.affinity import keep_jobs_in_place


def lease(job: str, *slots: tuple[str, int], app: str = "a") -> Lease:
    return Lease(app, job, tuple(GpuSlot(h, d) for h, d in slots), 0.0, 10.0)


def test_a_job_trades_its_lease_for_an_equal_one_on_its_host() -> None:
    leases = [lease("j1", ("h0", 1)), lease("j2", ("h1", 1), app="b")]
    kept = keep_jobs_in_place(leases, {"j1": "h1", "j2": "h2"})
    assert [(x.job_id, x.app_id, x.slots) for x in kept] == [
        ("j1", "a", (GpuSlot("h1", 1),)),
        ("j2", "b", (GpuSlot("h0", 1),)),
    ]


def test_no_trade_takes_a_lease_from_a_job_at_home_or_of_another_size() -> None:
    leases = [lease("j1", ("h0", 1)), lease("j2", ("h1", 1)), lease("j3", ("h1", 2), ("h1", 3))]
    assert keep_jobs_in_place(leases, {"j1": "h1", "j2": "h1"}) == leases


@given(
    st.lists(st.tuples(st.sampled_from(["h0", "h1", "h2"]), st.integers(1, 2)), min_size=1, max_size=8),
    st.dictionaries(st.sampled_from([f"j{i}" for i in range(8)]), st.sampled_from(["h0", "h1", "h2"])),
)
def test_trades_keep_every_slot_and_every_jobs_count(
    shape: list[tuple[str, int]], home: dict[str, str]
) -> None:
    leases, device = [], 0
    for i, (host, size) in enumerate(shape):
        slots = []
        for _ in range(size):
            slots.append((host, device))
            device += 1
        leases.append(lease(f"j{i}", *slots))
    kept = keep_jobs_in_place(leases, home)
    assert sorted(s for x in kept for s in x.slots) == sorted(s for x in leases for s in x.slots)
    assert [(x.job_id, len(x.slots)) for x in kept] == [(x.job_id, len(x.slots)) for x in leases]
    at_home = sum(1 for x in kept if {s.host_id for s in x.slots} == {home.get(x.job_id)})
    assert at_home >= sum(1 for x in leases if {s.host_id for s in x.slots} == {home.get(x.job_id)})
