"""The one GPU ledger model of the cluster: each GPU of a host is idle, committed to a cell, or
leased to a best-effort job until a deadline.

Pure (no I/O, time passed in). Three drivers keep one each, with the same counts:

* the local scheduler: the authority on its host, fed ``gpu.commit`` / ``gpu.release``, replica
  exits and job leases. A commit is keyed by (kernel, replica, msg_id) and is idempotent, because
  a replica's retry of the same ``gpu.commit`` must get the same device ids rather than a second set;
* the global scheduler: a mirror of each host's ledger (``mirror`` from heartbeats, ``record``
  from election events) plus its own *tentative* commits (``reserve``: an executor designated,
  not yet elected; its devices are the host's to choose), so placement reads one book;
* the simulator: one per simulated host, committed and released as cells run.

A commit only takes idle GPUs. A cell that finds too few takes leased ones only through
``revoke``: the victims' leases are *suspended* (their devices leave the lease in the same step
that binds them to the cell) and come back with ``resume_lease`` once the cell has released them.
Every change checks the invariant that a device is in exactly one of idle / committed / leased, so
no view ever shows a GPU bound to a cell and a job at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


class LedgerError(RuntimeError):
    """A commit or lease that cannot be granted (not enough idle GPUs); ``str`` says why."""


class LedgerInvariantError(AssertionError):
    """A device found in two of idle / committed / leased (or in none): a bug, never a refusal."""


@dataclass(frozen=True, slots=True)
class Commit:
    kernel_id: str
    replica_id: str
    msg_id: str
    device_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Lease:
    job_id: str
    device_ids: tuple[int, ...]
    expires_at: float


def split_commit_key(key: str) -> tuple[str, str]:
    """``"<kernel_id>/<msg_id>"`` (a heartbeat's ``committed`` key) -> (kernel_id, msg_id)."""
    kernel_id, _, msg_id = key.partition("/")
    return kernel_id, msg_id


class GpuLedger:
    def __init__(self, device_ids: Iterable[int], *, on_change: Callable[[], None] | None = None) -> None:
        self._all: tuple[int, ...] = tuple(sorted(set(device_ids)))
        self._idle: set[int] = set(self._all)
        self._commits: dict[tuple[str, str, str], Commit] = {}
        self._leases: dict[str, Lease] = {}
        self._leased = 0
        self._tentative: dict[tuple[str, str], int] = {}  # (kernel_id, msg_id) -> GPUs, no devices yet
        self._suspended: dict[str, tuple[Lease, tuple[str, str, str]]] = {}  # job -> (lease, cell key)
        self._on_change = on_change

    def _changed(self) -> None:
        self.check_invariant()
        if self._on_change is not None:
            self._on_change()

    def check_invariant(self) -> None:
        """Each device is idle, committed to one cell, or leased to one job: exactly one of them."""
        seen: dict[int, str] = {d: "idle" for d in self._idle}
        owners = [(f"cell {c.kernel_id}/{c.msg_id}", c.device_ids) for c in self._commits.values()]
        owners += [(f"job {lease.job_id}", lease.device_ids) for lease in self._leases.values()]
        for owner, device_ids in owners:
            for d in device_ids:
                if d in seen:
                    raise LedgerInvariantError(f"GPU {d} bound to {owner} while {seen[d]}")
                seen[d] = owner
        if set(seen) != set(self._all) or self._leased != sum(
            len(x.device_ids) for x in self._leases.values()
        ):
            raise LedgerInvariantError(f"devices {sorted(set(self._all) ^ set(seen))} lost or invented")

    # ---- counts -----------------------------------------------------------------------------

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self._all

    @property
    def total(self) -> int:
        return len(self._all)

    @property
    def committed_count(self) -> int:
        """GPUs committed to cells, tentative commits included (a cell counts once)."""
        bound = len(self._all) - len(self._idle) - self._leased
        if not self._tentative:
            return bound
        cells = {(k, m) for k, _, m in self._commits}
        return bound + sum(n for key, n in self._tentative.items() if key not in cells)

    @property
    def leased_count(self) -> int:
        return self._leased

    @property
    def idle_count(self) -> int:
        """GPUs neither committed (tentatively or not) nor leased: what a new cell can bind."""
        return max(len(self._all) - self.committed_count - self._leased, 0)

    free_count = idle_count  # the local scheduler's name for it (warm pool, gpu.commit refusals)

    def idle_device_ids(self) -> tuple[int, ...]:
        """Devices neither committed nor leased."""
        return tuple(sorted(self._idle))

    # ---- commits ----------------------------------------------------------------------------

    def commits(self) -> list[Commit]:
        return list(self._commits.values())

    def commit(self, kernel_id: str, replica_id: str, msg_id: str, gpus: int) -> Commit:
        """Bind ``gpus`` idle device ids (lowest first) to the replica executing ``msg_id``.

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
        if gpus > len(self._idle):
            raise LedgerError(f"needs {gpus} GPUs, {len(self._idle)} of {len(self._all)} free")
        chosen = tuple(sorted(self._idle)[:gpus])
        return self._bind(key, chosen)

    def _bind(self, key: tuple[str, str, str], device_ids: tuple[int, ...]) -> Commit:
        self._idle.difference_update(device_ids)
        commit = Commit(*key, device_ids)
        self._commits[key] = commit
        self._changed()
        return commit

    def release(self, kernel_id: str, replica_id: str, msg_id: str) -> tuple[int, ...]:
        """Give back what ``msg_id`` holds; releasing twice (a retry) is harmless and returns ()."""
        commit = self._commits.pop((kernel_id, replica_id, msg_id), None)
        if commit is None:
            return ()
        self._idle.update(commit.device_ids)
        self._changed()
        return commit.device_ids

    def holds(self, kernel_id: str, replica_id: str) -> bool:
        """Whether the replica holds GPUs for some cell (it executes one at a time)."""
        return any(k[0] == kernel_id and k[1] == replica_id for k in self._commits)

    def holds_kernel(self, kernel_id: str, *, tentative: bool = True) -> bool:
        """Whether some cell of ``kernel_id`` holds GPUs here (tentative commits too, by default)."""
        return any(k[0] == kernel_id for k in self._commits) or (
            tentative and any(k[0] == kernel_id for k in self._tentative)
        )

    def release_replica(self, kernel_id: str, replica_id: str) -> tuple[int, ...]:
        """Give back everything a replica holds (it exited, or it is committing anew)."""
        released: list[int] = []
        for key in [k for k in self._commits if k[0] == kernel_id and k[1] == replica_id]:
            released.extend(self.release(*key))
        return tuple(sorted(released))

    def snapshot(self) -> dict[str, list[int]]:
        """``{"<kernel_id>/<msg_id>": [device ids]}``: the ``committed`` map of ``host.heartbeat``."""
        return {f"{c.kernel_id}/{c.msg_id}": list(c.device_ids) for c in self._commits.values()}

    # ---- a mirror of another host's ledger (the global scheduler's view) ---------------------

    def reserve(self, kernel_id: str, msg_id: str, gpus: int) -> None:
        """A tentative commit: ``gpus`` counted as committed to the cell before its host binds them."""
        if gpus > 0:
            self._tentative[(kernel_id, msg_id)] = gpus
            self._changed()

    def forget(self, kernel_id: str, msg_id: str) -> None:
        """The cell finished (or its election was abandoned): drop its commits, tentative or not."""
        changed = self._tentative.pop((kernel_id, msg_id), None) is not None
        for key in [k for k in self._commits if k[0] == kernel_id and k[2] == msg_id]:
            commit = self._commits.pop(key)
            self._idle.update(commit.device_ids)
            changed = True
        if changed:
            self._changed()

    def tentative(self) -> dict[tuple[str, str], int]:
        return dict(self._tentative)

    def record(self, kernel_id: str, replica_id: str, msg_id: str, device_ids: Sequence[int] | int) -> Commit:
        """What the host reports it bound for ``msg_id`` (its ledger is the authority): its device
        ids where this ledger knows them (taken from any stale commit holding them), else as many
        idle ones; the cell's earlier commits here are replaced."""
        for key in [k for k in self._commits if k[0] == kernel_id and k[2] == msg_id]:
            self._idle.update(self._commits.pop(key).device_ids)
        key = (kernel_id, replica_id, msg_id)
        if isinstance(device_ids, int) or not set(device_ids) <= set(self._all):
            count = device_ids if isinstance(device_ids, int) else len(device_ids)
            return self._bind(key, tuple(sorted(self._idle)[:count]))
        known = tuple(sorted(set(device_ids)))
        for other, commit in list(self._commits.items()):  # the host says these are this cell's
            if not set(commit.device_ids).isdisjoint(known):
                self._commits[other] = Commit(*other, tuple(d for d in commit.device_ids if d not in known))
        self._take_from_leases(known)
        self._idle.update(known)  # bound just below
        return self._bind(key, known)

    def _take_from_leases(self, device_ids: tuple[int, ...]) -> None:
        for lease in [
            lease for lease in self._leases.values() if not set(lease.device_ids).isdisjoint(device_ids)
        ]:
            kept = tuple(d for d in lease.device_ids if d not in device_ids)
            self._leased -= len(lease.device_ids) - len(kept)
            self._leases[lease.job_id] = Lease(lease.job_id, kept, lease.expires_at)

    def mirror(
        self, committed: Mapping[str, Sequence[int] | int], leased: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        """Replace every commit by a host's report (a heartbeat's ``committed`` map) and, when the
        host reports them (``leased``: job id -> device ids), every lease; tentative commits stay
        until ``forget`` (the report may predate the election)."""
        for key in list(self._commits):
            self._idle.update(self._commits.pop(key).device_ids)
        if leased is not None:
            for job_id in list(self._leases):
                self.end_lease(job_id)
            for job_id, devices in leased.items():
                known = tuple(sorted(d for d in set(devices) if d in self._idle))
                if known:
                    self.lease(job_id, len(known), float("inf"), device_ids=known)
        for cell, devices in committed.items():
            kernel_id, msg_id = split_commit_key(cell)
            self.record(kernel_id, "", msg_id, devices)
        self._changed()

    # ---- leases to best-effort jobs ----------------------------------------------------------

    def lease(
        self, job_id: str, gpus: int, expires_at: float, device_ids: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """Lease ``gpus`` idle devices (lowest first; exactly ``device_ids`` when given, as for a
        paused job resuming on the GPUs its process sees) to ``job_id`` until ``expires_at``; a
        second lease of the same job is refused (end it first)."""
        if gpus <= 0:
            raise LedgerError(f"cannot lease {gpus} GPUs")
        if job_id in self._leases:
            raise LedgerError(f"job {job_id} already holds a lease")
        if gpus > len(self._idle):
            raise LedgerError(f"needs {gpus} GPUs, {len(self._idle)} of {len(self._all)} idle")
        wanted = tuple(sorted(set(device_ids)))
        if wanted and (len(wanted) != gpus or not self._idle.issuperset(wanted)):
            raise LedgerError(f"GPUs {list(wanted)} are not all idle (idle: {sorted(self._idle)})")
        chosen = wanted or tuple(sorted(self._idle)[:gpus])
        self._idle.difference_update(chosen)
        self._leases[job_id] = Lease(job_id, chosen, expires_at)
        self._leased += gpus
        self._changed()
        return chosen

    def end_lease(self, job_id: str) -> tuple[int, ...]:
        """Give back the job's devices; ending twice is harmless and returns ()."""
        lease = self._leases.pop(job_id, None)
        if lease is None:
            return ()
        self._leased -= len(lease.device_ids)
        self._idle.update(lease.device_ids)
        self._changed()
        return lease.device_ids

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def leased_snapshot(self) -> dict[str, list[int]]:
        """``{job_id: [device ids]}``: the ``leased`` map of ``host.heartbeat``."""
        return {lease.job_id: list(lease.device_ids) for lease in self._leases.values()}

    # ---- revocation: a cell takes leased GPUs ------------------------------------------------

    def revoke(
        self, kernel_id: str, replica_id: str, msg_id: str, gpus: int, victims: Sequence[str]
    ) -> tuple[Commit, list[Lease]]:
        """Suspend the ``victims``' leases and commit ``gpus`` devices to the cell in one step
        (idle ones first, then the victims' freed ones). Nothing changes if even that is too few.
        The suspended leases are kept (``suspended``) until ``resume_lease``."""
        key = (kernel_id, replica_id, msg_id)
        existing = self._commits.get(key)
        if existing is not None:
            return existing, []
        leases = [self._leases[j] for j in dict.fromkeys(victims) if j in self._leases]
        freed = [d for lease in leases for d in lease.device_ids]
        held = [d for k, c in self._commits.items() if k[:2] == key[:2] for d in c.device_ids]
        if gpus > len(self._idle) + len(freed) + len(held):
            raise LedgerError(
                f"needs {gpus} GPUs: {len(self._idle)} idle, {len(freed)} leased to {list(victims)}"
            )
        self.release_replica(kernel_id, replica_id)
        for lease in leases:
            del self._leases[lease.job_id]
            self._leased -= len(lease.device_ids)
            self._suspended[lease.job_id] = (lease, key)
        idle_first = sorted(self._idle - set(freed)) + sorted(freed)
        self._idle.update(freed)
        return self._bind(key, tuple(sorted(idle_first[:gpus]))), leases

    def suspended(self) -> dict[str, tuple[Lease, tuple[str, str, str]]]:
        """Suspended leases: job id -> (the lease as it was, the key of the cell that took it)."""
        return dict(self._suspended)

    def resume_lease(self, job_id: str, expires_at: float) -> tuple[int, ...]:
        """Give a suspended job its own devices back (LedgerError while any is still bound)."""
        lease, _ = self._suspended[job_id]
        chosen = self.lease(job_id, len(lease.device_ids), expires_at, device_ids=lease.device_ids)
        del self._suspended[job_id]
        return chosen

    def drop_suspended(self, job_id: str) -> None:
        """The suspended job will not come back (stopped, or its lease expired)."""
        self._suspended.pop(job_id, None)

    def expire_leases(self, now: float) -> list[Lease]:
        """End every lease whose ``expires_at`` is not after ``now``; returns them."""
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            self.end_lease(lease.job_id)
        return expired
