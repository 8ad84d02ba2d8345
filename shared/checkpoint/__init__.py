"""Concurrent, validated, incremental checkpoints of training jobs, in the spirit of POS.

- ``state``: what an image holds (model, optimizer, scheduler, scaler, RNG, loader position, step).
- ``cow``: the dispatch modes (soft copy-on-write from op schemas; on-demand restore's gate).
- ``capture``: one checkpoint in flight (concurrent copy, validation, packing).
- ``agent``: begin / step_boundary / wait, retakes of torn images.
- ``restore``: on-demand restore into a freshly built job.
- ``manifest``: the image's table of contents and garbage collection over manifests.
- ``pusher``: the thread-safe link to the async data store.
"""

from shared.checkpoint.agent import CheckpointAgent, CommitResult
from shared.checkpoint.manifest import Manifest, collectable, referenced_digests
from shared.checkpoint.pusher import StoreLink
from shared.checkpoint.restore import Restore
from shared.checkpoint.sampler import ResumableSampler
from shared.checkpoint.state import TrainingState

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
