"""Where an RL run's groups land on several nodes, checked before any node starts (``moetrain rl --nnodes``).

The groups take consecutive global ranks: disaggregated, the rollout replicas first (replica ``i`` on ranks
``i·G .. i·G + G − 1``), then the trainer group, then the reward and reference workers (``moetrain.rl.roles``);
colocated, the trainer's layout on every rank and ``ranks / gen_ep`` generation replicas of ``gen_ep``
consecutive ranks (``moetrain.rl.fusion``). The rule they are held to is ``moetrain.config.nodes``'s, which
``moetrain plan --rl`` applies to the jobs it plans.

Torch-free: the CLI checks it before launching.
"""

from __future__ import annotations

from moetrain.config.nodes import RankGroups, placement_problems
from moetrain.rl.spec import RLRunSpec


def rank_groups(spec: RLRunSpec) -> RankGroups:
    """The replicas and the trainer group of ``spec`` on its global ranks."""
    tp = spec.trainer.parallel.tp
    if spec.disaggregated:
        roles = spec.roles
        return RankGroups(roles.replicas, roles.ranks_per_replica, roles.first_trainer, roles.trainer_ranks, tp)
    gen_ep = spec.rollout.ranks_per_replica or 1
    world = spec.trainer.world_size
    return RankGroups(world // gen_ep, gen_ep, 0, world, tp, "generation replica")


def node_problems(spec: RLRunSpec, ranks_per_node: int) -> list[str]:
    """Why ``spec``'s groups sit badly on nodes of ``ranks_per_node`` ranks (empty: they place well)."""
    return placement_problems(rank_groups(spec), ranks_per_node)
