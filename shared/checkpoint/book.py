"""The checkpoint service's bookkeeping: each job's latest complete image, and what may be deleted.

Pure (ARCHITECTURE.md §3): no store, no clock, no sockets. The service's shell reads a job's
manifest from the data store, checks that every object it names is there, and only then calls
``commit``: so ``latest`` moves in one assignment from one complete image to the next, never to a
partial one, and never backwards (a late announcement of an older step is refused as stale).

Garbage collection is a function of the book: an object is kept while a kept entry of any job
needs it (packs are content-addressed and shared across jobs and across images of one job, so
"needed" is the union over every job) or while it is protected (packs of a checkpoint the agent
has written but not committed yet, for ``protect_s``). Everything else the book was told of is
collectable; the shell deletes it and reports ``deleted``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared.checkpoint.manifest import Manifest, referenced_digests
from shared.datastore import ObjectRef

DEFAULT_KEEP = 1  # images kept per job: the latest (the agent's next increment reuses its packs)
DEFAULT_PROTECT_S = 600.0  # packs announced before their manifest stay this long at least


class BookError(ValueError):
    """An announcement the book refuses (wrong job, older than the latest); the reason says why."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One committed image of a job: where its manifest is and every object it needs."""

    job_id: str
    step: int
    manifest: ObjectRef
    digests: frozenset[str]  # the manifest object itself, its packs and its meta
    committed_at: float
    image_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "step": self.step,
            "manifest": self.manifest.to_dict(),
            "digests": sorted(self.digests),
            "committed_at": self.committed_at,
            "image_bytes": self.image_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        return cls(
            job_id=str(data["job_id"]),
            step=int(data["step"]),
            manifest=ObjectRef.from_dict(data["manifest"]),
            digests=frozenset(str(d) for d in data["digests"]),
            committed_at=float(data["committed_at"]),
            image_bytes=int(data.get("image_bytes", 0)),
        )

    def describe(self) -> dict[str, Any]:
        """What ``checkpoint.latest`` answers: enough for a job to restore."""
        return {
            "step": self.step,
            "manifest": self.manifest.to_dict(),
            "committed_at": self.committed_at,
            "image_bytes": self.image_bytes,
        }


@dataclass(frozen=True, slots=True)
class Committed:
    """The outcome of ``commit``: the job's new latest entry, the one it replaced (None: first, or
    the same manifest announced again), and the digests now collectable."""

    entry: Entry
    previous: Entry | None
    collect: frozenset[str]
    repeated: bool = False


@dataclass
class CheckpointBook:
    keep: int = DEFAULT_KEEP
    protect_s: float = DEFAULT_PROTECT_S
    jobs: dict[str, list[Entry]] = field(default_factory=dict)  # oldest first; the last is the latest
    protected: dict[str, float] = field(default_factory=dict)  # digest -> protected until
    stored: set[str] = field(default_factory=set)  # every digest the book knows to be in the store
    # Per job, what its exited processes journaled: protected like any pack written ahead of its
    # manifest, and released when the job is forgotten (nothing of it will be committed again).
    journaled: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError("a checkpoint book keeps at least the latest image of a job")

    def latest(self, job_id: str) -> Entry | None:
        entries = self.jobs.get(job_id)
        return entries[-1] if entries else None

    def written(self, digests: Iterable[str], now: float, *, job_id: str | None = None) -> None:
        """Objects an agent stored ahead of its manifest: kept ``protect_s`` even if unreferenced
        (another job's agent may have stored the same content and not committed yet). ``job_id``:
        the journal of a job's exited process (what a capture killed mid-way left included)."""
        until = now + self.protect_s
        digests = set(digests)
        for digest in digests:
            self.stored.add(digest)
            self.protected[digest] = max(until, self.protected.get(digest, until))
        if job_id is not None:
            self.journaled.setdefault(job_id, set()).update(digests)

    def commit(
        self,
        job_id: str,
        manifest_ref: ObjectRef,
        manifest: Manifest,
        now: float,
        *,
        written: Iterable[str] = (),
    ) -> Committed:
        """Make ``manifest`` (verified complete in the store by the caller) the job's latest image.

        ``written``: the packs its agent stored for it, failed attempts included; those it does not
        reference are collectable at once (nothing else will ever point at them)."""
        if manifest.job != job_id:
            raise BookError(f"manifest of job {manifest.job!r} announced for job {job_id!r}")
        digests = frozenset(referenced_digests(manifest) | {manifest_ref.digest})
        written = set(written)
        for digest in written:
            self.protected.pop(digest, None)
        self.stored |= digests | written
        current = self.latest(job_id)
        if current is not None and current.manifest.digest == manifest_ref.digest:
            return Committed(current, None, frozenset(self.collectable(now)), repeated=True)
        if current is not None and manifest.step < current.step:
            raise BookError(
                f"job {job_id}: image of step {manifest.step} is older than the latest, step {current.step}"
            )
        entry = Entry(job_id, manifest.step, manifest_ref, digests, now, manifest.image_bytes())
        entries = [*self.jobs.get(job_id, []), entry]
        self.jobs[job_id] = entries[-self.keep :]
        return Committed(entry, current, frozenset(self.collectable(now)))

    def forget(self, job_id: str, now: float) -> frozenset[str]:
        """The job is over (finished or cancelled): its images go; what they alone needed is collectable."""
        self.jobs.pop(job_id, None)
        for digest in self.journaled.pop(job_id, set()):
            self.protected.pop(digest, None)
        return frozenset(self.collectable(now))

    def needed(self, now: float) -> set[str]:
        needed = {d for d, until in self.protected.items() if until > now}
        for entries in self.jobs.values():
            for entry in entries:
                needed |= entry.digests
        return needed

    def collectable(self, now: float) -> set[str]:
        """Digests the book knows of that nothing kept or protected needs: safe to delete."""
        return self.stored - self.needed(now)

    def deleted(self, digests: Iterable[str]) -> None:
        """The shell deleted these (or found them gone): forget them."""
        digests = set(digests)
        for digest in digests:
            self.stored.discard(digest)
            self.protected.pop(digest, None)
        for job_id in list(self.journaled):
            self.journaled[job_id] -= digests
            if not self.journaled[job_id]:
                del self.journaled[job_id]

    # ---- persistence (the shell writes this JSON atomically after every change) ----------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep": self.keep,
            "protect_s": self.protect_s,
            "jobs": {job: [e.to_dict() for e in entries] for job, entries in self.jobs.items()},
            "protected": dict(self.protected),
            "stored": sorted(self.stored),
            "journaled": {job: sorted(digests) for job, digests in self.journaled.items()},
        }

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, keep: int | None = None, protect_s: float | None = None
    ) -> CheckpointBook:
        book = cls(
            keep=int(data.get("keep", DEFAULT_KEEP)) if keep is None else keep,
            protect_s=float(data.get("protect_s", DEFAULT_PROTECT_S)) if protect_s is None else protect_s,
            jobs={
                str(job): [Entry.from_dict(e) for e in entries]
                for job, entries in data.get("jobs", {}).items()
            },
            protected={str(d): float(t) for d, t in data.get("protected", {}).items()},
            stored={str(d) for d in data.get("stored", [])},
            journaled={str(job): {str(d) for d in ds} for job, ds in data.get("journaled", {}).items()},
        )
        for job, entries in book.jobs.items():
            book.jobs[job] = entries[-book.keep :]
        return book
