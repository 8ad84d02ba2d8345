"""The host memory index: after any sequence of updates and removals, a name's keys are those of
every span linked to its own by a chain of overlaps, as a brute-force closure finds them."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_replica.memory_index import MemoryIndex, Span


def closure(spans: dict[str, list[Span]], name: str) -> set[Hashable]:
    """Keys of every span reachable from ``name``'s through overlaps (brute force)."""
    every = [span for group in spans.values() for span in group]
    found = list(spans.get(name, []))
    seen = set(found)
    while found:
        start, end, _ = found.pop()
        for other in every:
            if other not in seen and other[0] < end and start < other[1]:
                seen.add(other)
                found.append(other)
    return {key for _, _, key in seen}


spans_of = st.lists(
    st.tuples(st.integers(0, 60), st.integers(1, 15)).map(lambda p: (p[0], p[0] + p[1])), max_size=4
)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["update", "update", "remove"]), st.integers(0, 5), spans_of), max_size=30
    )
)
def test_keys_are_the_overlap_closure_after_any_updates_and_removals(
    steps: list[tuple[str, int, list[tuple[int, int]]]],
) -> None:
    index = MemoryIndex()
    current: dict[str, list[Span]] = {}
    for step, (op, n, raw) in enumerate(steps):
        name = f"n{n}"
        if op == "remove":
            index.remove(name)
            current.pop(name, None)
            continue
        spans = [(start, end, (name, step, i)) for i, (start, end) in enumerate(raw)]
        keys = index.update(name, spans)
        current[name] = spans
        assert keys == closure(current, name)
        for other in current:  # what the index holds for everyone is still exact
            probe = [(s, e, ("probe", s, e)) for s, e, _ in current[other]]
            held = index.update("probe", probe) - {key for _, _, key in probe}
            index.remove("probe")
            assert held == closure(current, other)


def test_adjacent_spans_do_not_join_and_a_bridge_joins_them_until_it_goes() -> None:
    index = MemoryIndex()
    assert index.update("a", [(0, 10, "A")]) == {"A"}
    assert index.update("b", [(10, 20, "B")]) == {"B"}  # touching is not sharing
    assert index.update("t", [(5, 15, "T")]) == {"A", "B", "T"}
    index.remove("t")
    assert index.update("c", [(12, 13, "C")]) == {"B", "C"}  # the cluster split again
