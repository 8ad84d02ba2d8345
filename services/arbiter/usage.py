"""What the cluster's GPUs are doing, from the hosts' reports: pure, no I/O.

Each ``agent.report`` says how many of a host's GPUs are committed to cells, leased to best-effort
jobs, or idle. This keeps the latest per host and integrates them over time into GPU-seconds per
use (the cells / BE / idle split of provisioned GPU time), and an exponentially weighted average
of the GPUs best-effort jobs could use (leased + leasable idle): the capacity R against which an app's
T_id is computed (``shared.arbiter.estimate``), time-averaged so that notebook load, which BE
apps cannot change, does not make every app look unfair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

USES = ("cells", "be", "idle")


@dataclass
class HostUse:
    gpus: int
    committed: int
    leased: int
    idle: list[int]  # leasable
    reserved: int  # idle too, kept for cells
    at: float


@dataclass
class UsageMeter:
    window_s: float
    stale_s: float  # a host silent this long is left out (down, or gone)
    hosts: dict[str, HostUse] = field(default_factory=dict)
    gpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(USES, 0.0))
    be_capacity: float | None = None
    _last: float | None = None

    def observe(self, report: dict[str, Any], now: float) -> None:
        """A host's ``agent.report``: its GPUs by use."""
        self.advance(now)
        jobs = [j for j in report["jobs"] if isinstance(j, dict) and j.get("running")]
        leased = sum(len(j.get("device_ids") or []) for j in jobs)
        self.hosts[str(report["host_id"])] = HostUse(
            int(report["gpus"]),
            int(report["committed"]),
            leased,
            [int(d) for d in report["idle"]],
            int(report.get("reserved", 0)),
            now,
        )

    def live(self, now: float) -> dict[str, HostUse]:
        return {h: u for h, u in self.hosts.items() if now - u.at <= self.stale_s}

    def split(self, now: float) -> dict[str, int]:
        """GPUs by use now: cells, be, idle (and provisioned, their sum over live hosts)."""
        live = self.live(now).values()
        out = {
            "cells": sum(u.committed for u in live),
            "be": sum(u.leased for u in live),
            "idle": sum(len(u.idle) + u.reserved for u in live),
        }
        out["provisioned"] = sum(u.gpus for u in live)
        return out

    def advance(self, now: float) -> None:
        """Integrate the current split up to ``now`` (GPU-seconds and the capacity average)."""
        if self._last is None or now <= self._last:
            self._last = now if self._last is None else self._last
            return
        dt = now - self._last
        self._last = now
        split = self.split(now)
        for use in USES:
            self.gpu_seconds[use] += dt * split[use]
        if self.be_capacity is not None:
            keep = math.exp(-dt / self.window_s)
            self.be_capacity = keep * self.be_capacity + (1 - keep) * self._usable(now)

    def capacity(self, now: float) -> float:
        """T_id's R: the time-averaged GPUs BE jobs could use; the average starts at the first
        auction with hosts (the first with jobs: by then every host has reported, not just the
        first to come up)."""
        self.advance(now)
        if self.be_capacity is None and self.live(now):
            self.be_capacity = self._usable(now)
        return self.be_capacity or 0.0

    def _usable(self, now: float) -> float:
        return float(sum(u.leased + len(u.idle) for u in self.live(now).values()))

    def report(self, now: float) -> dict[str, Any]:
        """Now and over time: GPUs by use, and the share of provisioned GPU time each had."""
        self.advance(now)
        total = sum(self.gpu_seconds.values())
        return {
            "gpus_now": self.split(now),
            "gpu_seconds": {k: round(v, 3) for k, v in self.gpu_seconds.items()},
            "utilization": {k: round(v / total, 4) if total else 0.0 for k, v in self.gpu_seconds.items()},
            "be_capacity_gpus": round(self._usable(now) if self.be_capacity is None else self.be_capacity, 3),
        }
