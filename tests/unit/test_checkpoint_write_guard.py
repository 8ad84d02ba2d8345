"""The write guard sees every write an op declares (foreach and fused optimizers included), the
BatchNorm statistics its schema hides, and writes through views of tracked storage; the sampler
resumes mid-epoch exactly where it stopped."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.checkpoint.cow import UNDECLARED_WRITES, WriteGuard
from shared.checkpoint.pieces import byte_extent, storage_key
from shared.checkpoint.sampler import ResumableSampler


def _written_by(step: object, rules: dict | None = None) -> list[torch.Tensor]:  # type: ignore[type-arg]
    seen: list[torch.Tensor] = []
    with WriteGuard(seen.extend, UNDECLARED_WRITES if rules is None else rules):
        step()  # type: ignore[operator]
    return seen


def _storages(tensors: list[torch.Tensor]) -> set[int | None]:
    return {storage_key(t) for t in tensors}


def test_foreach_and_fused_adam_declare_every_parameter_and_moment() -> None:
    for options in ({"foreach": True}, {"fused": True}):
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
        for p in params:
            p.grad = torch.randn(3)
        opt = torch.optim.Adam(params, **options)
        opt.step()  # creates the state
        written = _storages(_written_by(opt.step))
        for p in params:
            state = opt.state[p]
            assert {
                storage_key(p),
                storage_key(state["exp_avg"]),
                storage_key(state["exp_avg_sq"]),
            } <= written


def test_batch_norm_running_statistics_come_from_the_rule_table_only() -> None:
    bn = torch.nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    assert storage_key(bn.running_mean) not in _storages(_written_by(lambda: bn(x), rules={}))
    written = _storages(_written_by(lambda: bn(x)))
    assert {storage_key(bn.running_mean), storage_key(bn.running_var)} <= written
    bn.eval()
    assert storage_key(bn.running_mean) not in _storages(_written_by(lambda: bn(x)))


def test_a_write_through_a_view_reports_the_view_over_the_same_storage() -> None:
    base = torch.zeros(10, 10)
    view = base.data[2:4]
    written = _written_by(lambda: view.add_(1))
    assert storage_key(written[0]) == storage_key(base)
    start, end = byte_extent(written[0])
    assert (start, end) == (20 * 4, 40 * 4)


def test_strided_view_extent_covers_every_element() -> None:
    base = torch.arange(60.0).reshape(6, 10)
    column = base[1:, 3]
    start, end = byte_extent(column)
    assert start == (10 + 3) * 4 and end == (50 + 3 + 1) * 4


def _epochs(sampler: ResumableSampler) -> Iterator[int]:
    while True:
        yield from sampler


@settings(max_examples=50)
@given(st.integers(1, 40), st.integers(0, 100), st.integers(0, 5))
def test_a_resumed_sampler_hands_out_what_the_original_would_have(length: int, taken: int, seed: int) -> None:
    original = ResumableSampler(length, seed=seed)
    stream = _epochs(original)
    head = [next(stream) for _ in range(taken)]
    saved = original.state_dict()
    rest = [next(stream) for _ in range(length)]
    resumed = ResumableSampler(length, seed=seed)
    resumed.load_state_dict(saved)
    again = _epochs(resumed)
    assert [next(again) for _ in range(length)] == rest
    assert len(head) == taken
