"""Workload model for trace-driven evaluation: the trace data model, a seeded IDLT generator fitted
to the published AdobeTrace statistics, a CSV importer/exporter for real traces, the paper's
billing model and metric helpers shared by the simulator and the live load test."""

from shared.workload.idlt import IdltParams, QuantileFunction, excerpt_17_5h, generate
from shared.workload.model import Session, Task, Trace, default_resources

__all__ = [
    "IdltParams",
    "QuantileFunction",
    "Session",
    "Task",
    "Trace",
    "default_resources",
    "excerpt_17_5h",
    "generate",
]
