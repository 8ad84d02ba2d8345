"""The authoritative record of which GPUs on this host are committed to which executing replica.

Pure (no I/O): the local scheduler feeds it ``gpu.commit`` / ``gpu.release`` and replica exits.
A commit is keyed by (kernel, replica, msg_id) and is idempotent, because a replica's retry of the
same ``gpu.commit`` must get the same device ids rather than a second set.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class LedgerError(RuntimeError):
    """A commit that cannot be granted (not enough free GPUs); ``str`` says why."""


@dataclass(frozen=True, slots=True)
class Commit:
    kernel_id: str
    replica_id: str
    msg_id: str
    device_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GpuLease:
    """GPUs a best-effort job holds until ``expires_at`` (wall clock); no cell may take them."""

    job_id: str
    device_ids: tuple[int, ...]
    expires_at: float


class GpuLedger:
    def __init__(self, device_ids: Iterable[int]) -> None:
        self._all: tuple[int, ...] = tuple(sorted(set(device_ids)))
        self._free: set[int] = set(self._all)
        self._commits: dict[tuple[str, str, str], Commit] = {}
        self._leases: dict[str, GpuLease] = {}

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self._all

    @property
    def total(self) -> int:
        return len(self._all)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def committed_count(self) -> int:
        """GPUs committed to cells (not counting leased ones)."""
        return sum(len(c.device_ids) for c in self._commits.values())

    @property
    def leased_count(self) -> int:
        return sum(len(x.device_ids) for x in self._leases.values())

    def idle_device_ids(self) -> tuple[int, ...]:
        """Neither committed to a cell nor leased."""
        return tuple(sorted(self._free))

    def leases(self) -> list[GpuLease]:
        return list(self._leases.values())

    def lease(
        self, job_id: str, gpus: int, expires_at: float, device_ids: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """Lease ``gpus`` idle GPUs (lowest first; exactly ``device_ids`` when given: a paused job
        resumes only on the GPUs its process sees) to a job. A job that holds a lease of that
        size already keeps its GPUs with the new expiry (a renewal)."""
        held = self._leases.get(job_id)
        if held is not None and len(held.device_ids) == gpus:
            self._leases[job_id] = GpuLease(job_id, held.device_ids, expires_at)
            return held.device_ids
        if gpus < 1:
            raise LedgerError(f"cannot lease {gpus} GPUs")
        self.end_lease(job_id)
        wanted = tuple(sorted(set(device_ids)))
        if wanted and (len(wanted) != gpus or not self._free.issuperset(wanted)):
            raise LedgerError(f"GPUs {list(wanted)} are not all idle (idle: {sorted(self._free)})")
        if gpus > len(self._free):
            raise LedgerError(f"needs {gpus} GPUs, {len(self._free)} of {len(self._all)} idle")
        chosen = wanted or tuple(sorted(self._free)[:gpus])
        self._free.difference_update(chosen)
        self._leases[job_id] = GpuLease(job_id, chosen, expires_at)
        return chosen

    def end_lease(self, job_id: str) -> tuple[int, ...]:
        held = self._leases.pop(job_id, None)
        if held is None:
            return ()
        self._free.update(held.device_ids)
        return held.device_ids

    def expire_leases(self, now: float) -> list[GpuLease]:
        """End every lease whose expiry has passed; the leases ended."""
        ended = [x for x in self._leases.values() if x.expires_at <= now]
        for held in ended:
            self.end_lease(held.job_id)
        return ended

    def commits(self) -> list[Commit]:
        return list(self._commits.values())

    def commit(self, kernel_id: str, replica_id: str, msg_id: str, gpus: int) -> Commit:
        """Bind ``gpus`` device ids (lowest free first) to the replica executing ``msg_id``.

        A replica executes one cell at a time, so a commit it still holds for another msg_id is a
        missed release; it is released here rather than leaking GPUs forever.
        """
        if gpus < 0:
            raise LedgerError(f"cannot commit {gpus} GPUs")
        key = (kernel_id, replica_id, msg_id)
        existing = self._commits.get(key)
        if existing is not None:
            return existing
        self.release_replica(kernel_id, replica_id)
        if gpus > len(self._free):
            raise LedgerError(f"needs {gpus} GPUs, {len(self._free)} of {len(self._all)} free")
        chosen = tuple(sorted(self._free)[:gpus])
        self._free.difference_update(chosen)
        commit = Commit(kernel_id, replica_id, msg_id, chosen)
        self._commits[key] = commit
        return commit

    def release(self, kernel_id: str, replica_id: str, msg_id: str) -> tuple[int, ...]:
        """Give back what ``msg_id`` holds; releasing twice (a retry) is harmless and returns ()."""
        commit = self._commits.pop((kernel_id, replica_id, msg_id), None)
        if commit is None:
            return ()
        self._free.update(commit.device_ids)
        return commit.device_ids

    def holds(self, kernel_id: str, replica_id: str) -> bool:
        """Whether the replica holds GPUs for some cell (it executes one at a time)."""
        return any(k[0] == kernel_id and k[1] == replica_id for k in self._commits)

    def release_replica(self, kernel_id: str, replica_id: str) -> tuple[int, ...]:
        """Give back everything a replica holds (it exited, or it is committing anew)."""
        released: list[int] = []
        for key in [k for k in self._commits if k[0] == kernel_id and k[1] == replica_id]:
            released.extend(self.release(*key))
        return tuple(sorted(released))

    def snapshot(self) -> dict[str, list[int]]:
        """``{"<kernel_id>/<msg_id>": [device ids]}``: the ``committed`` map of ``host.heartbeat``."""
        return {f"{c.kernel_id}/{c.msg_id}": list(c.device_ids) for c in self._commits.values()}
