"""CURVE on the service links: only issued keys connect, and a server knows who sent what."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from shared import messages
from shared.envelope import Envelope
from shared.rpc import RpcClient, RpcError, RpcServer, RpcTimeout
from shared.security import curve


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


class Echo:
    """A server that answers who it thinks asked."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: Path, authorize: Any = None) -> None:
        self.authority = curve.CurveAuthority.acquire(ctx)
        self.authority.serve(curve.SCHEDULER, curve.PeerDirectory(keys, exclude=(curve.SCHEDULER,)))
        self.seen: list[str] = []
        self.server = RpcServer(
            ctx,
            self._handle,
            name="echo",
            curve=curve.server_curve(keys, curve.SCHEDULER),
            authorize=authorize or self._note,
        )
        self.address = self.server.bind("tcp://127.0.0.1:0")
        self.server.start()

    def _note(self, principal: str, identity: bytes, env: Envelope) -> str | None:
        self.seen.append(principal)
        return None

    def _handle(self, identity: bytes, env: Envelope) -> Envelope:
        return env.reply({"ok": True})

    async def close(self) -> None:
        await self.server.close()
        self.authority.release()


def test_key_files_are_private_and_issuing_twice_keeps_the_first(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    first = curve.issue(keys, "host.h1")
    again = curve.issue(keys, "host.h1")
    assert first == again and first.secret is not None
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for path in keys.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_an_issued_key_connects_and_the_server_learns_its_principal(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)
    curve.issue(keys, "host.h1")

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys)
        client = RpcClient(ctx, name="h1", curve=curve.client_curve(keys, "host.h1", curve.SCHEDULER))
        client.connect(echo.address)
        answer = await client.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=5)
        assert answer.body == {"ok": True}
        assert echo.seen == ["host.h1"]
        await client.close()
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())


def test_a_client_without_an_issued_key_never_reaches_the_handler(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys)
        stranger = RpcClient(
            ctx,
            name="stranger",
            curve=curve.ClientCurve(curve.new_keypair(), curve.load(keys, curve.SCHEDULER).public),
        )
        stranger.connect(echo.address)
        bare = RpcClient(ctx, name="bare")  # no CURVE at all
        bare.connect(echo.address)
        for client in (stranger, bare):
            with pytest.raises(RpcTimeout):
                await client.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=1.0)
            await client.close()
        assert echo.seen == []
        assert echo.authority.refused >= 1
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())


def test_a_refused_message_gets_an_unauthorized_error_naming_the_reason(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)

    def only_gateway(principal: str, identity: bytes, env: Envelope) -> str | None:
        return None if principal == curve.GATEWAY else f"{principal} may not send {env.type}"

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys, authorize=only_gateway)
        operator = RpcClient(ctx, name="op", curve=curve.client_curve(keys, curve.OPERATOR, curve.SCHEDULER))
        operator.connect(echo.address)
        with pytest.raises(RpcError) as refused:
            await operator.request(Envelope(messages.KERNEL_STATUS, {"kernel_id": "k1"}), timeout=5)
        assert refused.value.code == "unauthorized"
        assert "operator may not send kernel.status" in refused.value.reason
        await operator.close()
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())


def test_a_host_key_issued_after_the_server_started_is_accepted(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys)
        curve.issue(keys, "host.late")  # no wait: the next handshake sees the new file
        client = RpcClient(ctx, name="late", curve=curve.client_curve(keys, "host.late", curve.SCHEDULER))
        client.connect(echo.address)
        await client.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=5)
        assert echo.seen == ["host.late"]
        await client.close()
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())


def test_a_rotated_key_is_refused_from_its_next_connection(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)
    old = curve.issue(keys, "host.h1")

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys)
        before = RpcClient(ctx, name="before", curve=curve.client_curve(keys, "host.h1", curve.SCHEDULER))
        before.connect(echo.address)
        await before.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=5)
        await before.close()
        curve.rotate(keys, "host.h1")
        stale = RpcClient(
            ctx, name="stale", curve=curve.ClientCurve(old, curve.load(keys, curve.SCHEDULER).public)
        )
        stale.connect(echo.address)
        with pytest.raises(RpcTimeout):
            await stale.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=1, retries=0)
        await stale.close()
        fresh = RpcClient(ctx, name="fresh", curve=curve.client_curve(keys, "host.h1", curve.SCHEDULER))
        fresh.connect(echo.address)
        await fresh.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=5)
        assert echo.seen == ["host.h1", "host.h1"]
        await fresh.close()
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())
