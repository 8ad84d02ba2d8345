"""Pushes to a restarting gateway wait for it (services/global_scheduler/gateway_outbox.py)."""

from __future__ import annotations

import pytest

from services.global_scheduler.gateway_outbox import GatewayOutbox
from shared.envelope import Envelope


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
