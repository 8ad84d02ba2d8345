"""Checkpoint manifests: pieces tile tensors, JSON round-trips, damaged manifests are refused, and
garbage collection never deletes what a live manifest or an open checkpoint needs."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.checkpoint.manifest import Manifest, PieceLocation, TensorRecord, collectable, referenced_digests
from shared.checkpoint.pieces import piece_ranges
from shared.datastore import ObjectRef


def _ref(name: str, size: int = 1 << 20) -> ObjectRef:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return ObjectRef("local", f"objects/{digest[:2]}/{digest[2:4]}/{digest}", digest, size, "0" * 32)


def _manifest(packs: list[str], tensors: dict[str, list[tuple[int, int, int]]], step: int = 1) -> Manifest:
    records = tuple(
        TensorRecord(
            name,
            "float32",
            (sum(p[2] for p in pieces) // 4,),
            sum(p[2] for p in pieces),
            tuple(f"{i:032x}" for i in range(len(pieces))),
            tuple(PieceLocation(*p) for p in pieces),
        )
        for name, pieces in tensors.items()
    )
    return Manifest("job", step, 4096, tuple(_ref(p) for p in packs), _ref(f"meta{step}", 100), records)


@given(st.integers(0, 10_000), st.integers(1, 5000))
def test_pieces_tile_the_tensor_in_order(nbytes: int, piece_bytes: int) -> None:
    ranges = piece_ranges(nbytes, piece_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(0 < b - a <= piece_bytes for a, b in ranges) or nbytes == 0


def test_manifest_round_trips_through_canonical_json() -> None:
    manifest = _manifest(["a", "b"], {"w": [(0, 0, 4096), (1, 8, 100)], "b": [(1, 0, 8)]})
    raw = manifest.to_json()
    assert Manifest.from_json(raw) == manifest
    assert Manifest.from_json(raw).to_json() == raw


@pytest.mark.parametrize(
    "pieces",
    [
        [(2, 0, 16)],  # a pack that does not exist
        [(0, (1 << 20) - 8, 16)],  # past the end of its pack
    ],
)
def test_a_manifest_pointing_outside_its_packs_is_refused(pieces: list[tuple[int, int, int]]) -> None:
    raw = _manifest(["a", "b"], {"w": pieces}).to_json()
    with pytest.raises(ValueError):
        Manifest.from_json(raw)


def test_pieces_that_do_not_add_up_to_the_tensor_are_refused() -> None:
    manifest = _manifest(["a"], {"w": [(0, 0, 16)]})
    bad = TensorRecord("w", "float32", (4,), 20, ("0" * 32,), (PieceLocation(0, 0, 16),))
    with pytest.raises(ValueError):
        Manifest.from_json(dataclasses.replace(manifest, tensors=(bad,)).to_json())


@given(
    st.lists(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=4), max_size=4),
    st.sets(st.sampled_from("abcdefghij")),
    st.sets(st.sampled_from("abcdefghij"), max_size=2),
)
def test_collection_spares_every_pack_a_live_manifest_or_open_checkpoint_needs(
    live_packs: list[list[str]], stored_names: set[str], open_names: set[str]
) -> None:
    live = [_manifest(packs, {"w": [(0, 0, 4)]}, step=i) for i, packs in enumerate(live_packs)]
    stored = {_ref(n).digest for n in stored_names} | {m.meta.digest for m in live}
    keep = {_ref(n).digest for n in open_names}
    doomed = collectable(stored, live, keep)
    needed = set().union(*(referenced_digests(m) for m in live)) | keep
    assert doomed == stored - needed
