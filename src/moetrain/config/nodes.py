"""Groups of consecutive ranks on nodes: the one statement of where a run's groups may sit across nodes, read
by ``moetrain rl --nnodes`` before it launches (``moetrain.rl.node_placement``) and by ``moetrain plan --rl``
when it says whether a planned job runs (``moetrain.planner.rl_search``).

torchrun gives each node a block of consecutive global ranks, ``ranks_per_node`` of them, so a group of
consecutive ranks stays on one node exactly when it does not cross a multiple of ``ranks_per_node``. The
groups whose ranks talk every token (a generation replica's EP ranks, which exchange every decode step's
tokens; the trainer's TP group, tp innermost in its rank grid) must sit inside one node when they fit there,
and fill whole nodes when they do not.
"""

from __future__ import annotations

from dataclasses import dataclass


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node that holds global rank ``rank``."""
    return rank // ranks_per_node


def crossing(group: range, ranks_per_node: int) -> bool:
    """Whether a group of consecutive ranks sits badly on nodes of ``ranks_per_node``: it fits in one node but
    spans two, or it is larger than a node and does not fill whole nodes."""
    if len(group) <= ranks_per_node:
        return node_of(group[0], ranks_per_node) != node_of(group[-1], ranks_per_node)
    return group[0] % ranks_per_node != 0 or len(group) % ranks_per_node != 0


@dataclass(frozen=True)
class RankGroups:
    """An RL run's groups on its global ranks: ``replicas`` generation replicas of ``replica_ranks``
    consecutive ranks from rank 0, and a trainer group of ``trainer_ranks`` from ``trainer_first`` in TP
    groups of ``tp`` consecutive ranks."""

    replicas: int
    replica_ranks: int
    trainer_first: int
    trainer_ranks: int
    tp: int = 1
    replica_kind: str = "rollout replica"
    """How a message names a replica (disaggregated: rollout replica; colocated: generation replica)."""


def _groups(first: int, size: int, count: int) -> list[range]:
    return [range(first + i * size, first + (i + 1) * size) for i in range(count)]


def placement_problems(groups: RankGroups, ranks_per_node: int) -> list[str]:
    """Why ``groups`` sit badly on nodes of ``ranks_per_node`` ranks: one sentence each (the first replica and
    the first TP group that do), naming the mend; empty when every one is inside a node or fills whole nodes."""
    problems = []
    for i, group in enumerate(_groups(0, groups.replica_ranks, groups.replicas)):
        if crossing(group, ranks_per_node):
            problems.append(f"{groups.replica_kind} {i} (ranks {group[0]}–{group[-1]}) would span nodes of "
                            f"{ranks_per_node} ranks: {_mend(len(group), ranks_per_node)}")
            break
    tp = groups.tp
    for group in _groups(groups.trainer_first, tp, groups.trainer_ranks // tp) if tp > 1 else ():
        if crossing(group, ranks_per_node):
            problems.append(f"the trainer's tp {tp} group of ranks {group[0]}–{group[-1]} would span nodes of "
                            f"{ranks_per_node} ranks: {_mend(tp, ranks_per_node)}, and start the trainer group on "
                            f"a node (its first rank {groups.trainer_first} a multiple of the ranks per node)")
            break
    return problems


def _mend(size: int, ranks_per_node: int) -> str:
    if size <= ranks_per_node:
        return f"give each node (--nproc) a multiple of the group's {size} ranks"
    return f"a group larger than a node fills whole nodes: give it a multiple of the {ranks_per_node} ranks per node"
