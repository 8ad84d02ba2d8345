"""The replica's Raft side: a thread with its own uvloop running the Raft peer, the election core
(``kernel_replica/election_core.py``: this module feeds it and carries out its commands, and holds
no election policy), the replicated namespace and the scheduler link, plus the cross-thread calls
the kernel makes.

Why a thread: user code blocks the kernel's main thread (and its event loop) for as long as a cell
runs; Raft must keep heartbeating and the scheduler link must keep answering meanwhile. Everything
Raft-related therefore lives on the ``tandem-raft`` thread; the kernel calls in with
``run_coroutine_threadsafe`` (one hop per step of the execute path) and the Raft thread calls out
with ``call_soon_threadsafe`` on the kernel's loop (namespace loads, execution counts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import structlog
import uvloop
import zmq.asyncio

from kernel_replica import log_entries
from kernel_replica.election import ElectionBook
from kernel_replica.election_core import (
    DIVERGED_EXIT_CODE,
    Answer,
    ApplyState,
    BindFailed,
    BindGpus,
    CellFinished,
    CellReplicated,
    Command,
    Decision,
    DeliverDone,
    ElectionCore,
    ElectionSettings,
    Execute,
    ExitDiverged,
    Failed,
    Log,
    NotifyScheduler,
    Propose,
    RaftView,
    ReleaseGpus,
    Replay,
    Standby,
    TransferLeadership,
    Unavailable,
    lost_content,
)
from kernel_replica.log_entries import Done, LogEntry, LogEntryError, State
from kernel_replica.scheduler_link import SchedulerLink
from kernel_replica.state_sync import ReplicatedNamespace, open_replica_datastore
from shared.background_threads import background_thread
from shared.config import Config
from shared.datastore import DataStore, ObjectRef
from shared.raft.driver import NotRunning, PeerConfig, ProposalDropped, RaftError, RaftPeer, RaftTimeout
from shared.raft.tls import LinkTls
from shared.raft.types import ConfChange, ConfState, Entry, RaftConfig
from shared.rpc import RpcError, RpcTimeout
from shared.security.curve import ClientCurve

T = TypeVar("T")

# What the kernel imports from here (the decisions are the election core's).
__all__ = [
    "BindFailed",
    "Decision",
    "Execute",
    "Failed",
    "RaftBridge",
    "RaftThread",
    "Replay",
    "ReplicaCore",
    "ReplicaSettings",
    "Standby",
    "Unavailable",
    "lost_content",
]

SNAPSHOT_VERSION = 1
# One propose() attempt: a proposal forwarded to a leader that then died is never answered, so it
# is proposed again (a duplicate LEAD/YIELD/VOTE/DONE/STATE changes nothing in the book).
PROPOSE_ATTEMPT_S = 1.0
# After replica.stop, how long the main thread gets to stop gracefully before the process exits.
STOP_GRACE_S = 0.5
# A replica the log overruled (``ExitDiverged``) exits this long after it found out, whatever the
# kernel thread does meanwhile: time for the cell's reply to go out first.
DIVERGED_EXIT_GRACE_S = 1.0
# ``replica.hibernate`` waits this long for the last cell's entries to be applied here (its STATE
# may be written behind the reply: hundreds of MB to the data store first)
HIBERNATE_SETTLE_S = 120.0
IMAGE_VERSION = 1  # a namespace image: {"v", "ns": the ReplicatedNamespace snapshot, "count"}
# Exit status of a replica whose Raft stopped on an error it cannot continue after (its state
# machine may have diverged): the local scheduler reports the exit and the member is replaced.
RAFT_FATAL_EXIT = 70  # EX_SOFTWARE


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """The replica's Raft peer and scheduler link; the election's timing is ``election``."""

    gpus: int = 0
    tick_interval_s: float = 0.02
    election_ticks: int = 10
    snapshot_every: int = 1000
    raft_fsync: bool = False  # config raft.fsync: see shared/raft/storage.py's durability policy
    raft_transport: str = "tcp"  # config raft.transport: shared/raft/tcp_transport.py says why
    # This member's TLS identity on the Raft links (shared/raft/tls.py); None only with raft.tls off
    raft_tls: LinkTls | None = None
    commit_notice_s: float = 0.002  # PeerConfig.commit_notice_delay (``raft.commit_notice_ms``)
    election: ElectionSettings = field(default_factory=ElectionSettings)  # config [election]
    # keys on the link to the local scheduler (shared/security/curve.link_env); None: plain link
    link_curve: ClientCurve | None = None
    # the configuration the data store is opened with (hibernation images); None: no store
    store_config: Config | None = None


class RaftThread:
    """A daemon thread running a uvloop event loop; ``submit`` schedules coroutines on it."""

    def __init__(self, name: str = "tandem-raft") -> None:
        self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        self._thread = background_thread(self._run, name=name)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 2.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


class ReplicaCore:
    """Everything of one replica that runs on the Raft thread. Only touch it from that thread.

    The shell around ``ElectionCore``: it feeds the core what the Raft peer applies, what the
    scheduler and the kernel ask, and the results of the core's commands (proposals, GPU
    bindings), each with the time, and carries those commands out. No election policy here."""

    def __init__(
        self,
        *,
        kernel_id: str,
        replica_id: str,
        data_dir: Path,
        raft_address: str,
        raft_listener: socket.socket | None = None,
        scheduler_address: str,
        settings: ReplicaSettings,
        post_to_kernel: Callable[..., None],
        join: bool = False,
    ) -> None:
        self.kernel_id = kernel_id
        self.replica_id = replica_id
        self.settings = settings
        self.raft_address = raft_address
        self._raft_listener = raft_listener  # holds raft_address's port until Raft serves on it
        self.join = join  # start as a new member of an existing group, not a bootstrap voter
        self._data_dir = data_dir
        self._post = post_to_kernel  # thread-safe: runs fn(*args) on the kernel's main thread
        self._log = structlog.get_logger("replica.raft").bind(kernel=kernel_id, replica=replica_id)
        self.election = ElectionCore(
            replica_id, settings.election, raft=self._raft_view, now=time.monotonic()
        )
        self.namespace = ReplicatedNamespace()
        self._store: DataStore | None = None  # opened on the first hibernation image written or read
        self.skipped_entries = 0  # committed entries that did not decode (skipped by every replica)
        self.peer: RaftPeer | None = None
        self._ctx = zmq.asyncio.Context()
        self.scheduler = SchedulerLink(
            self._ctx,
            kernel_id=kernel_id,
            replica_id=replica_id,
            address=scheduler_address,
            curve=settings.link_curve,
        )
        self._background: set[asyncio.Task[Any]] = set()
        self._answers: dict[int, asyncio.Future[Any]] = {}  # core request id -> its caller
        # finish jobs of ``finish_cell``: job id -> (the kernel's ``replicated`` future, the STATE)
        self._jobs: dict[int, tuple[concurrent.futures.Future[None] | None, State | None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.finish_ms: deque[float] = deque(maxlen=1000)  # executed cell -> DONE and STATE committed
        self.on_stop_requested: Callable[[], None] = lambda: None
        self.on_done: Callable[[Done], None] = lambda done: None
        self.on_state: Callable[[State], None] = lambda state: None
        # (imports, [(group, names)], gpu_resident, comms, names to delete, process context) from
        # ReplicatedNamespace: the namespace restored
        self.on_namespace_restored: Callable[[Any], None] = lambda contents: None
        # a resumed kernel's execution count, from its namespace image: every replica numbers on
        self.on_execution_count: Callable[[int], None] = lambda count: None

    @property
    def book(self) -> ElectionBook:
        """The election book of the entries applied so far (read by the kernel's thread too)."""
        return self.election.book

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def connect_scheduler(self) -> None:
        self.scheduler.set_handlers(
            on_configure=self.configure,
            on_stop=self._stop_requested,
            on_membership=self.membership,
            on_hibernate=self.hibernate_image,
        )
        self.scheduler.connect()
        await self.scheduler.register(self.raft_address)
        self._log.info("registered", raft_address=self.raft_address)

    async def configure(self, peers: dict[str, str], restore: dict[str, Any] | None = None) -> None:
        """Start Raft with ``peers`` as bootstrap voters (or, joining, as the members to reach).
        ``restore``: a hibernated kernel's namespace image, loaded before Raft starts, so every
        replica of the resumed group applies its log on top of the same state (a snapshot from
        Raft, later, replaces it as usual: it already contains it)."""
        join = self.join
        if self.peer is not None:
            self._log.info("already_configured")
            return
        if restore is not None:
            await self._restore_image(restore)
        others = {rid: addr for rid, addr in peers.items() if rid != self.replica_id}
        voters = () if join else tuple(sorted(peers))
        config = PeerConfig(
            node_id=self.replica_id,
            address=self.raft_address,
            data_dir=self._data_dir / "raft",
            peers=others,
            bootstrap_voters=voters,
            tick_interval=self.settings.tick_interval_s,
            # Followers rarely propose (votes, and their own cells when they execute): they learn
            # a commit from the next append or, ``commit_notice_s`` after it, an empty append (not
            # one per entry), and a follower's own proposals are confirmed at once.
            raft=RaftConfig(
                election_ticks=self.settings.election_ticks, eager_commit=False, quiet_heartbeats=True
            ),
            commit_notice_delay=self.settings.commit_notice_s,
            snapshot_every=self.settings.snapshot_every,
            fsync=self.settings.raft_fsync,
            transport_kind=self.settings.raft_transport,
            tls=self.settings.raft_tls,
            listener=self._raft_listener,
        )
        self.election.configure(voters)
        peer = RaftPeer(
            config,
            on_apply=self._on_apply,
            take_snapshot=self._take_snapshot,
            restore_snapshot=self._restore_snapshot,
            on_conf_change=self._on_conf_change,
            check_snapshot=self._parse_snapshot,
            on_fatal=self._raft_failed,
            logger=self._log,
        )
        await peer.start()
        self.peer = peer
        status = peer.status()
        self._feed(
            lambda now: self.election.started(
                last_index=status.last_index, voters=status.voters, now=now, applied=status.applied
            )
        )
        self._spawn(self._report_raft_role())
        self._log.info("raft_running", voters=status.voters, join=join)

    async def membership(
        self, action: str, member: str, address: str, cells: list[str] | None = None
    ) -> dict[str, Any]:
        """``replica.membership``: one single-server change proposed through this member (Raft
        forwards it to the leader), retried while the leader refuses for a moment (a change still
        pending, a new term not yet committed); idempotent, so a retried request is harmless.
        Answers this replica's view of the group after it (``status``: just the view)."""
        if action == "lost":
            return self.member_lost(member, cells or [])
        if action == "busy":
            return self.member_busy(member)
        peer = self.peer
        if peer is None:
            raise RpcError("this replica's Raft group is not configured yet", "not_ready")
        deadline = time.monotonic() + self.settings.election.propose_timeout_s * 2
        while action != "status":
            st = peer.status()
            if (
                (action == "add_learner" and member in st.members)
                or (action == "promote" and member in st.voters)
                or (action == "remove" and member not in st.members)
            ):
                break
            if action == "add_learner" and not address:
                raise RpcError("add_learner needs the new member's address", "bad_request")
            try:
                if action == "add_learner":
                    await peer.add_learner(member, address, timeout=PROPOSE_ATTEMPT_S * 2)
                elif action == "promote":
                    await peer.promote(member, timeout=PROPOSE_ATTEMPT_S * 2)
                elif action == "remove":
                    await peer.remove(member, timeout=PROPOSE_ATTEMPT_S * 2)
                else:
                    raise RpcError(f"unknown membership action {action!r}", "bad_request")
                self._log.info("membership_changed", action=action, member=member)
                break
            except RaftError as exc:
                if time.monotonic() > deadline:
                    raise RpcError(f"{action} {member} failed: {exc}", "membership_failed") from None
                await asyncio.sleep(0.1)
        return self.status()

    def member_lost(self, member: str, started: list[str]) -> dict[str, Any]:
        """``replica.membership lost``: the scheduler saw ``member``'s process exit
        (``ElectionCore.member_lost`` says what that changes)."""
        if member == self.replica_id:
            raise RpcError("a replica cannot be told that it died itself", "bad_request")
        self._feed(lambda now: self.election.member_lost(member, started, now))
        return self.status()

    def member_busy(self, member: str) -> dict[str, Any]:
        """``replica.membership busy``: ``member``'s host says its process runs, though its Raft
        is silent (``ElectionCore.executor_busy``)."""
        self._feed(lambda now: self.election.executor_busy(member, now))
        return self.status()

    async def _image_store(self) -> DataStore:
        if self._store is None:
            if self.settings.store_config is None:
                raise RpcError("this replica has no data store configured", "unavailable")
            self._store = await open_replica_datastore(self.settings.store_config)
        return self._store

    async def hibernate_image(self) -> dict[str, Any]:
        """``replica.hibernate``: the replicated namespace as of everything committed, written to
        the data store (large values are there already: the image holds their pointers). The
        names whose latest value never reached the log (``unprotected``) are listed: the
        scheduler keeps such a kernel running rather than lose them."""
        peer = self.peer
        if peer is None:
            raise RpcError("this replica's Raft group is not configured yet", "not_ready")
        deadline = time.monotonic() + HIBERNATE_SETTLE_S
        while time.monotonic() < deadline:  # the last cell's DONE and STATE, still committing
            st = peer.status()
            if not self.election.finishing() and st.applied >= st.commit:
                break
            await asyncio.sleep(0.01)
        else:
            raise RpcError("the last cell's state is still committing", "busy")
        last = self.book.last_done()
        count = last.execution_count if last is not None else 0  # the resumed kernel numbers on
        data = msgpack.packb({"v": IMAGE_VERSION, "ns": self.namespace.to_snapshot(), "count": count})
        store = await self._image_store()
        try:
            ref = await store.put(data)
        except Exception as exc:
            reason = f"writing the namespace image failed: {exc.__class__.__name__}: {exc}"
            raise RpcError(reason, "unavailable") from None
        names = len(self.namespace.digests())
        self._log.info("namespace_image_written", bytes=len(data), names=names)
        return {
            "image": ref.to_dict(),
            "bytes": len(data),
            "names": names,
            "unprotected": sorted(self.namespace.unprotected()),
            "modules": self.namespace.imported_modules(),
        }

    async def _restore_image(self, raw: dict[str, Any]) -> None:
        """Load a namespace image written by ``hibernate_image``; RpcError if it cannot be read
        or is malformed (the resume fails and the kernel stays hibernated, its image kept)."""
        store = await self._image_store()
        try:
            data = bytes(await store.get(ObjectRef.from_dict(raw)))
            image = msgpack.unpackb(data, raw=False)
            if (
                type(image) is not dict
                or image.get("v") != IMAGE_VERSION
                or type(image.get("count")) is not int
            ):
                raise ValueError("not a namespace image of this version")
            self.namespace.restore(image["ns"])  # checked: replaces all or nothing
        except Exception as exc:
            reason = f"namespace image unusable: {exc.__class__.__name__}: {exc}"
            raise RpcError(reason, "start_failed") from None
        self._post(self.on_execution_count, image["count"])
        self._post(self.on_namespace_restored, self._restored_contents([]))
        self._log.info("namespace_image_restored", bytes=len(data), names=len(self.namespace.digests()))

    async def _report_raft_role(self) -> None:
        """Push ``replica.event raft_role`` on every change: the global scheduler prefers the Raft
        leader as executor candidate (its LEAD commits one hop sooner)."""
        last: tuple[Any, ...] | None = None
        while self.peer is not None:
            st = self.peer.status()
            now = (st.role.name, st.leader, st.term)
            if now != last:
                last = now
                self.scheduler.event(
                    "raft_role", None, role=st.role.name.lower(), leader=st.leader, term=st.term
                )
            await asyncio.sleep(self.settings.tick_interval_s * 5)

    async def _stop_requested(self) -> None:
        """``replica.stop``: the kernel stops gracefully on its main thread; if user code holds that
        thread (a long cell), this thread stops Raft and ends the process after a short grace."""
        self._log.info("stop_requested")
        self._post(self.on_stop_requested)
        self._spawn(self._exit_if_stuck())

    async def _exit_if_stuck(self) -> None:
        await asyncio.sleep(STOP_GRACE_S)  # cancelled by stop() when the graceful path runs
        self._log.warning("forced_exit", reason="the main thread is busy (user code) after replica.stop")
        if self.peer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.peer.stop(), 1.0)
        os._exit(0)

    async def stop(self) -> None:
        if self.peer is not None:
            # the last cell's DONE and STATE, still committing: give them a moment
            deadline = time.monotonic() + 1.0
            while self.election.finishing() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        for task in list(self._background):
            task.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.election.close()
        if self.peer is not None:
            with contextlib.suppress(Exception):
                await self.peer.stop()
        with contextlib.suppress(Exception):
            await self.scheduler.close()
        if self._store is not None:
            with contextlib.suppress(Exception):
                await self._store.close()
        self._ctx.destroy(linger=0)

    def status(self) -> dict[str, Any]:
        """This replica's view of its Raft group, for logs and debugging."""
        if self.peer is None:
            return {"configured": False}
        st = self.peer.status()
        stats = self.peer.transport_stats
        return {
            "configured": True,
            "running": st.running,
            "role": st.role.name,
            "leader": st.leader,
            "term": st.term,
            "commit": st.commit,
            "applied": st.applied,
            "voters": list(st.voters),
            "learners": list(st.learners),
            # frames dropped because they did not decode, connections refused by authentication
            "malformed_frames": stats.malformed if stats is not None else 0,
            "refused_connections": stats.refused if stats is not None else 0,
            "skipped_entries": self.skipped_entries,
        }

    def _raft_failed(self, exc: BaseException) -> None:
        """Raft stopped for good (storage failed, or a committed entry or accepted snapshot could
        not be applied: this replica's state may differ from the group's). Lingering would keep a
        member the scheduler counts as alive but that answers nothing; exiting gets it replaced,
        and the replacement catches up from the leader's snapshot and log."""
        self._log.critical(
            "raft_failed_exiting", error=repr(exc), exit_status=RAFT_FATAL_EXIT, status=self.status()
        )
        os._exit(RAFT_FATAL_EXIT)

    # ---- the election core's inputs and commands -----------------------------------------------------
    def _raft_view(self) -> RaftView:
        """The election core's read-only port on the Raft peer."""
        peer = self.peer
        if peer is None:
            return RaftView(running=False, leader=None)
        st = peer.status()
        return RaftView(running=st.running, leader=st.leader, voters=st.voters)

    def _feed(self, step: Callable[[float], T]) -> T:
        """One input to the election core, with the time; then carry out its commands."""
        result = step(time.monotonic())
        self._carry_out()
        return result

    def _carry_out(self) -> None:
        for command in self.election.take_commands():
            try:
                self._execute(command)
            except Exception:  # one failed command (a bad STATE, say) must not stop the others
                self._log.exception("election_command_failed", command=type(command).__name__)
        self._arm_tick()

    def _execute(self, command: Command) -> None:
        match command:
            case Propose(entry=entry, token=token):
                self._spawn(self._propose_for_core(entry, token))
            case BindGpus(token=token, msg_id=msg_id):
                self._spawn(self._bind_for_core(msg_id, token))
            case ReleaseGpus(msg_id=msg_id):
                self._spawn(self._release(msg_id))
            case Answer(request=request, value=value):
                fut = self._answers.pop(request, None)
                if fut is not None and not fut.done():
                    fut.set_result(value)
            case NotifyScheduler(event="elected", msg_id=msg_id, gpus=gpus):
                self.scheduler.event("elected", msg_id, gpus=list(gpus))
            case NotifyScheduler(event="executor_quiet", msg_id=msg_id, executor=executor):
                self.scheduler.event("executor_quiet", msg_id, executor=executor)
            case NotifyScheduler(event=event, msg_id=msg_id):
                self.scheduler.event(event, msg_id)
            case TransferLeadership(to=target):
                self._spawn(self._transfer(target))
            case DeliverDone(done=done):
                self._post(self.on_done, done)
            case ApplyState(state=state, notify_kernel=notify_kernel):
                try:  # the namespace is the state machine's too: a half-applied entry is fatal
                    accepted = self.namespace.apply(state)  # as every replica applies it
                except Exception as exc:
                    self._log.critical("log_entry_not_applied", msg_id=state.msg_id, exc_info=True)
                    self._raft_failed(exc)
                    return
                if notify_kernel:
                    self._post(self.on_state, accepted)
            case CellReplicated(job=job):
                replicated = self._jobs.get(job, (None, None))[0]
                _resolve_once(replicated)
            case CellFinished(job=job, msg_id=msg_id, finish_s=finish_s):
                state = self._jobs.pop(job, (None, None))[1]
                if finish_s is not None:
                    self.finish_ms.append(finish_s * 1000)
                    self._log.debug(
                        "cell_finished",
                        msg_id=msg_id,
                        finish_ms=round(self.finish_ms[-1], 3),
                        state_bytes=sum(sum(g.get("sizes", ())) for g in state.groups) if state else 0,
                    )
            case ExitDiverged():
                # the kernel exits once the cell's reply is out (kernel.py); this is the backstop
                # for a cell whose reply went out before the log overruled it
                asyncio.get_running_loop().call_later(DIVERGED_EXIT_GRACE_S, os._exit, DIVERGED_EXIT_CODE)
            case Log(level=level, event=event, fields=fields):
                getattr(self._log, level)(event, **fields)

    def _arm_tick(self) -> None:
        """A timer for the core's next deadline (one timer: the earliest wins)."""
        deadline = self.election.next_deadline()
        if deadline is None or (
            self._timer is not None and self._timer_at is not None and self._timer_at <= deadline
        ):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), self._on_tick
        )

    def _on_tick(self) -> None:
        self._timer = self._timer_at = None
        self._feed(self.election.tick)

    async def _request(self, start: Callable[[float], int]) -> Any:
        """Start a request in the core and wait for its ``Answer``."""
        request = start(time.monotonic())
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._answers[request] = answer
        self._carry_out()
        return await answer

    async def _propose_for_core(self, entry: LogEntry, token: int) -> None:
        try:
            result: int | Exception = await self.propose(entry)
        except Exception as exc:  # RaftError, or a bug: the core must hear either way
            result = exc
        self._feed(lambda now: self.election.proposal_settled(token, result, now))

    async def _bind_for_core(self, msg_id: str, token: int) -> None:
        try:
            result: list[int] | Exception = await self.scheduler.gpu_commit(msg_id, self.settings.gpus)
        except Exception as exc:  # RpcError, RpcTimeout, ValueError: the node refused or is gone
            result = exc
        self._feed(lambda now: self.election.bind_settled(token, result, now))

    async def _transfer(self, target: str) -> None:
        peer = self.peer
        if peer is None:
            return
        try:
            await peer.transfer_leadership(target, timeout=2.0)
            self._log.info("leadership_transferred", to=target, reason="executor")
        except RaftError as exc:
            self._log.info("leadership_transfer_failed", to=target, error=str(exc))

    # ---- applying the log (called by RaftPeer, in log order) ---------------------------------------
    def _on_apply(self, entry: Entry) -> None:
        """Apply one committed entry. One that does not decode is skipped (every replica decodes
        the same bytes alike, so all skip it: no divergence), counted and logged; one that
        decodes but cannot be applied stops this replica (``ApplyState``, ``_raft_failed``)."""
        try:
            decoded = log_entries.decode(entry.data)
        except LogEntryError as exc:
            self.skipped_entries += 1
            self._log.warning(
                "log_entry_skipped", index=entry.index, reason=str(exc), total=self.skipped_entries
            )
            return
        self._feed(lambda now: self.election.apply(entry.index, decoded, now))

    def _on_conf_change(self, change: ConfChange | None, conf: ConfState) -> None:
        """A membership change committed, or (``change`` None) a snapshot restored."""
        self._feed(lambda now: self.election.set_voters(conf.voters, now, restored=change is None))

    def _take_snapshot(self) -> bytes:
        return msgpack.packb(
            {"v": SNAPSHOT_VERSION, "book": self.book.to_snapshot(), "ns": self.namespace.to_snapshot()},
            use_bin_type=True,
        )

    @staticmethod
    def _parse_snapshot(data: bytes) -> tuple[ElectionBook, bytes]:
        """A snapshot's election book and namespace data, checked without side effects (no import
        run, nothing unpickled); ValueError naming the problem. ``RaftPeer`` drops a peer's
        snapshot that fails this on arrival, so a malformed one never reaches the state machine."""
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for garbage
            raise ValueError(f"replica snapshot is not msgpack: {type(exc).__name__}") from None
        if type(raw) is not dict or raw.get("v") != SNAPSHOT_VERSION:
            raise ValueError(
                f"unsupported replica snapshot (version {raw.get('v') if type(raw) is dict else raw!r:.40})"
            )
        if type(raw.get("book")) is not dict or type(raw.get("ns")) is not bytes:
            raise ValueError("a replica snapshot holds a 'book' map and 'ns' bytes")
        ReplicatedNamespace.parse_snapshot(raw["ns"])
        return ElectionBook.from_snapshot(raw["book"]), raw["ns"]

    def _restored_contents(self, gone: list[str]) -> tuple[Any, ...]:
        """What the kernel rebuilds its namespace from after a snapshot or an image was restored
        (``Kernel._load_namespace``): imports, groups, GPU objects, comms, names ``gone``, the
        process context and the output history."""
        return (
            *self.namespace.contents(),
            self.namespace.gpu_resident(),
            self.namespace.comms(),
            gone,
            self.namespace.process_context(),
            self.namespace.outputs(),
        )

    def _restore_snapshot(self, data: bytes) -> None:
        if not data:
            return
        book, namespace = self._parse_snapshot(data)
        before = self.namespace.digests()
        self.namespace.restore(namespace)  # checked: replaces all or nothing
        # names the replica held that the snapshot no longer has (a resumed kernel's image loaded
        # before its group's snapshot came, a lagging follower): the kernel deletes them too
        gone = sorted(set(before) - set(self.namespace.digests()))
        self._post(self.on_namespace_restored, self._restored_contents(gone))
        self._feed(lambda now: self.election.restore(book, now))
        self._log.info("snapshot_restored", names=len(self.namespace.digests()))

    # ---- proposing ---------------------------------------------------------------------------------
    async def propose(self, entry: LogEntry, *, timeout: float | None = None) -> int:
        """Propose until applied here; retries dropped proposals (a duplicate entry is harmless:
        the book ignores a second LEAD/YIELD/DONE). Raises ``RaftError`` naming the cause."""
        if self.peer is None:
            raise NotRunning("this replica's Raft group is not configured yet")
        data = log_entries.encode(entry)
        deadline = time.monotonic() + (timeout or self.settings.election.propose_timeout_s)
        last: RaftError | None = None
        attempts = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise last or RaftTimeout("proposal timed out")
            attempts += 1
            try:
                return await self.peer.propose(data, timeout=min(remaining, PROPOSE_ATTEMPT_S))
            except ProposalDropped as exc:  # definitely not appended: safe to retry
                last = exc
                await asyncio.sleep(0.02)
            except RaftTimeout as exc:  # lost with a dead leader, or just slow: propose again
                last = exc
            if attempts in (1, 10, 100):
                self._log.info(
                    "proposal_retry",
                    kind=type(entry).__name__,
                    msg_id=entry.msg_id,
                    attempts=attempts,
                    error=str(last),
                )

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, msg_id: str) -> None:
        try:
            await self.scheduler.gpu_release(msg_id)
        except (RpcError, RpcTimeout) as exc:
            self._log.warning("gpu_release_failed", msg_id=msg_id, error=str(exc))

    # ---- the execute path (called from the kernel through RaftThread.submit) -----------------------
    async def decide(self, msg_id: str, *, lead: bool, silent: str | None = None) -> Decision:
        """Steps 3-4 of the execute path (``ElectionCore.decide``). ``silent``: the designated
        candidate the scheduler found hung (not waited for again)."""
        designated = self.scheduler.designated(msg_id)  # before the core takes its gpu.bound
        decision: Decision = await self._request(
            lambda now: self.election.decide(msg_id, lead=lead, silent=silent, now=now)
        )
        if isinstance(decision, Execute) and designated and self.peer is not None:
            # The cell's DONE and STATE follow in one append, which tells the standbys that the
            # LEAD committed too: no notice of it now (a cell running longer than a tick: the
            # heartbeat tells them). Only for a designated cell: nobody else waits on this LEAD.
            self.peer.hold_commit_notices(self.settings.tick_interval_s)
        if self.scheduler.settle_bound_ahead(msg_id, executing=isinstance(decision, Execute)):
            self._spawn(self._release(msg_id))  # bound ahead for a cell this replica will not run
        return decision

    async def outcome_of(self, msg_id: str, executor: str) -> Decision:
        """The scheduler lost ``executor`` while it ran msg_id (``ElectionCore.outcome_of``)."""
        decision: Decision = await self._request(lambda now: self.election.outcome_of(msg_id, executor, now))
        return decision

    async def wait_done(self, msg_id: str, winner: str, execution_count: int) -> Done | str:
        """A standby's wait for the executor's DONE, or the reason none can come."""
        result: Done | str = await self._request(
            lambda now: self.election.wait_done(msg_id, winner, execution_count, now)
        )
        return result

    async def finish(self, done: Done, *, release_gpus: bool) -> None:
        """Step 5 without a run: release the GPUs (not on the critical path) and commit DONE."""
        error = await self._request(
            lambda now: self.election.finish(done, release_gpus=release_gpus, now=now)
        )
        if error is not None:
            raise error

    def abandon(self) -> None:
        """An Execute decision whose cell will not run after all (its outcome was committed
        without it): stop the PROGRESS beats. Call on the Raft thread."""
        self._feed(self.election.abandon)

    def finishing(self) -> bool:
        """Whether DONE/STATE entries of cells executed here are still in flight (any thread)."""
        return self.election.finishing()

    def finish_cell(
        self,
        done: Done,
        state: State,
        written: concurrent.futures.Future[State] | None = None,
        replicated: concurrent.futures.Future[None] | None = None,
    ) -> None:
        """Steps 5 and 7 off the critical path (``ElectionCore.finish_cell``). Call on the Raft
        thread. ``written``: the STATE to propose instead, once its large objects are in the data
        store (write-behind, ``state_sync.complete_state``); DONE does not wait for it.
        ``replicated`` is resolved once DONE and STATE are committed (with write-behind, once DONE
        is: the upload is not waited for), or once that has failed: the kernel publishes idle
        then. The GPUs were released by the local scheduler as the reply went by (its
        ``_release_on_reply``)."""
        job = self.election.finish_cell(done, None if written else state, time.monotonic())
        self._jobs[job] = (replicated, None if written else state)
        self._carry_out()
        if written is not None:
            loop = asyncio.get_running_loop()
            written.add_done_callback(lambda fut: loop.call_soon_threadsafe(self._state_written, job, fut))

    def finish_repair(self, state: State, written: concurrent.futures.Future[State] | None = None) -> None:
        """Propose a repair STATE (``ElectionCore.finish_repair``). ``written``: the STATE to
        propose instead, once its values are in the data store. Call on the Raft thread."""
        job = self.election.finish_repair(None if written else state, time.monotonic())
        self._carry_out()
        if written is not None:
            loop = asyncio.get_running_loop()
            written.add_done_callback(lambda fut: loop.call_soon_threadsafe(self._state_written, job, fut))

    def _state_written(self, job: int, fut: concurrent.futures.Future[State]) -> None:
        """The written-behind STATE (or why writing it failed) to the core, on this loop."""
        result: State | Exception
        if fut.cancelled():
            result = RuntimeError("writing the cell's large objects was cancelled")
        else:
            exc = fut.exception()
            result = fut.result() if exc is None else exc  # type: ignore[assignment]
        if isinstance(result, State) and job in self._jobs:
            self._jobs[job] = (self._jobs[job][0], result)
        self._feed(lambda now: self.election.state_written(job, result, now))


def _resolve_once(future: concurrent.futures.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class RaftBridge:
    """The kernel's handle on the Raft thread: builds the core there and carries calls to it."""

    def __init__(self, thread: RaftThread, core: ReplicaCore) -> None:
        self.thread = thread
        self.core = core
        self._stopped = False

    @classmethod
    def start(cls, **core_kwargs: Any) -> RaftBridge:
        thread = RaftThread()
        thread.start()

        async def build() -> ReplicaCore:  # on the Raft thread, so its sockets belong to that loop
            return ReplicaCore(**core_kwargs)

        return cls(thread, thread.submit(build()).result(timeout=10))

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the Raft thread and await its result from the kernel's loop."""
        return await asyncio.wrap_future(self.thread.submit(coro))

    def call_blocking(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """For threads without a loop of their own in use (the launcher, the control thread)."""
        return self.thread.submit(coro).result(timeout)

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop Raft cleanly (closing its WAL and sockets), then the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.call_blocking(self.core.stop(), timeout)
        except Exception as exc:  # shutting down regardless
            structlog.get_logger("replica.raft").warning("raft_stop_failed", error=repr(exc))
        self.thread.stop()
