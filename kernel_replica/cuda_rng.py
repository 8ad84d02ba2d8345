"""The notebook's CUDA random generator, carried from executor to executor.

``torch.manual_seed(0)`` in a first cell seeds the GPUs' generators too (lazily, before CUDA
starts), and a later cell's dropout, ``torch.randn(..., device="cuda")`` or ``randperm`` draws
from the generator of the cell's GPU. The CPU generator travels with the executor's settings
(``library_settings``); the CUDA one did not, so after an executor change a seeded notebook drew
other numbers on the GPU, silently: the next executor's generator was its own (unseeded, or at
an older position).

What travels (a ``library_settings`` setting, so only when it changed, in the process context):

- ``("state", bytes)``: the generator state of the cell's GPU, once the executor has started CUDA
  (a Philox seed and offset; reading it starts nothing and syncs nothing);
- ``("seeds", ((which, seed), ...))``: seeds the executor was given before CUDA started, in call
  order, read from the calls torch queued for CUDA's start (``which`` is ``"all"`` for
  ``manual_seed_all`` / ``torch.manual_seed``, ``"current"`` for ``torch.cuda.manual_seed``);
- ``None``: neither (the generator is still at its default).

A standby keeps the latest value *pending* and puts it on the generator of the GPU its next cell
binds (``device_residency`` calls ``bind``): applying it on arrival would seed whichever device
happened to be current, and on a standby that never starts CUDA each arrival would queue another
call in torch. A notebook that seeds again itself before that (on this replica) wins: the
pending value is dropped. Only the bound GPU's generator is carried: a cell that addresses other
GPUs by index draws from theirs, as each executor has them.
"""

from __future__ import annotations

import typing as t

Value = tuple[str, t.Any] | None

ALL, CURRENT = "all", "current"


def queued_seeds(cuda: t.Any) -> tuple[tuple[str, int], ...]:
    """The seeds torch will apply when this process starts CUDA, oldest first. ValueError when
    torch keeps them otherwise than this reads (another torch version): the setting is then
    logged as not replicated, not guessed."""
    tracker = cuda._lazy_seed_tracker
    seeds = []
    for entry in tracker.get_calls():
        if entry is None:
            continue
        callback = entry[0]
        which = ALL if entry is tracker.manual_seed_all_cb else CURRENT
        try:
            cell = callback.__closure__[callback.__code__.co_freevars.index("seed")]
        except (AttributeError, TypeError, ValueError):
            raise ValueError("torch's queued CUDA seed call holds no 'seed'") from None
        seeds.append((which, int(cell.cell_contents)))
    return tuple(seeds)


def _state_bytes(generator: t.Any) -> bytes:
    return bytes(generator.get_state().numpy().tobytes())


class CudaRngCarrier:
    """This process's side: ``read`` / ``write`` for the setting, ``bind`` for the GPU a cell
    gets."""

    def __init__(self) -> None:
        self._pending: Value = None
        self._mark: tuple[t.Any, ...] | None = None  # this process's generators when it arrived

    @property
    def pending(self) -> bool:
        """Whether a value from another executor waits for this replica's next GPU cell."""
        return self._pending is not None

    @staticmethod
    def _generators_now(cuda: t.Any) -> tuple[t.Any, ...]:
        """What a notebook's own seeding or drawing on this replica changes: the generators'
        states once CUDA started, else the seed calls queued for its start (by identity)."""
        if cuda.is_initialized():
            return (True, *(_state_bytes(g) for g in cuda.default_generators))
        tracker = cuda._lazy_seed_tracker
        return (False, tracker.manual_seed_all_cb, tracker.manual_seed_cb)

    def _still_pending(self, cuda: t.Any) -> bool:
        if self._pending is None:
            return False
        now, mark = self._generators_now(cuda), self._mark or ()
        if len(now) == len(mark) and all(a is b or a == b for a, b in zip(now, mark, strict=True)):
            return True
        self._pending = self._mark = None  # the notebook seeded or drew here since: its own wins
        return False

    def read(self, torch: t.Any) -> Value:
        cuda = torch.cuda
        if self._still_pending(cuda):
            return self._pending
        if cuda.is_initialized():
            return ("state", _state_bytes(cuda.default_generators[cuda.current_device()]))
        seeds = queued_seeds(cuda)
        return ("seeds", seeds) if seeds else None

    def write(self, torch: t.Any, value: Value) -> None:
        if value is None:
            return  # the executor's generator was at its default: nothing to carry
        kind, data = value
        if kind not in ("state", "seeds"):
            raise ValueError(f"unknown CUDA generator value {kind!r}")
        self._pending, self._mark = (kind, data), self._generators_now(torch.cuda)

    def bind(self, torch: t.Any, index: int) -> None:
        """The cell's GPU is ``index`` (current now, or being made current as CUDA starts):
        put the pending value on its generator."""
        cuda = torch.cuda
        if not self._still_pending(cuda):
            return
        assert self._pending is not None
        kind, data = self._pending
        self._pending = self._mark = None
        generators = cuda.default_generators
        if kind == "state":
            generators[index].set_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return
        for which, seed in data:
            for generator in generators if which == ALL else (generators[index],):
                generator.manual_seed(seed)


CARRIER = CudaRngCarrier()
