"""The node-level read cache: LRU order, a byte bound that always holds, read-only entries."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.datastore.cache import ByteLRU


def view(n: int, fill: int = 0) -> memoryview:
    return memoryview(bytearray([fill]) * n)


def test_evicts_least_recently_used() -> None:
    cache = ByteLRU(10)
    cache.put("a", view(4))
    cache.put("b", view(4))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", view(4))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.size_bytes == 8 and cache.stats.evictions == 1


def test_too_large_is_not_admitted_and_evicts_nothing() -> None:
    cache = ByteLRU(10)
    cache.put("a", view(6))
    assert cache.put("big", view(11)) is False
    assert "a" in cache and cache.size_bytes == 6


def test_entries_are_read_only_and_replace_counts_once() -> None:
    cache = ByteLRU(100)
    cache.put("a", view(10))
    cache.put("a", view(20))
    assert cache.size_bytes == 20 and len(cache) == 1
    entry = cache.get("a")
    assert entry is not None and entry.readonly
    with pytest.raises(TypeError):
        entry[0] = 1


def test_hits_misses_discard_clear() -> None:
    cache = ByteLRU(100)
    assert cache.get("x") is None
    cache.put("x", view(5))
    assert cache.get("x") is not None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    cache.discard("x")
    cache.discard("x")
    assert cache.size_bytes == 0
    cache.put("y", view(5))
    cache.clear()
    assert len(cache) == 0 and cache.size_bytes == 0


def test_zero_capacity_caches_nothing() -> None:
    cache = ByteLRU(0)
    assert cache.put("a", view(1)) is False
    assert cache.put("empty", view(0)) is True


@given(
    capacity=st.integers(0, 64),
    ops=st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 80), st.booleans()), max_size=60),
)
def test_bound_always_holds(capacity: int, ops: list[tuple[str, int, bool]]) -> None:
    cache = ByteLRU(capacity)
    for key, size, read in ops:
        if read:
            cache.get(key)
        else:
            cache.put(key, view(size))
        assert cache.size_bytes <= capacity
        assert cache.size_bytes == sum(v.nbytes for v in cache._entries.values())
