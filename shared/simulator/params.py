"""The simulator's cost model and cluster parameters, read from the ``[simulator]`` config table.

One frozen object so a run is fully described by (trace, policy, params, seed): that tuple is what
makes a result reproducible. Validation names the key, as everywhere in the configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from shared.cluster_core.core import CoreConfig, retry_schedule
from shared.config import Config, ConfigError, load_config
from shared.policies.autoscale import AutoscaleConfig
from shared.workload.billing import Rates


@dataclass(frozen=True, slots=True)
class SimParams:
    gpus_per_host: int = 8
    initial_hosts: int = 3
    min_hosts: int = 3
    max_hosts: int = 1000
    host_provision_s: float = 120.0
    cold_start_s: float = 10.0
    warm_start_s: float = 0.5
    start_jitter_sigma: float = 0.25
    large_object_mb: float = 1024.0
    datastore_read_mb_per_s: float = 400.0
    datastore_write_mb_per_s: float = 200.0
    election_s: float = 0.03
    autoscale_interval_s: float = 120.0
    scaling_factor: float = 1.05
    buffer_hosts: int = 1
    max_ratio_after_scale_in: float = 2.0
    subscription_ratio_watermark: float = 3.0
    prewarm_per_host: int = 1
    lcp_pool_per_host: int = 8
    vm_rate_per_hour: float = 10.0
    markup: float = 1.15
    standby_fraction: float = 0.125
    timeline_step_s: float = 60.0
    reclaim_after_h: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
    replicas_per_kernel: int = 3
    # The live cluster's own keys (``autoscale.scale_in_idle_s``, ``scheduler.migration_*``,
    # ``scheduler.heartbeat_interval_s``): the simulated cluster core decides with the same values.
    scale_in_idle_s: float = 30.0
    migration_retry_base_s: float = 0.5
    migration_retry_max_s: float = 4.0
    migration_deadline_s: float = 30.0
    ledger_settle_s: float = 1.0
    # ``autoscale.scale_out_timeout_s``: a kernel start, or a held cell's migration, waiting for
    # hosts a scale-out asked for gives up after this; it must exceed ``host_provision_s``.
    scale_out_timeout_s: float = 300.0
    # Hibernation (``kernel.hibernate_after_s``, the live key; 0: off): a kernel idle this long
    # releases its replicas; its next cell first waits for a resume of ``resume_s`` (the measured
    # small-namespace resume, scripts/bench_hibernate.py) plus its large objects read back at
    # ``resume_read_mb_per_s`` (measured: a 500 MB resume minus a small one). ``kernel_memory_mb``:
    # the RSS of a kernel's three replicas (scripts/bench_kernel_memory.py, torch imported), what a
    # hibernated kernel gives back.
    hibernate_after_s: float = 0.0
    resume_s: float = 1.5
    resume_read_mb_per_s: float = 220.0
    kernel_memory_mb: float = 770.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "reclaim_after_h":
                if not all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in v):
                    raise ConfigError(f"simulator.reclaim_after_h must be positive hours, got {v!r}")
                continue
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"simulator.{f.name} must be a finite number >= 0, got {v!r}")
        if self.gpus_per_host < 1 or self.autoscale_interval_s <= 0 or self.timeline_step_s <= 0:
            raise ConfigError(
                "simulator: gpus_per_host, autoscale_interval_s and timeline_step_s must be > 0"
            )
        if self.scale_out_timeout_s <= self.host_provision_s:
            raise ConfigError(
                f"autoscale.scale_out_timeout_s ({self.scale_out_timeout_s:g}) must exceed "
                f"simulator.host_provision_s ({self.host_provision_s:g}): every scale-out would miss "
                "its deadline and each start or held cell waiting for a host would fail"
            )
        if self.initial_hosts > self.max_hosts:
            raise ConfigError(
                f"simulator.initial_hosts ({self.initial_hosts}) exceeds max_hosts ({self.max_hosts})"
            )

    @classmethod
    def from_config(cls, cfg: Config | None = None) -> SimParams:
        section: dict[str, Any] = dict((cfg or load_config())["simulator"])
        section["reclaim_after_h"] = tuple(float(x) for x in section.get("reclaim_after_h", ()))
        cfg = cfg or load_config()
        return cls(
            **section,
            replicas_per_kernel=cfg.get("cluster.replicas_per_kernel"),
            scale_in_idle_s=float(cfg.get("autoscale.scale_in_idle_s")),
            migration_retry_base_s=float(cfg.get("scheduler.migration_retry_base_s")),
            migration_retry_max_s=float(cfg.get("scheduler.migration_retry_max_s")),
            migration_deadline_s=float(cfg.get("scheduler.migration_deadline_s")),
            ledger_settle_s=float(cfg.get("scheduler.heartbeat_interval_s")),
            scale_out_timeout_s=float(cfg.get("autoscale.scale_out_timeout_s")),
            hibernate_after_s=float(cfg.get("kernel.hibernate_after_s")),
        )

    @property
    def read_s(self) -> float:
        """A fresh runtime loading the session's large objects (model, data) from the data store."""
        return self.large_object_mb / self.datastore_read_mb_per_s if self.datastore_read_mb_per_s else 0.0

    @property
    def write_s(self) -> float:
        """A per-cell runtime writing them back before it stops (batch, lcp)."""
        return self.large_object_mb / self.datastore_write_mb_per_s if self.datastore_write_mb_per_s else 0.0

    @property
    def resume_mean_s(self) -> float:
        """A hibernated kernel's resume: the measured start and image load, and its large objects."""
        read = self.large_object_mb / self.resume_read_mb_per_s if self.resume_read_mb_per_s else 0.0
        return self.resume_s + read

    def autoscale_config(self) -> AutoscaleConfig:
        return AutoscaleConfig(
            scaling_factor=self.scaling_factor,
            gpus_per_host=self.gpus_per_host,
            buffer_hosts=self.buffer_hosts,
            min_hosts=min(max(self.min_hosts, self.replicas_per_kernel), self.max_hosts),
            max_hosts=self.max_hosts,
            replicas_per_kernel=self.replicas_per_kernel,
            max_ratio_after_scale_in=self.max_ratio_after_scale_in,
        )

    def core_config(self) -> CoreConfig:
        """The simulated cluster core's configuration: the live one's rules with these values."""
        return CoreConfig(
            autoscale=self.autoscale_config(),
            scale_in_idle_s=self.scale_in_idle_s,
            retry=retry_schedule(
                self.migration_retry_base_s, self.migration_retry_max_s, self.migration_deadline_s
            ),
            ledger_settle_s=self.ledger_settle_s,
            watermark=self.subscription_ratio_watermark,
            replicas_per_kernel=self.replicas_per_kernel,
            scale_out_timeout_s=self.scale_out_timeout_s,
        )

    def rates(self) -> Rates:
        return Rates(self.vm_rate_per_hour, self.gpus_per_host, self.markup, self.standby_fraction)
