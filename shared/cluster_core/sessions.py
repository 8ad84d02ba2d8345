"""The session-level interface of the cluster core's scheduling plug-ins (NotebookOS §5.1.1):
the four events of a notebook session's life in, plain-data actions out.

    on_session_start(session)           -> actions
    on_cell_submit(session_id, cell_id) -> actions
    on_cell_end(session_id, cell_id)    -> actions
    on_session_end(session_id)          -> actions

plus cluster membership (``add_host``/``remove_host``). The plug-ins are the replicated kernels
of ``replicated.py`` (``notebookos``) and the baselines of ``shared.policies.baselines``
(``reservation``, ``batch``, ``lcp``); ``ClusterCore`` holds one and steps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.policies.autoscale import ScaleOut
from shared.policies.migration import MigrationPlan
from shared.resources import Resources


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    resources: Resources


# ---- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartRuntime:
    session_id: str
    host_id: str
    bound_gpus: int = 0  # GPUs bound to it from the start (reservation, batch)
    replica: int | None = None  # notebookos: which of the R replicas


@dataclass(frozen=True, slots=True)
class StopRuntime:
    session_id: str
    host_id: str
    replica: int | None = None


@dataclass(frozen=True, slots=True)
class TakeWarm:
    session_id: str
    host_id: str


@dataclass(frozen=True, slots=True)
class ReturnWarm:
    session_id: str
    host_id: str


@dataclass(frozen=True, slots=True)
class RunCell:
    session_id: str
    cell_id: str
    host_id: str
    gpus: int  # bind these before executing (already bound under reservation)


@dataclass(frozen=True, slots=True)
class Queued:
    session_id: str
    cell_id: str | None  # None: the session start itself waits
    reason: str


@dataclass(frozen=True, slots=True)
class Migrate:
    session_id: str
    plan: MigrationPlan


@dataclass(frozen=True, slots=True)
class Held:
    """No replica of the session's kernel can run the cell now: the core retries it (a
    migration) on its retry schedule until the deadline, as live (``ClusterCore.migration_failed``)."""

    session_id: str
    cell_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class WakeHeld:
    """A host reserved for this held cell registered: look at it now (not at its next retry)."""

    session_id: str
    cell_id: str


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The session's kernel could not be placed and no host is coming for it (or they did not
    come within ``autoscale.scale_out_timeout_s``): its start fails, as live, and so do its cells."""

    session_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Rejected:
    session_id: str
    cell_id: str | None
    reason: str


Action = (
    StartRuntime
    | StopRuntime
    | TakeWarm
    | ReturnWarm
    | RunCell
    | Queued
    | Migrate
    | Held
    | WakeHeld
    | StartFailed
    | Rejected
    | ScaleOut
)


class SessionPolicy(Protocol):
    name: str

    def add_host(self, host_id: str, gpus: int) -> list[Action]: ...

    def remove_host(self, host_id: str) -> None: ...

    def on_session_start(self, session: Session) -> list[Action]: ...

    def on_cell_submit(self, session_id: str, cell_id: str) -> list[Action]: ...

    def on_cell_end(self, session_id: str, cell_id: str) -> list[Action]: ...

    def on_session_end(self, session_id: str) -> list[Action]: ...
