"""Content addresses and read checksums.

Two hashes, each where it pays (single-thread throughput on this project's 2-core machines,
256 MiB buffers: SHA-256 1.9 GB/s with SHA-NI, blake2b 1.3 GB/s, BLAKE3 7.1 GB/s, XXH3-128 28-32 GB/s):

- the *address* is BLAKE3-256. It must resist crafted collisions, because notebooks run untrusted
  code and dedup would otherwise let one object alias another, so it must be a cryptographic hash;
  BLAKE3 is the fastest one here by 3.7x over SHA-256, which matters because the address is
  computed on every write: SHA-256 alone took as long as the fsync'd write of the same bytes and
  held the local backend at ~0.5x of a raw write. It runs in a worker thread, overlapping the I/O.
- the *read checksum* is XXH3-128: it catches bit rot, truncation and partial writes with a
  miss probability of 2^-128. It is no defence against someone who can rewrite the store: XXH3's
  secret is public and a block's words add linearly, so an object of the same size and checksum
  that starts with bytes of one's choosing takes a few additions to make
  (tests/security/_xxh3_forge.py), and a namespace object starts with the pickle a replica loads.
  So every read checks the address too (``ChecksumVerifier``): the reference that names the object
  comes from an authenticated source (the Raft log, the scheduler, the checkpoint book), and
  with it the store is trusted for availability only, never for what a replica unpickles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import xxhash
from blake3 import blake3

from shared.background_threads import background_pool
from shared.datastore.buffers import Buffer, nbytes

ADDRESS_ALGORITHM = "blake3"
CHECKSUM_ALGORITHM = "xxh3-128"


@dataclass(frozen=True, slots=True)
class ContentId:
    """What a finished write knows about its content: address, read checksum, size."""

    digest: str
    checksum: str
    size: int


class ContentHasher:
    """Incremental address + checksum of a byte stream (blake3 and xxhash release the GIL on large inputs)."""

    __slots__ = ("_address", "_checksum", "_size")

    def __init__(self) -> None:
        self._address = blake3()
        self._checksum = xxhash.xxh3_128()
        self._size = 0

    def update(self, chunk: Buffer) -> None:
        self._address.update(chunk)
        self._checksum.update(chunk)
        self._size += nbytes(chunk)

    def result(self) -> ContentId:
        return ContentId(self._address.hexdigest(), self._checksum.hexdigest(), self._size)


def content_id(chunks: Iterable[Buffer]) -> ContentId:
    hasher = ContentHasher()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.result()


# Chunks at least this large are hashed for the address in a worker thread while the reader
# fetches the next one (BLAKE3 runs at a fraction of a page-cache read's speed on one core).
_OVERLAP_BYTES = 4 * 1024 * 1024
_ADDRESS_HASHERS = background_pool(2, thread_name_prefix="read-address")
# Large chunks a read may have handed on before their address hash ran: a reader faster than
# the hash waits here, or a streamed object would be held whole by the queue behind it
_HASHES_BEHIND = 2


class ChecksumVerifier:
    """Running read checksum and address; ``mismatch`` says why the bytes read are not the
    bytes written (the address: why they are not the bytes the reference names). A chunk must
    stay unchanged until ``mismatch`` (large ones are hashed behind the reader's back)."""

    __slots__ = ("_address", "_behind", "_checksum", "_hashing", "_size")

    def __init__(self) -> None:
        self._address = blake3(max_threads=blake3.AUTO)  # a read waits on it: every core helps
        self._checksum = xxhash.xxh3_128()
        self._hashing: Future[None] | None = None  # the address hash of the last large chunk
        self._behind: deque[Future[None]] = deque()  # large chunks' hashes not known to be done
        self._size = 0

    def update(self, chunk: Buffer) -> None:
        self._checksum.update(chunk)
        self._size += nbytes(chunk)
        if self._hashing is None and nbytes(chunk) < _OVERLAP_BYTES:
            self._address.update(chunk)
        else:  # in order: each chunk's hash waits for the one before (submitted, so started, first)
            self._hashing = _ADDRESS_HASHERS.submit(self._hash_after, self._hashing, chunk)
            self._behind.append(self._hashing)
            while len(self._behind) > _HASHES_BEHIND:
                self._behind.popleft().result()

    def _hash_after(self, previous: Future[None] | None, chunk: Buffer) -> None:
        if previous is not None:
            previous.result()
        self._address.update(chunk)

    @property
    def size(self) -> int:
        return self._size

    def mismatch(self, checksum: str, size: int, digest: str) -> str | None:
        if self._size != size:
            return f"size {self._size} bytes, expected {size}"
        got = self._checksum.hexdigest()
        if got != checksum:
            return f"{CHECKSUM_ALGORITHM} {got}, expected {checksum}"
        if self._hashing is not None:
            self._hashing.result()
        address = self._address.hexdigest()
        if address != digest:  # the checksum matched: crafted to, not damaged by chance
            return f"{ADDRESS_ALGORITHM} {address}, expected {digest} (with a matching {CHECKSUM_ALGORITHM})"
        return None


def is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def object_path(digest: str) -> str:
    """Sharded relative path ``ab/cd/abcd…``: 65,536 directories keep every one small."""
    if not is_digest(digest):
        raise ValueError(f"not a {ADDRESS_ALGORITHM} hex digest: {digest!r}")
    return f"{digest[:2]}/{digest[2:4]}/{digest}"
