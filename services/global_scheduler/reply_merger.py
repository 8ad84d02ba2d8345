"""Merge the replicas' Jupyter traffic for one kernel into what a single ipykernel would send.

Per request msg_id the client must see exactly one ``status: busy``, the responder's outputs once,
its one reply and its ``status: idle`` (protocol.md, execute path step 6). The responder is:

- the elected executor (``replica.event elected``, or an ``execute_reply`` whose
  ``metadata.tandem.role`` is ``executor``);
- for a request sent to one replica, that replica (known when the request is opened);
- for a broadcast whose replies are all alike (shutdown, interrupt) the first replica to reply;
- after a failed election, or when every live target replied without naming an executor (a
  msg_id answered from the Raft log), the first replica to reply.

Frames from a replica whose role is not yet known are held and released in arrival order once it
is. Pure and clock-free on the hot path: the shell parses the few header fields needed and passes
them in; only ``expired`` takes the time, from the shell's periodic check.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

Frames = list[bytes]
Forward = tuple[str, Frames]  # (channel, frames) for the client

REPLY_CHANNELS = frozenset(("shell", "control"))
FINISHED_MEMORY = 4096  # how many finished msg_ids keep routing late frames from their responder


@dataclass(slots=True)
class Incoming:
    """One Jupyter message from a replica, with the header fields the merger needs."""

    replica_id: str
    channel: str
    msg_type: str
    parent_id: str | None
    frames: Frames
    execution_state: str | None = None  # for iopub status messages
    role: str | None = None  # metadata.tandem.role of a reply, when the shell looked


@dataclass(slots=True)
class Failed:
    """A request the merger gave up on; the shell synthesizes what the client still lacks."""

    msg_id: str
    context: Any
    reply_channel: str
    busy_sent: bool
    reply_sent: bool
    idle_sent: bool


@dataclass(slots=True)
class Merged:
    forwards: list[Forward] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # msg_ids now fully answered
    responders: list[tuple[str, str]] = field(default_factory=list)  # (msg_id, replica_id) newly known
    # execute requests whose executor could not get the GPUs (an execute_reply marked
    # ``no_executor``, held back from the client): the scheduler migrates them and sends them again
    no_executor: list[str] = field(default_factory=list)
    # cells their designated replica declined (leaving: nothing done for them there), withdrawn
    # from the client's view with their frames: the scheduler routes them again elsewhere
    declined: list[tuple[str, Frames]] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    msg_id: str
    reply_channel: str
    targets: set[str]
    responder: str | None
    context: Any
    serial: bool
    first_reply_wins: bool
    busy_sent: bool = False
    reply_sent: bool = False
    idle_sent: bool = False
    progressed: bool = False
    election_failed: bool = False
    armed_at: float | None = None
    heard: bool = False  # anything arrived from a target (for a designated candidate: it is alive)
    silent_since: float | None = None  # ``silent_candidates``: when it first could have answered
    repliers: list[str] = field(default_factory=list)
    held: dict[str, list[Incoming]] = field(default_factory=dict)
    early_idle: Incoming | None = None  # the responder's idle, overtook its reply (another socket)


class ReplyMerger:
    """One per kernel; replica ids are unique within a kernel."""

    def __init__(self) -> None:
        self._pending: dict[str, _Request] = {}  # insertion order = arrival order
        self._finished: OrderedDict[str, str | None] = OrderedDict()  # msg_id -> responder
        self.dropped = 0  # frames deliberately not forwarded (other replicas' copies, unknown parents)
        # A restarted scheduler adopted this kernel: requests routed by its predecessor are unknown
        # here, and their frames (only a designated executor or a one-replica target sends any)
        # go to the client rather than being dropped, so a cell running across the restart ends.
        self.forward_unknown = False

    # ---- requests ---------------------------------------------------------------------------

    def open(
        self,
        msg_id: str,
        targets: set[str] | frozenset[str],
        *,
        reply_channel: str = "shell",
        responder: str | None = None,
        context: Any = None,
        serial: bool = True,
        first_reply_wins: bool = False,
        busy_sent: bool = False,
    ) -> None:
        """Start tracking a request sent to ``targets``.

        ``serial``: the replicas handle it in order behind earlier shell requests, so its deadline
        only starts once every earlier serial request finished (a long cell is not a hang).
        ``busy_sent``: the client already saw busy (a cell sent again after a failed election).
        """
        self._finished.pop(msg_id, None)
        self._pending[msg_id] = _Request(
            msg_id,
            reply_channel,
            set(targets),
            responder,
            context,
            serial,
            first_reply_wins,
            busy_sent,
        )

    def reopen(self, failed: Failed, targets: set[str]) -> None:
        """Track a request that failed with its responder again, now sent to ``targets`` (the
        first to reply answers it), ahead of every other pending request: it was the oldest
        serial one, and what the client already saw of it still counts."""
        self.open(
            failed.msg_id,
            targets,
            reply_channel=failed.reply_channel,
            context=failed.context,
            first_reply_wins=True,
            busy_sent=failed.busy_sent,
        )
        self._pending = {failed.msg_id: self._pending.pop(failed.msg_id), **self._pending}

    def is_pending(self, msg_id: str) -> bool:
        return msg_id in self._pending

    def pending_ids(self) -> list[str]:
        return list(self._pending)

    def targets_of(self, msg_id: str) -> frozenset[str]:
        req = self._pending.get(msg_id)
        return frozenset(req.targets) if req is not None else frozenset()

    def responder_of(self, msg_id: str) -> str | None:
        req = self._pending.get(msg_id)
        if req is not None:
            return req.responder
        return self._finished.get(msg_id)

    # ---- frames -----------------------------------------------------------------------------

    def on_frame(self, inc: Incoming) -> Merged:
        out = Merged()
        parent = inc.parent_id
        req = self._pending.get(parent) if parent is not None else None
        if req is None:
            # Late output of a finished request (a thread still printing) flows from its responder.
            late_output = (
                parent is not None
                and inc.msg_type != "status"
                and inc.channel == "iopub"
                and self._finished.get(parent) == inc.replica_id
            )
            if late_output or (self.forward_unknown and parent is not None and parent not in self._finished):
                out.forwards.append((inc.channel, inc.frames))
            else:
                self.dropped += 1
            return out
        if inc.replica_id not in req.targets:
            self.dropped += 1
            return out
        req.heard = True
        if inc.msg_type == "status" and inc.execution_state == "busy" and not req.busy_sent:
            req.busy_sent = True
            out.forwards.append((inc.channel, inc.frames))
            return out
        if req.responder is None:
            req.held.setdefault(inc.replica_id, []).append(inc)
            if inc.channel in REPLY_CHANNELS:
                req.repliers.append(inc.replica_id)
                if inc.role == "executor" or req.first_reply_wins or req.election_failed:
                    self._decide(req, req.repliers[0] if inc.role != "executor" else inc.replica_id, out)
                else:
                    self._decide_if_all_replied(req, out)
            return out
        if inc.replica_id == req.responder:
            self._forward(req, inc, out)
        else:
            self.dropped += 1
        return out

    def set_responder(self, msg_id: str, replica_id: str) -> Merged:
        """The elected executor is known (``replica.event elected``)."""
        out = Merged()
        req = self._pending.get(msg_id)
        if req is not None and req.responder is None and replica_id in req.targets:
            self._decide(req, replica_id, out)
        return out

    def election_failed(self, msg_id: str) -> Merged:
        out = Merged()
        req = self._pending.get(msg_id)
        if req is not None and req.responder is None:
            req.election_failed = True
            if req.repliers:
                self._decide(req, req.repliers[0], out)
        return out

    # ---- failures ---------------------------------------------------------------------------

    def replica_lost(self, replica_id: str) -> tuple[Merged, list[Failed]]:
        """A replica died: requests it was answering (or that have no one left) fail."""
        out = Merged()
        failed: list[Failed] = []
        for req in list(self._pending.values()):
            if replica_id not in req.targets:
                continue
            req.targets.discard(replica_id)
            req.held.pop(replica_id, None)
            if replica_id in req.repliers:
                req.repliers.remove(replica_id)
            if req.responder == replica_id or not req.targets:
                failed.append(self._fail(req))
            elif req.responder is None:
                self._decide_if_all_replied(req, out)
        return out, failed

    def executing_on(self, replica_id: str) -> list[str]:
        """Pending cells ``replica_id`` was elected for (it took their GPUs)."""
        return [
            m for m, req in self._pending.items() if req.responder == replica_id and _is_execute(req.context)
        ]

    def orphans_of(self, lost: str) -> list[str]:
        """Undecided cells sent to ``lost`` alone (it was their designated executor and had not
        started them): they are withdrawn and sent again to a live replica."""
        return [
            m
            for m, req in self._pending.items()
            if req.responder is None and req.targets == {lost} and _is_execute(req.context)
        ]

    def ignore(self, msg_id: str) -> None:
        """Replies to ``msg_id`` (a request no client awaits) are never forwarded."""
        self._finished[msg_id] = None
        if len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def fail(self, msg_id: str) -> Failed | None:
        req = self._pending.get(msg_id)
        return self._fail(req) if req is not None else None

    def fail_all(self) -> list[Failed]:
        return [self._fail(req) for req in list(self._pending.values())]

    def expired(self, now: float, timeout: float) -> list[Failed]:
        """Requests that made no progress for ``timeout`` seconds since they could have."""
        failed: list[Failed] = []
        serial_ahead = False
        for req in list(self._pending.values()):
            if req.serial:
                if serial_ahead:
                    continue
                serial_ahead = True
            if req.progressed:
                continue
            if req.armed_at is None:
                req.armed_at = now
            elif now - req.armed_at >= timeout:
                failed.append(self._fail(req))
        return failed

    def silent_candidates(self, now: float, timeout: float) -> list[str]:
        """Cells sent to a designated candidate alone that has sent nothing for ``timeout``
        seconds since it could have (every earlier serial request finished): it is alive to its
        local scheduler, but hung. Each is reported once; the shell then asks the other replicas
        too (``widen``)."""
        for req in self._pending.values():
            if not req.serial:
                continue
            if req.responder is None and not req.heard and len(req.targets) == 1 and _is_execute(req.context):
                if req.silent_since is None:
                    req.silent_since = now
                elif now - req.silent_since >= timeout:
                    req.silent_since = math.inf  # reported once
                    return [req.msg_id]
            return []  # only the first serial request can have been answered by now
        return []

    def widen(self, msg_id: str, targets: set[str]) -> None:
        """More replicas were sent ``msg_id``: expect their answers too."""
        req = self._pending.get(msg_id)
        if req is not None:
            req.targets |= targets

    # ---- internals --------------------------------------------------------------------------

    def _decide_if_all_replied(self, req: _Request, out: Merged) -> None:
        if req.repliers and req.targets.issubset(req.repliers):
            self._decide(req, req.repliers[0], out)

    def _decide(self, req: _Request, replica_id: str, out: Merged) -> None:
        req.responder = replica_id
        req.progressed = True
        out.responders.append((req.msg_id, replica_id))
        held = req.held.pop(replica_id, ())
        self.dropped += sum(len(v) for v in req.held.values())
        req.held.clear()
        for inc in held:
            if req.msg_id not in self._pending:
                break
            self._forward(req, inc, out)

    def _forward(self, req: _Request, inc: Incoming, out: Merged) -> None:
        req.progressed = True
        if inc.msg_type == "status":
            if inc.execution_state == "busy":
                if req.busy_sent:
                    self.dropped += 1
                    return
                req.busy_sent = True
            elif inc.execution_state == "idle":
                if req.idle_sent or req.early_idle is not None:
                    self.dropped += 1
                    return
                if not req.reply_sent and _is_execute(req.context):
                    # Reply and idle leave the replica on different sockets and may swap on the
                    # way; a client sees them in the kernel's order: reply, then idle. (Only for
                    # execute_request: comm messages, say, have no reply to wait for.)
                    req.early_idle = inc
                    return
                req.idle_sent = True
        elif inc.channel in REPLY_CHANNELS:
            if req.reply_sent:
                self.dropped += 1
                return
            req.reply_sent = True
        out.forwards.append((inc.channel, inc.frames))
        if req.reply_sent and req.early_idle is not None:
            idle, req.early_idle = req.early_idle, None
            self._forward(req, idle, out)
            return
        if req.reply_sent and req.idle_sent:
            self._finish(req, req.responder)
            out.finished.append(req.msg_id)

    def _fail(self, req: _Request) -> Failed:
        self._finish(req, None)
        return Failed(
            req.msg_id, req.context, req.reply_channel, req.busy_sent, req.reply_sent, req.idle_sent
        )

    def _finish(self, req: _Request, responder: str | None) -> None:
        self._pending.pop(req.msg_id, None)
        self._finished[req.msg_id] = responder
        if len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)


def _is_execute(context: Any) -> bool:
    return isinstance(context, dict) and context.get("msg_type") == "execute_request"
