"""What the global scheduler pushes to the gateway, kept while the gateway is not connected.

Replies and outputs of cells go to the gateway as pushes. While the gateway restarts (killed,
restarted by ``tandem up``) the cells keep running on their replicas, and ZMQ would drop what
they answer meanwhile: the clients would wait for replies that never come. The scheduler's
socket refuses a push to a peer that is not connected (``ROUTER_MANDATORY``), so such a push is
kept here, in order, and later pushes queue behind it; the first message from the gateway (a
restarted one asks at once about every kernel it restored) sends them on. The restarted gateway
routes a reply whose request it never saw by the client's session (kernel_endpoint.py).

Bounded: beyond ``limit`` pushes the oldest are dropped, with a warning and a count.

The kernels' Jupyter messages (``forward``) go at the end of the loop turn they were made in, one
``jupyter.reply`` per run of one kernel's messages: every envelope costs the scheduler and the
gateway a CURVE box and a decode, and one message from a local scheduler often releases several
pushes (a ``batch`` whose busy is forwarded at once and whose ``elected`` event releases the
execute_input the merger held: two pushes). Nothing waits for later I/O: only what one loop turn
had goes together, in order, and any other push goes behind it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import structlog

from shared import messages
from shared.envelope import Envelope

log = structlog.get_logger("global_scheduler.gateway_outbox")

KEPT_PUSHES = 50_000


Forward = tuple[str, list[bytes]]  # (channel, frames) of one Jupyter message for the client
# Runs a callback later in this loop turn (``loop.call_soon``); False: no loop, run nothing
Soon = Callable[[Callable[[], None]], bool]


class GatewayOutbox:
    def __init__(
        self, send: Callable[[Envelope], bool], *, limit: int = KEPT_PUSHES, soon: Soon | None = None
    ) -> None:
        """``soon``: how a loop turn's forwards are flushed together; None: each at once."""
        if limit < 1:
            raise ValueError(f"the outbox must keep at least one push, not {limit}")
        self._send = send
        self._limit = limit
        self._soon = soon
        self._kept: deque[Envelope] = deque()
        self._forwards: list[tuple[str, list[Forward]]] = []  # (kernel id, its messages) this turn
        self.dropped = 0

    @property
    def waiting(self) -> int:
        return len(self._kept)

    def forward(self, kernel_id: str, forwards: list[Forward]) -> None:
        """``kernel_id``'s Jupyter messages for its client, sent with what else this loop turn
        forwards (one ``jupyter.reply`` per run of one kernel's messages, in order)."""
        if not forwards:
            return
        pending = self._forwards
        if pending and pending[-1][0] == kernel_id:
            pending[-1][1].extend(forwards)
            return
        first = not pending
        pending.append((kernel_id, list(forwards)))
        if first and (self._soon is None or not self._soon(self.flush)):
            self.flush()

    def flush(self) -> None:
        """Push the forwards not pushed yet (at the end of the loop turn that made them)."""
        pending, self._forwards = self._forwards, []
        step = messages.MAX_BATCH_ITEMS
        for kernel_id, forwards in pending:
            for start in range(0, len(forwards), step):
                reply = messages.jupyter_reply(kernel_id, forwards[start : start + step])
                self._push(Envelope(messages.JUPYTER_REPLY, reply))

    def push(self, env: Envelope) -> None:
        """Send now (behind this turn's forwards), or keep it (behind whatever is kept already,
        so the order holds)."""
        if self._forwards:
            self.flush()
        self._push(env)

    def _push(self, env: Envelope) -> None:
        if not self._kept and self._send(env):
            return
        if not self._kept:
            log.warning("gateway_unreachable", keeping=env.type)
        if len(self._kept) >= self._limit:
            self._kept.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("gateway_pushes_dropped", dropped=self.dropped, kept=self._limit)
        self._kept.append(env)

    def gateway_seen(self) -> None:
        """The gateway sent something, so it is connected: send what was kept, in order."""
        sent = 0
        while self._kept:
            if not self._send(self._kept[0]):
                break
            self._kept.popleft()
            sent += 1
        if sent:
            log.info("gateway_pushes_delivered", pushes=sent, still_kept=len(self._kept))
