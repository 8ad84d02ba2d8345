"""A replica's Raft port is chosen at start and bound later: it must come from outside the range
the kernel hands out to outgoing connections, or one of those can take it in between."""

from __future__ import annotations

import random
import socket

from kernel_replica.__main__ import RAFT_PORT_FLOOR, ephemeral_port_floor, free_port


def test_raft_ports_come_from_below_the_ephemeral_range() -> None:
    rng = random.Random(7)
    ports = {free_port("127.0.0.1", rng) for _ in range(20)}
    assert all(RAFT_PORT_FLOOR <= p < ephemeral_port_floor() for p in ports)


def test_a_port_in_use_is_skipped() -> None:
    taken = free_port("127.0.0.1", random.Random(1))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        assert free_port("127.0.0.1", random.Random(1)) != taken  # same draw first, then the next
