"""The Raft links' identities and TLS, without sockets: certificates from the cluster's Raft CA
name exactly one member of one kernel, two ``TlsSession``s pumped into each other authenticate
both ways, and everything else (another CA, no certificate, garbage, another kernel, another
member) is refused with a reason."""

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
    IDENTITY_ENV,
    IdentityError,
    LinkTls,
    MemberIdentity,
    TlsFailure,
    TlsSession,
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
