"""The in-process checkpoint agent a job runner (or a kernel replica) drives at step boundaries.

    agent = CheckpointAgent(TrainingState(model, opt, sched, loader=sampler), link, job="job-7")
    for step, batch in enumerate(loader, start=1):
        train_step(batch)
        result = agent.step_boundary(step)      # commits a finished checkpoint; retakes a torn one
        if want_checkpoint: agent.begin()       # e.g. on the service's "begin" message
    agent.checkpoint()                          # checkpoint-and-stop: the image of now

``begin`` costs the training thread microseconds per tensor; copying happens on a background
thread; the training thread pays only for copy-on-write of pieces it writes before the copier
reaches them. A result names a manifest in the data store; the service records it (commit) and
garbage-collects packs no live manifest references (``manifest.collectable``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import _get_current_dispatch_mode

from shared.background_threads import background_pool
from shared.checkpoint.capture import DENSE_PIECE_BYTES, Capture, CaptureStats, Known, Layout, known_pieces
from shared.checkpoint.clock import StallClock
from shared.checkpoint.cow import UNDECLARED_WRITES, WriteGuard, WriteRule
from shared.checkpoint.manifest import Manifest
from shared.checkpoint.pusher import StoreLink
from shared.checkpoint.staging import Staging
from shared.checkpoint.state import Structure, TrainingState
from shared.datastore import ObjectRef

DEFAULT_PIECE_BYTES = 64 * 1024
DEFAULT_PACK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class CommitResult:
    """A committed image. ``step`` is its instant: the requested boundary, or a later one if an
    attempt was found torn and retaken (``torn`` names what validation caught)."""

    manifest: Manifest
    manifest_ref: ObjectRef
    step: int
    attempts: int
    torn: tuple[str, ...]
    stall_s: float  # training-thread wall time spent on this checkpoint (retakes included)
    stall_cpu_s: float  # and its CPU time
    stats: CaptureStats
    written: tuple[str, ...]  # digests of packs stored during this checkpoint, failed attempts included


class CheckpointAgent:
    """Begins, tracks and commits concurrent checkpoints of one ``TrainingState``.

    All methods are called on the training thread (the dispatch mode is that thread's).
    """

    def __init__(
        self,
        state: TrainingState,
        link: StoreLink,
        *,
        job: str,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        strict: bool = False,
        rules: dict[Any, WriteRule] | None = None,
        max_retakes: int = 2,
        pacer: Callable[[], None] | None = None,
        last: Manifest | None = None,
        last_ref: ObjectRef | None = None,
    ) -> None:
        self.state = state
        self.link = link
        self.job = job
        self.piece_bytes = piece_bytes
        self.pack_bytes = pack_bytes
        self.strict = strict
        self.rules = UNDECLARED_WRITES if rules is None else rules
        self.max_retakes = max_retakes
        self.pacer = pacer
        self.last = last
        self.last_ref = last_ref
        self.unsafe: set[str] = set()  # tensors caught written behind the dispatcher: cloned at begin
        self.capture: Capture | None = None
        self._guard: WriteGuard | None = None
        self._known: dict[str, Known] = known_pieces(last)
        self._layouts: dict[int, Layout] = {}
        self._outside: set[int] = set()  # addresses written outside the last image's tensors
        # The last structure walked: reused at begin, checked by the copier (a stale one retakes).
        self._structure: Structure | None = None
        self._staging = Staging(max(pack_bytes, piece_bytes))
        self._dense: frozenset[str] = frozenset()  # tensors whose every piece changed last time
        # One long-lived copier thread: starting a thread per checkpoint costs the training thread
        # a scheduler round trip (tens of ms on a loaded machine).
        self._copier = background_pool(1, thread_name_prefix=f"checkpoint-{job}")
        self._attempts = 0
        self._torn: list[str] = []  # tensors found torn by this checkpoint's attempts so far
        self._clock = StallClock()  # its cost to the training thread, attempts included
        self._written: set[str] = set()  # packs its attempts stored

    def _reset(self) -> None:
        """Forget the attempts of the checkpoint just ended (committed, failed or abandoned)."""
        self._attempts, self._torn, self._clock, self._written = 0, [], StallClock(), set()

    def planned_pieces(self) -> int:
        """How many pieces the next image is cut into (tensors that all changed in the last one in
        big pieces): what a caller pacing or reporting the copier's progress counts."""
        dense = min(DENSE_PIECE_BYTES, self._staging.slab_bytes)
        tensors = self.state.tensors()
        return sum(
            max(1, -(-t.nbytes // (dense if name in self._dense else self.piece_bytes)))
            for name, t in tensors
        )

    @property
    def in_flight(self) -> bool:
        return self.capture is not None

    @property
    def guarded(self) -> bool:
        """The write guard is on (from begin until every tracked tensor is settled or the end)."""
        return self._guard is not None

    def begin(self) -> None:
        """Take the image of this instant (call at a step boundary, training thread)."""
        if self.capture is not None:
            raise RuntimeError("a checkpoint is already in flight")
        started = self._clock.start()
        self._attempts += 1
        cached = self._structure
        structure = cached if cached is not None else self.state.structure()
        self._structure = structure
        eager = (
            {name for name, _ in structure.tensors} if self._attempts > self.max_retakes + 1 else self.unsafe
        )
        self.capture = Capture(
            job=self.job,
            step=self.state.step,
            structure=structure,
            meta=self.state.instant_meta(structure),
            link=self.link,
            known=self._known,
            eager=eager,
            piece_bytes=self.piece_bytes,
            staging=self._staging,
            dense=self._dense,
            last=self.last,
            strict=self.strict,
            parent=self.last_ref.digest if self.last_ref is not None else None,
            pacer=self.pacer,
            layouts=self._layouts,
            walk=self.state.structure if cached is not None else None,
            outside=self._outside,
        )
        if not self.capture.instant.complete:  # else every tensor was copied at the instant
            self._guard = WriteGuard(self.capture.before_writes, self.rules)
            self._guard.__enter__()
        self._copier.submit(self.capture.run)
        self._clock.stop(started)

    def step_boundary(self, step: int) -> CommitResult | None:
        """Record the step count; commit a finished checkpoint (or retake a torn one now)."""
        self.state.step = step
        capture = self.capture
        if capture is None:
            return None
        started = self._clock.start()
        capture.boundary()
        if capture.done():
            result = self._finish()
        else:
            result = None
            if self._guard is not None and capture.settled():
                # Every tracked tensor is copied and marked written: later writes need nothing
                # from the guard, and the next steps run without its per-op dispatch cost.
                self._drop_guard()
        self._clock.stop(started)
        return result

    def _drop_guard(self) -> None:
        """Pop the write guard (training thread). A mode pushed after it stays innermost: the guard
        is popped under it only when the checkpoint ends (modes pop in order)."""
        guard = self._guard
        if guard is not None and _get_current_dispatch_mode() is guard:
            self._guard = None
            guard.__exit__(None, None, None)

    def checkpoint(self) -> CommitResult:
        """Checkpoint-and-stop: the image of this instant (training is paused). A checkpoint in
        flight from an earlier boundary is committed first, so it is not wasted."""
        if self.capture is not None:
            self.wait()
        self.begin()
        return self.wait()

    def close(self) -> None:
        """Abandon what is in flight and stop the copier thread."""
        self.abandon()
        self._copier.shutdown(wait=True)

    def abandon(self) -> None:
        """Drop the checkpoint in flight (the job is stopping without needing it); its copier ends
        at once and what it stored is left to the service's garbage collection."""
        capture, guard = self.capture, self._guard
        if capture is None:
            return
        if guard is not None:
            guard.__exit__(None, None, None)
        self.capture, self._guard = None, None
        capture.cancel()
        capture.future.exception()
        self._reset()

    def wait(self) -> CommitResult:
        """Training is paused: finish the checkpoint in flight (retaking at once if torn), or take one."""
        if self.capture is None:
            self.begin()
        while True:
            assert self.capture is not None
            self.capture.quiesce()
            started = self._clock.start()
            futures.wait([self.capture.future])  # _finish raises a copier failure, after cleanup
            self._clock.stop(started)
            result = self._finish()
            if result is not None:
                return result

    def _finish(self) -> CommitResult | None:
        capture = self.capture
        assert capture is not None
        if self._guard is not None:
            self._guard.__exit__(None, None, None)
            self._guard = None
        self.capture = None
        self._clock.add(capture.clock)
        try:
            outcome = capture.future.result()  # re-raises a copier failure on the training thread
        except BaseException:
            self._reset()
            raise
        self._written |= outcome.written
        self._dense = outcome.dense
        if capture.layouts:
            self._layouts = capture.layouts
        self._outside = capture.outside_seen()
        if outcome.stale:
            # The model or the optimizer changed shape since the last walk: walk again, retake now.
            self._structure = None
            self._known = outcome.known
            self.begin()
            return None
        if outcome.manifest is None or outcome.manifest_ref is None:
            # Torn: those tensors are written where the dispatcher cannot see; clone them at begin.
            self.unsafe |= set(outcome.torn)
            self._torn.extend(outcome.torn)
            self._known = outcome.known
            self.begin()
            return None
        result = CommitResult(
            manifest=outcome.manifest,
            manifest_ref=outcome.manifest_ref,
            step=outcome.step,
            attempts=self._attempts,
            torn=tuple(self._torn),
            stall_s=self._clock.wall_s,
            stall_cpu_s=self._clock.cpu_s,
            stats=outcome.stats,
            written=tuple(sorted(self._written)),
        )
        self.last, self.last_ref = outcome.manifest, outcome.manifest_ref
        self._known = outcome.known
        self._reset()
        return result
