"""What the cluster's GPUs are doing, from the hosts' reports: pure, no I/O.

Each ``agent.report`` says how many of a host's GPUs are committed to cells, leased to best-effort
jobs, or idle. This keeps the latest per host and integrates them over time into GPU-seconds per
use (the cells / BE / idle split of provisioned GPU time), and says how many GPUs best-effort
jobs could use now (leased + leasable idle, not the cells' reserve): what the arbiter feeds the
core's ``CapacityMeter`` for T_id's R.
"""

from __future__ import annotations

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
    stale_s: float  # a host silent this long is left out (down, or gone)
    hosts: dict[str, HostUse] = field(default_factory=dict)
    gpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(USES, 0.0))
    _last: float | None = None

    def observe(self, report: dict[str, Any], now: float) -> None:
        """A host's ``agent.report``: its GPUs by use."""
        self.advance(now)
        jobs = [j for j in report["jobs"] if isinstance(j, dict) and j.get("running")]
        # distinct devices: two jobs packed on one GPU (issue #18) lease it once
        leased = len({int(d) for j in jobs for d in j.get("device_ids") or []})
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
        """Integrate the current split up to ``now`` (GPU-seconds by use)."""
        if self._last is None or now <= self._last:
            self._last = now if self._last is None else self._last
            return
        dt = now - self._last
        self._last = now
        split = self.split(now)
        for use in USES:
            self.gpu_seconds[use] += dt * split[use]

    def usable(self, now: float) -> float:
        """GPUs best-effort jobs could use now: leased, or idle beyond the cells' reserve."""
        return float(sum(u.leased + len(u.idle) for u in self.live(now).values()))

    def by_host(self, now: float) -> dict[str, dict[str, int]]:
        """Each live host's GPUs now: cells, be, free (leasable) and reserved (idle, kept for
        cells); what the dashboard draws per host."""
        return {
            host: {
                "gpus": u.gpus,
                "cells": u.committed,
                "be": u.leased,
                "free": len(u.idle),
                "reserved": u.reserved,
            }
            for host, u in sorted(self.live(now).items())
        }

    def report(self, now: float) -> dict[str, Any]:
        """Now and over time: GPUs by use, and the share of provisioned GPU time each had."""
        self.advance(now)
        total = sum(self.gpu_seconds.values())
        return {
            "gpus_now": self.split(now),
            "hosts": self.by_host(now),
            "gpu_seconds": {k: round(v, 3) for k, v in self.gpu_seconds.items()},
            "utilization": {k: round(v / total, 4) if total else 0.0 for k, v in self.gpu_seconds.items()},
        }
