"""Requests that a ROUTER side sends to one of its peers and awaits (scheduler → local scheduler,
local scheduler → replica). ``shared.rpc.RpcServer`` only pushes; answers come back through the
server's handler as ``reply``/``error`` envelopes and are matched here by envelope id.
"""

from __future__ import annotations

import asyncio

from shared import messages
from shared.envelope import Envelope
from shared.rpc import RpcError, RpcServer, RpcTimeout


class OutboundRequests:
    def __init__(self, server: RpcServer) -> None:
        self._server = server
        self._pending: dict[str, asyncio.Future[Envelope]] = {}
        self._peer_of: dict[str, bytes] = {}

    async def request(self, identity: bytes, env: Envelope, *, timeout: float) -> Envelope:
        """Send ``env`` to the peer ``identity``; ``RpcError`` on an error answer, ``RpcTimeout``."""
        fut: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._pending[env.id] = fut
        self._peer_of[env.id] = identity
        try:
            self._server.send(identity, env)
            try:
                answer = await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise RpcTimeout(f"no answer to {env.type} from {identity!r} within {timeout:g}s") from None
        finally:
            self._pending.pop(env.id, None)
            self._peer_of.pop(env.id, None)
        if answer.type == messages.ERROR:
            raise RpcError(str(answer.body.get("reason")), str(answer.body.get("code", "error")))
        return answer

    def on_answer(self, env: Envelope) -> bool:
        """Feed a ``reply``/``error`` received by the server; False if nobody waits for it."""
        fut = self._pending.get(env.id)
        if fut is None or fut.done():
            return False
        fut.set_result(env)
        return True

    def fail_peer(self, identity: bytes, reason: str) -> int:
        """The peer is gone (host declared dead): end every wait on it now, not at its timeout."""
        failed = 0
        for request_id, peer in list(self._peer_of.items()):
            fut = self._pending.get(request_id)
            if peer == identity and fut is not None and not fut.done():
                fut.set_exception(RpcError(reason, "unreachable"))
                failed += 1
        return failed

    def cancel_all(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
