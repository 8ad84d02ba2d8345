"""Who may speak on a Raft link: the cluster's Raft CA, each member's certificate, and the TLS
contexts of the TCP transport (``shared.raft.tcp_transport``).

Why TLS: a Raft peer's messages end in ``pickle.loads`` and ``exec`` (a kernel's STATE entries and
snapshots), so a peer must prove it is a member of the same kernel's group before anything it
sends is decoded. Mutual TLS 1.3 gives that and encryption with the standard library's ``ssl``;
the ``cryptography`` package only mints the certificates.

The scheme (minting is ``shared.raft.tls_ca``'s, with ``cryptography``; this module needs only the
standard library):

- The global scheduler holds one **Raft CA** per cluster (``ClusterCA``: an ECDSA P-256 key and a
  self-signed certificate, created on first use in its keys directory, key file 0600). It survives
  a scheduler restart, so a kernel adopted after one still gets certificates for its replacements.
- Each replica start (``replica.start``, ``replica.restart``) carries a fresh ``MemberIdentity``:
  the CA certificate, and a key and certificate of the replica's own whose subject CN is the
  member id and whose one SAN URI is ``urn:tandem:raft:<kernel id>:<member id>``. The local
  scheduler hands it to the replica process in its environment (``IDENTITY_ENV``), never argv.
- A link (``LinkTls``) admits only a peer whose certificate chains to that CA **and** names the same
  kernel; the member id it may then claim in its hello is the one in its certificate. An outbound
  link also checks that the peer it reached is the member it meant to reach.

One CA for the cluster (rather than one per kernel) keeps the scheduler's state one key pair, and
cross-kernel isolation comes from the kernel id bound in every certificate, checked on each link.

**Links that never leave the machine** (both ends of the TCP connection loopback addresses: the
embedded cluster, where every "host" is a process on one machine) are authenticated by the same
mutual handshake, and their frames then travel in the clear on that connection. Encryption
protects bytes on a wire; on loopback they only cross the kernel's buffers, which no unprivileged
process can read or write into (that takes ``CAP_NET_RAW``, i.e. root), and what the handshake
proved stays bound to the connection because nobody can splice into it. Both ends must agree,
so the mode is negotiated inside the handshake by ALPN (``ALPN_LOOPBACK_PLAIN``, authenticated by
TLS 1.3's Finished messages): each side offers it only if it sees a loopback connection and
``raft.encrypt_loopback`` is off, and a peer that does not offer it (another version, another
setting) gets an encrypted link as before. Why: a record costs each side 10-20 us of CPU in situ
(cold caches, OpenSSL's per-call machinery), a cell sends about 12 of them, and that was most of
what security cost a trivial cell (``scripts/bench_security_cost.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.host_address import is_loopback
from shared.private_files import write_private

IDENTITY_ENV = "TANDEM_RAFT_IDENTITY"  # a replica's MemberIdentity, JSON, in its environment
# ALPN protocol ids (offered in preference order): records encrypted, or the clear after the
# handshake on a loopback connection (module docstring)
ALPN_ENCRYPTED = "tandem-raft/1"
ALPN_LOOPBACK_PLAIN = "tandem-raft/1+loopback-plain"
SAN_PREFIX = "urn:tandem:raft:"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # as shared.messages admits ids


class IdentityError(ValueError):
    """A Raft identity that cannot be used; the message says what is wrong with it."""


def member_uri(group: str, member: str) -> str:
    """The SAN URI naming ``member`` of ``group`` (a kernel id)."""
    for what, value in (("group", group), ("member", member)):
        if _ID.fullmatch(value) is None or ".." in value:
            raise IdentityError(f"Raft {what} id {value[:80]!r} is not a safe id")
    return f"{SAN_PREFIX}{group}:{member}"


def parse_member_uri(uri: str) -> tuple[str, str] | None:
    """(group, member) of a SAN URI made by ``member_uri``, else None."""
    if not uri.startswith(SAN_PREFIX):
        return None
    group, sep, member = uri[len(SAN_PREFIX) :].partition(":")
    if not sep or _ID.fullmatch(group) is None or _ID.fullmatch(member) is None:
        return None
    return group, member


@dataclass(frozen=True, slots=True)
class MemberIdentity:
    """What one replica is given to join its group's links: PEM bytes of the CA certificate, its
    own certificate and its private key, and the (group, member) they were issued for."""

    group: str
    member: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def to_json(self) -> str:
        return json.dumps(
            {
                "group": self.group,
                "member": self.member,
                "ca": self.ca_pem.decode(),
                "cert": self.cert_pem.decode(),
                "key": self.key_pem.decode(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> MemberIdentity:
        try:
            raw = json.loads(text)
            fields = {name: raw[name] for name in ("group", "member", "ca", "cert", "key")}
        except (ValueError, TypeError, KeyError) as exc:
            raise IdentityError(f"malformed Raft identity: {exc!r}") from None
        if not all(isinstance(v, str) and v for v in fields.values()):
            raise IdentityError("malformed Raft identity: every field must be a non-empty string")
        return cls(
            fields["group"],
            fields["member"],
            fields["ca"].encode(),
            fields["cert"].encode(),
            fields["key"].encode(),
        )

    def to_wire(self) -> dict[str, str]:
        """As a ``replica.start`` body field (msgpack map of strings)."""
        return json.loads(self.to_json())

    @classmethod
    def from_wire(cls, raw: Any) -> MemberIdentity:
        if not isinstance(raw, dict):
            raise IdentityError("a Raft identity must be a map")
        return cls.from_json(json.dumps(raw))


# --------------------------------------------------------------------------- TLS contexts


@dataclass(frozen=True, slots=True)
class LinkTls:
    """The TLS contexts of one member's links, and whom they speak for: ``server`` (inbound,
    requires a client certificate from the CA) and ``client`` (outbound, presents ours and verifies
    the peer's) encrypt every record; the ``*_loopback`` pair also offers the clear after the
    handshake, for a connection whose ends are both loopback (None with ``encrypt_loopback``)."""

    group: str
    member: str
    server: ssl.SSLContext
    client: ssl.SSLContext
    server_loopback: ssl.SSLContext | None = None
    client_loopback: ssl.SSLContext | None = None

    @classmethod
    def from_identity(cls, identity: MemberIdentity, *, encrypt_loopback: bool = False) -> LinkTls:
        offers = [[ALPN_ENCRYPTED]] + ([] if encrypt_loopback else [[ALPN_LOOPBACK_PLAIN, ALPN_ENCRYPTED]])
        with _pem_files(identity.cert_pem, identity.key_pem) as (cert_file, key_file):
            servers, clients = [
                [_context(protocol, identity.ca_pem, cert_file, key_file, alpn) for alpn in offers]
                for protocol in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT)
            ]
        return cls(identity.group, identity.member, servers[0], clients[0], *servers[1:], *clients[1:])

    def session(self, *, server_side: bool, loopback: bool) -> TlsSession:
        """A session for one connection; ``loopback``: both its ends are loopback addresses
        (``is_loopback_connection``), so the clear may be negotiated."""
        plain = self.server_loopback if server_side else self.client_loopback
        encrypted = self.server if server_side else self.client
        return TlsSession(plain if loopback and plain is not None else encrypted, server_side=server_side)

    def peer_problem(self, ssl_object: Any, expected_member: str | None = None) -> tuple[str | None, str]:
        """(the member a verified peer's certificate names, None) or (None, why it is refused):
        the peer must belong to this group, and be ``expected_member`` when one is given."""
        if ssl_object is None:
            return None, "not a TLS connection"
        named = member_of(ssl_object.getpeercert())
        if named is None:
            return None, "the peer's certificate names no Raft member"
        group, member = named
        if group != self.group:
            return None, f"the peer's certificate is for kernel {group!r}, not {self.group!r}"
        if expected_member is not None and member != expected_member:
            return None, f"reached member {member!r} where {expected_member!r} was expected"
        return member, ""


def is_loopback_connection(sockname: Any, peername: Any) -> bool:
    """Whether a TCP connection's two ends (``getsockname()``/``getpeername()`` tuples) are both
    loopback addresses, so that its bytes never leave this machine's kernel."""
    return all(
        isinstance(end, tuple) and end and isinstance(end[0], str) and is_loopback(end[0])
        for end in (sockname, peername)
    )


def member_of(cert: dict[str, Any] | None) -> tuple[str, str] | None:
    """(group, member) named by a verified peer certificate (``SSLObject.getpeercert()``): its one
    ``urn:tandem:raft:`` SAN URI, which the CN must repeat."""
    if not cert:
        return None
    uris = [
        value
        for kind, value in cert.get("subjectAltName", ())
        if kind == "URI" and value.startswith(SAN_PREFIX)
    ]
    if len(uris) != 1:
        return None
    named = parse_member_uri(uris[0])
    if named is None:
        return None
    common_names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if common_names != [named[1]]:
        return None
    return named


def _context(protocol: int, ca_pem: bytes, cert_file: str, key_file: str, alpn: list[str]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # peers are named by member id (checked by LinkTls), not by host
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(alpn)  # a server picks the first of its own list the client offers
    if protocol == ssl.PROTOCOL_TLS_SERVER:
        # no session tickets: links never resume, and on a loopback-plain link nothing may follow
        # the server's Finished in TLS records
        ctx.num_tickets = 0
    try:
        ctx.load_verify_locations(cadata=ca_pem.decode())
        ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, ValueError) as exc:
        raise IdentityError(f"the Raft CA, certificate or key does not load: {exc}") from None
    return ctx


@contextlib.contextmanager
def _pem_files(*blobs: bytes) -> Iterator[tuple[str, ...]]:
    """``ssl`` loads certificates and keys only from files: each blob in a private temporary file
    (0600 in a 0700 directory), removed as soon as it is loaded."""
    with tempfile.TemporaryDirectory(prefix="tandem-raft-tls-") as tmp:
        paths = []
        for n, blob in enumerate(blobs):
            path = Path(tmp) / f"{n}.pem"
            write_private(path, blob, exclusive=True)
            paths.append(str(path))
        yield tuple(paths)


def take_identity_env(environ: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """Take (and remove) this process's Raft identity (JSON) from its environment, so that user
    code in the replica does not find the key lying in ``os.environ``. None when none was given."""
    return (os.environ if environ is None else environ).pop(IDENTITY_ENV, None)


# --------------------------------------------------------------------------- sans-I/O session


class TlsFailure(Exception):
    """The TLS session failed (handshake refused, certificate not trusted, corrupt record)."""


READ_CHUNK = 16_384  # one TLS record's plaintext at most (2**14): a larger read buffer is only allocated


class TlsSession:
    """One TLS connection over memory buffers, with no socket (like ``h11``'s ``Connection``):
    ``receive`` takes the bytes that came off the wire and returns the plaintext they carried,
    ``encrypt`` turns plaintext into wire bytes, and ``pending`` is what the handshake has to
    send. The transport's protocols drive it; failures come out as ``TlsFailure`` with a reason,
    before any of the peer's bytes are handed on. ``plaintext``: the handshake negotiated
    ``ALPN_LOOPBACK_PLAIN``, and both directions carry the clear from there on (what followed the
    peer's last handshake record in the same read is returned by ``receive`` as it is).

    Why not ``asyncio``'s own TLS (``create_server(ssl=...)``): it hides failed handshakes (no
    callback, nothing to count), and with uvloop a plain connection cannot be upgraded without
    losing the bytes that arrived first."""

    def __init__(self, context: ssl.SSLContext, *, server_side: bool) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self.established = False
        self.plaintext = False
        self.closed = False  # the peer sent close_notify

    def start(self) -> bytes:
        """The bytes that open the handshake (a client's hello; nothing for a server)."""
        self._handshake()
        return self._outgoing.read()

    def pending(self) -> bytes:
        """Handshake or session bytes waiting to go to the peer (send them after ``receive``)."""
        return self._outgoing.read()

    def receive(self, data: bytes) -> bytes:
        """Feed wire bytes; the plaintext they completed (b"" while the handshake runs)."""
        if self.plaintext:
            return data
        self._incoming.write(data)
        if not self.established:
            if not self._handshake():
                return b""
            if self.plaintext:  # OpenSSL reads a record at a time: the rest is the peer's clear
                return self._incoming.read()
        chunks = []
        incoming, tls = self._incoming, self.ssl_object
        # Every call into the SSL object releases the GIL, which the replica's busy kernel thread
        # then takes for up to a switch interval: so no ``tls.pending()`` after each record (a
        # read of READ_CHUNK takes a whole record, so OpenSSL keeps plaintext back only after a
        # read that filled the chunk), only the BIO's own count, which holds the GIL.
        more = incoming.pending > 0
        while more:
            try:
                chunk = tls.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                break  # a record not complete yet
            except ssl.SSLZeroReturnError:
                self.closed = True
                break
            except ssl.SSLError as exc:
                raise TlsFailure(f"TLS record refused: {exc.reason or exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            more = incoming.pending > 0 or (len(chunk) == READ_CHUNK and tls.pending() > 0)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def encrypt(self, *parts: bytes) -> bytes:
        """Wire bytes carrying ``parts`` in order (once established)."""
        if self.plaintext:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        tls = self.ssl_object
        for part in parts:
            tls.write(part)
        return self._outgoing.read()

    def _handshake(self) -> bool:
        try:
            self.ssl_object.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLError as exc:
            raise TlsFailure(
                f"TLS handshake failed: {getattr(exc, 'verify_message', None) or exc.reason or exc}"
            ) from None
        self.established = True
        self.plaintext = self.ssl_object.selected_alpn_protocol() == ALPN_LOOPBACK_PLAIN
        return True


def link_tls_for(
    enabled: bool,
    transport: str,
    identity_json: str | None,
    group: str,
    member: str,
    *,
    encrypt_loopback: bool = False,
) -> LinkTls | None:
    """The TLS of a replica's Raft links (config ``raft.tls``, ``raft.transport``,
    ``raft.encrypt_loopback``), or why it
    cannot start (IdentityError): with authentication on it needs an identity for exactly this
    member of this kernel, and the TCP transport (the ZMQ one cannot authenticate its peers)."""
    if not enabled:
        return None
    if transport != "tcp":
        raise IdentityError(
            f'raft.transport = {transport!r} cannot authenticate Raft peers: use "tcp" (TLS), '
            "or set raft.tls = false on a network where every host is trusted"
        )
    if identity_json is None:
        raise IdentityError(
            f"no Raft identity in ${IDENTITY_ENV}: the scheduler issues one with replica.start "
            "(raft.tls is on; set it false on every node to run without authentication)"
        )
    identity = MemberIdentity.from_json(identity_json)
    if (identity.group, identity.member) != (group, member):
        raise IdentityError(
            f"the Raft identity is for member {identity.member!r} of {identity.group!r}, "
            f"not {member!r} of {group!r}"
        )
    return LinkTls.from_identity(identity, encrypt_loopback=encrypt_loopback)
