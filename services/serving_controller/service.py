"""The serving controller's asyncio shell over the pure core (``shared/serving/core.py``).

Hosts (their local schedulers, with their host keys) report their warm-runtime pools every
``prewarm.interval_s`` and get back the target the core decided for them over the whole cluster;
the host starts or stops runtimes to meet it (it owns the processes). The global scheduler asks
``runtime.acquire`` before a replica start (migration, scale-out, replacement, hibernation
resume): the answer promises a ready runtime on that host or says the start will be cold. The
operator and the scheduler read ``serving.status``. Every peer is authenticated by its CURVE key
(``shared/security/authorization.serving_refusal`` says who may send what); SIGTERM stops it
cleanly (``shared.runner``). It keeps no state on disk: a restarted controller learns every pool
from the next reports, and hosts keep their last target meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
import zmq
import zmq.asyncio

from shared import messages
from shared.config import Config
from shared.envelope import Envelope
from shared.rpc import RpcServer
from shared.security import curve
from shared.security.authorization import host_identity_refusal, serving_refusal
from shared.serving import HostReport, ServingConfig, ServingCore

log = structlog.get_logger("serving_controller")


def serving_config(cfg: Config) -> ServingConfig:
    prewarm = cfg["prewarm"]
    return ServingConfig(
        policy=str(prewarm["policy"]),
        per_host=int(prewarm["per_host"]),
        max_per_host=int(prewarm["max_per_host"]),
        headroom=float(prewarm["headroom"]),
        half_life_s=float(prewarm["half_life_s"]),
        stale_s=float(cfg.get("serving.stale_s")),
    )


class ServingController:
    def __init__(self, cfg: Config, *, clock: Any = time.monotonic) -> None:
        self.cfg = cfg
        self.core = ServingCore(serving_config(cfg))
        self._clock = clock
        self._targets: dict[str, int] = {}  # the last target told to each host, to log changes
        self._keys_dir = cfg.keys_dir()
        self._ctx = zmq.asyncio.Context()
        self._authority: curve.CurveAuthority | None = None
        self._server = RpcServer(
            self._ctx,
            self._handle,
            name="serving_controller",
            mandatory=True,
            curve=curve.server_curve(self._keys_dir, curve.SERVING),
            authorize=self._authorize,
        )

    def bind(self, address: str) -> str:
        if self._authority is None:
            self._authority = curve.CurveAuthority.acquire(self._ctx)
            directory = curve.PeerDirectory(self._keys_dir, exclude=(curve.SERVING, curve.GATEWAY))
            self._authority.serve(curve.SERVING, directory)
        return self._server.bind(address)

    @property
    def address(self) -> str:
        return self._server.address

    async def run(self, stop: asyncio.Event) -> None:
        self._server.start()
        log.info("started", address=self.address, policy=self.core.config.policy)
        try:
            await stop.wait()
        finally:
            await self._server.close()
            if self._authority is not None:
                self._authority.release()
                self._authority = None
            self._ctx.destroy(linger=0)
            log.info("stopped")

    # ---- messages -------------------------------------------------------------------------------

    def _authorize(self, principal: str, identity: bytes, env: Envelope) -> str | None:
        return host_identity_refusal(principal, identity) or serving_refusal(principal, env.type, env.body)

    def _handle(self, identity: bytes, env: Envelope) -> Any:
        body, now = env.body, self._clock()
        if env.type == messages.POOL_REPORT:
            warmup = body.get("warmup_s")
            report = HostReport(
                body["host_id"],
                warm=body["warm"],
                starting=body["starting"],
                idle_gpus=int(body.get("idle_gpus", 0)),
                taken=int(body.get("taken", 0)),
                misses=int(body.get("misses", 0)),
                warmup_s=float(warmup) if warmup is not None else None,
            )
            target = self.core.report(report, now)
            if self._targets.get(report.host_id) != target:
                self._targets[report.host_id] = target
                log.info("pool_target", host=report.host_id, target=target, warm=report.warm,
                         starting=report.starting, policy=self.core.config.policy)  # fmt: skip
            return env.reply({"target": target})
        if env.type == messages.RUNTIME_ACQUIRE:
            grant = self.core.acquire(body["host_id"], now)
            log.debug("runtime_acquire", host=grant.host_id, warm=grant.warm, reason=grant.reason,
                      kernel=body.get("kernel_id"), purpose=body.get("purpose"))  # fmt: skip
            return env.reply({"host_id": grant.host_id, "warm": grant.warm, "reason": grant.reason})
        if env.type == messages.SERVING_STATUS:
            return env.reply(self.core.status(now))
        if env.type in (messages.REPLY, messages.ERROR):
            return None
        return env.error(f"the serving controller does not handle {env.type!r}", code="unsupported")
