"""A kernel's resource request and a host's capacity, in the units of the NotebookOS paper."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class Resources:
    millicpus: int = 0  # 1000 = one vCPU
    memory_mb: int = 0
    gpus: int = 0
    vram_gb: float = 0.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, what: str = "resource request") -> Resources:
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{what}: unknown field(s) {sorted(unknown)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in raw:
                continue
            value = raw[f.name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{what}: {f.name} must be a number, got {value!r}")
            if value < 0:
                raise ValueError(f"{what}: {f.name} must be >= 0, got {value}")
            if f.name != "vram_gb" and value != int(value):
                raise ValueError(f"{what}: {f.name} must be a whole number, got {value}")
            values[f.name] = float(value) if f.name == "vram_gb" else int(value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fits_in(self, other: Resources) -> bool:
        return (
            self.millicpus <= other.millicpus
            and self.memory_mb <= other.memory_mb
            and self.gpus <= other.gpus
            and self.vram_gb <= other.vram_gb
        )

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.millicpus + other.millicpus,
            self.memory_mb + other.memory_mb,
            self.gpus + other.gpus,
            self.vram_gb + other.vram_gb,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.millicpus - other.millicpus,
            self.memory_mb - other.memory_mb,
            self.gpus - other.gpus,
            self.vram_gb - other.vram_gb,
        )
