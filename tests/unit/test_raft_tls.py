"""The Raft links' identities and TLS, without sockets: certificates from the cluster's Raft CA
name exactly one member of one kernel, two ``TlsSession``s pumped into each other authenticate
both ways, and everything else (another CA, no certificate, garbage, another kernel, another
member) is refused with a reason. A loopback connection negotiates the clear after the handshake
only when both ends see loopback and allow it."""

from __future__ import annotations

import contextlib
import os
import ssl
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.raft.tls import (
    ALPN_LOOPBACK_PLAIN,
    IDENTITY_ENV,
    IdentityError,
    LinkTls,
    MemberIdentity,
    TlsFailure,
    TlsSession,
    is_loopback_connection,
    link_tls_for,
    member_of,
    member_uri,
    parse_member_uri,
    take_identity_env,
)
from shared.raft.tls_ca import CA_CERT_FILE, CA_KEY_FILE, ClusterCA, member_of_pem

CA = ClusterCA.create()  # one for the module: minting is cheap, but not free
SERVER_ID = CA.issue("k", "r2")


def pump(client: TlsSession, server: TlsSession) -> None:
    """Carry bytes between the two until neither has anything to say (raises TlsFailure)."""
    to_server = client.start()
    for _ in range(10):
        if to_server:
            server.receive(to_server)
        to_client = server.pending()
        if to_client:
            client.receive(to_client)
        to_server = client.pending()
        if not to_server and not to_client:
            return
    raise AssertionError("the handshake did not settle")


def sessions(
    client_id: MemberIdentity | None, server_id: MemberIdentity
) -> tuple[TlsSession, TlsSession, LinkTls]:
    server_tls = LinkTls.from_identity(server_id)
    if client_id is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = LinkTls.from_identity(client_id).client
    return TlsSession(ctx, server_side=False), TlsSession(server_tls.server, server_side=True), server_tls


def test_member_uri_round_trips_and_refuses_unsafe_ids() -> None:
    assert parse_member_uri(member_uri("k-1.a", "r2")) == ("k-1.a", "r2")
    for group, member in (("../etc", "r1"), ("k", "r:1"), ("", "r1"), ("k", "a/b")):
        with pytest.raises(IdentityError):
            member_uri(group, member)
    assert parse_member_uri("urn:tandem:raft:k") is None
    assert parse_member_uri("https://k/r1") is None


def test_an_issued_certificate_names_its_member_and_kernel_in_san_and_cn() -> None:
    identity = CA.issue("kernel-a", "r3")
    assert member_of_pem(identity.cert_pem) == ("kernel-a", "r3")
    assert identity.ca_pem == CA.cert_pem


def test_member_of_requires_one_raft_uri_repeated_by_the_cn() -> None:
    uri = ("URI", "urn:tandem:raft:k:r1")
    cn = ((("commonName", "r1"),),)
    assert member_of({"subject": cn, "subjectAltName": (uri,)}) == ("k", "r1")
    assert member_of({"subject": ((("commonName", "r2"),),), "subjectAltName": (uri,)}) is None
    assert member_of({"subject": cn, "subjectAltName": (uri, ("URI", "urn:tandem:raft:k:r2"))}) is None
    assert member_of({"subject": cn, "subjectAltName": (("DNS", "r1"),)}) is None
    assert member_of({}) is None and member_of(None) is None


def test_an_identity_survives_json_and_the_wire_and_malformed_ones_are_refused() -> None:
    identity = CA.issue("k", "r1")
    assert MemberIdentity.from_json(identity.to_json()) == identity
    assert MemberIdentity.from_wire(identity.to_wire()) == identity
    for bad in ("", "[]", "{}", '{"group": "k", "member": "r1", "ca": "", "cert": "x", "key": "y"}'):
        with pytest.raises(IdentityError):
            MemberIdentity.from_json(bad)
    with pytest.raises(IdentityError):
        MemberIdentity.from_wire(["not", "a", "map"])


def test_two_members_of_a_kernel_authenticate_each_other_and_exchange_data() -> None:
    client, server, server_tls = sessions(CA.issue("k", "r1"), CA.issue("k", "r2"))
    pump(client, server)
    assert client.established and server.established
    assert server_tls.peer_problem(server.ssl_object) == ("r1", "")
    client_tls = LinkTls(server_tls.group, "r1", server_tls.server, server_tls.client)
    assert client_tls.peer_problem(client.ssl_object, "r2") == ("r2", "")
    payload = os.urandom(100_000)  # several TLS records
    assert server.receive(client.encrypt(b"head", payload)) == b"head" + payload


def test_the_outbound_side_refuses_a_peer_that_is_not_the_member_it_meant_to_reach() -> None:
    client, server, _ = sessions(CA.issue("k", "r1"), CA.issue("k", "r3"))
    pump(client, server)
    ours = LinkTls.from_identity(CA.issue("k", "r1"))
    member, problem = ours.peer_problem(client.ssl_object, "r2")
    assert member is None and "'r3' where 'r2' was expected" in problem


def test_a_member_of_another_kernel_is_authenticated_but_refused() -> None:
    client, server, server_tls = sessions(CA.issue("other", "r1"), CA.issue("k", "r2"))
    pump(client, server)
    member, problem = server_tls.peer_problem(server.ssl_object)
    assert member is None and "kernel 'other'" in problem


@pytest.mark.parametrize("who", ["another CA", "no certificate"])
def test_the_server_refuses_the_handshake_of_a_non_member(who: str) -> None:
    stranger = ClusterCA.create().issue("k", "r1") if who == "another CA" else None
    client, server, _ = sessions(stranger, CA.issue("k", "r2"))
    with pytest.raises(TlsFailure):
        pump(client, server)
    assert not server.established


def test_garbage_instead_of_a_handshake_is_a_tls_failure() -> None:
    server = TlsSession(LinkTls.from_identity(CA.issue("k", "r2")).server, server_side=True)
    with pytest.raises(TlsFailure):
        server.receive(b"\x00\x00\x00\x05hello" * 20)


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=1, max_size=2048))
def test_any_bytes_before_the_handshake_only_ever_raise_tls_failure(data: bytes) -> None:
    server = TlsSession(LinkTls.from_identity(SERVER_ID).server, server_side=True)
    with contextlib.suppress(TlsFailure):
        assert server.receive(data) == b""
    assert not server.established


def test_a_replica_needs_an_identity_for_itself_and_the_tcp_transport() -> None:
    identity = CA.issue("k", "r1").to_json()
    assert link_tls_for(False, "zmq", None, "k", "r1") is None  # authentication off
    tls = link_tls_for(True, "tcp", identity, "k", "r1")
    assert tls is not None and (tls.group, tls.member) == ("k", "r1")
    with pytest.raises(IdentityError, match="cannot authenticate"):
        link_tls_for(True, "zmq", identity, "k", "r1")
    with pytest.raises(IdentityError, match="no Raft identity"):
        link_tls_for(True, "tcp", None, "k", "r1")
    with pytest.raises(IdentityError, match="not 'r2' of 'k'"):
        link_tls_for(True, "tcp", identity, "k", "r2")


def test_the_identity_is_taken_out_of_the_environment() -> None:
    env = {IDENTITY_ENV: "x", "OTHER": "y"}
    assert take_identity_env(env) == "x" and env == {"OTHER": "y"}
    assert take_identity_env(env) is None


def test_the_cluster_ca_is_kept_private_and_reloaded_after_a_restart(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    first = ClusterCA.load_or_create(keys)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / CA_KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((keys / CA_CERT_FILE).stat().st_mode) == 0o600
    again = ClusterCA.load_or_create(keys)
    assert again.cert_pem == first.cert_pem
    # a member certified before the restart and one certified after it trust each other
    client, server, server_tls = sessions(first.issue("k", "r1"), again.issue("k", "r4"))
    pump(client, server)
    assert server_tls.peer_problem(server.ssl_object) == ("r1", "")


def test_an_unreadable_ca_is_an_error_naming_the_files(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / CA_KEY_FILE).write_text("not a key")
    with pytest.raises(IdentityError, match=CA_CERT_FILE):
        ClusterCA.load_or_create(keys)


def loopback_sessions(
    *,
    client_sees_loopback: bool = True,
    server_sees_loopback: bool = True,
    client_encrypts_loopback: bool = False,
    server_encrypts_loopback: bool = False,
) -> tuple[TlsSession, TlsSession]:
    client_tls = LinkTls.from_identity(CA.issue("k", "r1"), encrypt_loopback=client_encrypts_loopback)
    server_tls = LinkTls.from_identity(CA.issue("k", "r2"), encrypt_loopback=server_encrypts_loopback)
    client = client_tls.session(server_side=False, loopback=client_sees_loopback)
    server = server_tls.session(server_side=True, loopback=server_sees_loopback)
    pump(client, server)
    assert client.established and server.established
    assert server_tls.peer_problem(server.ssl_object) == ("r1", "")
    assert client_tls.peer_problem(client.ssl_object, "r2") == ("r2", "")
    return client, server


def test_members_on_a_loopback_connection_authenticate_then_exchange_frames_in_the_clear() -> None:
    client, server = loopback_sessions()
    assert client.plaintext and server.plaintext
    assert client.ssl_object.selected_alpn_protocol() == ALPN_LOOPBACK_PLAIN
    frame = b"\x00\x00\x00\x05hello"
    assert client.encrypt(frame) == frame and client.encrypt(b"a", b"b") == b"ab"
    assert server.receive(frame) == frame


@pytest.mark.parametrize(
    "setting",
    [
        {"client_sees_loopback": False},
        {"server_sees_loopback": False},
        {"client_encrypts_loopback": True},
        {"server_encrypts_loopback": True},
    ],
    ids=["client-not-loopback", "server-not-loopback", "client-encrypts", "server-encrypts"],
)
def test_records_stay_encrypted_unless_both_ends_see_loopback_and_allow_the_clear(
    setting: dict[str, bool],
) -> None:
    client, server = loopback_sessions(**setting)
    assert not client.plaintext and not server.plaintext
    payload = b"secret frame" * 10
    wire = client.encrypt(payload)
    assert payload not in wire and wire[:1] == b"\x17"  # a TLS application-data record
    assert server.receive(wire) == payload


def test_what_follows_the_last_handshake_record_in_one_read_is_the_peer_s_clear() -> None:
    client_tls = LinkTls.from_identity(CA.issue("k", "r1"))
    server_tls = LinkTls.from_identity(CA.issue("k", "r2"))
    client = client_tls.session(server_side=False, loopback=True)
    server = server_tls.session(server_side=True, loopback=True)
    assert server.receive(client.start()) == b""
    client.receive(server.pending())
    assert client.established and client.plaintext
    finished = client.pending()  # the client's last handshake flight, then its first frames
    assert server.receive(finished + client.encrypt(b"hello") + client.encrypt(b"next")) == b"hellonext"
    assert server.plaintext and server.pending() == b""  # no session tickets behind the handshake


@pytest.mark.parametrize("who", ["another CA", "no certificate"])
def test_a_non_member_on_loopback_is_refused_at_the_handshake_too(who: str) -> None:
    server = LinkTls.from_identity(CA.issue("k", "r2")).session(server_side=True, loopback=True)
    if who == "another CA":
        client = LinkTls.from_identity(ClusterCA.create().issue("k", "r1")).session(
            server_side=False, loopback=True
        )
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols([ALPN_LOOPBACK_PLAIN])
        client = TlsSession(ctx, server_side=False)
    with pytest.raises(TlsFailure):
        pump(client, server)
    assert not server.established and not server.plaintext


@pytest.mark.parametrize(
    ("sockname", "peername", "loopback"),
    [
        (("127.0.0.1", 4000), ("127.0.0.1", 5000), True),
        (("127.0.0.1", 4000), ("127.8.9.10", 5000), True),
        (("::1", 4000, 0, 0), ("::1", 5000, 0, 0), True),
        (("::ffff:127.0.0.1", 4000, 0, 0), ("::ffff:127.0.0.1", 5000, 0, 0), True),
        (("10.0.0.5", 4000), ("127.0.0.1", 5000), False),
        (("127.0.0.1", 4000), ("10.0.0.6", 5000), False),
        (("fe80::1%eth0", 4000, 0, 2), ("fe80::2%eth0", 5000, 0, 2), False),
        (None, ("127.0.0.1", 5000), False),
        (("not an address", 1), ("127.0.0.1", 5000), False),
    ],
)
def test_only_a_connection_with_two_loopback_ends_counts_as_loopback(
    sockname: object, peername: object, loopback: bool
) -> None:
    assert is_loopback_connection(sockname, peername) is loopback
