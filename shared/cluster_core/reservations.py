"""Hosts that registered with replica slots reserved for kernels still waiting to be placed
(NotebookOS §3.4.2: "resources are immediately reserved for the paused kernel replicas on newly
provisioned servers"): until those kernels are placed, other placements see each such host as
already subscribed by them, so a kernel that did not ask for it cannot take the room first.

One per ``ClusterCore``; the live autoscaling shell and the replicated-kernel plug-in (the
simulator) place through ``place``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shared.policies.kernel_placement import KernelPlacement
from shared.policies.placement import HostView, PlacementDecision, PlacementRequest
from shared.policies.placement_index import PlacementIndex
from shared.resources import Resources


class ArrivedReservations:
    def __init__(self) -> None:
        self._on: dict[str, list[tuple[str, Resources]]] = {}  # registered host -> reservations

    def __contains__(self, host_id: object) -> bool:
        return host_id in self._on

    def arrived(self, host_id: str, reservations: Sequence[tuple[str, Resources]]) -> None:
        """``host_id`` registered carrying these (kernel_id, resources) reservations."""
        if reservations:
            self._on[host_id] = list(reservations)

    def done(self, kernel_id: str) -> None:
        """``kernel_id`` no longer waits (placed, failed, shut down): its reservations go."""
        for host_id in list(self._on):
            kept = [(k, r) for k, r in self._on[host_id] if k != kernel_id]
            if kept:
                self._on[host_id] = kept
            else:
                del self._on[host_id]

    def views_for(self, kernel_id: str, views: Sequence[HostView]) -> list[HostView]:
        """The views as ``kernel_id`` sees them: other kernels' reservations count as subscribed."""
        if not self._on:
            return list(views)
        out = []
        for view in views:
            for k, resources in self._on.get(view.host_id, ()):
                if k != kernel_id:
                    view = replace(
                        view,
                        subscribed_gpus=view.subscribed_gpus + resources.gpus,
                        subscribed=view.subscribed + resources,
                    )
            out.append(view)
        return out

    def place(
        self,
        placement: KernelPlacement,
        index: PlacementIndex,
        request: PlacementRequest,
        *,
        can_add_hosts: bool,
    ) -> PlacementDecision:
        """One placement decision with other kernels' arrived reservations overlaid."""
        if not self._on:
            return placement.place(index, request, can_add_hosts=can_add_hosts)
        reserved = [v for host_id in self._on if (v := index.get(host_id)) is not None]
        with index.overlaid(self.views_for(request.kernel_id, reserved)):
            return placement.place(index, request, can_add_hosts=can_add_hosts)
