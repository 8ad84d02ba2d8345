"""Checkpoints of a job on the job-side API: restore where the last run left off, checkpoint
concurrently while training, and checkpoint-and-stop when the job must leave its GPUs.

    import tandem_job
    from tandem_job.checkpoints import checkpoints

    with tandem_job.session(total=10_000) as job:
        model, optimizer = build()                       # from code, as usual
        state = TrainingState(model, optimizer)          # shared.checkpoint.state
        with checkpoints(job, state, every=200):         # restores the image the host handed over
            for step in job.steps():                     # starts at the image's step
                train_one_step(step)

Under Tandem the host passes the data store (``$TANDEM_CHECKPOINT_STORE``, the cluster's
``[datastore]`` section) and, when the job has a committed image, that image's manifest
(``$TANDEM_CHECKPOINT``). The in-process agent (``shared.checkpoint``, POS-style) copies the state
in the background every ``every`` steps; on the stop word (lease over, moved, host drained) it
takes the image of that step boundary (an image in flight is committed first), and the process
exits at once (``exit_on_stop``; the interpreter's own teardown would hold the GPUs for seconds).
Each committed image is announced in ``checkpoint.json`` in the job's directory, which the host
relays to the checkpoint service; only then does the host release the job's GPUs. Every object
the agent stores until its next announcement is journaled (``checkpoint-written.log``); once the
process has exited, the host hands the journal to the service, which collects what no kept image
needs (a capture killed mid-way leaves packs no commit names). A job
killed without a stop (SIGKILL, host lost) restarts from its last committed image, losing at most
the steps since. Outside Tandem (no store in the environment) nothing is checkpointed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tandem_job import Job, write_atomically

if TYPE_CHECKING:
    from shared.checkpoint import CheckpointAgent, CommitResult, Restore, StoreLink, TrainingState
    from shared.datastore import ObjectRef

ENV_STORE = "TANDEM_CHECKPOINT_STORE"  # JSON: the [datastore] section, its path absolute
ENV_IMAGE = "TANDEM_CHECKPOINT"  # JSON: the manifest's ObjectRef of the image to restore
ANNOUNCE_FILE = "checkpoint.json"
# Every object the agent stored since its last announcement, a digest a line, written as the store
# answers: a process killed mid-capture leaves packs no commit will name, and once it has exited
# the host hands these to the service to collect. An announcement accounts for everything stored
# before it (its image, and its ``written`` packs of failed attempts), so it empties the journal.
JOURNAL_FILE = "checkpoint-written.log"


class Journal:
    """``JOURNAL_FILE``: appended from the store's loop thread, emptied from the training thread."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def stored(self, ref: ObjectRef) -> None:
        with self._lock:
            self._file.write(ref.digest + "\n")

    def announced(self) -> None:
        with self._lock:
            self._file.truncate(0)

    def close(self) -> None:
        with self._lock:
            self._file.close()


DEFAULT_EVERY = 100


class Checkpoints:
    """A ``Job`` hook; see the module docstring. ``restored_step``: the image restored, if any."""

    def __init__(
        self, job: Job, state: TrainingState, *, every: int = DEFAULT_EVERY, exit_on_stop: bool = True
    ) -> None:
        if every < 1:
            raise ValueError("checkpoint every >= 1 steps")
        self.job = job
        self.state = state
        self.every = every
        self.exit_on_stop = exit_on_stop
        self.restored_step: int | None = None
        self.last: CommitResult | None = None
        self._dir = Path(os.environ["TANDEM_JOB_DIR"]) if os.environ.get("TANDEM_JOB_DIR") else None
        self._link: StoreLink | None = None
        self._agent: CheckpointAgent | None = None
        self._restore: Restore | None = None
        self._restore_started = 0.0
        self._journal: Journal | None = None

    def __enter__(self) -> Checkpoints:
        raw_store = os.environ.get(ENV_STORE)
        if not raw_store:
            return self
        from shared.checkpoint import CheckpointAgent, Manifest, Restore, StoreLink
        from shared.config import config_from_json
        from shared.datastore import ObjectRef, open_datastore

        config = config_from_json(json.dumps({"datastore": json.loads(raw_store)}))
        self._link = link = StoreLink.start(lambda: open_datastore(config))
        if self._dir is not None:
            self._journal = Journal(self._dir / JOURNAL_FILE)
            link.on_stored = self._journal.stored
        raw_image = os.environ.get(ENV_IMAGE)
        last = last_ref = None
        if raw_image:
            self._restore_started = time.monotonic()
            last_ref = ObjectRef.from_dict(json.loads(raw_image))
            last = Manifest.from_json(link.get(last_ref).result())
            self._restore = Restore(self.state, link, last)
            self._restore.start()  # the small state now; tensors load while the first step runs
            self.restored_step = self.state.step = last.step
            self.job.start = self.job.done = last.step
            self.job.reported.update(restored_step=last.step)
        self._agent = CheckpointAgent(
            self.state, link, job=self.job.job_id or "job", last=last, last_ref=last_ref
        )
        self.job.hooks.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self in self.job.hooks:
            self.job.hooks.remove(self)
        self._finish_restore()
        if self._agent is not None:
            self._agent.close()
        if self._link is not None:
            self._link.close()
        if self._journal is not None:
            self._journal.close()

    def _finish_restore(self) -> None:
        if self._restore is not None:
            self._restore.wait()
            self._restore = None
            self.job.reported.update(restore_s=round(time.monotonic() - self._restore_started, 4))

    # ---- the hook ---------------------------------------------------------------------------------

    def boundary(self, done: int) -> None:
        agent = self._agent
        if agent is None:
            return
        self._finish_restore()  # before the next image is begun (it reads the tensors)
        result = agent.step_boundary(done)
        if result is not None:
            self._announce(result)
        if done % self.every == 0 and not agent.in_flight:
            agent.begin()

    def stopping(self, done: int) -> None:
        """Checkpoint-and-stop: the image of this boundary, committed before the loop ends."""
        agent = self._agent
        if agent is None:
            return
        self._finish_restore()
        started = time.monotonic()
        agent.state.step = done
        result = agent.checkpoint()
        self.job.reported.update(checkpoint_stop_s=round(time.monotonic() - started, 4))
        self._announce(result)
        if self.exit_on_stop:
            self._exit_stopped(done)

    def _exit_stopped(self, done: int) -> None:
        """Everything the job is resumes from the image just committed: end the process now. The
        interpreter's teardown of torch and its threads holds the GPUs for seconds more (4-6 s
        measured at the job's idle CPU priority on a loaded machine, 0.1 s with ``os._exit``)."""
        self.job.done = done
        self.job._report("stopped", force=True)
        print(f"tandem: stopped at step {done}, image committed; exiting", flush=True)
        sys.stderr.flush()
        os._exit(0)

    def _announce(self, result: CommitResult) -> None:
        """Tell the host (``checkpoint.json``, replaced atomically) what is now committed."""
        self.last = result
        announcement: dict[str, Any] = {
            "step": result.step,
            "manifest": result.manifest_ref.to_dict(),
            "written": list(result.written),
            "stall_ms": round(result.stall_s * 1000, 3),
            "at": time.time(),
        }
        self.job.reported.update(checkpoint_step=result.step)
        if self._dir is not None:
            write_atomically(self._dir / ANNOUNCE_FILE, json.dumps(announcement))
            if self._journal is not None:
                self._journal.announced()  # after the announcement: a kill between loses nothing
        self.job.report()


def checkpoints(
    job: Job, state: TrainingState, *, every: int = DEFAULT_EVERY, exit_on_stop: bool = True
) -> Checkpoints:
    """Restore and checkpoint ``state`` over ``job``'s steps (a context manager). ``exit_on_stop``:
    the process ends as soon as its stop image is committed (code after the loop does not run on a
    stop; it runs when the job finishes); False lets the loop end as usual, exiting later."""
    return Checkpoints(job, state, every=every, exit_on_stop=exit_on_stop)
