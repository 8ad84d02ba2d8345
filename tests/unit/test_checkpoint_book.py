"""The checkpoint service's pure bookkeeping: latest image per job, never backwards, and GC."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.checkpoint.book import BookError, CheckpointBook
from shared.checkpoint.manifest import Manifest, PieceLocation, TensorRecord
from shared.datastore import ObjectRef


def _ref(name: str, size: int = 64) -> ObjectRef:
    digest = hashlib.blake2b(name.encode(), digest_size=32).hexdigest()
    return ObjectRef("local", f"objects/{digest}", digest, size, "x")


def _image(job: str, step: int, packs: list[str]) -> tuple[ObjectRef, Manifest]:
    refs = tuple(_ref(p) for p in packs)
    tensors = tuple(
        TensorRecord(f"t{i}", "float32", (16,), 64, ("f",), (PieceLocation(i, 0, 64),))
        for i in range(len(refs))
    )
    manifest = Manifest(job, step, 64, refs, _ref(f"meta-{job}-{step}"), tensors)
    return _ref(f"manifest-{job}-{step}-{'-'.join(packs)}"), manifest


def test_latest_is_the_last_committed_image_and_never_goes_back() -> None:
    book = CheckpointBook()
    ref3, m3 = _image("j", 3, ["a"])
    ref6, m6 = _image("j", 6, ["b"])
    book.commit("j", ref3, m3, 1.0)
    committed = book.commit("j", ref6, m6, 2.0)
    assert committed.previous is not None and committed.previous.step == 3
    latest = book.latest("j")
    assert latest is not None and latest.step == 6 and latest.manifest == ref6
    late_ref, late = _image("j", 4, ["c"])
    with pytest.raises(BookError, match="older"):
        book.commit("j", late_ref, late, 3.0)
    assert book.latest("j") == latest


def test_an_image_announced_for_another_job_is_refused() -> None:
    ref, manifest = _image("other", 1, ["a"])
    with pytest.raises(BookError, match="announced for job"):
        CheckpointBook().commit("j", ref, manifest, 0.0)


def test_announcing_the_same_image_twice_changes_nothing() -> None:
    book = CheckpointBook()
    ref, manifest = _image("j", 2, ["a"])
    book.commit("j", ref, manifest, 1.0)
    again = book.commit("j", ref, manifest, 2.0)
    assert again.repeated and again.collect == frozenset()
    latest = book.latest("j")
    assert latest is not None and latest.committed_at == 1.0


def test_a_superseded_image_is_collected_except_packs_the_new_one_shares() -> None:
    book = CheckpointBook()
    ref1, m1 = _image("j", 1, ["frozen", "head1"])
    ref2, m2 = _image("j", 2, ["frozen", "head2"])
    book.commit("j", ref1, m1, 1.0)
    collect = book.commit("j", ref2, m2, 2.0).collect
    assert collect == {ref1.digest, m1.meta.digest, _ref("head1").digest}
    book.deleted(collect)
    assert book.collectable(3.0) == set()


def test_a_pack_shared_by_two_jobs_lives_while_either_needs_it() -> None:
    book = CheckpointBook()
    refa, ma = _image("a", 1, ["shared", "a1"])
    refb, mb = _image("b", 1, ["shared", "b1"])
    book.commit("a", refa, ma, 1.0)
    book.commit("b", refb, mb, 1.0)
    gone = book.forget("a", 2.0)
    assert _ref("shared").digest not in gone and _ref("a1").digest in gone
    assert _ref("shared").digest in book.forget("b", 3.0)


def test_packs_written_ahead_of_their_manifest_are_protected_until_committed_or_stale() -> None:
    book = CheckpointBook(protect_s=10.0)
    book.written([_ref("p").digest], now=0.0)
    assert book.collectable(5.0) == set()
    assert book.collectable(11.0) == {_ref("p").digest}
    ref, manifest = _image("j", 1, ["q"])
    # a torn attempt's pack, announced with the commit that does not use it: collectable at once
    committed = book.commit("j", ref, manifest, 12.0, written=[_ref("q").digest, _ref("torn").digest])
    assert _ref("torn").digest in committed.collect and _ref("q").digest not in committed.collect


def test_a_dead_process_journal_is_collected_after_protection_or_when_its_job_is_forgotten() -> None:
    """What an exited process stored: its latest image's objects stay; the packs of a capture
    killed mid-way go once protected long enough, or at once when the job is forgotten."""
    book = CheckpointBook(protect_s=10.0)
    ref, manifest = _image("j", 1, ["kept"])
    book.commit("j", ref, manifest, 0.0)
    journal = [_ref("kept").digest, ref.digest, _ref("orphan").digest]
    book.written(journal, 1.0, job_id="j")
    assert book.collectable(5.0) == set()
    assert book.collectable(12.0) == {_ref("orphan").digest}
    book.written([_ref("orphan2").digest], 13.0, job_id="j")
    assert _ref("orphan2").digest in book.forget("j", 14.0)  # nothing of j will be committed again
    book.deleted(book.collectable(14.0))
    assert not book.stored and not book.journaled


def test_keep_two_holds_the_previous_image_too() -> None:
    book = CheckpointBook(keep=2)
    images = [_image("j", s, [f"p{s}"]) for s in (1, 2, 3)]
    collected = [book.commit("j", ref, m, float(s)).collect for s, (ref, m) in enumerate(images)]
    assert collected[1] == frozenset()
    assert _ref("p1").digest in collected[2] and _ref("p2").digest not in collected[2]


def test_the_book_survives_its_json_round_trip() -> None:
    book = CheckpointBook(keep=2, protect_s=5.0)
    ref, manifest = _image("j", 4, ["a", "b"])
    book.commit("j", ref, manifest, 1.0)
    book.written(["ff" * 32], 2.0)
    book.written(["ee" * 32], 3.0, job_id="j")
    again = CheckpointBook.from_dict(book.to_dict())
    assert again == book


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("xy"),
            st.integers(0, 20),
            st.lists(st.sampled_from("abcdef"), min_size=1, max_size=3),
        ),
        max_size=25,
    )
)
def test_collectable_never_holds_an_object_a_latest_image_needs(
    announcements: list[tuple[str, int, list[str]]],
) -> None:
    book = CheckpointBook()
    best: dict[str, int] = {}
    for now, (job, step, packs) in enumerate(announcements):
        ref, manifest = _image(job, step, packs)
        try:
            committed = book.commit(job, ref, manifest, float(now))
        except BookError:
            assert step < best[job]
            continue
        best[job] = max(best.get(job, step), step)
        book.deleted(committed.collect)
    for job, step in best.items():
        latest = book.latest(job)
        assert latest is not None and latest.step == step
        assert not latest.digests & book.collectable(1e9)
