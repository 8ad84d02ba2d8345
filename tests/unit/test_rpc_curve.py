"""CURVE on the service links: only issued keys connect, and a server knows who sent what. A
server's ipc endpoint (PLAIN, derived credentials) admits the same principals and no one else."""

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

    def __init__(
        self, ctx: zmq.asyncio.Context, keys: Path, authorize: Any = None, *, local: Path | None = None
    ) -> None:
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
        self.local_address = self.server.bind(f"ipc://{local}") if local is not None else ""
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


def _ipc_socket(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    return run_dir / "s.sock"


def test_an_ipc_endpoint_admits_an_issued_key_by_its_derived_password_and_names_its_principal(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)
    curve.issue(keys, "host.h1")

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys, local=_ipc_socket(tmp_path))
        assert echo.server.address == echo.address and echo.server.local_address == echo.local_address
        host = RpcClient(ctx, name="h1", curve=curve.client_curve(keys, "host.h1", curve.SCHEDULER))
        host.connect(echo.local_address)
        gateway = RpcClient(ctx, name="gw", curve=curve.client_curve(keys, curve.GATEWAY, curve.SCHEDULER))
        gateway.connect(echo.address)  # the same server's TCP endpoint is still CURVE
        for client in (host, gateway):
            answer = await client.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=5)
            assert answer.body == {"ok": True}
            await client.close()
        assert echo.seen == ["host.h1", curve.GATEWAY]
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())


class _Impostor(curve.ClientCurve):
    """Claims another principal's name on the ipc endpoint, with a password it can derive."""

    def __init__(self, keys: curve.Keypair, server_public: bytes, claimed: str) -> None:
        super().__init__(keys, server_public, "host.h1")
        object.__setattr__(self, "_claimed", claimed)

    def connect(self, sock: zmq.Socket[Any], address: str) -> None:
        sock.plain_username = self._claimed.encode()  # type: ignore[attr-defined]
        sock.plain_password = curve.ipc_password(self.keys, "host.h1")
        sock.connect(address)


def test_an_ipc_endpoint_refuses_a_wrong_password_a_made_up_name_no_credentials_and_plain_on_tcp(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)
    h1 = curve.issue(keys, "host.h1")
    (tmp_path / "outside.key_secret").write_text("not a key")  # what a path-like name would reach

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        echo = Echo(ctx, keys, local=_ipc_socket(tmp_path))
        server_public = curve.load(keys, curve.SCHEDULER).public
        clients = []
        for claimed in (curve.OPERATOR, "../outside", curve.SCHEDULER):  # h1's password, not theirs
            client = RpcClient(ctx, name=f"as-{claimed}", curve=_Impostor(h1, server_public, claimed))
            client.connect(echo.local_address)
            clients.append(client)
        stranger = RpcClient(
            ctx, name="stranger", curve=curve.ClientCurve(curve.new_keypair(), server_public, "host.h1")
        )
        stranger.connect(echo.local_address)  # a key this cluster never issued
        bare = RpcClient(ctx, name="bare")  # no credentials at all (NULL)
        bare.connect(echo.local_address)
        plain_on_tcp = RpcClient(ctx, name="plain-on-tcp")
        plain_on_tcp._sock.plain_username = b"host.h1"
        plain_on_tcp._sock.plain_password = curve.ipc_password(h1, "host.h1")
        plain_on_tcp.connect(echo.address)  # the right password, on the CURVE endpoint
        for client in (*clients, stranger, bare, plain_on_tcp):
            with pytest.raises(RpcTimeout):
                await client.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=1.0)
            await client.close()
        assert echo.seen == []
        assert echo.authority.refused >= 4
        await echo.close()
        ctx.destroy(linger=0)

    run(scenario())


def test_the_ipc_password_is_bound_to_the_principal_and_its_secret() -> None:
    a, b = curve.new_keypair(), curve.new_keypair()
    assert curve.ipc_password(a, "host.h1") == curve.ipc_password(a, "host.h1")
    assert curve.ipc_password(a, "host.h1") != curve.ipc_password(a, "host.h2")
    assert curve.ipc_password(a, "host.h1") != curve.ipc_password(b, "host.h1")
    assert a.secret is not None and a.secret not in curve.ipc_password(a, "host.h1")


def test_a_tcp_endpoint_bound_after_an_ipc_one_is_still_curve(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    curve.ensure_cluster_keys(keys)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        authority = curve.CurveAuthority.for_cluster_server(ctx, keys, curve.SCHEDULER)
        server = RpcServer(
            ctx,
            lambda _i, env: env.reply({"ok": True}),
            name="s",
            curve=curve.server_curve(keys, curve.SCHEDULER),
        )
        server.bind(f"ipc://{_ipc_socket(tmp_path)}")
        tcp = server.bind("tcp://127.0.0.1:0")
        server.start()
        good = RpcClient(ctx, name="good", curve=curve.client_curve(keys, curve.GATEWAY, curve.SCHEDULER))
        good.connect(tcp)
        assert (await good.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=5)).body == {"ok": True}
        plain = RpcClient(ctx, name="plain")
        plain._sock.plain_username = curve.GATEWAY.encode()
        plain._sock.plain_password = curve.ipc_password(curve.load(keys, curve.GATEWAY), curve.GATEWAY)
        plain.connect(tcp)
        with pytest.raises(RpcTimeout):
            await plain.request(Envelope(messages.CLUSTER_STATUS, {}), timeout=1.0)
        for closing in (good, plain, server):
            await closing.close()
        authority.release()
        ctx.destroy(linger=0)

    run(scenario())
