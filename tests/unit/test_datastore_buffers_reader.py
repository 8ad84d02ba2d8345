"""The file the S3 backend uploads a list of buffers from, without joining them."""

from __future__ import annotations

import io
import os

from hypothesis import given
from hypothesis import strategies as st

from shared.datastore.s3_backend import BuffersReader


def test_reads_the_concatenation_across_buffer_boundaries() -> None:
    parts = [b"abc", b"", b"defgh", b"i"]
    reader = BuffersReader([memoryview(p) for p in parts])
    assert len(reader) == 9
    out = bytearray(4)
    assert reader.readinto(out) == 4 and out == b"abcd"
    assert reader.read() == b"efghi"
    assert reader.read() == b""


def test_seeks_back_for_a_retry_and_to_the_end_for_the_length() -> None:
    reader = BuffersReader([memoryview(b"hello "), memoryview(b"world")])
    assert reader.seek(0, io.SEEK_END) == 11 and reader.tell() == 11
    reader.seek(3)
    assert reader.read(5) == b"lo wo"
    reader.seek(-2, io.SEEK_CUR)
    assert reader.read() == b"world"
    reader.seek(0)
    assert reader.read() == b"hello world"


@given(st.lists(st.binary(max_size=50), max_size=6), st.integers(min_value=1, max_value=17))
def test_any_block_size_gives_back_the_bytes(parts: list[bytes], block: int) -> None:
    reader = BuffersReader([memoryview(p) for p in parts])
    got = bytearray()
    while chunk := reader.read(block):
        got += chunk
    assert got == b"".join(parts)


def test_numpy_like_buffers_are_read_as_bytes() -> None:
    data = os.urandom(64)
    view = memoryview(data).cast("Q")  # 8-byte items, as a numpy array's buffer may be
    reader = BuffersReader([view.cast("B")])
    assert reader.read() == data
