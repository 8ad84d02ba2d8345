"""Content addresses, read checksums, and the reference that travels in the Raft log."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import xxhash
from blake3 import blake3

from shared.datastore.base import ObjectRef
from shared.datastore.keys import ChecksumVerifier, ContentHasher, content_id, is_digest, object_path


def test_address_is_blake3_and_checksum_is_xxh3_128() -> None:
    data = b"hello tandem" * 1000
    cid = content_id([data[:5], memoryview(data)[5:]])
    assert cid.digest == blake3(data).hexdigest()
    assert cid.checksum == xxhash.xxh3_128(data).hexdigest()
    assert cid.size == len(data)


def test_incremental_equals_one_shot() -> None:
    hasher = ContentHasher()
    for i in range(10):
        hasher.update(bytes([i]) * 1000)
    assert hasher.result() == content_id([b"".join(bytes([i]) * 1000 for i in range(10))])


def test_verifier_names_the_mismatch() -> None:
    data = b"abc" * 100
    cid = content_id([data])
    ok = ChecksumVerifier()
    ok.update(data)
    assert ok.mismatch(cid.checksum, cid.size, cid.digest) is None
    short = ChecksumVerifier()
    short.update(data[:-1])
    assert "size 299 bytes, expected 300" in str(short.mismatch(cid.checksum, cid.size, cid.digest))
    flipped = ChecksumVerifier()
    flipped.update(b"abd" + data[3:])
    assert "xxh3-128" in str(flipped.mismatch(cid.checksum, cid.size, cid.digest))


def test_object_path_is_sharded_and_rejects_non_digests() -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    assert object_path(digest) == f"{digest[:2]}/{digest[2:4]}/{digest}"
    assert is_digest(digest) and not is_digest("../" + digest[3:])
    with pytest.raises(ValueError):
        object_path("../../etc/passwd")


def test_ref_survives_msgpack_and_rejects_garbage() -> None:
    digest = hashlib.sha256(b"x").hexdigest()
    ref = ObjectRef("s3", f"objects/{object_path(digest)}", digest, 1, "0" * 32)
    assert ObjectRef.from_dict(msgpack.unpackb(msgpack.packb(ref.to_dict()))) == ref
    with pytest.raises(ValueError):
        ObjectRef.from_dict({"backend": "s3"})
    with pytest.raises(ValueError):
        ObjectRef.from_dict({**ref.to_dict(), "digest": "nothex"})
