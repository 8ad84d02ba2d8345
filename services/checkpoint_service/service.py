"""The checkpoint service's asyncio shell: each job's latest complete image (issue #17).

A job's in-process agent (``shared/checkpoint``, POS-style concurrent checkpoints) writes its
packs and its manifest to the data store itself; what it commits its host relays here
(``checkpoint.commit``: the manifest's ref). The service reads the manifest back, checks that it
parses, tiles its tensors and names only objects the store holds, and only then records it in the
pure ``CheckpointBook`` (``shared/checkpoint/book.py``): "latest of job J" therefore never points
at a partial image. The book is written to ``<state_dir>/checkpoint/book.json`` (0600, atomic
rename) before the commit is answered, so an answered commit survives a restart; objects no kept
image needs are then deleted from the store. A host restarting a job asks ``checkpoint.latest``
and hands the image's ref to the job, which restores from it (on demand, ``shared/checkpoint/restore.py``).

Authenticated like the other services: CURVE with the ``checkpoint`` server key; hosts (their
``host.<id>`` keys) commit and ask, the operator asks, forgets a job and reads the status.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from typing import Any

import structlog

from shared import messages
from shared.checkpoint.book import BookError, CheckpointBook
from shared.checkpoint.manifest import Manifest
from shared.config import Config
from shared.datastore import DataStore, DataStoreError, ObjectRef, open_datastore
from shared.datastore.keys import is_digest
from shared.envelope import Envelope
from shared.private_files import replace_private
from shared.rpc import ClusterServerShell
from shared.security import curve
from shared.security.authorization import checkpoint_refusal

log = structlog.get_logger("checkpoint")

TIMINGS_KEPT = 1000


class CheckpointService(ClusterServerShell):
    server_key = curve.CHECKPOINT

    def __init__(self, cfg: Config, *, store: DataStore | None = None) -> None:
        """``store``: an open data store to use (tests); by default ``[datastore]``'s, opened in ``run``."""
        self.cfg = cfg
        section = cfg["checkpoint"]
        self._path = cfg.state_dir() / "checkpoint" / "book.json"
        self.book = self._load(int(section["keep"]), float(section["protect_s"]))
        self.collect_interval_s = float(section["collect_interval_s"])
        self.store = store
        self._owns_store = store is None
        self._lock = asyncio.Lock()  # commits of one job are applied in arrival order, one at a time
        self.commit_ms: collections.deque[float] = collections.deque(maxlen=TIMINGS_KEPT)
        self.deleted_objects = 0
        self._deleting: set[asyncio.Future[None]] = set()
        self.ready = asyncio.Event()  # set once the store is open and the socket serves
        self._listen(cfg.keys_dir(), self._handle, name="checkpoint", authorize=self._authorize)

    # ---- lifecycle ------------------------------------------------------------------------------

    def _load(self, keep: int, protect_s: float) -> CheckpointBook:
        try:
            return CheckpointBook.from_dict(
                json.loads(self._path.read_text()), keep=keep, protect_s=protect_s
            )
        except FileNotFoundError:
            return CheckpointBook(keep=keep, protect_s=protect_s)

    def _save(self) -> None:
        replace_private(self._path, json.dumps(self.book.to_dict()))

    async def run(self, stop: asyncio.Event) -> None:
        if self.store is None:
            self.store = await open_datastore(self.cfg)
        self._server.start()
        self.ready.set()
        log.info("started", address=self.address, jobs=len(self.book.jobs), stored=len(self.book.stored))
        try:
            await self._collect(time.time())  # what a crash left between a commit and its deletes
            while not stop.is_set():
                # Protections expire with no commit to notice: journaled packs of a capture
                # killed mid-way, packs of a job that never committed again.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.collect_interval_s)
                if not stop.is_set():
                    await self._collect(time.time())
        finally:
            await asyncio.gather(*self._deleting, return_exceptions=True)
            self._save()
            await self._server.close()
            if self._authority is not None:
                self._authority.release()
            if self._owns_store and self.store is not None:
                await self.store.close()
            self._ctx.destroy(linger=0)
            log.info("stopped")

    # ---- messages -------------------------------------------------------------------------------

    @staticmethod
    def _authorize(principal: str, identity: bytes, env: Envelope) -> str | None:
        host = curve.host_of(principal)
        if host is not None and identity != host.encode():
            return f"{principal} may not use the routing identity {identity!r}"
        return checkpoint_refusal(principal, env.type)

    def _handle(self, identity: bytes, env: Envelope) -> Any:
        if env.type in (messages.REPLY, messages.ERROR):
            return None
        if env.type == messages.CHECKPOINT_COMMIT:
            return self._commit(env)
        if env.type == messages.CHECKPOINT_LATEST:
            latest = self.book.latest(env.body["job_id"])
            return env.reply({"job_id": env.body["job_id"], "checkpoint": latest and latest.describe()})
        if env.type == messages.CHECKPOINT_FORGET:
            return self._forget(env)
        if env.type == messages.CHECKPOINT_STATUS:
            return env.reply(self.status())
        if env.type == messages.CHECKPOINT_WRITTEN:
            return self._written(env)
        return env.error(f"the checkpoint service does not handle {env.type!r}", code="unsupported")

    async def _commit(self, env: Envelope) -> Envelope:
        started = time.perf_counter()
        job_id = env.body["job_id"]
        written = [str(d) for d in env.body.get("written") or []]
        try:
            ref = ObjectRef.from_dict(env.body["manifest"])
            manifest = await self._verified(ref)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("commit_refused", job=job_id, reason=str(exc))
            return env.error(f"job {job_id}: {exc}", code="bad_request")
        async with self._lock:
            try:
                committed = self.book.commit(job_id, ref, manifest, time.time(), written=written)
            except BookError as exc:
                log.warning("commit_refused", job=job_id, reason=str(exc))
                return env.error(str(exc), code="stale" if "older" in str(exc) else "bad_request")
            self._save()  # answered commits survive a restart of the service
        elapsed_ms = (time.perf_counter() - started) * 1000
        self.commit_ms.append(elapsed_ms)
        if not committed.repeated:
            log.info(
                "checkpoint_committed",
                job=job_id,
                step=committed.entry.step,
                previous_step=committed.previous.step if committed.previous else None,
                image_bytes=committed.entry.image_bytes,
                ms=round(elapsed_ms, 2),
            )
        deleting = asyncio.ensure_future(self._delete(committed.collect))  # after the answer
        self._deleting.add(deleting)
        deleting.add_done_callback(self._deleting.discard)
        return env.reply(
            {"job_id": job_id, "committed": not committed.repeated, **committed.entry.describe()}
        )

    async def _verified(self, ref: ObjectRef) -> Manifest:
        """The manifest behind ``ref``, parsed and checked, every object it names present: a job
        is never pointed at an image a crashed agent left half-written."""
        assert self.store is not None
        try:
            manifest = Manifest.from_json(await self.store.get(ref))
        except (OSError, DataStoreError) as exc:
            raise ValueError(f"manifest {ref.digest[:16]} cannot be read: {exc}") from None
        needed = [*manifest.packs, manifest.meta]
        present = await asyncio.gather(*(self.store.exists(r) for r in needed))
        missing = [r.digest[:16] for r, ok in zip(needed, present, strict=True) if not ok]
        if missing:
            raise ValueError(
                f"image of step {manifest.step} is incomplete: {len(missing)} objects missing ({missing[:3]})"
            )
        return manifest

    async def _written(self, env: Envelope) -> Envelope:
        """A job's process exited: every object its agent stored. Those no kept image needs are
        collected once their protection ends (an agent of another job may have stored the same
        content and not committed yet)."""
        digests = [str(d) for d in env.body["digests"]]
        if not all(is_digest(d) for d in digests):
            return env.error("checkpoint.written takes content digests", code="bad_request")
        async with self._lock:
            self.book.written(digests, time.time(), job_id=str(env.body["job_id"]))
            self._save()
        log.info("checkpoint_journal", job=env.body["job_id"], objects=len(digests))
        return env.reply({"job_id": env.body["job_id"], "protected": len(digests)})

    async def _forget(self, env: Envelope) -> Envelope:
        job_id = env.body["job_id"]
        async with self._lock:
            had = self.book.latest(job_id) is not None
            collect = self.book.forget(job_id, time.time())
            self._save()
        await self._delete(collect)
        log.info("job_forgotten", job=job_id, had_images=had, collected=len(collect))
        return env.reply({"job_id": job_id, "forgotten": had})

    async def _collect(self, now: float) -> None:
        await self._delete(frozenset(self.book.collectable(now)))

    async def _delete(self, digests: frozenset[str]) -> None:
        """Delete what no kept image needs (re-checked now: a commit since may need it again)."""
        if not digests or self.store is None:
            return
        store = self.store
        async with self._lock:
            doomed = sorted(set(digests) & self.book.collectable(time.time()))
            for digest in doomed:
                try:
                    await store.delete_digest(digest)
                except (OSError, DataStoreError) as exc:
                    log.warning("delete_failed", digest=digest[:16], reason=str(exc))
                    continue
                self.book.deleted([digest])
                self.deleted_objects += 1
            if doomed:
                self._save()

    # ---- status ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        timings = sorted(self.commit_ms)
        return {
            "jobs": {job: entries[-1].describe() for job, entries in self.book.jobs.items() if entries},
            "stored_objects": len(self.book.stored),
            "protected_objects": len(self.book.protected),
            "deleted_objects": self.deleted_objects,
            "commit_ms_p50": timings[len(timings) // 2] if timings else None,
            "commits": len(timings),
        }
