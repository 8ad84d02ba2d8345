"""A second preimage for XXH3-128, the data store's read checksum, with a chosen prefix.

XXH3 is not a cryptographic hash: within the first 1024-byte block of a long input, each 64-bit
word adds either itself or a product of its 32-bit halves (xored with the public default secret)
to the accumulators, and a word whose xor with the secret has a zero half adds only itself. Two
stripes of such words after the chosen prefix bring the accumulators back to what the original
block left, so every later block, and the digest, are the original's. What ``forge`` returns has
the original's size and XXH3-128 and starts with ``prefix``.
"""

from __future__ import annotations

import struct

import xxhash

M64 = (1 << 64) - 1
BLOCK = 1024  # 16 stripes of 64 bytes with the 192-byte default secret
# XXH3's default secret (kSecret in xxhash.h): the first 184 bytes are the ones a block reads
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)


def _key(stripe: int, lane: int) -> int:
    return int(struct.unpack_from("<Q", SECRET, 8 * stripe + 8 * lane)[0])


def _added(block: bytes, stripes: range) -> list[int]:
    """What these stripes of the block add to each of the 8 accumulators."""
    acc = [0] * 8
    for s in stripes:
        for lane in range(8):
            word = int(struct.unpack_from("<Q", block, 64 * s + 8 * lane)[0])
            mixed = word ^ _key(s, lane)
            acc[lane ^ 1] = (acc[lane ^ 1] + word) & M64
            acc[lane] = (acc[lane] + (mixed & 0xFFFFFFFF) * (mixed >> 32)) & M64
    return acc


def forge(original: bytes, prefix: bytes) -> bytes:
    if len(original) <= BLOCK or len(prefix) > 14 * 64:
        raise ValueError("the original must be over 1 KiB and the prefix at most 896 bytes")
    target = _added(original[:BLOCK], range(16))
    block = bytearray(prefix + original[len(prefix) : BLOCK])
    have = _added(bytes(block), range(14))
    for acc in range(8):  # accumulator acc gets stripes 14 and 15's words at lane acc ^ 1
        need, lane = (target[acc] - have[acc]) & M64, acc ^ 1
        k14, k15 = _key(14, lane), _key(15, lane)
        low = ((need & 0xFFFFFFFF) - (k15 & 0xFFFFFFFF)) & 0xFFFFFFFF  # stripe 14: free low half
        carry = (low + (k15 & 0xFFFFFFFF)) >> 32
        high = ((need >> 32) - (k14 >> 32) - carry) & 0xFFFFFFFF  # stripe 15: free high half
        struct.pack_into("<Q", block, 64 * 14 + 8 * lane, (k14 & ~0xFFFFFFFF & M64) | low)
        struct.pack_into("<Q", block, 64 * 15 + 8 * lane, (high << 32) | (k15 & 0xFFFFFFFF))
    forged = bytes(block) + original[BLOCK:]
    assert xxhash.xxh3_128(forged).digest() == xxhash.xxh3_128(original).digest()
    return forged
