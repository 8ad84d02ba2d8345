"""Sealed records: how a Raft link carries its messages once its TLS handshake has authenticated
both ends (``shared.raft.tls``, ``shared.raft.tcp_transport``).

Why not TLS records all the way: a trivial cell sends about 30 records among its three replicas,
and Python's ``ssl`` (OpenSSL 3.0 through a memory BIO) cost 7-18 µs of the Raft thread's CPU per
record on a loaded machine (about 0.28 ms of CPU per cell, 0.17 ms of the cell's p50), each call
also releasing the GIL to the replica's kernel thread. An AES-256-GCM call from ``cryptography``
is one C call that keeps the GIL.

The scheme (no new primitive, and nothing TLS does not already rely on):

- The link's writer (connections are one-way) draws a fresh 256-bit key per connection
  (``os.urandom``) and sends it inside its TLS hello, after the mutual TLS 1.3 handshake and the
  certificate checks. Only the certified peer can have sent it and only the certified reader can
  read it; TLS's ECDHE gives it forward secrecy.
- After the hello, the bytes on the connection are records ``length (4 bytes, big-endian) ||
  AES-GCM(key, nonce = the record's sequence number, plaintext, associated data = the length)``.
  The sequence number is implicit, counted by both sides from 0, as TLS 1.3 counts its records:
  a record that was altered, replayed, reordered, dropped or injected fails authentication, and
  the reader closes the connection before any of it is decoded.
- One key seals at most ``MAX_RECORDS`` records (2**24: under TLS 1.3's AES-GCM limit, RFC 8446
  §5.5, with records of at most ``MAX_RECORD_PLAINTEXT``); then the writer closes the connection
  and its reconnection brings a new handshake and a new key.

The plaintext of the records is one byte stream (the transport's length-prefixed frames), as TLS's
is: a frame may span records, so a large message is sealed in chunks without a copy.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
TAG_BYTES = 16
NONCE_BYTES = 12
MAX_RECORDS = 1 << 24  # per key (see the module docstring)
MAX_RECORD_PLAINTEXT = 1 << 20  # larger plaintexts are sealed in several records
MAX_RECORD_BYTES = MAX_RECORD_PLAINTEXT + TAG_BYTES  # a longer length is refused before buffering it
HEADER = struct.Struct(">I")


class RecordRefused(Exception):
    """A record that may not be read: it failed authentication, or its length is impossible."""


def new_key() -> bytes:
    """A fresh key for one connection's records."""
    return os.urandom(KEY_BYTES)


class Sealer:
    """The writing end of one connection: plaintext in, wire records out."""

    __slots__ = ("_aead", "_seq")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._seq = 0

    @property
    def spent(self) -> bool:
        """This key sealed all it may: close the connection (the next one has a new key)."""
        return self._seq >= MAX_RECORDS

    def seal(self, plaintext: bytes | memoryview) -> bytes:
        """One record carrying ``plaintext`` (at most ``MAX_RECORD_PLAINTEXT`` bytes)."""
        seq = self._seq
        if seq >= MAX_RECORDS:
            raise RecordRefused("this key has sealed its last record")
        self._seq = seq + 1
        header = HEADER.pack(len(plaintext) + TAG_BYTES)
        return header + self._aead.encrypt(seq.to_bytes(NONCE_BYTES, "big"), plaintext, header)

    def seal_all(self, parts: list[bytes]) -> list[bytes]:
        """Records carrying ``parts`` in order: one for a small total, else chunks of each part."""
        total = sum(map(len, parts))
        if total <= MAX_RECORD_PLAINTEXT:
            return [self.seal(parts[0] if len(parts) == 1 else b"".join(parts))]
        records = []
        for part in parts:
            view = memoryview(part)
            for start in range(0, len(view), MAX_RECORD_PLAINTEXT):
                records.append(self.seal(view[start : start + MAX_RECORD_PLAINTEXT]))
        return records


class Opener:
    """The reading end of one connection: wire bytes in, the plaintext of whole records out."""

    __slots__ = ("_aead", "_buf", "_seq")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._seq = 0
        self._buf = bytearray()

    def open(self, data: bytes) -> bytes:
        """Feed wire bytes; the plaintext of the records they completed (b"" if none).
        ``RecordRefused`` on the first record that does not authenticate: nothing of it, nor of
        anything after it, is returned."""
        buf = self._buf
        if buf:
            buf += data
            wire: bytes | bytearray = buf
        else:
            wire = data  # the usual case: whole records in one read, no copy into the buffer
        offset, end_of_data = 0, len(wire)
        out = []
        view = memoryview(wire)
        try:
            while end_of_data - offset >= 4:
                (length,) = HEADER.unpack_from(wire, offset)
                if length < TAG_BYTES or length > MAX_RECORD_BYTES:
                    raise RecordRefused(f"a record of {length} bytes (at most {MAX_RECORD_BYTES})")
                end = offset + 4 + length
                if end > end_of_data:
                    break
                seq = self._seq
                if seq >= MAX_RECORDS:
                    raise RecordRefused("a record past the key's last one")
                try:
                    out.append(
                        self._aead.decrypt(
                            seq.to_bytes(NONCE_BYTES, "big"),
                            view[offset + 4 : end],
                            view[offset : offset + 4],
                        )
                    )
                except InvalidTag:
                    raise RecordRefused(f"record {seq} failed authentication") from None
                self._seq = seq + 1
                offset = end
        finally:
            view.release()
        if wire is buf:
            del buf[:offset]
        elif offset < end_of_data:
            buf += wire[offset:]
        return out[0] if len(out) == 1 else b"".join(out)
