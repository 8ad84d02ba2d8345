"""The Tandem kernel replica: an ``IPythonKernel`` that executes a cell only when its Raft group
elects it (NotebookOS §3.2.2; docs/protocol.md, execute path steps 3-7).

Hooks into ipykernel 7.4 (tornado/asyncio, not anyio; the shell handler runs on the main thread
and user code blocks it):

* ``execute_request`` is replaced (the base publishes ``execute_input`` and runs the code before
  anything could be decided), reusing ``do_execute``, ``init_metadata``/``finish_metadata`` and
  ``_publish_execute_input``; ``yield_request`` is added as a shell handler via ``msg_types``;
* ``pre_handler_hook``/``post_handler_hook`` install a SIGINT handler that raises
  ``KeyboardInterrupt`` only while user code runs (ipykernel's own ``default_int_handler`` would
  raise it inside the event loop while a handler awaits Raft, which ends the kernel);
* ``_abort_queues`` is disabled: which queued requests an error aborts depends on each replica's
  arrival timing, so replicas would disagree; the scheduler owns that decision;
* ``do_shutdown`` stops Raft before the base shuts the kernel down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import os
import signal
import sys
import time
import typing as t
import uuid
from collections import deque
from types import FrameType

import structlog
import zmq
from ipykernel.ipkernel import IPythonKernel
from ipykernel.jsonutil import json_clean

from kernel_replica import comm_sync, helper
from kernel_replica.cell_analysis import (
    FunctionFacts,
    analyse_cell,
    identifier_before,
    mentioned_names,
    names_to_check,
    names_to_load,
    update_registry,
)
from kernel_replica.device_residency import GpuResidency
from kernel_replica.durability import (
    Backoff,
    ExecutorRecord,
    missing_here,
    missing_notice,
    protected_again,
    unprotected_warning,
)
from kernel_replica.election_core import COMMITTED, DIVERGED_EXIT_CODE, SUPERSEDED, UNCOMMITTED
from kernel_replica.lazy_load import LazyLoader, Load, Silence
from kernel_replica.library_settings import modules_missing
from kernel_replica.log_entries import Done, State
from kernel_replica.object_codec import DEFAULT_LARGE_OBJECT_BYTES, ObjectCodec, is_large
from kernel_replica.output_history import (
    CellOutput,
    Unreplicated,
    capture_output,
    enter_outputs,
    output_loaded,
    reads_outputs,
    resolve_output,
)
from kernel_replica.process_context import ProcessContext, ProcessState
from kernel_replica.raft_bridge import (
    BindFailed,
    Execute,
    Failed,
    RaftBridge,
    Replay,
    Standby,
    Unavailable,
)
from kernel_replica.state_sync import (
    StatePlan,
    apply_state,
    complete_state,
    not_imported,
    not_loaded_reason,
    open_replica_datastore,
    plan_state,
    preimport,
    replicable_names,
    value_fingerprint,
)
from shared.config import Config
from shared.datastore.base import DataStore
from shared.election_round import OUTCOME_FIELD, SILENT_FIELD, election_key, round_of
from shared.raft.driver import RaftError

if t.TYPE_CHECKING:
    from kernel_replica.state_image import StateImager

EXECUTOR = "executor"
# A standby learns a cell from its DONE; its input history and function registry catch up on
# the next request it handles, or once this many cells are waiting (off the critical path).
FOLLOWED_CATCH_UP = 64
# The executor's idle waits for the cell's DONE and STATE to commit, at most this long (a group
# that lost its quorum must not leave the client without idle; the commit goes on behind it).
IDLE_REPLICATION_WAIT_S = 2.0
# A replica whose namespace ran ahead of the log (``cell_outcome_superseded``) exits with
# DIVERGED_EXIT_CODE this long after its reply; the scheduler replaces it like any dead replica.
DIVERGED_EXIT_DELAY_S = 0.3
TIMING_SUMMARY_EVERY = 100
STANDBY = "standby"


def error_content(ename: str, evalue: str, execution_count: int) -> dict[str, t.Any]:
    """An ``execute_reply`` error body for a cell Tandem could not run (no user traceback)."""
    return {
        "status": "error",
        "ename": ename,
        "evalue": evalue,
        "traceback": [f"{ename}: {evalue}"],
        "execution_count": execution_count,
        "user_expressions": {},
        "payload": [],
    }


class TandemKernel(IPythonKernel):
    """One replica of a distributed kernel; see the module docstring for the ipykernel hooks."""

    implementation = "tandem"
    msg_types = [*IPythonKernel.msg_types, "yield_request"]

    def __init__(self, **kwargs: t.Any) -> None:
        super().__init__(**kwargs)
        self.replica_id = os.environ.get("TANDEM_REPLICA_ID", "r?")
        self.kernel_id = os.environ.get("TANDEM_KERNEL_ID", "?")
        self._bridge: RaftBridge | None = None
        self._slog = structlog.get_logger("replica.kernel")
        self._user_code_running = False
        self._interrupt_pending = False
        self._exit_asked = False  # exit() ran in the current cell (``_ask_exit``)
        self._config: Config | None = None
        self._codec: ObjectCodec | None = None
        self._store_timer: _TimedStore | None = None
        self._behind_store: DataStore | None = None  # write-behind: a store on the Raft thread's loop
        # datastore.background_image: large objects copied after the reply (state_image.py), made
        # on the first cell that needs one (it imports torch)
        self._imager: StateImager | None = None
        self._registry: dict[str, FunctionFacts] = {}  # notebook functions seen in cells (any role)
        self._warned: set[str] = set()  # names reported as not replicated, once each
        self._idle_sent: str | None = None  # msg_id whose idle went out before its handler ended
        self._followed: list[tuple[int, str]] = []  # (count, code) of cells run elsewhere, not yet in history
        self._apply_tail: asyncio.Future[None] | None = None  # the latest STATE being applied here
        self.apply_ms: deque[float] = deque(maxlen=1000)  # standby: STATE applied to the namespace
        self.timings: deque[dict[str, float]] = deque(maxlen=1000)  # recent per-cell step timings (ms)
        self._executed_since_summary = 0
        self._pending_digests: dict[str, bytes] | None = None  # digests of the latest unconfirmed STATE
        self._trace_sync = False  # log.sync_timings: per-cell state_sent / state_applied info lines
        self._residency = GpuResidency()  # before any cell: pins CUDA_DEVICE_ORDER (NVML order)
        # No ok without durability (kernel_replica/durability.py): what this process holds that
        # the log does not, the STATE outcomes still to settle into it (in cell order: a write
        # behind the reply settles when it ends), and the marks already told to the user here
        self._own = ExecutorRecord()
        self._settling: deque[tuple[State | concurrent.futures.Future[State], tuple[str, ...]]] = deque()
        self._told: set[tuple[str, str]] = set()
        self._not_loaded: dict[str, str] = {}  # names whose logged value failed to load here, and why
        # datastore.lazy_load: large groups of applied STATEs read in the background (lazy_load.py)
        self._loader: LazyLoader | None = None
        self._loading_silence: Silence | None = None  # while the loader is busy
        self.cell_loads: deque[dict[str, t.Any]] = deque(maxlen=100)  # ``_load_for``'s records
        self._store_retry = Backoff()  # reopening a data store that failed to open
        self._store_lock: asyncio.Lock | None = None
        self._write_outcome_wait_s = 0.005  # datastore.write_outcome_wait_s
        self._cells_active = 0  # cell requests being handled (the background retry waits for none)
        self._repair_task: asyncio.Future[None] | None = None  # encoding unstored values between cells
        self._repair_write: concurrent.futures.Future[State] | None = None  # and writing them behind
        self._repair_timer: asyncio.TimerHandle | None = None
        self._pending_comm_digests: dict[str, bytes] | None = None  # of the latest unconfirmed STATE
        self._comm_opened: dict[str, dict[str, t.Any]] = {}  # front-end comm_open data (comm_sync)
        # working directory, environment and sys.path: what this process started with, and the
        # context applied here since (kernel_replica/process_context.py)
        self._process = ProcessState()
        self._process.notebook_modules.holder = self._variable_holding
        user_ns = self.shell.user_ns if self.shell is not None else None
        self._process.library_patches.namespace = self._process.notebook_modules.namespace = user_ns
        self._process_notice: str | None = None  # what could not be applied, for the next cell here
        # library settings other executors changed (library_settings), set before a cell runs here:
        # in the cells' own context (numpy's error and print options, decimal's are context
        # variables: set by the task that loads a STATE, they would stay in that task)
        self._pending_settings: dict[str, bytes] = {}
        # (count, object) of the outputs (Out[n]) other executors showed, taken as their STATE
        # applied here, entered into this shell's output history before a cell runs here
        # (kernel_replica/output_history.py); markers of those whose variable was still loading
        self._pending_outputs: list[tuple[int, t.Any]] = []
        self._awaited_outputs: list[Unreplicated] = []
        self._comm_watch = comm_sync.CommWatch()  # which comms changed since their records were taken
        self._comms_not_loaded: dict[str, str] = {}  # comm id -> why it could not be re-created here
        # comm messages from the front end: handled here, then their effect on the comms replicated
        for msg_type in ("comm_open", "comm_msg", "comm_close"):
            self.shell_handlers[msg_type] = self._comm_request
        if self.shell is not None:
            self.shell.register_magic_function(self._tandem_magic, magic_kind="line", magic_name="tandem")
            self._record_config_magics(self.shell)

    def _record_config_magics(self, shell: t.Any) -> None:
        """Every line magic goes through ``run_line_magic`` (IPython rewrites ``%name line`` to
        it): the configuration ones that ran are recorded for the next executor to replay
        (``process_context.CONFIG_MAGICS``)."""
        run = shell.run_line_magic

        def run_line_magic(magic_name: str, line: str, _stack_depth: int = 1) -> t.Any:
            result = run(magic_name, line, _stack_depth=_stack_depth + 1)  # one frame more: ours
            self._process.record_magic(magic_name, line)
            return result

        shell.run_line_magic = run_line_magic

    def _replay_magic(self, name: str, line: str) -> None:
        """A configuration magic another executor ran, run here quietly (between cells: what it
        prints would reach no cell)."""
        assert self.shell is not None
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            self.shell.run_line_magic(name, line)

    def attach(
        self, bridge: RaftBridge, *, kernel_id: str, replica_id: str, config: Config | None = None
    ) -> None:
        """Called by the launcher once the Raft thread runs; wires the Raft thread's callbacks.
        ``config``'s ``[datastore]`` section names the store large objects go to."""
        self._bridge = bridge
        self._config = config
        self._trace_sync = bool(config.get("log.sync_timings")) if config is not None else False
        if config is not None:
            self._residency.mode = str(config.get("kernel.gpu_residency"))
            self._write_outcome_wait_s = float(config.get("datastore.write_outcome_wait_s"))
            for backoff in (self._own.backoff, self._store_retry):
                backoff.initial_s = float(config.get("datastore.retry_initial_s"))
                backoff.max_s = float(config.get("datastore.retry_max_s"))
        self.kernel_id, self.replica_id = kernel_id, replica_id
        self._slog = structlog.get_logger("replica.kernel").bind(kernel=kernel_id, replica=replica_id)
        core = bridge.core
        core.on_done = self._apply_remote_done
        core.on_state = self._apply_remote_state
        core.on_namespace_restored = self._load_namespace
        core.on_execution_count = self._resume_count
        core.on_stop_requested = self._stop_requested
        self.shell.ask_exit = self._ask_exit  # type: ignore[method-assign]

    def _ask_exit(self) -> None:
        """``exit()`` / ``quit()`` in a cell. ipykernel's own ends this process (its ``exit_now``
        stops the loop): the two standbys ran on with the namespace, and the next cell found every
        variable of the notebook that asked to exit. Here the reply carries ipykernel's payload
        as usual, and once it is sent the scheduler is told (``replica.event exit``) and stops the
        whole kernel, as a kernel process ending would. ``exit(keep_kernel=True)`` only writes
        the payload, as in ipykernel."""
        assert self.shell is not None
        keep = self.shell.keepkernel_on_exit
        self.shell.payload_manager.write_payload({"source": "ask_exit", "keepkernel": keep})
        if not keep:
            self._exit_asked = True

    # ---- SIGINT: KeyboardInterrupt only inside user code ---------------------------------------------
    def pre_handler_hook(self) -> None:
        if self._followed:
            self._catch_up_followed()
        self.saved_sigint_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def post_handler_hook(self) -> None:
        signal.signal(signal.SIGINT, self.saved_sigint_handler)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self._user_code_running:
            raise KeyboardInterrupt
        # Waiting on Raft (election, DONE): raising here would unwind the event loop. Remember it so
        # a cell this replica is about to execute is not started.
        self._interrupt_pending = True
        self._slog.info("interrupt_outside_user_code")

    def _abort_queues(self, subshell_id: str | None = None) -> None:
        """Disabled: replicas must agree on every cell, and abort timing is per replica."""

    # ---- status -------------------------------------------------------------------------------------
    def _publish_status(self, status: str, channel: str, parent: dict[str, t.Any] | None = None) -> None:
        if status == "idle" and self._idle_sent is not None:
            header = (parent or self.get_parent(channel) or {}).get("header") or {}
            if header.get("msg_id") == self._idle_sent:
                self._idle_sent = None  # already published (``_publish_executor_idle``)
                return
        super()._publish_status(status, channel, parent)

    def _serialized_idle(self, parent: dict[str, t.Any]) -> list[bytes]:
        """The executor's idle for ``parent``, made and signed before the commit it waits for, so
        that only its send is left once the commit comes."""
        assert self.session is not None
        msg = self.session.msg("status", {"execution_state": "idle"}, parent=parent)
        return self.session.serialize(msg, ident=self._topic("status"))

    def _publish_executor_idle(self, parent: dict[str, t.Any], frames: list[bytes]) -> None:
        """The executor's idle once the cell's DONE and STATE are committed (the cell's output,
        flushed in ``_execute``, precedes it), from inside the handler; ipykernel's own idle for
        this request, after its flushes and hooks, is then skipped."""
        self.iopub_socket.send_multipart(frames)
        self._idle_sent = parent["header"]["msg_id"]

    # ---- the execute path ----------------------------------------------------------------------------
    async def execute_request(self, stream: t.Any, ident: t.Any, parent: dict[str, t.Any]) -> None:
        await self._in_cell(self._cell_request(stream, ident, parent, lead=True))

    async def yield_request(self, stream: t.Any, ident: t.Any, parent: dict[str, t.Any]) -> None:
        """The scheduler decided this replica cannot execute the cell (``execute_request`` rewritten)."""
        await self._in_cell(self._cell_request(stream, ident, parent, lead=False))

    async def _in_cell(self, request: t.Coroutine[t.Any, t.Any, None]) -> None:
        """A cell request waits for a background store of unprotected values to end (that write
        reads the live objects, which the cell could change under it), and none starts during
        the request."""
        repair = self._repair_task
        if repair is not None and not repair.done():
            with contextlib.suppress(Exception):
                await repair
        self._cells_active += 1
        try:
            await request
        finally:
            self._cells_active -= 1

    async def _cell_request(
        self, stream: t.Any, ident: t.Any, parent: dict[str, t.Any], *, lead: bool
    ) -> None:
        if not self.session or self.shell is None:
            return
        try:
            # a cell sent again after a failed election is elected afresh under its round's key
            msg_id: str = election_key(parent["header"]["msg_id"], round_of(parent["header"]))
            content = parent["content"]
            code: str = content["code"]
            silent: bool = content.get("silent", False)
            execute_args: dict[str, t.Any] = {
                "code": code,
                "silent": silent,
                "store_history": content.get("store_history", not silent),
                "user_expressions": content.get("user_expressions", {}),
                "allow_stdin": content.get("allow_stdin", False),
            }
            cell_meta = parent.get("metadata") or {}
            if self._do_exec_accepted_params["cell_meta"]:
                execute_args["cell_meta"] = cell_meta
            if self._do_exec_accepted_params["cell_id"]:
                execute_args["cell_id"] = cell_meta.get("cellId")
        except Exception:
            self.log.error("Got bad msg: %s", parent)
            return
        log = self._slog.bind(msg_id=msg_id)
        self._interrupt_pending = False
        metadata = self.init_metadata(parent)
        started = time.perf_counter()
        timing: dict[str, float] = {}
        executed = replayed = no_executor = diverged = declined = False
        bridge = self._bridge
        if bridge is None:
            reply, role = (
                error_content("ReplicaNotReady", "the replica has no Raft bridge", self._count()),
                STANDBY,
            )
        else:
            silent = parent["header"].get(SILENT_FIELD)  # the designated candidate, found hung
            lost_executor = parent["header"].get(OUTCOME_FIELD)  # died running it: only its outcome
            decision = None
            if isinstance(lost_executor, str) and not lead:
                decision = await bridge.call(bridge.core.outcome_of(msg_id, lost_executor))
            if decision is None:
                decision = await bridge.call(
                    bridge.core.decide(msg_id, lead=lead, silent=silent if isinstance(silent, str) else None)
                )
            timing["decide_ms"] = (time.perf_counter() - started) * 1000
            match decision:
                case Execute(device_ids=device_ids):
                    timing |= {"elect_ms": decision.elect_ms, "state_wait_ms": decision.state_wait_ms}
                    timing["bind_ms"] = decision.bind_ms
                    if decision.state_missing:
                        self._warn_state_missing(decision.state_missing)
                    waited = time.perf_counter()
                    await self._state_applied(log)  # a STATE from another executor, being loaded
                    comm_sync.set_owner(self.comm_manager.comms, self)  # its widgets talk from here
                    timing["apply_wait_ms"] = (time.perf_counter() - waited) * 1000
                    if self._followed:  # DONEs that arrived while this cell waited for them
                        self._catch_up_followed()
                    if self._not_loaded:  # the store may work again: load them before telling
                        await self._load_again(bridge, log)
                    self._apply_settings()
                    if self._pending_outputs:
                        await self._enter_outputs(code)
                    if self._process_notice is not None and sys.stderr is not None:
                        print(f"Tandem: {self._process_notice}.", file=sys.stderr, flush=True)
                        self._process_notice = None
                    waited = time.perf_counter()
                    # a GPU cell moves the notebook's GPU objects onto its GPU first: those too
                    gpu = self._residency.names() if device_ids else set()
                    await self._load_for(
                        code, execute_args["user_expressions"].values(), msg_id=msg_id, also=gpu
                    )
                    timing["load_wait_ms"] = (time.perf_counter() - waited) * 1000
                    self._tell_missing(bridge)
                    ended = bridge.core.election.ended_before_run(msg_id)
                    if ended is not None:
                        # This replica won the cell, then stalled (paused, swapped out) before
                        # running it for longer than the executor silence: the standbys committed
                        # its outcome without it (ExecutorLost). The log is the truth; never run.
                        log.warning("cell_ended_before_it_ran", ename=ended.content.get("ename"))
                        bridge.thread.call(bridge.core.abandon)
                        reply, role, replayed = ended.content, STANDBY, True
                    else:
                        ran = time.perf_counter()
                        reply = await self._execute(parent, execute_args, device_ids, log)
                        timing["run_ms"] = (time.perf_counter() - ran) * 1000
                        timing |= self._residency.timings  # to_gpu_ms / to_host_ms, when tensors moved
                        role, executed = EXECUTOR, True
                case BindFailed(reason=reason):
                    reply = error_content(
                        "GpuUnavailable",
                        f"replica {self.replica_id} could not bind GPUs: {reason}",
                        self._count(),
                    )
                    reply, role = await self._commit_done(msg_id, reply, False, log), EXECUTOR
                    # the scheduler migrates a GPU cell rather than pass this on, unless the log
                    # holds another outcome (the standbys took this replica for dead meanwhile)
                    reply, verdict = bridge.core.election.committed_answer(msg_id, reply, self._count())
                    no_executor = verdict == COMMITTED
                case Standby(winner=winner):
                    log.debug("standby", executor=winner)
                    # its history learns the cell from the DONE (``_apply_remote_done``)
                    reply, role = await self._wait_for_executor(msg_id, winner), STANDBY
                case Replay(done=done):
                    log.info("answered_from_log", executor=done.replica_id)
                    # the original executor answers as executor again, so a merger that waits
                    # for the executor's reply gets one (unless that replica is gone)
                    role = EXECUTOR if done.replica_id == self.replica_id else STANDBY
                    reply, replayed = done.content, True
                case Failed():
                    reply = error_content(
                        "NoExecutorAvailable",
                        "no replica of this kernel can run the cell now: every replica yielded "
                        "(no free GPUs on their hosts); the scheduler will migrate a replica",
                        self._count(),
                    )
                    role, no_executor = STANDBY, True
                case Unavailable(reason=reason, declined=declined):
                    log.warning("cell_not_run", reason=reason, declined=declined)
                    reply, role = error_content("ReplicaUnavailable", reason, self._count()), STANDBY
        idle: list[bytes] | None = None
        if executed and bridge is not None:
            # The reply and idle go out once the cell's DONE and STATE are committed: what the
            # client hears is what a majority of the replicas holds. A client that kills the
            # executor as soon as it sees idle still finds the cell's variables on the next
            # executor (idle before that commit lost them in some such runs: 4 of 5 when idle
            # preceded the planning, 1 CI run when it followed the hand-off to the Raft thread),
            # and an executor lost before its reply leaves the survivors the cell's outcome in
            # the log: its DONE, or the ``ExecutorLost`` one they commit for it, never an ``ok``
            # the log does not hold. The namespace changes are taken now, before the next cell
            # can change them. ipykernel's flushes after the handler cost nothing: nothing was
            # queued on IOPub since the cell's own flush (streams.py).
            idle = self._serialized_idle(parent)
            timing |= await self._replicate_cell(bridge, msg_id, code, reply, log, execute_args)
            # Only a committed outcome is answered (ElectionCore.committed_answer). Superseded:
            # this replica stalled inside the cell past the executor silence; the standbys
            # committed the cell's outcome without it (ExecutorLost) and ignored its DONE and
            # STATE. The client hears the log's outcome, and this process, whose namespace now
            # holds changes the group does not, leaves so a fresh replica replaces it.
            reply, verdict = bridge.core.election.committed_answer(msg_id, reply, self._count())
            if verdict == SUPERSEDED:
                log.error("cell_outcome_superseded", ename=reply.get("ename"))
                diverged = True
            elif verdict == UNCOMMITTED:
                log.error("cell_outcome_not_committed")
        timing["total_ms"] = (time.perf_counter() - started) * 1000
        metadata = self.finish_metadata(parent, metadata, reply)
        metadata["tandem"] = {"replica_id": self.replica_id, "role": role}
        if replayed:
            metadata["tandem"]["replayed"] = True
        if no_executor:  # the global scheduler sends a GPU cell on again after a migration
            metadata["tandem"]["no_executor"] = True
        if declined:  # the global scheduler sends it to another replica
            metadata["tandem"]["declined"] = True
        self.session.send(stream, "execute_reply", reply, parent, metadata=metadata, ident=ident)
        if hasattr(stream, "flush"):
            # A ZMQStream only queues the reply; send it now, ahead of the idle that follows
            # (ipykernel would flush it only after publishing idle).
            stream.flush(zmq.POLLOUT)
        if executed and idle is not None:  # idle: made above, for a cell run here with a bridge
            self._publish_executor_idle(parent, idle)
        self._record_timing(role, reply, timing, log)
        if executed and bridge is not None and not diverged:
            self._report_timing(bridge, msg_id, timing)
        if self._exit_asked:
            self._exit_asked = False
            if executed and bridge is not None and not diverged:
                log.info("exit_asked")
                bridge.thread.call(bridge.core.scheduler.event, "exit", msg_id)
        if diverged:  # after the reply and idle are on their way
            asyncio.get_running_loop().call_later(DIVERGED_EXIT_DELAY_S, os._exit, DIVERGED_EXIT_CODE)

    @staticmethod
    def _report_timing(bridge: RaftBridge, msg_id: str, timing: dict[str, float]) -> None:
        """The executor's step times to the scheduler's metrics (``replica.event cell_timings``,
        via the local scheduler). Sent after the reply, from the Raft thread: off the critical path."""
        detail = {k: round(v, 3) for k, v in timing.items()}
        bridge.thread.call(bridge.core.scheduler.cell_timings, msg_id, detail)

    def _record_timing(
        self, role: str, reply: dict[str, t.Any], timing: dict[str, float], log: t.Any
    ) -> None:
        """Per-cell step timings: kept in ``timings``, logged at debug, summarised at info every
        ``TIMING_SUMMARY_EVERY`` executed cells (medians and p90s)."""
        timing["replied_ms"] = timing.pop("total_ms")
        self.timings.append(timing)
        log.debug(
            "cell_replied",
            role=role,
            status=reply.get("status"),
            **{k: round(v, 3) for k, v in timing.items()},
        )
        if role != EXECUTOR:
            return
        self._executed_since_summary += 1
        if self._executed_since_summary < TIMING_SUMMARY_EVERY:
            return
        self._executed_since_summary = 0
        recent = [tm for tm in list(self.timings)[-TIMING_SUMMARY_EVERY * 3 :] if "run_ms" in tm]
        summary: dict[str, t.Any] = {}
        keys = ("decide_ms", "elect_ms", "state_wait_ms", "apply_wait_ms", "bind_ms", "run_ms", "replied_ms")
        keys += ("analysis_ms", "fingerprint_ms", "serialize_ms", "store_ms", "state_bytes")
        for key in keys:
            values = sorted(tm[key] for tm in recent if key in tm)
            if values:
                summary[key] = [round(values[len(values) // 2], 3), round(values[int(len(values) * 0.9)], 3)]
        if self._bridge is not None:
            finish = sorted(list(self._bridge.core.finish_ms)[-TIMING_SUMMARY_EVERY:])
            if finish:
                summary["finish_ms"] = [  # DONE and STATE committed (the Raft commit step)
                    round(finish[len(finish) // 2], 3),
                    round(finish[int(len(finish) * 0.9)], 3),
                ]
        applied = sorted(list(self.apply_ms)[-TIMING_SUMMARY_EVERY:])
        if applied:  # STATE entries of other executors applied here while a standby
            summary["apply_ms"] = [
                round(applied[len(applied) // 2], 3),
                round(applied[int(len(applied) * 0.9)], 3),
            ]
        self._slog.info("cell_timings", cells=len(recent), p50_p90=summary)

    async def _execute(
        self, parent: dict[str, t.Any], args: dict[str, t.Any], device_ids: list[int], log: t.Any
    ) -> dict[str, t.Any]:
        """Step 5 on the executor: run with the bound GPUs; returns the reply (sent once DONE and
        STATE commit, see ``_replicate_cell``)."""
        assert self.shell is not None
        if not args["silent"]:
            self._publish_execute_input(args["code"], parent, self.execution_count)
        # CUDA_VISIBLE_DEVICES is left alone: CUDA reads it once per process, so a later cell bound
        # to another GPU could not reach it; the bound GPU is addressed by index instead.
        saved_env = {k: os.environ.get(k) for k in ("TANDEM_GPU_IDS",)}
        os.environ["TANDEM_GPU_IDS"] = ",".join(str(d) for d in device_ids)
        helper._bind(device_ids)
        # the cell and its user expressions (a front end's, evaluated after it: they may call code)
        self._before_user_code(args["code"], args["user_expressions"].values())
        self._residency.before_cell(self.shell.user_ns, device_ids)  # notebook tensors to the GPU
        try:
            if self._interrupt_pending:
                reply = error_content(
                    "KeyboardInterrupt", "interrupted before the cell started", self._count()
                )
            else:
                self._user_code_running = True
                # Python's own handler while user code runs: its KeyboardInterrupt carries no
                # frame of ours, so the user's traceback ends in their code (IPython always shows
                # the frame that raised, even one marked __tracebackhide__)
                outside = signal.signal(signal.SIGINT, signal.default_int_handler)
                try:
                    reply = await self.do_execute(**args)
                finally:
                    signal.signal(signal.SIGINT, outside)
                    self._user_code_running = False
        except KeyboardInterrupt:  # landed outside IPython's own handler: still a normal reply
            reply = error_content("KeyboardInterrupt", "interrupted", self._count())
        except Exception as exc:  # a bug of ours: the GPUs must still go back and DONE still commit
            log.exception("execute_failed")
            reply = error_content("TandemInternalError", f"{exc.__class__.__name__}: {exc}", self._count())
        finally:
            self._residency.after_cell(self.shell.user_ns)  # to host memory, before STATE pickles
            helper._unbind()
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if sys.stdout is not None:
            sys.stdout.flush()
        if sys.stderr is not None:
            sys.stderr.flush()
        # ipykernel sleeps ``_execute_sleep`` here so flushed output reaches clients before the
        # reply; the DONE commit below takes longer than that, so the sleep would only add latency.
        try:
            return json_clean(reply)
        except Exception as exc:
            return error_content("TandemInternalError", f"reply is not JSON-able: {exc}", self._count())

    async def _commit_done(
        self,
        msg_id: str,
        reply: dict[str, t.Any],
        state_follows: bool,
        log: t.Any,
        *,
        release_gpus: bool = False,
    ) -> dict[str, t.Any]:
        """Commit DONE so every replica replies the same; a lost quorum becomes an error reply."""
        assert self._bridge is not None
        done = Done(msg_id, self.replica_id, reply, self._count(), state_follows)
        try:
            await self._bridge.call(self._bridge.core.finish(done, release_gpus=release_gpus))
        except RaftError as exc:
            log.error("done_not_committed", error=str(exc))
            return error_content(
                "ReplicationFailed",
                f"the cell ran on {self.replica_id} but its completion could not be committed to the "
                f"kernel's Raft log ({exc.__class__.__name__}: {exc}); the kernel has probably lost quorum",
                self._count(),
            )
        return reply

    async def _wait_for_executor(self, msg_id: str, winner: str) -> dict[str, t.Any]:
        assert self._bridge is not None
        result = await self._bridge.call(self._bridge.core.wait_done(msg_id, winner, self._count()))
        if isinstance(result, Done):
            return result.content
        return error_content(
            "ReplicaUnavailable", f"waiting for {winner} to finish the cell: {result}", self._count()
        )

    def _catch_up_followed(self) -> None:
        """Put the cells other replicas executed into this replica's input history (``In``,
        ``_i``, history requests answered by any replica list the same cells) and function
        registry (for when it executes next), in log order. Deferred from the DONE to here: a
        standby is not on any cell's critical path, and most of this work is never needed soon."""
        followed, self._followed = self._followed, []
        for count, code in followed:
            if self.shell is not None:
                try:
                    self.shell.history_manager.store_inputs(count, self.shell.transform_cell(code), code)
                except Exception as exc:  # history is a convenience; never fail a request for it
                    self._slog.debug("history_not_recorded", error=repr(exc))
            self._remember_functions(code)

    def _cell_output(self, count: int) -> CellOutput | None:
        """Cell ``count``'s Out[n] as the log carries it (None: it showed none)."""
        assert self.shell is not None
        namespace, hidden = self.shell.user_ns, self.shell.user_ns_hidden
        config = self._config
        limit = int(config.get("datastore.large_object_bytes")) if config else DEFAULT_LARGE_OBJECT_BYTES
        try:
            return capture_output(
                namespace, count, lambda: replicable_names(namespace, hidden), max_bytes=limit
            )
        except Exception as exc:  # the history is a convenience: never fail the cell for it
            self._slog.debug("output_not_recorded", error=repr(exc))
            return None

    def _count(self) -> int:
        return int(self.shell.execution_count) if self.shell is not None else 0

    # ---- DONE and state replication ------------------------------------------------------------------
    async def _replicate_cell(
        self,
        bridge: RaftBridge,
        msg_id: str,
        code: str,
        reply: dict[str, t.Any],
        log: t.Any,
        execute_args: dict[str, t.Any],
    ) -> dict[str, float]:
        """Steps 5 and 7 as the cell ends: find and encode the namespace changes here (the main
        thread owns the namespace, and the next cell must not change it first), then hand DONE
        and STATE to the Raft thread, which commits them in order. Returns the replication steps'
        timings (ms) once DONE and STATE are committed (at most ``IDLE_REPLICATION_WAIT_S``;
        large objects written behind are not waited for)."""
        assert self.shell is not None
        finished_at = time.time()
        # the code the standbys put in their input history (None: not stored there)
        history = code if not execute_args["silent"] and execute_args["store_history"] else None
        done = Done(msg_id, self.replica_id, reply, self._count(), True, history)
        self._settle_written()
        effects = None
        try:
            started = time.perf_counter()
            effects = analyse_cell(code, self._registry)
            update_registry(self._registry, effects)
            self._process.library_patches.note(effects.attribute_targets, self.shell.user_ns)
            analysed_ms = (time.perf_counter() - started) * 1000
            codec = await self._get_codec()
            timer = self._store_timer
            plan = await plan_state(
                effects,
                self.shell.user_ns,
                self._replicated_digests(bridge),
                codec,
                hidden=self.shell.user_ns_hidden,
                store_seconds=(lambda: timer.write_s) if timer is not None else None,
                # while the store fails, write before the reply: the attempt's outcome is then
                # on this cell's output, not found out after it
                defer_large=self._behind_store is not None and not self._own.backoff.failing,
                defer_max_bytes=int(self._config.get("datastore.write_behind_max_bytes"))
                if self._config
                else None,
                retry=self._own.retry_names(time.monotonic()),
                unprotected={*self._own.names, *bridge.core.namespace.unprotected()},
                images=self._images_wanted(),
                loading=self._loader.pending.names() if self._loader is not None else (),
            )
            plan.timings["analysis_ms"] += analysed_ms
        except Exception as exc:  # never leave the group waiting for a STATE that will not come
            log.exception("state_detection_failed")
            plan = StatePlan()
            why = f"Tandem could not encode the cell's changes: {exc.__class__.__name__}: {exc}"
            if effects is not None and not effects.unknown:
                plan.unstored = dict.fromkeys(
                    (n for n in effects.candidates() if n in self.shell.user_ns and not n.startswith("_")),
                    why,
                )
        for name, reason in plan.skipped.items():
            self._warn_unreplicable(name, reason)
        # with what this replica keeps in host memory for the GPU: the next executor needs it too
        state = plan.state(msg_id, self.replica_id, self._residency.carried())
        comms, closed = self._comm_changes(bridge)
        if comms or closed:
            state = dataclasses.replace(state, comms=comms, comms_closed=closed)
        process, logged = self._process.capture(), bridge.core.namespace.process_context()
        notices = {
            **self._process.notebook_modules.take_warnings(),
            **self._process.library_patches.take_warnings(),
        }
        for name, notice in notices.items():
            self._slog.warning("module_global_not_replicated", variable=name, notice=notice)
            if sys.stderr is not None:
                print(f"Tandem: {notice}.", file=sys.stderr, flush=True)
        if process != logged:  # %cd, %env, sys.path, %load_ext, np.random.seed
            state = dataclasses.replace(state, process=process.changed_since(logged))
        if history is not None and isinstance(reply.get("execution_count"), int):
            output = self._cell_output(reply["execution_count"])
            if output is not None:
                state = dataclasses.replace(state, output=output)
        if plan:
            pending = dict(self._replicated_digests(bridge))
            pending.update(plan.fingerprints)
            for name in plan.deleted:
                pending.pop(name, None)
            self._pending_digests = pending
        written = None
        images = self._begin_images(plan, log)
        if (plan.deferred or images) and self._behind_store is not None:  # behind, on the Raft thread
            written = bridge.thread.submit(
                complete_state(state, plan.deferred, self._behind_store, log, images=images)
            )
        self._settling.append((written if written is not None else state, plan.retried))
        replicated: concurrent.futures.Future[None] = concurrent.futures.Future()
        proposed_at = time.time()
        bridge.thread.call(bridge.core.finish_cell, done, state, written, replicated)
        waited = time.perf_counter()
        try:
            # blocking at once (the Raft thread needs the GIL to propose), GIL released: the Raft
            # thread wakes this thread directly, no loop turn
            replicated.result(IDLE_REPLICATION_WAIT_S)
        except concurrent.futures.TimeoutError:
            log.warning("idle_before_state_committed", waited_s=IDLE_REPLICATION_WAIT_S)
        if written is not None:  # a store that refuses writes fails at once (the open fails)
            concurrent.futures.wait([written], timeout=self._write_outcome_wait_s)
        self._settle_written()
        self._warn_unprotected(log)
        timings = {k: v for k, v in plan.timings.items()}
        timings["replicate_ms"] = (time.perf_counter() - waited) * 1000
        if plan:
            timings["state_bytes"] = float(plan.nbytes())
            log.debug(
                "state_proposed",
                names=sorted(n for g in plan.groups for n in g["names"]),
                imports=[a for a, _ in plan.imports],
                deleted=plan.deleted,
                pointers=sum(1 for g in plan.groups if g.get("pointer")),
                **{k: round(v, 3) for k, v in timings.items()},
            )
        if self._trace_sync:  # wall clock: the standbys' state_applied lines are compared to it
            log.info("state_sent", replied_at=finished_at, proposed_at=proposed_at, **timings)
        return timings

    # ---- %tandem ----------------------------------------------------------------------------------------
    def _tandem_magic(self, line: str) -> None:
        """``%tandem pin``: the kernel's cells run on this replica whenever its host can run them
        (the scheduler's executor choice prefers it: ``shared.policies.executor_choice``), for
        objects that cannot be replicated or data kept on this host's GPU; ``%tandem unpin``: the
        scheduler chooses again; ``%tandem``: where this cell runs."""
        from IPython.core.error import UsageError

        command = (line.split() or ["status"])[0]
        where = f"replica {self.replica_id} (host {os.environ.get('TANDEM_HOST_ID', '?')})"
        if command == "status":
            print(f"Tandem: this cell runs on {where} of kernel {self.kernel_id}.")
            return
        if command not in ("pin", "unpin"):
            raise UsageError(f"%tandem {command}: expected pin, unpin or nothing")
        bridge = self._bridge
        if bridge is None:
            raise UsageError("this replica is not attached to its kernel's group: nothing to pin")
        pinned = command == "pin"
        event = functools.partial(bridge.core.scheduler.event, "pinned", None, pinned=pinned, at=time.time())
        bridge.thread.call(event)
        self._slog.info("pin_requested", pinned=pinned)
        if pinned:
            print(
                f"Tandem: this kernel's cells now run on {where} whenever its host can run them "
                "(objects that cannot be replicated stay usable); %tandem unpin releases it."
            )
        else:
            print("Tandem: the kernel is not pinned any more; each cell's executor is chosen again.")

    # ---- comms (kernel_replica/comm_sync.py) ----------------------------------------------------------
    async def _comm_request(self, stream: t.Any, ident: t.Any, parent: dict[str, t.Any]) -> None:
        """``comm_open``/``comm_msg``/``comm_close`` from the front end. The scheduler sends them
        to the kernel's last executor: this replica, which takes over the comms (with every STATE
        it was handed applied first, so a comm opened on the previous executor exists here), lets
        ipykernel's comm manager handle the message, and replicates what it changed at once (a
        slider moved between cells must not be lost if the next cell runs elsewhere)."""
        await self._state_applied(self._slog)
        await self._load_for(None)  # a comm handler may reach any name
        comm_sync.set_owner(self.comm_manager.comms, self)
        self._before_user_code()  # a comm handler is user code: it may write what is being imaged
        msg_type = parent["header"]["msg_type"]
        if msg_type == "comm_open":
            content = parent.get("content") or {}
            self._comm_opened[str(content.get("comm_id"))] = {
                "data": content.get("data") or {},
                "metadata": parent.get("metadata") or {},
            }
        getattr(self.comm_manager, msg_type)(stream, ident, parent)
        bridge = self._bridge
        if bridge is None:
            return
        comms, closed = self._comm_changes(bridge)
        if comms or closed:
            state = State(
                f"comm-{uuid.uuid4().hex}", self.replica_id, repair=True, comms=comms, comms_closed=closed
            )
            bridge.thread.call(bridge.core.finish_repair, state, None)
            self._slog.debug("comms_proposed", comms=sorted(comms), closed=list(closed))

    def _comm_changes(self, bridge: RaftBridge) -> tuple[dict[str, dict[str, t.Any]], tuple[str, ...]]:
        """The comm records to replicate against what the log will hold once this process's
        STATEs in flight commit; a widget whose state cannot be taken is told once."""
        for comm_id in [c for c in self._comm_opened if c not in self.comm_manager.comms]:
            del self._comm_opened[comm_id]
        replicated = self._pending_comm_digests
        if replicated is None or not bridge.core.finishing():
            replicated = bridge.core.namespace.comm_digests()
        namespace = self.shell.user_ns if self.shell is not None else None
        comms, closed, failed = self._comm_watch.changes(
            self.comm_manager.comms, self._comm_opened, replicated, namespace
        )
        for comm_id, reason in failed.items():
            self._warn_unreplicable(comm_id, reason, what="widget model")
        pending = {cid: fp for cid, fp in replicated.items() if cid not in closed}
        pending.update({cid: comm_sync.record_digest(record) for cid, record in comms.items()})
        self._pending_comm_digests = pending
        return comms, closed

    async def _get_codec(self) -> ObjectCodec:
        """The codec, with the configured data store (opened on first use). A store that fails
        to open is opened again on later cells, with backoff; meanwhile large objects go inline
        in the Raft log, up to ``object_codec.MAX_INLINE_BYTES``, and larger ones are unstored."""
        if self._codec is None:
            config = self._config
            large = int(config.get("datastore.large_object_bytes")) if config else DEFAULT_LARGE_OBJECT_BYTES
            self._codec = ObjectCodec(None, large_object_bytes=large)
            if config is None:
                self._codec.store_error = "no configuration"
        if self._codec.store is None and self._config is not None and self._store_retry.due(time.monotonic()):
            if self._store_lock is None:
                self._store_lock = asyncio.Lock()
            async with self._store_lock:  # a STATE applied meanwhile would open a second one
                if self._codec.store is None and self._store_retry.due(time.monotonic()):
                    await self._open_store(self._codec, self._config)
        return self._codec

    async def _open_store(self, codec: ObjectCodec, config: Config) -> None:
        try:
            store = await open_replica_datastore(config)
        except Exception as exc:
            codec.store_error = f"{exc.__class__.__name__}: {exc}"
            self._store_retry.failed(time.monotonic())
            self._slog.warning("datastore_unavailable", error=codec.store_error)
            return
        self._store_retry.succeeded()
        if config.get("datastore.write_behind"):
            bridge = self._bridge
            try:  # its clients belong to the loop that writes: the Raft thread's
                self._behind_store = await bridge.call(open_replica_datastore(config)) if bridge else None
            except Exception as exc:
                self._slog.warning("write_behind_unavailable", error=f"{exc.__class__.__name__}: {exc}")
        self._store_timer = _TimedStore(store)
        codec.store, codec.store_error = self._store_timer, ""  # type: ignore[assignment]

    # ---- large objects imaged after the reply (kernel_replica/state_image.py) ------------------------
    def _images_wanted(self) -> bool:
        """Whether this cell's large groups go to a background image: configured, written behind
        (a store on the Raft thread to propose from), the store not failing (then the write's
        outcome belongs on the cell's own output), and torch already imported (the image is
        torch's machinery; a notebook without torch does not pay for importing it)."""
        config = self._config
        return (
            config is not None
            and bool(config.get("datastore.background_image"))
            and self._behind_store is not None
            and not self._own.backoff.failing
            and "torch" in sys.modules
        )

    def _begin_images(self, plan: StatePlan, log: t.Any) -> dict[int, concurrent.futures.Future[t.Any]]:
        """Mark the instant of each large group of ``plan`` and copy it in the background; a group
        whose image cannot even begin fails like a write that failed (it is reported unstored)."""
        if not plan.images:
            return {}
        started = time.perf_counter()
        if self._imager is None:
            from kernel_replica.state_image import StateImager  # imports torch (already imported)

            config = self._config
            assert config is not None
            self._imager = StateImager(lambda: open_replica_datastore(config), kernel=self.kernel_id)
        images: dict[int, concurrent.futures.Future[t.Any]] = {}
        for index, views in plan.images.items():
            try:
                images[index] = self._imager.begin(plan.groups[index]["names"], views, self._count())
            except Exception as exc:
                log.exception("state_image_not_begun")
                images[index] = concurrent.futures.Future()
                images[index].set_exception(exc)
        plan.images = {}  # the live views are the image's now
        plan.timings["image_begin_ms"] = (time.perf_counter() - started) * 1000
        return images

    def _before_user_code(self, code: str | None = None, expressions: t.Iterable[t.Any] = ()) -> None:
        """User code runs next: images in flight clone what no write guard would see first, of
        the groups ``code`` may change (the analysis the cell's replication trusts too, with
        its fallbacks: every name when it cannot tell); every group for other code (a comm
        handler)."""
        imager = self._imager
        if imager is None or not imager.untracked_in_flight():
            return
        names = None
        if code is not None and self.shell is not None:
            try:
                effects = analyse_cell("\n".join([code, *map(str, expressions)]), self._registry)
                sharing = self._codec.sharing() if self._codec is not None else None
                names = names_to_check(effects, self.shell.user_ns, shared_with=sharing)
            except Exception as exc:  # the safe side: every group
                self._slog.debug("cell_not_analysed", error=repr(exc))
        imager.before_user_code(names)

    # ---- no ok without durability (kernel_replica/durability.py) ------------------------------------
    def _settle_written(self) -> None:
        """Fold the STATE outcomes known so far into ``_own``, in cell order: a cell whose write
        behind the reply still runs holds back the cells after it."""
        while self._settling:
            outcome, retried = self._settling[0]
            if isinstance(outcome, concurrent.futures.Future):
                if not outcome.done():
                    return
                if outcome.cancelled() or outcome.exception() is not None:  # complete_state never raises
                    self._settling.popleft()
                    continue
                outcome = outcome.result()
            self._settling.popleft()
            self._own.settle(outcome, retried, time.monotonic())

    def _warn_unprotected(self, log: t.Any) -> None:
        """On the executor's cell, before its reply: the names whose latest values are only in
        this process's memory, and why (every cell, until a write succeeds); and those that were
        stored since the last warning, once."""
        recovered = self._own.take_recovered()
        if recovered and sys.stderr is not None:
            print(protected_again(recovered), file=sys.stderr)
            sys.stderr.flush()
        unstored = self._own.unstored()
        if not unstored:
            return
        self._schedule_repair()
        retry_in = max(0.0, self._own.backoff.next_at - time.monotonic())
        log.warning("state_unprotected", names=sorted(unstored), failures=self._own.backoff.failures)
        if sys.stderr is not None:
            print(unprotected_warning(unstored, retry_in), file=sys.stderr)
            sys.stderr.flush()

    def _schedule_repair(self) -> None:
        """Store the unstored values in the background when the backoff allows, not only with
        the next cell: a user who stops after the warning gets them protected all the same."""
        if self._repair_timer is not None:
            self._repair_timer.cancel()
        delay = max(0.05, self._own.backoff.next_at - time.monotonic())
        self._repair_timer = asyncio.get_running_loop().call_later(delay, self._start_repair)

    def _start_repair(self) -> None:
        self._repair_timer = None
        if (
            self._cells_active
            or (self._repair_task is not None and not self._repair_task.done())
            or (self._repair_write is not None and not self._repair_write.done())
        ):
            return  # the cell as it ends, or the write as it settles, schedules this again
        self._repair_task = asyncio.ensure_future(self._repair())

    async def _repair(self) -> None:
        """One background attempt: encode the unstored names as they are now, copy the large
        ones aside (cells wait for this, not for the write: the write must not read objects a
        cell is changing, and a hung store must not hold cells up), write them to the store on
        the Raft thread, and propose a repair STATE (``durability.apply_repair``) after this
        replica's cells in flight. Once it settles, scheduled again if anything is unstored."""
        bridge, shell = self._bridge, self.shell
        if bridge is None or shell is None:
            return
        self._settle_written()
        namespace = shell.user_ns
        names = [name for name in self._own.retry_names(time.monotonic()) if name in namespace]
        if not names:
            if self._own.unstored():
                self._schedule_repair()
            return
        log = self._slog.bind(retry=names)
        behind = self._behind_store
        try:
            codec = await self._get_codec()
            result = await codec.encode(
                namespace,
                names,
                universe=replicable_names(namespace, shell.user_ns_hidden),
                defer_large=behind is not None,
            )
            fingerprints = {name: value_fingerprint(namespace[name], namespace) for name in result.names}
        except Exception as exc:  # never raises out of the background: it is tried again
            log.warning("state_repair_failed", error=f"{exc.__class__.__name__}: {exc}")
            self._own.backoff.failed(time.monotonic())
            self._schedule_repair()
            return
        state = State(
            f"repair-{uuid.uuid4().hex}",
            self.replica_id,
            {name: fp for name, fp in fingerprints.items() if fp is not None},
            groups=tuple(group.to_dict() for group in result.groups),
            unstored=result.unstored,
            repair=True,
        )
        written = None
        if result.deferred and behind is not None:
            written = bridge.thread.submit(complete_state(state, result.deferred, behind, log))
        bridge.thread.call(bridge.core.finish_repair, state, written)
        self._settling.append((written if written is not None else state, tuple(names)))
        log.info("state_repair_proposed", behind=written is not None)
        if written is None:
            self._repair_settled()
        else:
            self._repair_write = written
            loop = asyncio.get_running_loop()
            written.add_done_callback(lambda _: loop.call_soon_threadsafe(self._repair_settled))

    def _repair_settled(self) -> None:
        """A background attempt's outcome is known: settle it, and try again later if needed."""
        self._settle_written()
        unstored = self._own.unstored()
        self._slog.info("state_repair_settled", unstored=sorted(unstored))
        if unstored:
            self._schedule_repair()

    def _tell_missing(self, bridge: RaftBridge) -> None:
        """Before the executor runs a cell: the names the previous executor could not get into
        the log, which this replica therefore lacks or holds an older value of, and those the
        log has but this replica could not load; each once, on the cell's stderr."""
        self._settle_written()
        missing = missing_here(bridge.core.namespace.unprotected(), self._own.names, self._told)
        not_loaded = {n: why for n, why in self._not_loaded.items() if (n, why) not in self._told}
        comms = {c: why for c, why in self._comms_not_loaded.items() if (c, why) not in self._told}
        if comms and sys.stderr is not None:
            self._told.update(comms.items())
            lines = [f"  widget model {comm_id}: {why}" for comm_id, why in sorted(comms.items())]
            print(
                f"Tandem: WARNING: replica {self.replica_id} runs this cell without these front-end "
                "objects (the front end's messages to them are dropped here):\n" + "\n".join(lines),
                file=sys.stderr,
            )
            sys.stderr.flush()
        if (not missing and not not_loaded) or self.shell is None:
            return
        self._told.update((name, marker.msg_id) for name, marker in missing.items())
        self._told.update(not_loaded.items())
        self._slog.warning("state_missing_here", names=sorted({*missing, *not_loaded}))
        if sys.stderr is not None:
            print(missing_notice(missing, not_loaded, self.shell.user_ns, self.replica_id), file=sys.stderr)
            sys.stderr.flush()

    async def _load_again(self, bridge: RaftBridge, log: t.Any) -> None:
        """Load the logged values of names that failed to load here (a store that was down)."""
        names = list(self._not_loaded)
        imports, groups = bridge.core.namespace.contents_of(names)
        logged = {alias for alias, _ in imports} | {n for _, kept in groups for n in kept}
        for name in names:
            if name not in logged:  # the log holds no value of it any more: nothing to load
                self._not_loaded.pop(name, None)
        if imports or groups:
            self._chain_apply("load_again", imports, [(g, kept) for g, kept in groups], [])
            await self._state_applied(log)

    def _replicated_digests(self, bridge: RaftBridge) -> dict[str, bytes]:
        """What the log will hold once this process's in-flight STATE entries commit: compare
        against that, or a cell that runs before the previous STATE commits would resend it."""
        if self._pending_digests is not None and bridge.core.finishing():
            return self._pending_digests
        self._pending_digests = None
        return bridge.core.namespace.digests()

    def _variable_holding(self, obj: t.Any) -> str | None:
        """A notebook variable that reaches ``obj`` itself, as the codec last recorded."""
        return self._codec.holder_of(obj) if self._codec is not None else None

    def _warn_unreplicable(self, name: str, reason: str, *, what: str = "variable") -> None:
        """Tell the user once per name (on the cell's stderr) that it stays on this replica."""
        if name in self._warned:
            return
        self._warned.add(name)
        self._slog.warning("variable_not_replicated", variable=name, reason=reason)
        if sys.stderr is not None:
            print(
                f"Tandem: {what} {name!r} is not replicated to this kernel's other replicas "
                f"({reason}); it will be missing if the notebook moves to another executor.",
                file=sys.stderr,
            )
            sys.stderr.flush()

    def _warn_state_missing(self, cells: tuple[str, ...]) -> None:
        """Running on a namespace that may lack an earlier cell's changes must not be silent."""
        if sys.stderr is not None:
            print(
                f"Tandem: the state left by {len(cells)} earlier cell(s) did not reach replica "
                f"{self.replica_id} in time (their executor was probably lost); variables those "
                "cells changed may be missing or stale here.",
                file=sys.stderr,
            )
            sys.stderr.flush()

    def _remember_functions(self, code: str) -> None:
        """A standby learns the cell's notebook functions too, for when it becomes the executor."""
        try:
            update_registry(self._registry, analyse_cell(code, self._registry))
        except Exception as exc:  # analysis is an optimisation; names_to_check has fallbacks
            self._slog.debug("cell_not_analysed", error=repr(exc))

    # ---- callbacks from the Raft thread (run on this thread via call_soon_threadsafe) ---------------
    def _apply_remote_done(self, done: Done) -> None:
        """Another replica finished a cell: number the next cell as it will (counts must agree),
        and follow its code (``_catch_up_followed``)."""
        if self.shell is not None:
            self.shell.execution_count = done.execution_count
        count = done.content.get("execution_count")
        if done.code is not None and isinstance(count, int) and done.content.get("ename") != "ExecutorLost":
            self._followed.append((count, done.code))
            # The batch runs after this cell's STATE is applied (``_apply``), not before it: ~20 ms
            # of history and analysis would otherwise delay the STATE on every standby at once.
            # Twice the batch: STATEs stopped coming, catch up here.
            if len(self._followed) >= 2 * FOLLOWED_CATCH_UP:
                self._catch_up_followed()

    def _apply_settings(self) -> None:
        """The library settings of the cells other executors ran since this replica last ran one."""
        if not self._pending_settings:
            return
        pending, self._pending_settings = self._pending_settings, {}
        unset = self._process.apply_settings(pending)
        if unset is not None:
            self._process_notice = "; ".join(n for n in (self._process_notice, unset) if n)

    async def _enter_outputs(self, code: str) -> None:
        """The outputs other executors showed, into this shell's history in log order. One held by
        a variable still loading here is loaded first if the cell may read the history (``_``,
        ``Out``), else entered as a marker that the load replaces."""
        loader = self._loader
        awaited = {m.awaiting for m in self._awaited_outputs if m.awaiting is not None}
        if awaited and loader is not None and reads_outputs(mentioned_names(code)):
            with contextlib.suppress(Exception):  # a failed load leaves its marker, which says so
                await loader.demand(awaited & loader.pending.names())
        pending, self._pending_outputs = self._pending_outputs, []
        try:
            enter_outputs(self.shell, pending)
        except Exception as exc:  # the history is a convenience: never fail the cell for it
            self._slog.warning("outputs_not_entered", error=repr(exc), count=len(pending))

    def _apply_remote_state(self, state: State) -> None:
        """Another executor's STATE: load it in the background, in log order (the next cell
        executed here waits for it, ``_state_applied``)."""
        if self.shell is None:
            return
        if state.comms or state.comms_closed or not state.repair:
            comm_sync.set_owner(self.comm_manager.comms, None)  # another replica owns the comms
        comms = (state.comms, state.comms_closed)
        if state.repair:  # values its executor stored after their cell: only those it still held
            if state.groups or state.comms or state.comms_closed:
                groups = [(g, list(g["names"])) for g in state.groups]
                self._chain_apply(state.msg_id, [], groups, [], comms=comms)
            return
        self._residency.adopt(state.gpu_resident)  # its GPU objects are ours when we execute next
        groups = [(g, None) for g in state.groups]
        mine = state.replica_id == self.replica_id  # this process has them already
        process = state.process if not mine else None
        outputs = [(state.output, state.replica_id)] if state.output is not None and not mine else []
        self._chain_apply(
            state.msg_id,
            list(state.imports),
            groups,
            list(state.deleted),
            time.time(),
            comms=comms,
            process=process,
            outputs=outputs,
        )
        if state.replica_id != self.replica_id and self._bridge is not None:
            self._yield_unprotected(self._bridge)

    def _yield_unprotected(self, bridge: RaftBridge) -> None:
        """Another replica executed after this one and told its user what it lacked (its STATE
        cleared the marks): values only this process could not store are not the notebook's any
        more. Put the log's values of those names back (or remove them), so this replica agrees
        with the others when it executes again, and stop retrying them. Unpicklable values are
        left alone: no replica can have them, and the user was told so when they were made."""
        self._settling.clear()  # earlier cells of this process: all applied before this STATE
        names = sorted(self._own.unstored())
        self._own.drop_all()
        if not names or self.shell is None:
            return
        imports, groups = bridge.core.namespace.contents_of(names)
        logged = {alias for alias, _ in imports} | {n for _, kept in groups for n in kept}
        gone = [name for name in names if name not in logged]
        self._slog.info("unprotected_values_dropped", names=names)
        self._chain_apply("unprotected", imports, [(g, kept) for g, kept in groups], gone)

    def _resume_count(self, count: int) -> None:
        """A hibernated kernel resumed: its cells go on numbering where they stopped."""
        if self.shell is not None and count > 0:
            self.shell.execution_count = count

    def _load_namespace(self, contents: t.Any) -> None:
        """A snapshot or a hibernation image was restored: rebuild the namespace from it (the log
        replays the rest) and the output history, and take over what its last executor kept in
        host memory for the GPU."""
        if self.shell is not None:
            imports, groups, gpu_resident, comms, gone, process, outputs = contents
            self._residency.adopt(gpu_resident)
            self._chain_apply(
                "snapshot", imports, groups, list(gone), comms=(comms, ()), process=process, outputs=outputs
            )

    def _chain_apply(
        self,
        msg_id: str,
        imports: list[tuple[str, str]],
        groups: list[tuple[dict[str, t.Any], list[str] | None]],
        deleted: list[str],
        received_at: float | None = None,
        *,
        comms: tuple[t.Mapping[str, dict[str, t.Any]], t.Iterable[str]] = ({}, ()),
        process: ProcessContext | None = None,
        outputs: t.Sequence[tuple[CellOutput, str]] = (),
    ) -> None:
        previous = self._apply_tail
        self._apply_tail = asyncio.ensure_future(
            self._apply(msg_id, imports, groups, deleted, previous, received_at, comms, process, outputs)
        )

    async def _apply(
        self,
        msg_id: str,
        imports: list[tuple[str, str]],
        groups: list[tuple[dict[str, t.Any], list[str] | None]],
        deleted: list[str],
        previous: asyncio.Future[None] | None,
        received_at: float | None = None,
        comms: tuple[t.Mapping[str, dict[str, t.Any]], t.Iterable[str]] = ({}, ()),
        process: ProcessContext | None = None,
        outputs: t.Sequence[tuple[CellOutput, str]] = (),
    ) -> None:
        """``received_at``: when the Raft thread handed the entry over (wall clock, for the trace).
        ``comms``: the records and closed ids the entry carries, applied before the namespace
        (a name bound to a widget is a reference to its model). ``process``: the executor's
        working directory, environment and sys.path, applied first (the imports may need them)."""
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous
        if self.shell is None:
            return
        started = time.perf_counter()
        codec: ObjectCodec | None = None
        failures: list[str] = []
        lazy = self._get_loader()
        silence = self._silence() if lazy is None and any(is_large(g) for g, _names in groups) else None
        try:
            if process is not None:
                self._process_notice = self._process.apply(process, self._replay_magic)
            if comms[0] or comms[1]:  # before the namespace: names bound to widgets refer to them
                self._load_comms(*comms)
            codec = await self._get_codec()
            modules = not_imported(statement for _alias, statement in imports)
            importing = self._silence() if modules else None
            if modules and lazy is not None:  # a cold import off this thread: it answers meanwhile
                await asyncio.to_thread(preimport, modules)
            failures = await apply_state(
                self.shell.user_ns, codec, imports, groups, deleted, self._not_loaded, lazy, msg_id
            )
            if importing is not None:
                self._log_silence(
                    "imports_loaded", importing, msg_id=msg_id, modules=modules, lazy=bool(lazy)
                )
            if process is not None and process.settings:  # applied when a cell runs here next
                self._pending_settings.update(process.settings)
                missing = modules_missing(process.settings)
                if missing:  # numpy.random, say: imported now, not on the next cell's path
                    await asyncio.to_thread(preimport, missing)
            # each the object as of its cell (a later one may rebind its name); from a snapshot,
            # only those this shell has not shown or been given already
            shown_here = self.shell.user_ns.get("_oh", {})
            # a STATE's one output is never pending yet; a snapshot's may be
            pending = {count for count, _ in self._pending_outputs} if len(outputs) > 1 else set()
            for output in outputs:
                if output[0].count in shown_here or output[0].count in pending:
                    continue
                shown = resolve_output(
                    self.shell.user_ns, *output, loading=lazy.pending.names() if lazy is not None else ()
                )
                if isinstance(shown, Unreplicated) and shown.awaiting is not None:
                    self._awaited_outputs.append(shown)
                self._pending_outputs.append((output[0].count, shown))
            kept = max(3, int(self.shell.displayhook.cache_size))  # a standby's are bounded as Out is
            if len(self._pending_outputs) > kept:
                del self._pending_outputs[:-kept]
                self._awaited_outputs = self._awaited_outputs[-kept:]
            if comms[0]:
                failures += self._comms_failed(comms[0])
        except Exception as exc:
            failures.append(f"{exc.__class__.__name__}: {exc}")
        self.apply_ms.append((time.perf_counter() - started) * 1000)
        if silence is not None:
            self._log_silence("state_loaded", silence, msg_id=msg_id, lazy=False)
        if codec is not None and deleted:
            codec.forget(deleted)
        for failure in failures:
            self._slog.warning("namespace_not_loaded", reason=failure, msg_id=msg_id)
        if self._trace_sync and received_at is not None:
            self._slog.info(
                "state_applied",
                msg_id=msg_id,
                received_at=received_at,
                applied_at=time.time(),
                apply_ms=round(self.apply_ms[-1], 3),
            )
        else:
            self._slog.debug("state_applied", msg_id=msg_id, apply_ms=round(self.apply_ms[-1], 3))
        if len(self._followed) >= FOLLOWED_CATCH_UP:
            self._catch_up_followed()

    # ---- large objects loaded in the background (kernel_replica/lazy_load.py) ---------------------------
    async def inspect_request(self, stream: t.Any, ident: t.Any, parent: dict[str, t.Any]) -> None:
        """Inspection (``big?``, a front end's tooltip) reads the names it mentions: loaded first."""
        await self._load_mentioned(parent)
        await super().inspect_request(stream, ident, parent)

    async def complete_request(self, stream: t.Any, ident: t.Any, parent: dict[str, t.Any]) -> None:
        """Completion (``big.<tab>``) reads the names it mentions, and ``bi<tab>`` lists the names
        it starts: both loaded first."""
        await self._load_mentioned(parent, complete=True)
        await super().complete_request(stream, ident, parent)

    async def _load_mentioned(self, parent: dict[str, t.Any], *, complete: bool = False) -> None:
        """The still-loading names a request's (often unfinished, unparsable) code mentions, and for
        a completion those the identifier at the cursor begins: nothing runs, so the text is enough."""
        loader = self._loader
        if loader is None or not loader.pending:
            return
        content = parent.get("content") or {}
        code = str(content.get("code", ""))
        pending = loader.pending.names()
        wanted = mentioned_names(code) & pending
        if complete:
            cursor = content.get("cursor_pos")
            prefix = identifier_before(code, cursor if isinstance(cursor, int) else len(code))
            if prefix:
                wanted |= {name for name in pending if name.startswith(prefix)}
        await loader.demand(wanted)

    def _get_loader(self) -> LazyLoader | None:
        """The background loader, when configured (``datastore.lazy_load``) with a data store."""
        config = self._config
        if config is None or not config.get("datastore.lazy_load") or self.shell is None:
            return None
        if self._loader is None:
            shell = self.shell
            self._loader = LazyLoader(
                lambda: open_replica_datastore(config), self._take_loaded, lambda: shell.user_ns
            )
            self._loader.on_busy = self._loading_started
            self._loader.on_idle = self._loading_ended
        return self._loader

    async def _load_for(
        self,
        code: str | None,
        expressions: t.Iterable[t.Any] = (),
        *,
        msg_id: str = "",
        also: t.Collection[str] = (),
    ) -> None:
        """Before user code runs here: load the names it may touch that are still loading
        (``cell_analysis.names_to_load``; every one for other code, a comm handler, or when the
        analysis cannot tell), again until a loaded object's notebook code reaches no more;
        ``also``: names needed besides. Recorded in ``cell_loads`` (and logged): what it waited
        for, what still loads."""
        loader = self._loader
        if loader is None or not loader.pending:
            return
        started = time.perf_counter()
        waited_for: set[str] = set()
        try:
            await self._demand(loader, code, expressions, waited_for, also)
        finally:
            record = {
                "msg_id": msg_id,
                "waited_for": sorted(waited_for),
                "still_loading": sorted(loader.pending.names()),
                "wait_ms": round((time.perf_counter() - started) * 1000, 1),
            }
            self.cell_loads.append(record)
            self._slog.info("loaded_before_code", **record)

    async def _demand(
        self,
        loader: LazyLoader,
        code: str | None,
        expressions: t.Iterable[t.Any],
        waited_for: set[str],
        also: t.Collection[str],
    ) -> None:
        while loader.pending and self.shell is not None:
            names = None
            if code is not None:
                try:
                    source = "\n".join([code, *map(str, expressions)])
                    names = names_to_load(
                        analyse_cell(source, self._registry),
                        source,
                        self.shell.user_ns,
                        loader.pending.names(),
                        shared_with=self._codec.sharing() if self._codec is not None else None,
                    )
                except Exception as exc:  # the safe side: everything
                    self._slog.debug("cell_not_analysed", error=repr(exc))
            if names is not None:
                names |= loader.pending.names() & set(also)
            if names is not None and not names:
                return
            waited_for.update(loader.pending.names() if names is None else names)
            await loader.demand(names)
            if names is None:
                return

    def _take_loaded(
        self,
        load: Load,
        names: frozenset[str],
        values: t.Mapping[str, t.Any] | None,
        error: BaseException | None,
    ) -> None:
        """A background load ended: its still-wanted names into the namespace, or, if it failed,
        into ``_not_loaded`` (told to the user when this replica executes, loaded again first)."""
        if self.shell is None:
            return
        if values is None:
            if names:
                why = not_loaded_reason(error or RuntimeError("not read"))
                self._not_loaded.update(dict.fromkeys(names, why))
                self._slog.warning(
                    "namespace_not_loaded", reason=why, names=sorted(names), msg_id=load.msg_id
                )
            return
        taken = {name: values[name] for name in names if name in values}
        self.shell.user_ns.update(taken)
        if self._awaited_outputs:  # outputs taken as markers while these loaded
            self._output_variables_loaded(taken)
        if self._codec is not None:
            self._codec.forget(taken)
        for name in taken:
            self._not_loaded.pop(name, None)
        self._slog.debug("state_loaded_name", names=sorted(taken), msg_id=load.msg_id, bytes=load.nbytes)

    def _output_variables_loaded(self, taken: t.Mapping[str, t.Any]) -> None:
        """Outputs held by variables that just loaded: their markers replaced, in the history and
        in the outputs not entered yet."""
        assert self.shell is not None
        loaded = {id(m): m for m in self._awaited_outputs if m.awaiting in taken}
        if not loaded:
            return
        self._awaited_outputs = [m for m in self._awaited_outputs if id(m) not in loaded]
        for marker in loaded.values():
            output_loaded(self.shell, marker, taken[marker.awaiting])  # type: ignore[index]
        self._pending_outputs = [
            (count, taken[shown.awaiting] if id(shown) in loaded else shown)  # type: ignore[index]
            for count, shown in self._pending_outputs
        ]

    def _loading_started(self) -> None:
        self._loading_silence = self._silence()

    def _loading_ended(self) -> None:
        if self._loading_silence is not None:
            self._log_silence("state_loaded", self._loading_silence, msg_id="background", lazy=True)
            self._loading_silence = None

    def _silence(self) -> Silence:
        """Watch how long the main loop (cells, the scheduler's requests) and the Raft loop go
        without running while large objects load or imports replay here."""
        raft = self._bridge.thread.loop if self._bridge is not None else None
        return Silence(asyncio.get_running_loop(), raft)

    def _log_silence(self, event: str, silence: Silence, **fields: t.Any) -> None:
        figures = silence.end()
        self._slog.info(event, **fields, **figures)

    def _load_comms(self, records: t.Mapping[str, dict[str, t.Any]], closed: t.Iterable[str]) -> None:
        """An entry's comm records and closed ids, applied here (``comm_sync.apply_comms``);
        what failed is kept in ``_comms_not_loaded`` (told when this replica executes)."""
        assert self.shell is not None
        closed = list(closed)
        for comm_id in [*records, *closed]:
            self._comms_not_loaded.pop(comm_id, None)
        self._comms_not_loaded.update(
            comm_sync.apply_comms(self.comm_manager, records, closed, self.shell.user_ns, self._comm_opened)
        )

    def _comms_failed(self, records: t.Mapping[str, dict[str, t.Any]]) -> list[str]:
        """After the namespace: records of a widget class the notebook defined (in the cell
        this entry comes from, so absent before) are applied again; the failures left."""
        again = {
            comm_id: records[comm_id]
            for comm_id in self._comms_not_loaded
            if records.get(comm_id, {}).get("class", [""])[0] == "__main__"
        }
        if again:
            self._load_comms(again, ())
        return [f"comm {c}: {self._comms_not_loaded[c]}" for c in records if c in self._comms_not_loaded]

    async def _state_applied(self, log: t.Any) -> None:
        """Before executing here: every STATE already handed to this kernel is in the namespace."""
        tail = self._apply_tail
        if tail is not None and not tail.done():
            try:
                await tail
            except Exception:
                log.exception("state_apply_failed")

    def _stop_requested(self) -> None:
        """``replica.stop`` from the local scheduler: stop Raft, then leave the event loop."""
        self._slog.info("stopping")
        if self._bridge is not None:
            self._bridge.shutdown()
        self.io_loop.call_later(0.1, self.io_loop.stop)

    # ---- shutdown ------------------------------------------------------------------------------------
    def do_shutdown(self, restart: bool) -> dict[str, t.Any]:
        self._slog.info("shutdown_request", restart=restart)
        if self._imager is not None:
            self._imager.abandon()
        if self._loader is not None:
            self._loader.close()
        if self._bridge is not None:
            self._bridge.shutdown()
        return super().do_shutdown(restart)


class _TimedStore:
    """A data store that adds up the time spent writing (``put_stream``), for the step timings."""

    def __init__(self, store: DataStore) -> None:
        self._store = store
        self.write_s = 0.0

    async def put_stream(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        started = time.perf_counter()
        try:
            return await self._store.put_stream(*args, **kwargs)
        finally:
            self.write_s += time.perf_counter() - started

    def __getattr__(self, name: str) -> t.Any:
        return getattr(self._store, name)
