"""A replica's Raft port is chosen at start and served on only once the replica is configured. It
is held in between (a listening socket that Raft adopts), and comes from outside the range the
kernel hands out to outgoing connections."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest

from kernel_replica.__main__ import (
    RAFT_PORT_FLOOR,
    ephemeral_port_floor,
    raft_listener_for,
    reserve_free_port,
)
from shared.raft.tcp_transport import TcpTransport


def test_raft_ports_come_from_below_the_ephemeral_range() -> None:
    rng = random.Random(7)
    held = [reserve_free_port("127.0.0.1", rng) for _ in range(20)]
    try:
        assert all(RAFT_PORT_FLOOR <= s.getsockname()[1] < ephemeral_port_floor() for s in held)
    finally:
        for sock in held:
            sock.close()


def test_a_port_in_use_is_skipped() -> None:
    first = reserve_free_port("127.0.0.1", random.Random(1))
    try:
        second = reserve_free_port("127.0.0.1", random.Random(1))  # same draw first, then the next
        assert second.getsockname()[1] != first.getsockname()[1]
        second.close()
    finally:
        first.close()


def test_a_chosen_port_cannot_be_taken_before_raft_serves_on_it() -> None:
    """The race a suite run lost: another process binding the chosen port (as asyncio's servers
    do, with SO_REUSEADDR) between the choice and Raft's start."""
    held = reserve_free_port("127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as rival:
            rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                rival.bind(("127.0.0.1", held.getsockname()[1]))
    finally:
        held.close()


def test_raft_serves_on_the_held_socket_and_a_restart_gets_the_same_address(tmp_path: Path) -> None:
    address, listener = raft_listener_for(tmp_path, "127.0.0.1")

    async def serve() -> str:
        transport = TcpTransport("r1", address, lambda messages: None, listener=listener)
        bound = await transport.start()
        _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
        writer.close()
        transport.close()
        return bound

    assert asyncio.run(serve()) == address
    again, listener_again = raft_listener_for(tmp_path, "127.0.0.1")
    listener_again.close()
    assert again == address
