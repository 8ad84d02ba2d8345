"""A tiny CPU PyTorch training loop on the job-side API (used by test_batch_jobs.py).

    python _train_job.py STEPS RECORD_FILE

Each step trains a small linear model for a few milliseconds and appends one line to RECORD_FILE:
the wall-clock time, this job's id, host and visible GPUs; what the test checks placement with.
Its state is checkpointed (``tandem_job.checkpoints``): when a lease ends it checkpoints and
stops, and its next run, on whichever host, restarts from that image.
"""

from __future__ import annotations

import os
import sys
import time

import tandem_job


def main() -> None:
    steps, record = int(sys.argv[1]), sys.argv[2]
    with tandem_job.session(total=steps) as job:  # first: the arbiter learns the total at once
        train(job, record)


def train(job: tandem_job.Job, record: str) -> None:
    import torch

    from shared.checkpoint import TrainingState
    from tandem_job.checkpoints import checkpoints

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    where = f"{os.environ.get('TANDEM_JOB_ID')} {os.environ.get('TANDEM_HOST_ID')} {os.environ.get('CUDA_VISIBLE_DEVICES')}"
    with open(record, "a") as out, checkpoints(job, TrainingState(model, optimizer), every=20):
        for step in job.steps():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            time.sleep(0.05)
            out.write(f"{time.time():.3f} {where} {step}\n")
            out.flush()
        print(f"{'stopped' if job.stopped else 'finished'} at {job.done} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
