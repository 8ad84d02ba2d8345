"""The mechanisms behind squeeze/swell: the duty cycle paces a step to share x the full-speed step
time from the very next step after a change, pays back oversleep, and reads shares a coordinator
publishes; LISS counts always sum to the global batch, move samples to faster workers, and the
ranks' slices always tile each global batch exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shared.packing.governor import (
    DutyCycle,
    DutyCycleGovernor,
    FileShare,
    quantize,
    threads_for,
    write_share,
)
from shared.packing.liss import LissBalancer, LissBatchSampler, loss_scale, split_counts
from shared.packing.mps import mps_client_env, sm_count_for


class _Clock:
    """A hand-driven clock for the governor's pure accounting (the step "takes" ``step_s``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _run_step(gov: DutyCycleGovernor, clock: _Clock, step_s: float) -> float:
    before = len(clock.sleeps)
    with gov.step():
        clock.now += step_s
    return sum(clock.sleeps[before:])


def test_a_squeeze_or_swell_takes_effect_on_the_next_step() -> None:
    share = [100]
    clock = _Clock()
    gov = DutyCycleGovernor(lambda: share[0], clock=clock, sleep=clock.sleep)
    for _ in range(5):
        assert _run_step(gov, clock, 0.01) == 0.0  # full speed: no pause, reference 10 ms
    share[0] = 30
    assert _run_step(gov, clock, 0.01) == pytest.approx(0.01 / 0.3 - 0.01)  # the very next step
    share[0] = 60
    assert _run_step(gov, clock, 0.01) == pytest.approx(0.01 / 0.6 - 0.01)
    share[0] = 100
    assert _run_step(gov, clock, 0.01) == 0.0


def test_pacing_follows_full_speed_step_time_not_a_shortened_step() -> None:
    cycle = DutyCycle()
    for _ in range(10):
        cycle.pause_after(0.010)
    cycle.set_share(50)
    # A squeezed process on a shared CPU runs its next steps faster (sleeper credit): the period
    # still is reference / share, so throughput stays at half of full speed.
    assert cycle.pause_after(0.004) == pytest.approx(0.020 - 0.004)


def test_a_stale_full_speed_reference_gives_way_to_the_steps_own_time() -> None:
    """A job squeezed for good never runs at 100% again: once its reference is older than
    ``max_age_s`` (its partner may have left), it paces to its own step time instead of staying
    at the speed it had then."""
    cycle = DutyCycle(max_age_s=5.0)
    for i in range(10):
        cycle.pause_after(0.020, now=float(i) * 0.02)  # full speed beside a partner: 20 ms
    cycle.set_share(50)
    assert cycle.pause_after(0.010, now=1.0) == pytest.approx(0.040 - 0.010)  # fresh: 20 ms / 0.5
    cycle.set_share(60)
    assert cycle.pause_after(0.006, now=10.0) == pytest.approx(0.010 - 0.006)  # stale: 6 ms / 0.6


def test_oversleep_is_paid_back_by_the_next_pause() -> None:
    cycle = DutyCycle()
    cycle.pause_after(0.010)
    cycle.set_share(50)
    owed = cycle.pause_after(0.010)
    cycle.slept(owed + 0.004)  # the OS woke us 4 ms late
    assert cycle.pause_after(0.010) == pytest.approx(0.010 - 0.004)


def test_shares_are_lgrr_steps_and_threads_cover_the_share() -> None:
    assert [quantize(x) for x in (0, 4, 26, 55, 100, 130)] == [10, 10, 30, 60, 100, 100]
    assert threads_for(100, 2) == 2 and threads_for(30, 2) == 1 and threads_for(50, 8) == 4


def test_a_published_share_reaches_the_job(tmp_path: Path) -> None:
    path = tmp_path / "share"
    source = FileShare(path)
    assert source.read() == 100  # nothing published yet
    write_share(path, 40)
    assert source.read() == 40
    write_share(path, 100)
    assert source.read() == 100


@given(batch=st.integers(2, 512), fractions=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=8))
def test_split_counts_sum_to_the_global_batch(batch: int, fractions: list[float]) -> None:
    if batch < len(fractions):
        with pytest.raises(ValueError):
            split_counts(batch, fractions)
        return
    counts = split_counts(batch, fractions)
    assert sum(counts) == batch and min(counts) >= 1


def test_balancer_moves_samples_to_the_faster_worker_and_ignores_jitter() -> None:
    b = LissBalancer(global_batch=32, world_size=2)
    assert b.observe([0.100, 0.105]) == [16, 16]  # under the 10% threshold
    counts = b.observe([0.100, 0.300])  # rank 1 is three times slower per sample
    assert counts == [24, 8] and b.moves == 1
    assert b.observe([0.120, 0.120]) == [24, 8]  # balanced: stays


def test_an_unpacked_job_goes_back_to_the_equal_split() -> None:
    balancer = LissBalancer(16, 2)
    assert balancer.observe([0.010, 0.030]) != [8, 8]
    assert balancer.reset() == [8, 8] and balancer.moves == 2
    assert balancer.reset() == [8, 8] and balancer.moves == 2  # already equal: no move


@given(counts=st.lists(st.integers(1, 10), min_size=1, max_size=5), epoch=st.integers(0, 3))
def test_rank_slices_tile_every_global_batch(counts: list[int], epoch: int) -> None:
    batch = sum(counts)
    balancer = LissBalancer(batch, len(counts))
    balancer.counts = counts
    samplers = [LissBatchSampler(100, batch, r, balancer, seed=5) for r in range(len(counts))]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    for step, global_batch in enumerate(samplers[0].global_batches()):
        assert [i for rank in per_rank for i in rank[step]] == global_batch


def test_loss_scale_makes_ddp_average_the_global_mean() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(16, 3, generator=g, dtype=torch.float64),
        torch.randn(16, 1, generator=g, dtype=torch.float64),
    )
    w = torch.randn(3, 1, generator=g, dtype=torch.float64, requires_grad=True)

    def grad(rows: slice, scale: float) -> torch.Tensor:
        (out,) = torch.autograd.grad(torch.nn.functional.mse_loss(x[rows] @ w, y[rows]) * scale, w)
        return out

    full = grad(slice(0, 16), 1.0)
    ddp_mean = (grad(slice(0, 12), loss_scale(12, 16, 2)) + grad(slice(12, 16), loss_scale(4, 16, 2))) / 2
    torch.testing.assert_close(ddp_mean, full)


def test_mps_client_env_and_sm_counts() -> None:
    env = mps_client_env(30, base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    with pytest.raises(ValueError):
        mps_client_env(0)
    assert [sm_count_for(p, 132) for p in (10, 50, 100)] == [14, 66, 132]  # H100 SXM: 132 SMs
