"""Pushes to a restarting gateway wait for it (services/global_scheduler/gateway_outbox.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.global_scheduler.gateway_outbox import GatewayOutbox
from shared import messages
from shared.envelope import Envelope, decode


class Link:
    def __init__(self) -> None:
        self.connected = True
        self.delivered: list[int] = []

    def send(self, env: Envelope) -> bool:
        if not self.connected:
            return False
        self.delivered.append(env.body["n"])
        return True


def push(outbox: GatewayOutbox, n: int) -> None:
    outbox.push(Envelope("jupyter.reply", {"n": n}))


def test_pushes_while_the_gateway_is_away_are_sent_in_order_once_it_speaks_again() -> None:
    link = Link()
    outbox = GatewayOutbox(link.send)
    push(outbox, 1)
    link.connected = False
    push(outbox, 2)
    link.connected = True
    push(outbox, 3)  # connected again, but behind what is kept: the order holds
    assert link.delivered == [1] and outbox.waiting == 2
    outbox.gateway_seen()
    assert link.delivered == [1, 2, 3] and outbox.waiting == 0
    push(outbox, 4)
    assert link.delivered == [1, 2, 3, 4]


def test_a_gateway_gone_again_mid_delivery_keeps_the_rest() -> None:
    link = Link()
    outbox = GatewayOutbox(link.send)
    link.connected = False
    for n in range(3):
        push(outbox, n)
    outbox.gateway_seen()
    assert outbox.waiting == 3 and link.delivered == []


def test_beyond_the_limit_the_oldest_pushes_are_dropped_and_counted() -> None:
    link = Link()
    outbox = GatewayOutbox(link.send, limit=2)
    link.connected = False
    for n in range(5):
        push(outbox, n)
    link.connected = True
    outbox.gateway_seen()
    assert link.delivered == [3, 4] and outbox.dropped == 3
    with pytest.raises(ValueError, match="at least one"):
        GatewayOutbox(link.send, limit=0)


class Turn:
    """A loop turn driven by the test: callbacks given to ``soon`` run at ``end``."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def soon(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


class Gateway:
    """What the gateway receives, decoded as the gateway decodes it."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []

    def send(self, env: Envelope) -> bool:
        self.envelopes.append(decode(env.encode()))
        return True

    def messages(self) -> list[tuple[str, str, bytes]]:
        """(kernel id, channel, first frame) of every Jupyter message, in arrival order."""
        return [
            (env.body["kernel_id"], channel, frames[0])
            for env in self.envelopes
            if env.type == messages.JUPYTER_REPLY
            for channel, frames in messages.jupyter_messages(env.body)
        ]


def jupyter(n: int) -> list[bytes]:
    return [f"{n}".encode(), b'{"msg_id": "m"}', b"{}", b"{}", b"{}"]


def test_one_loop_turns_forwards_for_a_kernel_cross_as_one_jupyter_reply_in_order() -> None:
    turn, gateway = Turn(), Gateway()
    outbox = GatewayOutbox(gateway.send, soon=turn.soon)
    outbox.forward("k1", [("iopub", jupyter(1))])  # a busy, forwarded at once by the merger
    outbox.forward("k1", [("iopub", jupyter(2)), ("iopub", jupyter(3))])  # released by `elected`
    assert gateway.envelopes == []  # nothing before the turn ends
    turn.end()
    assert len(gateway.envelopes) == 1
    assert gateway.messages() == [("k1", "iopub", b"1"), ("k1", "iopub", b"2"), ("k1", "iopub", b"3")]
    outbox.forward("k1", [("shell", jupyter(4))])  # the next turn: an envelope of its own
    turn.end()
    assert len(gateway.envelopes) == 2


def test_forwards_of_several_kernels_keep_their_order_across_kernels() -> None:
    turn, gateway = Turn(), Gateway()
    outbox = GatewayOutbox(gateway.send, soon=turn.soon)
    for kernel, n in (("k1", 1), ("k2", 2), ("k1", 3), ("k1", 4)):
        outbox.forward(kernel, [("iopub", jupyter(n))])
    turn.end()
    assert gateway.messages() == [
        ("k1", "iopub", b"1"),
        ("k2", "iopub", b"2"),
        ("k1", "iopub", b"3"),
        ("k1", "iopub", b"4"),
    ]
    assert len(gateway.envelopes) == 3  # one per run of one kernel's messages


def test_a_push_goes_behind_the_forwards_of_its_turn() -> None:
    turn, gateway = Turn(), Gateway()
    outbox = GatewayOutbox(gateway.send, soon=turn.soon)
    outbox.forward("k1", [("shell", jupyter(1))])  # a KernelDead error reply for the client ...
    outbox.push(Envelope(messages.KERNEL_DEAD, {"kernel_id": "k1", "reason": "quorum lost"}))  # ... then this
    assert [env.type for env in gateway.envelopes] == [messages.JUPYTER_REPLY, messages.KERNEL_DEAD]
    turn.end()  # nothing left to send
    assert len(gateway.envelopes) == 2


def test_without_a_loop_each_forward_is_pushed_at_once() -> None:
    gateway = Gateway()
    outbox = GatewayOutbox(gateway.send, soon=lambda callback: False)
    outbox.forward("k1", [("iopub", jupyter(1))])
    outbox.forward("k1", [("iopub", jupyter(2))])
    assert len(gateway.envelopes) == 2


def test_forwarded_while_the_gateway_is_away_they_wait_with_the_other_pushes() -> None:
    link, turn = Link(), Turn()
    sent: list[Envelope] = []

    def send(env: Envelope) -> bool:
        if not link.connected:
            return False
        sent.append(env)
        return True

    outbox = GatewayOutbox(send, soon=turn.soon)
    link.connected = False
    outbox.forward("k1", [("iopub", jupyter(1))])
    turn.end()
    assert outbox.waiting == 1
    link.connected = True
    outbox.gateway_seen()
    assert len(sent) == 1 and outbox.waiting == 0


def test_a_turn_with_more_messages_than_a_batch_holds_is_split() -> None:
    turn, gateway = Turn(), Gateway()
    outbox = GatewayOutbox(gateway.send, soon=turn.soon)
    outbox.forward("k1", [("iopub", jupyter(n)) for n in range(messages.MAX_BATCH_ITEMS + 1)])
    turn.end()
    assert len(gateway.envelopes) == 2
    assert [frame for _, _, frame in gateway.messages()] == [
        f"{n}".encode() for n in range(messages.MAX_BATCH_ITEMS + 1)
    ]
