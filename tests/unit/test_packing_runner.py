"""Packing in the job runner (issue #18): the arbiter's packing pass after its auction, and the
job-side API obeying a squeeze or swell at its next step boundary."""

from __future__ import annotations

import json
from pathlib import Path

import tandem_job
from services.arbiter.registry import JobRecord
from services.arbiter.service import packed_leases
from services.local_scheduler.packing import PackingSettings
from shared.arbiter import GpuSlot, Lease
from shared.config import DEFAULTS


def record(
    job_id: str, gpus: int = 1, *, at: float = 0.0, host: str | None = None, **kw: object
) -> JobRecord:
    r = JobRecord(job_id, "a", job_id, ["x"], "/", {}, gpus, gpus, at, state="queued", host=host)
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_jobs_the_auction_left_waiting_are_packed_on_packable_gpus_one_job_each() -> None:
    waiting = [record("a.3", 2, at=1.0), record("a.1", at=2.0), record("a.2", at=3.0), record("a.4", at=0.5)]
    won = {"a.4": Lease("a", "a.4", (GpuSlot("h1", 5),), 0.0, 10.0)}
    leases = packed_leases(waiting, won, {"h0": [0], "h1": [1, 2]}, set(), 100.0, 60.0)
    placed = {lease.job_id: lease.slots for lease in leases}
    # a.4 won a GPU in the auction; smaller jobs first, in submission order; a.3 (2 GPUs) finds
    # no host with two packable GPUs left
    assert placed == {"a.1": (GpuSlot("h0", 0),), "a.2": (GpuSlot("h1", 1),)}
    assert all(lease.expires_at == 160.0 for lease in leases)


def test_a_packed_job_whose_lease_ends_is_renewed_where_it_is_packed() -> None:
    packed = record("a.1", host="h0", device_ids=[0], packing={"with": "a.2", "share": 70})
    alone = record("a.2", host="h0", device_ids=[0])
    suspended = record("a.3", host="h1", device_ids=[1], packing={"with": "a.4"}, suspended=True)
    leases = packed_leases([packed, alone, suspended], {}, {}, {"a.1", "a.2", "a.3"}, 0.0, 60.0)
    assert [(lease.job_id, lease.slots) for lease in leases] == [("a.1", (GpuSlot("h0", 0),))]


def test_the_job_runs_at_the_share_written_from_its_next_step(tmp_path: Path) -> None:
    share = tmp_path / tandem_job.SHARE_FILE
    job = tandem_job.Job(6, job_dir=tmp_path)
    seen = []
    for step in job.steps():
        seen.append(job.share)
        if step == 1:
            tandem_job.write_atomically(share, "40\n")  # squeeze
        if step == 3:
            tandem_job.write_atomically(share, "100\n")  # swell
    assert seen == [100, 100, 40, 40, 100, 100]
    assert json.loads((tmp_path / tandem_job.PROGRESS_FILE).read_text())["share"] == 100


def test_the_packing_section_turns_the_nothing_to_gain_exit_off_and_on() -> None:
    assert PackingSettings.from_config({}).futile_exit is True  # on unless the section says otherwise
    assert PackingSettings.from_config({"futile_exit": False}).futile_exit is False
    assert PackingSettings.from_config(DEFAULTS["packing"]).futile_exit is DEFAULTS["packing"]["futile_exit"]
