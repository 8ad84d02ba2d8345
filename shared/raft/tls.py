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

from shared.private_files import write_private

IDENTITY_ENV = "TANDEM_RAFT_IDENTITY"  # a replica's MemberIdentity, JSON, in its environment
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
    """The two TLS contexts of one member's links, and whom they speak for."""

    group: str
    member: str
    server: ssl.SSLContext  # inbound: requires a client certificate from the CA
    client: ssl.SSLContext  # outbound: presents ours, verifies the peer's

    @classmethod
    def from_identity(cls, identity: MemberIdentity) -> LinkTls:
        with _pem_files(identity.cert_pem, identity.key_pem) as (cert_file, key_file):
            server = _context(ssl.PROTOCOL_TLS_SERVER, identity.ca_pem, cert_file, key_file)
            client = _context(ssl.PROTOCOL_TLS_CLIENT, identity.ca_pem, cert_file, key_file)
        return cls(identity.group, identity.member, server, client)

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


def _context(protocol: int, ca_pem: bytes, cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # peers are named by member id (checked by LinkTls), not by host
    ctx.verify_mode = ssl.CERT_REQUIRED
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
    before any of the peer's bytes are handed on.

    Why not ``asyncio``'s own TLS (``create_server(ssl=...)``): it hides failed handshakes (no
    callback, nothing to count), and with uvloop a plain connection cannot be upgraded without
    losing the bytes that arrived first."""

    def __init__(self, context: ssl.SSLContext, *, server_side: bool) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self.established = False
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
        self._incoming.write(data)
        if not self.established and not self._handshake():
            return b""
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
        return True


def link_tls_for(
    enabled: bool, transport: str, identity_json: str | None, group: str, member: str
) -> LinkTls | None:
    """The TLS of a replica's Raft links (config ``raft.tls``, ``raft.transport``), or why it
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
    return LinkTls.from_identity(identity)
