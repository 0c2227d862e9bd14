"""A lower bound on the max/mean rank load that any placement of a forecast can reach (issue #43).

Printed beside each decision, it says whether a "keep" is optimal (the current placement is at the
bound) or stuck (above it, and no candidate the solver offered got closer).

For loads ``l_e`` over ``R`` ranks of ``S`` slots, ``spare = R·S − E`` slots may hold extra replicas. Every
placement has max/mean at least each of:

* **mean**: 1 (the busiest rank carries at least the mean);
* **replica**: ``min_c max_e l_e / c_e / mean`` over replica counts ``1 <= c_e <= R`` with
  ``Σ (c_e − 1) <= spare``. Some replica of expert e serves at least ``1/c_e`` of its tokens, whatever the
  shares, and a rank holds an expert at most once. The minimum is reached by giving each extra replica to
  the expert whose per-replica load is then largest (greedy apportionment: the least maximum for every
  budget), so it is exact for this relaxation, not an estimate;
* **slot** (``spare == 0`` only): every slot then holds one whole expert, so the rank that holds the
  heaviest expert also holds ``S − 1`` others, at least the ``S − 1`` lightest ones.

Why not the LP relaxation of the exact program (``solver.solve_milp`` with the binary "expert e on rank r"
relaxed to [0, 1])? It lets every expert sit 1/R on every rank (``E/R <= S`` slots each), so its optimum is
the mean: weaker than the replica part above, which is already exact for fractional shares with integer
replica counts. A tighter bound would need the integer program itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrain.errors import UserError


@dataclass(frozen=True)
class ImbalanceBound:
    """Lower bounds on the forecast max/mean rank load of every placement with the given slots."""

    replica: float
    """The largest expert's per-replica load over the mean, with the spare slots given as replicas where
    they lower it most."""
    slot: float
    """With no spare slot: the heaviest expert and the ``S − 1`` lightest others on one rank, over the
    mean (0 where spare slots exist)."""
    replicas_allowed: int
    """Replicas the replica part gave the expert that decides it."""

    @property
    def value(self) -> float:
        return max(1.0, self.replica, self.slot)

    @property
    def kind(self) -> str:
        """Which part decides: ``mean``, ``replica`` or ``slot``."""
        if self.value == self.slot and self.slot > 1.0:
            return "slot"
        return "replica" if self.replica > 1.0 else "mean"


def imbalance_bound(loads: np.ndarray, num_ranks: int, slots_per_rank: int) -> ImbalanceBound:
    """The bound of the module docstring for loads [E] on ``num_ranks`` ranks of ``slots_per_rank`` slots."""
    loads = np.maximum(np.asarray(loads, dtype=float), 0.0)
    num_experts = loads.size
    spare = num_ranks * slots_per_rank - num_experts
    if spare < 0 or num_ranks < 1:
        raise UserError(f"{num_ranks} ranks × {slots_per_rank} slots cannot hold {num_experts} experts")
    mean = loads.sum() / num_ranks
    if mean <= 0.0:
        return ImbalanceBound(replica=1.0, slot=0.0, replicas_allowed=1)
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(spare):
        per_replica = np.where(counts < num_ranks, loads / counts, -1.0)
        hottest = int(np.argmax(per_replica))
        if per_replica[hottest] <= 0.0:
            break
        counts[hottest] += 1
    per_replica = loads / counts
    decides = int(np.argmax(per_replica))
    slot = 0.0
    if spare == 0 and slots_per_rank > 1:
        heaviest = int(np.argmax(loads))
        others = np.sort(np.delete(loads, heaviest))
        slot = float((loads[heaviest] + others[: slots_per_rank - 1].sum()) / mean)
    return ImbalanceBound(replica=float(per_replica[decides] / mean), slot=slot,
                          replicas_allowed=int(counts[decides]))
