"""The checkpoint agent on real torch training (CPU, deterministic seeds, a local data store; the
instant-equality trials also on CUDA where torch sees a GPU).

Each trial gates the copier on the training loop's step count, spreading the capture over 6-9
training steps at a random pace, so pieces are taken sometimes by the copier and sometimes by
copy-on-write just before an optimizer or BatchNorm write.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from datastore_fixtures import open_store, redis_url, s3_endpoint, s3_env  # noqa: F401 - fixtures
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shared.checkpoint import (
    CheckpointAgent,
    CommitResult,
    Restore,
    ResumableSampler,
    StoreLink,
    TrainingState,
    collectable,
    referenced_digests,
)
from shared.checkpoint.pieces import byte_view
from shared.datastore.local_backend import LocalStore

TRIALS = 20
# Device memory is cloned at the instant (stream-ordered) and copied to host by the copier: the
# instant-equality trials run there too when a GPU is visible (never in CI).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture
def link(tmp_path: Path) -> Iterator[StoreLink]:
    async def open_store() -> LocalStore:
        return LocalStore(tmp_path / "store", fsync=False)

    store_link = StoreLink.start(open_store)
    yield store_link
    store_link.close()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Job:
    state: TrainingState
    step_fn: Callable[[], None]


def _mlp_job(
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    batch_norm: bool = False,
    device: str = "cpu",
) -> Job:
    layers: list[nn.Module] = [nn.Linear(16, 32)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4)]
    model = nn.Sequential(*layers).to(device)
    opt = optimizer(list(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)

    def step() -> None:
        x = torch.randn(8, 16, device=device)
        y = torch.randint(0, 4, (8,), device=device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    return Job(TrainingState(model, opt, sched), step)


def _sparse_job(device: str = "cpu") -> Job:
    model = nn.Embedding(300, 8, sparse=True).to(device)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    readout = torch.randn(8, device=device)

    def step() -> None:
        rows = torch.randint(0, 300, (6,), device=device)
        loss = ((model(rows) @ readout) - 1.0).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Job(TrainingState(model, opt), step)


JOBS: dict[str, Callable[..., Job]] = {  # each takes an optional device (default "cpu")
    "adam_foreach": lambda device="cpu": _mlp_job(
        lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True), device=device
    ),
    "adam_fused": lambda device="cpu": _mlp_job(
        lambda p: torch.optim.Adam(p, lr=1e-2, fused=True), device=device
    ),
    "sgd_momentum": lambda device="cpu": _mlp_job(
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), device=device
    ),
    "batch_norm": lambda device="cpu": _mlp_job(
        lambda p: torch.optim.AdamW(p, lr=1e-2), batch_norm=True, device=device
    ),
    "sparse_adam": _sparse_job,
}


class StepGate:
    """Lets the copier take piece j only once training reached step ``j * span / pieces``."""

    def __init__(self, rng: random.Random, span: int, pieces: int) -> None:
        self.rng = rng
        self.span = span
        self.pieces = pieces
        self.taken = 0
        self.steps = 0
        self.cond = threading.Condition()

    def pace(self) -> None:
        due = self.taken * self.span // max(self.pieces, 1)
        self.taken += 1
        with self.cond:
            self.cond.wait_for(lambda: self.steps >= due, timeout=10)

    def stepped(self) -> None:
        with self.cond:
            self.steps += 1
            self.cond.notify_all()


def snapshot(state: TrainingState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return {name: byte_view(t).clone() for name, t in state.tensors()}, state.meta()


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(byte_view(a.contiguous()), byte_view(b.contiguous())), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def restored(make: Callable[[], Job], link: StoreLink, result: CommitResult) -> TrainingState:
    fresh = make().state
    restore = Restore(fresh, link, result.manifest)
    restore.start(on_demand=False)
    restore.wait()
    return fresh


def checkpoint_while_training(
    job: Job, agent: CheckpointAgent, gate: StepGate, inject: Callable[[int], None] | None = None
) -> tuple[CommitResult, dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]], int]:
    """Begin at this boundary, train until the image commits; the state at every boundary on the way."""
    references = {job.state.step: snapshot(job.state)}
    agent.begin()
    ran = 0
    while True:
        job.step_fn()
        ran += 1
        if inject is not None:
            inject(ran)
        step = job.state.step = job.state.step + 1
        references[step] = snapshot(job.state)
        gate.stepped()
        result = agent.step_boundary(step)
        if result is not None:
            return result, references, ran
        if ran >= 60:  # the store is slower than 60 steps here (a loaded run): pause and commit
            return agent.wait(), references, ran


@pytest.mark.parametrize("kind", sorted(JOBS))
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_taken_while_training_equals_the_state_at_its_instant(
    device: str, kind: str, link: StoreLink
) -> None:
    torch.manual_seed(1)
    job = JOBS[kind](device)
    for step in range(1, 4):
        job.step_fn()
        job.state.step = step
    rng = random.Random(kind)
    # One agent for every trial, as a job has: from the second image on, begin reuses the walked
    # structure and the copier's layouts, and writes to wholly captured tensors take the fast path.
    agent = CheckpointAgent(job.state, link, job=f"{kind}-{device}", piece_bytes=512, pack_bytes=8192)
    for trial in range(TRIALS):
        gate = StepGate(rng, span=rng.randint(6, 9), pieces=agent.planned_pieces())
        agent.pacer = gate.pace
        result, references, ran = checkpoint_while_training(job, agent, gate)
        assert ran >= 6, f"trial {trial}: only {ran} steps overlapped the checkpoint"
        assert result.attempts == 1 and result.torn == ()
        tensors, meta = references[result.step]
        image = restored(lambda: JOBS[kind](device), link, result)
        assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()}, f"trial {trial}")
        assert_same(meta, image.meta(), f"trial {trial} meta")


@pytest.mark.parametrize("kind", ["adam_foreach", "batch_norm"])  # BatchNorm: an int64 tensor alone
def test_an_image_copied_at_its_instant_runs_without_the_write_guard_and_equals_that_instant(
    kind: str, link: StoreLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device image (GPU tensors and a little host state) is copied whole at begin, so training
    runs without the write guard while the copier packs it. Here on host tensors, taken down the
    same path by marking the structure as on a device (the CUDA trials above run it for real)."""
    torch.manual_seed(4)
    job = JOBS[kind]()
    walk = job.state.structure
    monkeypatch.setattr(job.state, "structure", lambda: dataclasses.replace(walk(), on_device=True))
    for step in range(1, 3):
        job.step_fn()
        job.state.step = step
    agent = CheckpointAgent(job.state, link, job=f"instant-{kind}", piece_bytes=512, pack_bytes=8192)
    rng = random.Random(4)

    def unguarded_and_complete(ran: int) -> None:
        assert not agent.guarded and agent.capture is not None and agent.capture.instant.complete

    for trial in range(5):
        gate = StepGate(rng, span=6, pieces=agent.planned_pieces())
        agent.pacer = gate.pace
        result, references, ran = checkpoint_while_training(job, agent, gate, unguarded_and_complete)
        assert ran > 3, "training ran on while the copier packed the image"
        tensors, meta = references[result.step]
        image = restored(JOBS[kind], link, result)
        assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()}, f"trial {trial}")
        assert_same(meta, image.meta(), f"trial {trial} meta")


def test_batch_norm_statistics_written_behind_the_op_schema_are_caught_and_retaken(link: StoreLink) -> None:
    """Without the rule table, native_batch_norm's running-statistics update is an undeclared write:
    validation catches it, the torn attempt is dropped, and the retake (those buffers cloned at
    begin) equals the state at its own instant."""
    torch.manual_seed(2)
    job = JOBS["batch_norm"]()
    rng = random.Random(2)
    for trial in range(5):
        gate = StepGate(rng, span=3, pieces=40)
        agent = CheckpointAgent(job.state, link, job="bn", piece_bytes=512, rules={}, pacer=gate.pace)
        result, references, _ = checkpoint_while_training(job, agent, gate)
        assert {"model.1.running_mean", "model.1.running_var"} <= set(result.torn), trial
        assert result.attempts >= 2
        tensors, meta = references[result.step]
        image = restored(JOBS["batch_norm"], link, result)
        assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()}, f"trial {trial}")
        assert_same(meta, image.meta())


def test_the_copier_hands_the_gil_over_often_while_it_runs_and_puts_the_interval_back(
    link: StoreLink,
) -> None:
    """XXH3 holds the GIL: while a copier runs, the switch interval is short, so the training
    thread does not wait the default 5 ms for the GIL at every op; afterwards it is as it was."""
    import sys

    job = JOBS["sgd_momentum"]()
    before = sys.getswitchinterval()
    seen: list[float] = []
    agent = CheckpointAgent(
        job.state, link, job="gil", piece_bytes=512, pacer=lambda: seen.append(sys.getswitchinterval())
    )
    agent.checkpoint()
    agent.close()
    assert seen and max(seen) <= 0.0002 < before
    assert sys.getswitchinterval() == before


def _grow(job: Job) -> nn.Parameter:
    """A parameter the model and the optimizer gain mid-training (a new head, an unfrozen layer)."""
    extra = nn.Parameter(torch.zeros(700))
    job.state.model.register_parameter("extra", extra)
    assert job.state.optimizer is not None
    job.state.optimizer.add_param_group({"params": [extra]})
    return extra


def _adam_with_an_image(link: StoreLink, *, seed: int, name: str) -> tuple[Job, CheckpointAgent]:
    """An Adam job one step in, whose agent has committed a first image (begin reuses its walk)."""
    torch.manual_seed(seed)
    job = JOBS["adam_foreach"]()
    agent = CheckpointAgent(job.state, link, job=name, piece_bytes=512)
    job.step_fn()
    job.state.step = 1
    agent.checkpoint()
    return job, agent


def test_a_structure_changed_since_the_last_walk_is_walked_again_and_the_retake_holds_it(
    link: StoreLink,
) -> None:
    """begin reuses the structure walked for the last image; the copier walks again and finds a
    new parameter: that attempt is dropped and retaken with a fresh walk, at a later boundary."""
    job, agent = _adam_with_an_image(link, seed=6, name="grow")
    extra = _grow(job)
    with torch.no_grad():
        extra.add_(1.5)
    gate = StepGate(random.Random(6), span=3, pieces=_pieces(job.state, 512))
    agent.pacer = gate.pace
    result, references, _ = checkpoint_while_training(job, agent, gate)
    assert result.attempts == 2 and result.step > 1
    assert "model.extra" in {record.name for record in result.manifest.tensors}
    tensors, meta = references[result.step]

    def grown() -> Job:
        fresh = JOBS["adam_foreach"]()
        _grow(fresh)
        return fresh

    image = restored(grown, link, result)
    assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()})
    assert_same(meta, image.meta())


def test_the_write_guard_goes_once_every_tracked_tensor_is_written_whole_and_the_image_holds(
    link: StoreLink,
) -> None:
    """After the copier has captured everything, the first optimizer step writes every parameter
    and moment whole: each is settled in set operations, and at the next boundary the guard is
    popped (the steps until validation run without it); the image is still the instant's."""
    job, agent = _adam_with_an_image(link, seed=8, name="settle")
    tensors, meta = snapshot(job.state)
    agent.begin()
    assert agent.guarded and agent.capture is not None
    assert agent.capture.captured.wait(10)
    result = None
    for step in range(2, 5):  # validation waits for two boundaries after the capture
        job.step_fn()
        job.state.step = step
        result = result or agent.step_boundary(step)
        if step == 2:
            assert not agent.guarded, "every tensor was written whole: the guard should be gone"
    result = result or agent.wait()  # the store may still be writing: commit the image in flight
    assert result.step == 1 and result.attempts == 1
    image = restored(JOBS["adam_foreach"], link, result)
    assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()})
    assert_same(meta, image.meta())


def test_optimizer_state_gaining_a_plain_value_makes_the_reused_template_a_retake(link: StoreLink) -> None:
    """begin reuses the meta of optimizer states that hold tensors only; a state that gains a
    plain value is seen by the copier: the attempt is retaken and the image holds the value."""
    job, agent = _adam_with_an_image(link, seed=9, name="template")
    assert job.state.optimizer is not None
    for st in job.state.optimizer.state.values():
        st["note"] = 0.25
    gate = StepGate(random.Random(9), span=3, pieces=_pieces(job.state, 512))
    agent.pacer = gate.pace
    result, references, _ = checkpoint_while_training(job, agent, gate)
    assert result.attempts == 2
    tensors, meta = references[result.step]
    assert all(st["note"] == 0.25 for st in meta["optimizer"]["state"].values())
    image = restored(JOBS["adam_foreach"], link, result)
    assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()})
    assert_same(meta, image.meta())


def _pieces(state: TrainingState, piece_bytes: int) -> int:
    return sum(max(1, -(-t.nbytes // piece_bytes)) for _, t in state.tensors())


@pytest.mark.parametrize("when", ["before_capture", "during_capture"])
def test_numpy_writes_are_caught_by_begin_fingerprints_in_strict_mode(when: str, link: StoreLink) -> None:
    """An undeclared write (through a numpy view: no dispatch, no version bump) before the copier
    reaches the piece, or at a random moment of the capture from another thread, is caught."""
    torch.manual_seed(3)
    job = JOBS["adam_foreach"]()
    frozen = job.state.model[0].bias  # a tensor the optimizer never writes
    frozen.requires_grad_(False)
    rng = random.Random(when)
    pieces = _pieces(job.state, 512)
    for trial in range(5):
        gate = StepGate(rng, span=6, pieces=pieces)
        chosen = rng.randrange(pieces)

        def write() -> None:
            frozen.detach().numpy()[rng.randrange(frozen.numel())] += 1.0

        def pace(chosen: int = chosen, gate: StepGate = gate) -> None:
            if when == "during_capture" and gate.taken == chosen:
                write()
            gate.pace()

        def inject(ran: int) -> None:
            if when == "before_capture" and ran == 1:
                write()

        agent = CheckpointAgent(job.state, link, job="np", piece_bytes=512, strict=True, pacer=pace)
        result, references, _ = checkpoint_while_training(job, agent, gate, inject)
        assert "model.0.bias" in result.torn, trial
        tensors, _ = references[result.step]
        image = restored(JOBS["adam_foreach"], link, result)
        assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()}, f"trial {trial}")


def test_numpy_write_after_capture_is_caught_by_validation_fingerprints(link: StoreLink) -> None:
    torch.manual_seed(4)
    job = JOBS["sgd_momentum"]()
    frozen = job.state.model[3].weight
    frozen.requires_grad_(False)
    gate = StepGate(random.Random(4), span=2, pieces=30)
    agent = CheckpointAgent(job.state, link, job="np2", piece_bytes=512, pacer=gate.pace)

    injected: list[int] = []

    def inject(ran: int) -> None:
        capture = agent.capture
        if not injected and capture is not None and capture.captured.is_set():
            frozen.detach().numpy()[0, 0] += 1.0  # after its piece was captured, before validation
            injected.append(ran)

    result, references, _ = checkpoint_while_training(job, agent, gate, inject)
    assert injected and result.torn == ("model.3.weight",)
    tensors, _ = references[result.step]
    image = restored(JOBS["sgd_momentum"], link, result)
    assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()})


def test_writes_through_data_and_views_are_copied_before_they_land(link: StoreLink) -> None:
    """``p.data`` and views are other tensor objects over the tracked storage: the dispatch mode
    sees their writes by storage address and byte range, so no fallback is needed."""
    torch.manual_seed(5)
    job = JOBS["sgd_momentum"]()
    weight = job.state.model[0].weight
    gate = StepGate(random.Random(5), span=6, pieces=80)
    agent = CheckpointAgent(job.state, link, job="views", piece_bytes=512, pacer=gate.pace)

    def inject(ran: int) -> None:
        if ran == 1:
            weight.data.mul_(0.5)
            weight.detach().view(-1)[100:300].zero_()

    result, references, _ = checkpoint_while_training(job, agent, gate, inject)
    assert result.attempts == 1 and result.torn == ()
    tensors, _ = references[result.step]
    image = restored(JOBS["sgd_momentum"], link, result)
    assert_same(tensors, {name: byte_view(t) for name, t in image.tensors()})


def test_identical_weights_are_stored_once_and_an_unchanged_image_writes_nothing(link: StoreLink) -> None:
    torch.manual_seed(6)
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    b.load_state_dict(a.state_dict())
    frozen = nn.Linear(64, 8)
    model = nn.Sequential(a, b, frozen)
    frozen.requires_grad_(False)
    state = TrainingState(model)
    agent = CheckpointAgent(state, link, job="dedup", piece_bytes=1024)
    first = agent.checkpoint()
    weights = a.weight.nbytes + a.bias.nbytes
    assert first.stats.new_bytes == first.manifest.image_bytes() - weights
    assert agent.checkpoint().stats.new_bytes == 0
    with torch.no_grad():
        a.weight[0, :4] += 1.0  # one 1 KiB piece changes
    third = agent.checkpoint()
    assert third.stats.new_bytes == 1024
    image = Restore(
        TrainingState(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))),
        link,
        third.manifest,
    )
    image.start(on_demand=False)
    image.wait()
    assert_same(snapshot(state)[0], snapshot(image.state)[0])


@pytest.mark.parametrize("backend", ["local", "redis", "s3"])
def test_images_live_in_every_data_store_backend_and_collection_keeps_what_live_images_need(
    backend: str, request: pytest.FixtureRequest
) -> None:
    for fixture in {"local": ["tmp_path"], "redis": ["redis_url"], "s3": ["s3_env", "s3_endpoint"]}[backend]:
        request.getfixturevalue(fixture)  # servers start here, on the test's thread
    store_link = StoreLink.start(lambda: open_store(backend, request, chunk_bytes=1 << 20, cache_bytes=0))
    try:
        torch.manual_seed(7)
        job = JOBS["adam_foreach"]()
        job.state.model[0].weight.requires_grad_(False)  # unchanged pieces: later images share packs
        agent = CheckpointAgent(job.state, store_link, job=backend, piece_bytes=1024, pack_bytes=16384)
        results = []
        for step in range(1, 4):
            job.step_fn()
            agent.step_boundary(step)
            results.append(agent.checkpoint())
        expected = snapshot(job.state)
        refs = {ref.digest: ref for r in results for ref in (*r.manifest.packs, r.manifest.meta)}
        doomed = collectable(refs, [results[-1].manifest])
        assert doomed and not doomed & referenced_digests(results[-1].manifest)
        assert results[0].manifest.packs[0].digest in referenced_digests(results[-1].manifest)  # shared
        for digest in doomed:
            assert store_link.delete(refs[digest]).result()
        image = restored(JOBS["adam_foreach"], store_link, results[-1])
        assert_same(expected, snapshot(image))
    finally:
        store_link.close()


# ----- preempted N times == never preempted --------------------------------------------------


class ResumableJob:
    """A data-loader-driven job with dropout, an LR schedule, an AMP grad scaler and numpy/python
    randomness: everything a restore must put back besides the tensors."""

    def __init__(self) -> None:
        torch.manual_seed(11)
        data = TensorDataset(torch.randn(48, 12), torch.randint(0, 3, (48,)))
        self.sampler = ResumableSampler(len(data), seed=7)
        # Its own generator: a DataLoader draws a base seed when an iterator starts, which would
        # otherwise advance the global RNG once more in a restored process than in the original.
        self.loader = DataLoader(data, batch_size=8, sampler=self.sampler, generator=torch.Generator())
        model = nn.Sequential(
            nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.2), nn.Linear(24, 3)
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
        self.state = TrainingState(model, opt, sched, scaler=self.scaler, loader=self.sampler)

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self.loader

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        x = x + torch.from_numpy(np.random.normal(0, 0.01, x.shape).astype(np.float32)) * random.random()
        model, opt, sched = self.state.model, self.state.optimizer, self.state.scheduler
        assert opt is not None and sched is not None
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()  # its scale grows every 4 steps: part of the image
        sched.step()  # type: ignore[attr-defined]


def _seed_all() -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def test_a_job_preempted_many_times_ends_bitwise_equal_to_an_uninterrupted_run(link: StoreLink) -> None:
    total = 30
    _seed_all()
    plain = ResumableJob()
    batches = plain.batches()
    for step in range(1, total + 1):
        plain.step(next(batches))
        plain.state.step = step
    expected = snapshot(plain.state)

    _seed_all()
    job = ResumableJob()
    agent = CheckpointAgent(job.state, link, job="preempted", piece_bytes=256)
    batches = job.batches()
    last: CommitResult | None = None
    # At these steps the job is preempted: checkpoint-and-stop (pause) or killed without warning
    # (rewind to the last periodic checkpoint, losing the steps since).
    preemptions = {7: "pause", 11: "kill", 16: "pause", 22: "kill", 23: "pause", 27: "kill"}
    step = 0
    resumed = 0
    loading: Restore | None = None
    while step < total:
        job.step(next(batches))  # after a restore: runs while the optimizer state is still loading
        if loading is not None:
            loading.wait()
            loading = None
        step += 1
        last = agent.step_boundary(step) or last
        if step % 4 == 0 and not agent.in_flight:
            agent.begin()
        how = preemptions.pop(step, None)
        if how is None:
            continue
        if how == "pause":
            last = agent.checkpoint()
            assert last.step == step
        else:
            agent.abandon()  # the process died: its checkpoint in flight is lost with it
        assert last is not None
        # A fresh process: build the job from code, restore on demand, go on from the image's step.
        _seed_all()  # whatever the new process's seeds, the image's RNG states win
        job = ResumableJob()
        loading = Restore.from_ref(job.state, link, last.manifest_ref)
        loading.start()
        batches = job.batches()
        step = job.state.step
        agent = CheckpointAgent(
            job.state, link, job="preempted", piece_bytes=256, last=last.manifest, last_ref=last.manifest_ref
        )
        resumed += 1
    assert resumed == 6
    assert_same(expected[0], snapshot(job.state)[0], "tensors")
    assert_same(expected[1], snapshot(job.state)[1], "meta")
