"""This host's link to the checkpoint service: it relays what its jobs' agents committed and asks
for the image a job restarts from. The jobs themselves hold no keys (``tandem_job`` speaks to the
host through files); the host speaks to the service with its own ``host.<id>`` key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import zmq

from shared import messages
from shared.config import Config
from shared.envelope import Envelope
from shared.rpc import RpcClient
from shared.security import curve
from tandem_job.checkpoints import ENV_STORE


class CheckpointLink(Protocol):
    async def commit(self, job_id: str, announcement: dict[str, Any]) -> dict[str, Any]: ...
    async def latest(self, job_id: str) -> dict[str, Any] | None: ...
    async def forget(self, job_id: str) -> None: ...
    async def written(self, job_id: str, digests: list[str]) -> None: ...


class ServiceLink:
    """``CheckpointLink`` over CURVE to ``checkpoint.address``."""

    def __init__(self, ctx: zmq.Context[Any], cfg: Config, *, host_id: str, host_keys: curve.Keypair) -> None:
        self.timeout_s = float(cfg.get("checkpoint.commit_timeout_s"))
        self._client = RpcClient(
            ctx,
            identity=host_id.encode(),
            name="checkpoint",
            curve=curve.ClientCurve(host_keys, curve.load(cfg.keys_dir(), curve.CHECKPOINT).public),
        )
        self._address = str(cfg.get("checkpoint.address"))

    def connect(self) -> None:
        self._client.connect(self._address)

    async def commit(self, job_id: str, announcement: dict[str, Any]) -> dict[str, Any]:
        body = {
            "job_id": job_id,
            "manifest": announcement["manifest"],
            "written": announcement.get("written", []),
        }
        answer = await self._client.request(
            Envelope(messages.CHECKPOINT_COMMIT, body), timeout=self.timeout_s
        )
        return dict(answer.body)

    async def latest(self, job_id: str) -> dict[str, Any] | None:
        answer = await self._client.request(
            Envelope(messages.CHECKPOINT_LATEST, {"job_id": job_id}), timeout=self.timeout_s
        )
        checkpoint = answer.body.get("checkpoint")
        return dict(checkpoint) if checkpoint else None

    async def forget(self, job_id: str) -> None:
        await self._client.request(
            Envelope(messages.CHECKPOINT_FORGET, {"job_id": job_id}), timeout=self.timeout_s
        )

    async def written(self, job_id: str, digests: list[str]) -> None:
        await self._client.request(
            Envelope(messages.CHECKPOINT_WRITTEN, {"job_id": job_id, "digests": digests}),
            timeout=self.timeout_s,
        )

    async def close(self) -> None:
        await self._client.close()


def store_env(cfg: Config) -> dict[str, str]:
    """What a job needs to reach the cluster's data store: its ``[datastore]`` section, the local
    directory made absolute (the job runs in the submitter's working directory)."""
    section = dict(cfg["datastore"])
    if section.get("backend") == "local":
        path = Path(section["path"]).expanduser() if section.get("path") else cfg.state_dir() / "datastore"
        section["path"] = str(path.absolute())
    return {ENV_STORE: json.dumps(section)}
