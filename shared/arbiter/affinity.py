"""Which of a round's equal leases goes to which job: pure, no I/O.

The auction (``shared.arbiter``) decides how many GPUs each job gets and where each lease's GPUs
are; two leases of the same size are interchangeable to it (a job's value depends on its count and
layout, not on which host). They are not to the job: a job keeps a process on the host it last ran
on (running, or paused with ``arbiter.keep_paused_s``), and a lease elsewhere costs it a new
process that starts from scratch (imports, data loading, a checkpoint read). So before the leases
are carried out, a job whose lease is elsewhere trades it for an equal one on its host held by a
job that does not live there. Counts per job and per app, and every lease's layout, are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from shared.arbiter import Lease


def _host(lease: Lease) -> str | None:
    hosts = {s.host_id for s in lease.slots}
    return hosts.pop() if len(hosts) == 1 else None


def keep_jobs_in_place(leases: Sequence[Lease], home: Mapping[str, str]) -> list[Lease]:
    """``leases`` with the slots of equal-size leases swapped so that as many jobs as possible get
    theirs on ``home[job_id]`` (the host its process is on)."""
    out = list(leases)
    for i, lease in enumerate(out):
        want = home.get(lease.job_id)
        if want is None or _host(lease) == want:
            continue
        for j, other in enumerate(out):
            if (
                j != i
                and len(other.slots) == len(lease.slots)
                and _host(other) == want
                and home.get(other.job_id) != want
            ):
                out[i], out[j] = replace(lease, slots=other.slots), replace(other, slots=lease.slots)
                break
    return out
