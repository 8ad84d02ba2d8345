"""A deterministic CPU training job on the job-side API with Tandem's checkpoints.

    tandem job submit -- python examples/checkpointed_job.py TOTAL OUT_FILE [EVERY [STEP_SLEEP_S [WIDTH]]]

An MLP with Adam on random batches drawn from torch's generator (restored with the image, so a
resumed run draws the same batches). Once it reaches TOTAL it writes a digest of the model's and
the optimizer's tensors to OUT_FILE: what tests/integration/test_checkpoint_and_stop.py compares,
bitwise, with a run that was never interrupted (``final_digest``, called in the test's process).
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch
from torch import nn

import tandem_job
from shared.checkpoint import TrainingState
from tandem_job.checkpoints import checkpoints

STEP_SLEEP_S = 0.03  # a step's length beyond its arithmetic, so a stop lands between steps


def build(width: int = 256) -> TrainingState:
    """``width``: the hidden layer (its image is ~1.5 KiB per unit with Adam's moments)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return TrainingState(model, optimizer)


def train_step(state: TrainingState) -> None:
    assert state.optimizer is not None
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    loss = nn.functional.mse_loss(state.model(x), y)
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()


def final_digest(state: TrainingState) -> str:
    digest = hashlib.sha256()
    for name, tensor in state.tensors():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    total, out = int(sys.argv[1]), sys.argv[2]
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else STEP_SLEEP_S
    width = int(sys.argv[5]) if len(sys.argv) > 5 else 256
    with tandem_job.session(total=total) as job:
        state = build(width)
        with checkpoints(job, state, every=every) as images:
            for _ in job.steps():
                train_step(state)
                time.sleep(pause)
        outcome = "stopped" if job.stopped else "finished"
        print(f"{outcome} at {job.done}, restored from {images.restored_step}", flush=True)
        if not job.stopped:
            with open(out, "w") as f:
                f.write(final_digest(state))


if __name__ == "__main__":
    main()
