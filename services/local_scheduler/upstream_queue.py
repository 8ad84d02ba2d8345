"""What a local scheduler has for the global scheduler, and when it may go: the replicas' Jupyter
messages and the events behind them, in arrival order, with a cell's message pairs sent together.

Why hold anything: every envelope upstream costs each hop (this host, the global scheduler, the
gateway) a CURVE box or unbox, a decode and an authorisation check, and a trivial cell's four
messages come in two pairs that almost never land in one loop turn. Its ``busy`` goes out when
the replica takes the request and its ``execute_input`` only after the election (the ``elected``
event between them); its ``execute_reply`` leaves on the shell socket and its ``idle`` ~1 ms later
through ipykernel's IOPub thread. ``scripts/count_messages.py`` counted each of the four in an
envelope of its own 0.9 times per cell, and the global scheduler forwards what arrives apart
apart, so a cell cost 4.7 envelopes to the global scheduler and 3.7 on to the gateway. The
client gains nothing from the first of a pair alone: it waits for the reply *and* the idle, and
the global scheduler holds a ``busy`` until it knows the executor anyway.

So the first of a pair (an ``execute_request``'s ``busy``, any ``execute_reply``) holds back
itself and everything queued after it until the same replica's next message about the same
request (its partner) arrives, or ``pair_wait_s`` has passed; what was queued before it goes at
once. Holding never reorders and never drops: the worst it does is to delay a message by
``pair_wait_s``. Sans-I/O: the shell feeds it with the loop's clock and flushes when ``due`` says.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass

from shared.envelope import Envelope

Key = tuple[str, str]  # (kernel id, replica id)
JupyterItem = tuple[Key, str, list[bytes]]  # (sender, channel, [sig, header, parent, metadata, content, ...])
Item = JupyterItem | Envelope


@dataclass(slots=True)
class _Wait:
    parent: str  # the msg_id of the request both messages of the pair answer
    until: float
    seq: int  # the opener's place in the queue: it and everything after it wait


class UpstreamQueue:
    def __init__(self, pair_wait_s: float) -> None:
        if pair_wait_s < 0:
            raise ValueError(f"pair_wait_s must be >= 0, got {pair_wait_s}")
        self._pair_wait_s = pair_wait_s
        self._items: deque[tuple[int, Item]] = deque()
        self._next_seq = 0
        self._waits: dict[Key, _Wait] = {}
        # per replica, the request whose idle went by last: its reply (rarely behind the idle,
        # the two come on different sockets) then has no partner left to wait for
        self._idle_seen: dict[Key, str] = {}

    def __len__(self) -> int:
        return len(self._items)

    def jupyter(self, key: Key, channel: str, frames: list[bytes], now: float) -> None:
        """A replica's Jupyter message, queued behind everything before it."""
        seq = self._push((key, channel, frames))
        if self._pair_wait_s == 0:
            return
        wait = self._waits.get(key)
        if wait is not None and parent_id(frames) == wait.parent:
            del self._waits[key]  # its partner: the pair goes together
        opened, idle = _role_in_pair(channel, frames)
        if idle is not None:
            self._idle_seen[key] = idle
        if opened is not None and not (channel == "shell" and self._idle_seen.get(key) == opened):
            self._waits[key] = _Wait(opened, now + self._pair_wait_s, seq)

    def event(self, env: Envelope) -> None:
        """An envelope that must reach the scheduler behind the messages queued before it (an
        ``exited`` must not overtake the replica's reply)."""
        self._push(env)

    def forget(self, key: Key) -> None:
        """The replica is gone: no partner will come from it."""
        self._waits.pop(key, None)
        self._idle_seen.pop(key, None)

    def due(self) -> float | None:
        """When to flush: None when nothing is queued, -inf when something may go now, else the
        time the earliest hold ends."""
        if not self._items:
            return None
        if not self._waits:
            return -math.inf
        first_held = min(w.seq for w in self._waits.values())
        if self._items[0][0] < first_held:
            return -math.inf
        return min(w.until for w in self._waits.values())

    def take(self, now: float) -> list[Item]:
        """What may go at ``now``, in order: everything up to the first message still waiting
        for its partner (holds that ran out end here)."""
        for key in [k for k, w in self._waits.items() if w.until <= now]:
            del self._waits[key]
        cut = min((w.seq for w in self._waits.values()), default=math.inf)
        items = self._items
        out: list[Item] = []
        while items and items[0][0] < cut:
            out.append(items.popleft()[1])
        return out

    def _push(self, item: Item) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self._items.append((seq, item))
        return seq


def parent_id(frames: list[bytes]) -> str | None:
    """The msg_id of the request a Jupyter message answers (its parent header's), if readable."""
    try:
        parent = json.loads(frames[2])
        return parent.get("msg_id") if isinstance(parent, dict) else None
    except (ValueError, IndexError, TypeError, UnicodeDecodeError):
        return None


def _role_in_pair(channel: str, frames: list[bytes]) -> tuple[str | None, str | None]:
    """(the request this message opens a pair for, the request whose idle it is): an
    ``execute_request``'s busy and any ``execute_reply`` open one; an idle is noted. The header is
    parsed only when a byte test says it may matter: most IOPub traffic is output."""
    header = frames[1] if len(frames) > 1 else b""
    if channel == "shell":
        if b"execute_reply" not in header or _msg_type(header) != "execute_reply":
            return None, None
        return parent_id(frames), None
    if channel != "iopub" or b"status" not in header or _msg_type(header) != "status":
        return None, None
    try:
        state = json.loads(frames[4]).get("execution_state")
        parent = json.loads(frames[2])
    except (ValueError, IndexError, TypeError, AttributeError, UnicodeDecodeError):
        return None, None
    if not isinstance(parent, dict) or not isinstance(parent.get("msg_id"), str):
        return None, None
    if state == "busy" and parent.get("msg_type") == "execute_request":
        return parent["msg_id"], None
    if state == "idle":
        return None, parent["msg_id"]
    return None, None


def _msg_type(header: bytes) -> str | None:
    try:
        parsed = json.loads(header)
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    return parsed.get("msg_type") if isinstance(parsed, dict) else None
