"""Concurrent, validated, incremental checkpoints of training jobs, in the spirit of POS.

- ``state``: what an image holds (model, optimizer, scheduler, scaler, RNG, loader position, step).
- ``cow``: the dispatch modes (soft copy-on-write from op schemas; on-demand restore's gate).
- ``capture``: one checkpoint in flight (concurrent copy, validation, packing).
- ``agent``: begin / step_boundary / wait, retakes of torn images.
- ``restore``: on-demand restore into a freshly built job.
- ``manifest``: the image's table of contents and garbage collection over manifests.
- ``pusher``: the thread-safe link to the async data store.
- ``book``: the checkpoint service's bookkeeping (latest image per job, garbage collection).

The names below are imported on first use: the checkpoint service needs ``book`` and ``manifest``
only, and must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.checkpoint.agent import CheckpointAgent, CommitResult
    from shared.checkpoint.manifest import Manifest, collectable, referenced_digests
    from shared.checkpoint.pusher import StoreLink
    from shared.checkpoint.restore import Restore
    from shared.checkpoint.sampler import ResumableSampler
    from shared.checkpoint.state import TrainingState

_WHERE = {
    "CheckpointAgent": "agent",
    "CommitResult": "agent",
    "Manifest": "manifest",
    "collectable": "manifest",
    "referenced_digests": "manifest",
    "StoreLink": "pusher",
    "Restore": "restore",
    "ResumableSampler": "sampler",
    "TrainingState": "state",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"shared.checkpoint.{module}"), name)


__all__ = [
    "CheckpointAgent",
    "CommitResult",
    "Manifest",
    "Restore",
    "ResumableSampler",
    "StoreLink",
    "TrainingState",
    "collectable",
    "referenced_digests",
]
