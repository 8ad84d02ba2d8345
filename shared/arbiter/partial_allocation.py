"""Partial allocation (Themis §3.3.1, Pseudocode 1 lines 5-12; Cole, Gkatzelis, Goel [5]).

Formulation. Each bid is an XOR table of bundles (``shared.arbiter.agent.Bundle``) with a new rho
each. The proportional-fair allocation maximises prod_i 1/rho_i(G_i), i.e. sum_i log(1/rho_i);
since each app gets exactly one row of its table (or nothing, valued rho_old), the objective is
*linear* in one binary per (app, bundle): maximise sum x_ab * (log rho_old_a - log rho_ab) with

* sum_b x_ab <= 1 per app (one row of the XOR table);
* per host h: sum of GPUs of bundles packed on h <= free_h;
* overall: sum of GPUs of all chosen bundles <= free GPUs (bundles "anywhere" then fit in what
  the packed ones leave, because they accept any GPUs).

This is an exact MILP, no linearisation of the log needed; it is solved by HiGHS through
``scipy.optimize.milp`` with a relative gap of 1e-9. c_i = prod_{j != i} 1/rho_j(G_pf) /
prod_{j != i} 1/rho_j(G_pf^{-i}) = exp(sum_{j != i} gain_j(G_pf) - OPT^{-i}), from one more solve
without app i per winner (a loser's c_i does not matter: its share is empty; a winner whose
presence leaves every other bidder its best row has c_i = 1 with no solve). Each winner keeps
round(c_i * |G_i|) GPUs of its bundle, at least one; the rest is the hidden payment, leftover.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from shared.arbiter.agent import Bid, Bundle

_GAP = 1e-9


@dataclass(frozen=True)
class PfSolution:
    """A proportional-fair choice: the bundle each winner gets, and sum of log(rho_old/rho)."""

    choice: dict[str, Bundle]
    objective: float


@dataclass(frozen=True)
class PartialAllocation:
    """PA's result: each winner's PF bundle, its c_i, and how many GPUs of it the winner keeps."""

    pf: PfSolution
    c: dict[str, float]
    kept: dict[str, int]
    solves: int


def _gains(bid: Bid) -> list[tuple[Bundle, float]]:
    return [(b, math.log(bid.rho_old) - math.log(r)) for b, r in bid.table if r > 0 and r < bid.rho_old]


def proportional_fair(bids: Sequence[Bid], free_by_host: Mapping[str, int]) -> PfSolution:
    """argmax sum_i log(1/rho_i(G_i)) over the bids' tables (see the module docstring)."""
    columns: list[tuple[int, Bundle, float]] = []
    for a, bid in enumerate(bids):
        for bundle, gain in _gains(bid):
            if bundle.gpus <= sum(free_by_host.values()) and (
                bundle.host is None or bundle.gpus <= free_by_host.get(bundle.host, 0)
            ):
                columns.append((a, bundle, gain))
    if not columns:
        return PfSolution({}, 0.0)
    hosts = sorted(free_by_host)
    host_row = {h: len(bids) + i for i, h in enumerate(hosts)}
    total_row = len(bids) + len(hosts)
    rows, cols, vals = [], [], []
    for k, (a, bundle, _) in enumerate(columns):
        rows += [a, total_row]
        cols += [k, k]
        vals += [1.0, float(bundle.gpus)]
        if bundle.host is not None:
            rows.append(host_row[bundle.host])
            cols.append(k)
            vals.append(float(bundle.gpus))
    n_rows = total_row + 1
    a_mat = coo_array((vals, (rows, cols)), shape=(n_rows, len(columns))).tocsr()
    upper = np.array(
        [1.0] * len(bids) + [float(free_by_host[h]) for h in hosts] + [float(sum(free_by_host.values()))]
    )
    gains = np.array([g for _, _, g in columns])
    res = milp(
        c=-gains,
        constraints=LinearConstraint(a_mat, -np.inf, upper),
        integrality=np.ones(len(columns)),
        bounds=Bounds(0.0, 1.0),
        options={"mip_rel_gap": _GAP},
    )
    if res.x is None:
        raise RuntimeError(f"HiGHS found no allocation: {res.message}")
    choice = {bids[a].app_id: bundle for k, (a, bundle, _) in enumerate(columns) if res.x[k] > 0.5}
    objective = float(sum(g for k, (_, _, g) in enumerate(columns) if res.x[k] > 0.5))
    return PfSolution(choice, objective)


def partial_allocation(bids: Sequence[Bid], free_by_host: Mapping[str, int]) -> PartialAllocation:
    """Pseudocode 1's AUCTION: the PF allocation, each winner's c_i, and the GPUs it keeps."""
    pf = proportional_fair(bids, free_by_host)
    gain_of = {
        bid.app_id: dict(_gains(bid)).get(pf.choice[bid.app_id], 0.0)
        for bid in bids
        if bid.app_id in pf.choice
    }
    c: dict[str, float] = {}
    kept: dict[str, int] = {}
    solves = 1
    best = {bid.app_id: max((g for _, g in _gains(bid)), default=0.0) for bid in bids}
    for bid in bids:
        if bid.app_id not in pf.choice:
            continue
        with_i = pf.objective - gain_of[bid.app_id]
        bound = sum(g for a, g in best.items() if a != bid.app_id)
        if with_i >= bound - 1e-12:
            # The others already get their best rows with i present: OPT without i cannot beat
            # that upper bound, so c_i = 1 exactly, no solve needed.
            ci = 1.0
        else:
            others = [b for b in bids if b.app_id != bid.app_id]
            without = proportional_fair(others, free_by_host)
            solves += 1
            ci = min(1.0, math.exp(min(0.0, with_i - without.objective)))
        c[bid.app_id] = ci
        n = pf.choice[bid.app_id].gpus
        kept[bid.app_id] = max(1, min(n, math.floor(ci * n + 0.5)))
    return PartialAllocation(pf, c, kept, solves)
