"""The global scheduler's autoscaling shell (NotebookOS §3.4.2) around the pure ``Autoscaler``.

Two paths, both carried out through a ``HostProvider``:

* a kernel start whose placement fails asks ``Autoscaler.on_placement_failed``; on ScaleOut the
  provider starts hosts, the kernel's replica slots stay *reserved* on them (other kernels see
  those hosts as already subscribed), and the start resumes when they register instead of failing;
* a periodic ``evaluate`` over the live hosts: provisioned GPUs below f·ΣC plus the scaling buffer
  adds hosts; surplus releases up to ``autoscale.max_release`` idle hosts that the provider started,
  never going below ``cluster.hosts``. Idle (NotebookOS: no *active* replica) means nothing
  committed, no reservation, and no replica of a kernel that is starting or stopping, has a
  request in flight or held for a migration, or has a replica being started (a move under way),
  for ``autoscale.scale_in_idle_s``. An idle host may still hold standby replicas: the release
  cordons it, moves each of them to another host through the drain that ``tandem host drain``
  runs (``Migrator.drain``, a Raft membership change per replica), then asks the provider to stop
  it. A replica that no host can take abandons that release: the host is uncordoned and a
  ``scale_in_failed`` event says why (replicas already moved stay where they went); that host
  must then stay idle twice as long before it is tried again, and so on
  (``shared.policies.autoscale.scale_in_idle_wanted``).

Every decision is kept as a scale event for ``tandem status --json`` and the metrics; a scale-in's
event lists the migrations it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import structlog

from services.global_scheduler.cluster_state import ClusterState
from services.host_provider import HostProvider
from shared.cluster_core.core import ClusterCore, CoreConfig
from shared.cluster_core.held import held_key
from shared.cluster_core.idle import HostFacts, KernelFacts, replicas_and_active_hosts
from shared.cluster_core.starts import kernel_facts
from shared.config import Config
from shared.policies.autoscale import HostLoad, ScaleIn, ScaleOut
from shared.policies.kernel_placement import KernelPlacement
from shared.policies.placement import HostView, PlacementDecision, PlacementRequest
from shared.policies.placement_index import PlacementIndex

log = structlog.get_logger("autoscaling")

# Moves every replica off a cordoned host: ``{"moved": [...], "failed": [...], "replicas_left": n}``.
DrainHost = Callable[[str], Awaitable[dict[str, Any]]]


class ClusterAutoscaler:
    def __init__(
        self,
        cfg: Config,
        state: ClusterState,
        provider: HostProvider,
        *,
        core: ClusterCore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # the scheduler's cluster core: autoscaler, idle judgement (shared with the simulator)
        self.core = core if core is not None else ClusterCore(CoreConfig.from_config(cfg))
        self.config = self.core.config.autoscale
        self.policy = self.core.autoscaler
        self.state = state
        self.provider = provider
        self.enabled = provider.can_provision and self.config.max_hosts > self.config.min_hosts
        self._clock = clock
        self._interval = float(cfg.get("autoscale.interval_s"))
        self.events: deque[dict[str, Any]] = deque(maxlen=int(cfg.get("autoscale.events_kept")))
        self.scale_outs = 0  # hosts asked for
        self.scale_ins = 0  # hosts released
        self._expected: set[str] = set()  # asked of the provider, not registered yet
        self._waiters: dict[str, asyncio.Event] = {}  # kernel id -> set when its reserved hosts arrive
        self._abandoned: set[str] = set()  # kernels shut down while waiting for hosts
        self._releasing: set[str] = set()
        self._seen_min_hosts = False
        self._drain: DrainHost | None = None  # without one, only hosts holding no replica are released
        self.core.idle.can_drain = False
        self._release_round: asyncio.Future[Any] | None = None

    def attach_drain(self, drain: DrainHost) -> None:
        """The scheduler's migrator moves a released host's replicas (the ``tandem host drain`` path)."""
        self._drain = drain
        self.core.idle.can_drain = True

    def attach_provider(self, provider: HostProvider) -> None:
        """The provider needs the scheduler's bound address, known only once it runs."""
        self.provider = provider
        self.enabled = provider.can_provision and self.config.max_hosts > self.config.min_hosts
        log.info(
            "autoscaling",
            enabled=self.enabled,
            min_hosts=self.config.min_hosts,
            max_hosts=self.config.max_hosts,
            provider=type(provider).__name__,
        )

    # ---- placement with scale-out -----------------------------------------------------------

    def views_for(self, kernel_id: str, views: Sequence[HostView]) -> list[HostView]:
        """Hosts that arrived with another kernel's reservations look already subscribed by it."""
        return self.core.arrived.views_for(kernel_id, views)

    def _place_once(
        self, placement: KernelPlacement, request: PlacementRequest, index: PlacementIndex
    ) -> PlacementDecision:
        """One decision of the shared policy, with other kernels' reserved hosts overlaid."""
        # without room for a host, the watermark alone rules (KernelPlacement)
        can_add_hosts = self.core.can_add_hosts(self.live_hosts(), enabled=self.enabled)
        return self.core.arrived.place(placement, index, request, can_add_hosts=can_add_hosts)

    async def place(
        self, placement: KernelPlacement, request: PlacementRequest, index: Callable[[], PlacementIndex]
    ) -> tuple[PlacementDecision, str]:
        """Place ``request``, adding hosts when it cannot fit; ``(decision, why)``, ``why`` saying
        what the autoscaler did or why it could not help when the decision failed."""
        decision = self._place_once(placement, request, index())
        if decision.ok or not self.enabled:
            return decision, ""
        kernel_id = request.kernel_id
        deadline = self.core.start_deadline(self._clock())
        self._waiters.setdefault(kernel_id, asyncio.Event())  # from now on ``abandon`` can reach it
        try:
            while not decision.ok:
                outcome = self.core.start_unplaced(request, decision, self.live_hosts())
                why = outcome.reason
                if isinstance(outcome, ScaleOut):
                    await self._scale_out(outcome.count, outcome.reason, kernel_id=kernel_id)
                if not self.core.start_waits(kernel_id):
                    if isinstance(outcome, ScaleOut):
                        why = f"the hosts added for {kernel_id} did not come: {why}"
                    return decision, why  # nothing is coming for this kernel
                log.info("placement_waits_for_hosts", kernel=kernel_id, reason=why)
                if not await self._reserved_hosts_arrived(kernel_id, deadline):
                    timeout = self.core.config.scale_out_timeout_s
                    why = f"new hosts did not register within {timeout:g}s ({why})"
                    return self._place_once(placement, request, index()), why
                if kernel_id in self._abandoned:
                    return PlacementDecision((), decision.rejected), "the kernel was shut down while waiting"
                decision = self._place_once(placement, request, index())
            return decision, ""
        finally:
            self._done_waiting(kernel_id)

    async def _reserved_hosts_arrived(self, kernel_id: str, deadline: float) -> bool:
        """Wait until every host reserved for ``kernel_id`` registered (or was given up: a failed
        scale-out drops reservations); False when ``deadline`` passes first."""
        waiter = self._waiters.setdefault(kernel_id, asyncio.Event())
        while self.core.start_waits(kernel_id) and kernel_id not in self._abandoned:
            try:
                await asyncio.wait_for(waiter.wait(), max(deadline - self._clock(), 0.0))
            except TimeoutError:
                return False
            waiter.clear()
        return True

    def abandon(self, kernel_id: str) -> None:
        """``kernel_id`` was shut down before it was placed: its start stops waiting for hosts."""
        if kernel_id in self._waiters:
            self._abandoned.add(kernel_id)
            self._waiters[kernel_id].set()

    def _done_waiting(self, kernel_id: str) -> None:
        self.policy.cancel(kernel_id)
        self._waiters.pop(kernel_id, None)
        self._abandoned.discard(kernel_id)
        self.core.arrived.done(kernel_id)

    # ---- a held cell's host (the core's rule: shared.cluster_core.held) ----------------------

    async def scale_out_for_held(self, kernel_id: str, outcome: ScaleOut) -> None:
        """Ask the provider for the host the core reserved for ``kernel_id``'s held cell."""
        self._waiters.setdefault(held_key(kernel_id), asyncio.Event())
        await self._scale_out(outcome.count, outcome.reason, kernel_id=held_key(kernel_id))

    async def wait_for_held_host(self, kernel_id: str, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or less if a host reserved for the held cell registers (or
        its scale-out fails) meanwhile: the held cell is looked at again either way."""
        waiter = self._waiters.setdefault(held_key(kernel_id), asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout)
        waiter.clear()

    def held_over(self, kernel_id: str) -> None:
        """The kernel's held cell no longer waits: free the host reserved for it, in the core too."""
        self.core.held_over(kernel_id)
        self._done_waiting(held_key(kernel_id))

    def live_hosts(self) -> int:
        return sum(1 for h in self.state.hosts.values() if h.alive and h.host_id not in self._releasing)

    async def _scale_out(self, count: int, reason: str, *, kernel_id: str | None = None) -> None:
        self.scale_outs += count
        try:
            host_ids = await self.provider.provision(count)
        except Exception as exc:
            lost = self.core.scale_out_failed(count, str(exc))
            self._event("scale_out_failed", [], f"{reason}: provider failed: {exc}", kernel=kernel_id)
            log.error("scale_out_failed", count=count, reason=str(exc), kernels=list(lost))
            self._wake(lost)
            return
        self._expected.update(host_ids)
        self._event("scale_out", host_ids, reason, kernel=kernel_id)
        log.info("scale_out", hosts=host_ids, reason=reason, kernel=kernel_id)

    def _wake(self, kernel_ids: Sequence[str]) -> None:
        for kernel_id in kernel_ids:
            waiter = self._waiters.get(kernel_id)
            if waiter is not None:
                waiter.set()

    # ---- host events ------------------------------------------------------------------------

    def on_host_registered(self, host_id: str) -> None:
        """A host registered: if it is one we asked for, its reservations can now be placed."""
        if host_id not in self._expected:
            return
        self._expected.discard(host_id)
        reservations = self.policy.on_host_registered(host_id)
        self.core.arrived.arrived(host_id, reservations)
        self._event("host_added", [host_id], f"registered; reserved for {[k for k, _ in reservations]}")
        self._wake(list(dict.fromkeys(k for k, _ in reservations)))

    def on_host_exited(self, host_id: str, returncode: int) -> None:
        """A provisioned host's process ended on its own; before registering, its scale-out failed."""
        if host_id in self._expected:
            self._expected.discard(host_id)
            lost = self.core.scale_out_failed(1, f"host process exited with {returncode} before registering")
            self._event(
                "scale_out_failed", [host_id], f"host process exited with {returncode} before registering"
            )
            self._wake(lost)

    # ---- periodic check ---------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval)
                try:
                    await self.evaluate_once()
                except Exception:
                    log.exception("autoscale_check_failed")
        finally:
            if self._release_round is not None and not self._release_round.done():
                self._release_round.cancel()  # the scheduler stops: a drain under way ends with it
                await asyncio.gather(self._release_round, return_exceptions=True)

    def _kernel_facts(self) -> Iterator[KernelFacts]:
        """Each kernel's placed replicas' hosts and whether it is busy (the core's rule)."""
        for kernel in self.state.kernels.values():
            placed = [r for r in kernel.replicas.values() if r.alive or not r.started]
            yield kernel_facts(
                [r.host_id for r in placed],
                kernel_state=kernel.state,
                cell_in_flight=bool(kernel.router.merger.pending_ids()),
                held=kernel.held is not None,
                replica_starting=any(not r.started for r in placed),
            )

    def host_facts(self) -> list[HostFacts]:
        """What the core's idle judgement needs of each live host not being released."""
        replicas, active = replicas_and_active_hosts(self._kernel_facts())
        facts = []
        for host in self.state.hosts.values():
            if not host.alive or host.host_id in self._releasing:
                continue
            subscribed, _ = self.state.subscribed_on(host.host_id)
            facts.append(
                HostFacts(
                    host.host_id,
                    host.gpus,
                    host.committed_gpus,
                    subscribed,
                    replicas=replicas[host.host_id],
                    active=host.host_id in active,
                    reserved=host.host_id in self.core.arrived,
                    owned=self.provider.owns(host.host_id),
                )
            )
        return facts

    def host_loads(self) -> list[HostLoad]:
        """The hosts' loads as the core judges them now (idle timers advance)."""
        return self.core.idle.loads(self.host_facts(), self._clock())

    async def evaluate_once(self) -> None:
        if not self.enabled:
            return
        facts = self.host_facts()
        if not self._seen_min_hosts:  # the initial hosts are still registering: nothing to judge yet
            self._seen_min_hosts = len(facts) >= self.config.min_hosts
            if not self._seen_min_hosts:
                return
        decision = self.core.tick(self._clock(), facts)
        if isinstance(decision, ScaleOut):
            self.policy.expect_hosts(decision.count)
            await self._scale_out(decision.count, decision.reason)
        elif isinstance(decision, ScaleIn) and not self._releasing:
            # One round of at most max_release hosts at a time, in the background: its drains can
            # take a while, the periodic check goes on meanwhile (hosts being emptied are out of
            # ``loads``, so no other scale-in is judged until the round is over).
            self._releasing.update(decision.host_ids)
            self._release_round = asyncio.ensure_future(
                asyncio.gather(*(self._release(h, decision.reason) for h in decision.host_ids))
            )

    async def _release(self, host_id: str, reason: str) -> None:
        """Cordon, migrate the host's replicas away, stop it; on a failure put the host back."""
        host = self.state.hosts.get(host_id)
        if host is None:
            self._releasing.discard(host_id)
            return
        self._releasing.add(host_id)
        was_cordoned, host.cordoned = host.cordoned, True  # nothing new lands there while it empties
        moved: list[dict[str, str]] = []
        try:
            if self._drain is not None and any(r.alive for _, r in self.state.replicas_on(host_id)):
                log.info("scale_in_draining", host=host_id)
                outcome = await self._drain(host_id)
                moved = list(outcome.get("moved", ()))
                failed = [(f["kernel"], f["replica"], f["reason"]) for f in outcome.get("failed") or ()]
                stuck = self.core.why_not_drained(failed, int(outcome.get("replicas_left") or 0))
                if stuck:
                    raise RuntimeError(stuck)
            await self.provider.release(host_id)
        except Exception as exc:
            failures = self.core.release_failed(host_id)  # idle afresh, and longer, before the next try
            log.error(
                "scale_in_failed",
                host=host_id,
                reason=str(exc),
                migrations=len(moved),
                failures_in_a_row=failures,
                next_try_after_idle_s=self.core.idle.wanted(host_id),
            )
            host.cordoned = was_cordoned
            self._event("scale_in_failed", [host_id], str(exc), migrations=moved)
            return
        finally:
            self._releasing.discard(host_id)
        self.state.hosts.pop(host_id, None)
        self.core.host_released(host_id)
        self.scale_ins += 1
        self._event("scale_in", [host_id], reason, migrations=moved)
        log.info("scale_in", host=host_id, reason=reason, migrations=len(moved))

    # ---- reports ----------------------------------------------------------------------------

    def _event(
        self,
        kind: str,
        hosts: list[str],
        reason: str,
        *,
        kernel: str | None = None,
        migrations: list[dict[str, str]] | None = None,
    ) -> None:
        event: dict[str, Any] = {"at": round(time.time(), 3), "kind": kind, "hosts": hosts, "reason": reason}
        if kernel is not None:
            event["kernel"] = kernel
        if migrations is not None:
            event["migrations"] = migrations  # [{kernel, replica, to}]: the replicas moved off
        self.events.append(event)

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "min_hosts": self.config.min_hosts,
            "max_hosts": self.config.max_hosts,
            "scaling_factor": self.config.scaling_factor,
            "buffer_hosts": self.config.buffer_hosts,
            "pending_hosts": self.policy.pending_hosts,
            "expected_hosts": sorted(self._expected),
            "releasing_hosts": sorted(self._releasing),
            "hosts_added": self.scale_outs,
            "hosts_released": self.scale_ins,
        }
