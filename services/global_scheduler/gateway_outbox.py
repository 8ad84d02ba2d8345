"""What the global scheduler pushes to the gateway, kept while the gateway is not connected.

Replies and outputs of cells go to the gateway as pushes. While the gateway restarts (killed,
restarted by ``tandem up``) the cells keep running on their replicas, and ZMQ would drop what
they answer meanwhile: the clients would wait for replies that never come. The scheduler's
socket refuses a push to a peer that is not connected (``ROUTER_MANDATORY``), so such a push is
kept here, in order, and later pushes queue behind it; the first message from the gateway (a
restarted one asks at once about every kernel it restored) sends them on. The restarted gateway
routes a reply whose request it never saw by the client's session (kernel_endpoint.py).

Bounded: beyond ``limit`` pushes the oldest are dropped, with a warning and a count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import structlog

from shared.envelope import Envelope

log = structlog.get_logger("global_scheduler.gateway_outbox")

KEPT_PUSHES = 50_000


class GatewayOutbox:
    def __init__(self, send: Callable[[Envelope], bool], *, limit: int = KEPT_PUSHES) -> None:
        if limit < 1:
            raise ValueError(f"the outbox must keep at least one push, not {limit}")
        self._send = send
        self._limit = limit
        self._kept: deque[Envelope] = deque()
        self.dropped = 0

    @property
    def waiting(self) -> int:
        return len(self._kept)

    def push(self, env: Envelope) -> None:
        """Send now, or keep it (behind whatever is kept already, so the order holds)."""
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
