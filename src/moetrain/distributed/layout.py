"""The parallel layout: validated degrees, one rank grid, named process groups passed explicitly.

Two views of the same ranks (Megatron "MoE parallel folding", Liu et al. 2025, arXiv 2504.14960):
- the attention grid ``[pp, dp, cp, tp]`` (tp fastest, so a TP group sits on neighbouring ranks,
  i.e. inside one node) used by attention, dense FFNs, norms and embeddings;
- the expert grid: the ``dp·cp·tp`` ranks of one pipeline stage regrouped as ``[edp, ep, etp]``
  used by the routed experts.
Groups are built from these grids with numpy reshapes (nanotron's ``ParallelContext`` idea), so the
whole topology is a few lines to read and is tested without any process group (``rank_groups``).

Nothing here is global: a ``ParallelDims`` is built once per process and handed to every function
that needs a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import UserError

if TYPE_CHECKING:
    import torch.distributed as dist

AXES = ("world", "stage", "pp", "dp", "cp", "tp", "ep", "etp", "edp", "dp_cp", "embed", "ep_intra", "ep_inter")
"""Named groups: attention axes, expert axes, the replicas of a dense parameter (``dp_cp``), and the
first/last stage pair that share the embedding when multi-token prediction needs it on the last stage."""


def validate_layout(parallel: ParallelConfig, model: ModelConfig, world_size: int,
                    global_batch: int | None = None, micro_batch: int | None = None,
                    ranks_per_node: int | None = None) -> None:
    """Refuse a layout that does not divide the model or the world, before any process starts."""
    if parallel.world_size != world_size:
        raise UserError(
            f"tp·cp·pp·dp = {parallel.tp}·{parallel.cp}·{parallel.pp}·{parallel.dp} = {parallel.world_size} "
            f"but the world has {world_size} processes; make --nproc equal their product"
        )
    chunks = parallel.pp * parallel.vpp
    if model.num_layers < chunks:
        raise UserError(
            f"{model.num_layers} layers cannot fill pp·vpp = {chunks} pipeline chunks of at least one layer; "
            "pick pp·vpp no larger than the layer count"
        )
    if parallel.etp > 1:
        if model.moe is None:
            raise UserError(f"etp={parallel.etp} needs a model with MoE layers; {model.name} is dense")
        if model.moe.expert_ffn_hidden % parallel.etp:
            raise UserError(
                f"expert FFN width {model.moe.expert_ffn_hidden} does not divide by etp={parallel.etp}; "
                "pick etp dividing it"
            )
        if parallel.a2a == "hierarchical" and parallel.ep > 1:
            raise UserError("hierarchical all-to-all does not run with expert tensor parallelism (etp > 1); "
                            "use the flat all-to-all or --etp 1")
    if parallel.tp > 1:
        heads = model.attention.num_heads
        if heads % parallel.tp:
            raise UserError(f"{heads} attention heads do not divide by tp={parallel.tp}; pick tp dividing them")
        kv_heads = getattr(model.attention, "num_kv_heads", heads)
        if kv_heads % parallel.tp:
            raise UserError(f"{kv_heads} kv heads do not divide by tp={parallel.tp}; pick tp dividing them")
    if parallel.ep > 1:
        if model.moe is None:
            raise UserError(f"ep={parallel.ep} needs a model with MoE layers; {model.name} is dense")
        if model.moe.num_experts % parallel.ep:
            raise UserError(
                f"{model.moe.num_experts} experts do not divide by ep={parallel.ep}; pick ep dividing them"
            )
    if parallel.a2a == "hierarchical" and parallel.ep > 1:
        if ranks_per_node is None:
            raise UserError("hierarchical all-to-all needs the node size (--ranks-per-node or the cluster preset)")
        # An EP group is ep consecutive stage ranks (etp = 1, tp innermost in the attention grid).
        if parallel.ep % ranks_per_node and ranks_per_node % parallel.ep:
            raise UserError(
                f"ep={parallel.ep} and ranks_per_node={ranks_per_node}: an EP group must fill whole nodes "
                "(ep a multiple of the node size) or sit inside one"
            )
    if global_batch is not None and micro_batch is not None:
        per_replica = parallel.dp * micro_batch  # the cp ranks of a replica share its sequences
        if global_batch % (parallel.dp * micro_batch):
            raise UserError(
                f"global batch {global_batch} does not split into dp={parallel.dp} replicas of micro-batches "
                f"of {micro_batch}; make it a multiple of dp·micro_batch = {per_replica}"
            )
        num_micro = global_batch // (parallel.dp * micro_batch)
        if parallel.pp > 1 and parallel.vpp > 1 and num_micro % parallel.pp:
            raise UserError(
                f"interleaved 1F1B needs the micro-batches per replica ({num_micro}) to be a multiple of "
                f"pp={parallel.pp}"
            )


def layers_per_chunk(num_layers: int, pp: int, vpp: int, num_mtp_layers: int = 0) -> list[int]:
    """Decoder layers of each global pipeline chunk (0..pp·vpp-1; rank r holds chunks r, r+pp, ...).

    When pp·vpp divides the layers, every chunk gets the same count. Otherwise (Pangu's 61 layers) the
    ``L mod pp·vpp`` extra layers go, one at a time, to the pipeline rank with the least work so far,
    counting the multi-token-prediction modules (one layer each) and the output head (about one more)
    on the last rank, and inside that rank to a chunk that is neither the first nor the last of the
    model: the split that evens the ranks' work at whole-layer granularity, as the planner prices it."""
    chunks = pp * vpp
    counts = [num_layers // chunks] * chunks
    if pp == 1:  # one rank: where the extra layers go changes no rank's work
        for i in range(num_layers % chunks):
            counts[i] += 1
        return counts
    load = [float(sum(counts[r::pp])) for r in range(pp)]
    load[-1] += num_mtp_layers + 1.0  # MTP modules and the output head
    for _ in range(num_layers % chunks):
        rank = min(range(pp), key=lambda r: (load[r], abs(r - (pp - 1) / 2)))
        held = [c for c in range(rank, chunks, pp)]
        inner = [c for c in held if 0 < c < chunks - 1] or held
        chunk = min(inner, key=lambda c: (counts[c], c))
        counts[chunk] += 1
        load[rank] += 1.0
    return counts


def rank_groups(parallel: ParallelConfig, ranks_per_node: int | None = None,
                rank_offset: int = 0) -> dict[str, list[list[int]]]:
    """Every group of every named axis, as lists of global ranks (no torch needed).

    With ``ranks_per_node`` each EP group is also cut into ``ep_intra`` groups (its ranks on one node)
    and ``ep_inter`` groups (one rank per node, same position in the node): the two hops of the
    hierarchical all-to-all. ``rank_offset`` places the layout on ranks ``offset..offset+world-1`` of a
    larger process group (tests run several small layouts side by side in one world)."""
    pp, dp, cp, tp = parallel.pp, parallel.dp, parallel.cp, parallel.tp
    grid = rank_offset + np.arange(parallel.world_size).reshape(pp, dp, cp, tp)

    def along(axis_positions: tuple[int, ...], array: np.ndarray) -> list[list[int]]:
        # Move the group axes last, flatten them, every remaining index is one group.
        others = [a for a in range(array.ndim) if a not in axis_positions]
        moved = array.transpose(*others, *axis_positions)
        size = int(np.prod([array.shape[a] for a in axis_positions]))
        return [row.tolist() for row in moved.reshape(-1, size)]

    groups = {
        "world": [grid.reshape(-1).tolist()],
        "pp": along((0,), grid),
        "dp": along((1,), grid),
        "cp": along((2,), grid),
        "tp": along((3,), grid),
        "dp_cp": along((1, 2), grid),
        "stage": along((1, 2, 3), grid),
    }
    # Expert grid: one stage's dp·cp·tp ranks regrouped [edp, ep, etp].
    expert = grid.reshape(pp, parallel.edp, parallel.ep, parallel.etp)
    groups["ep"] = along((2,), expert)
    groups["etp"] = along((3,), expert)
    groups["edp"] = along((1,), expert)
    if parallel.etp > 1:
        # EP × ETP ranks of one EDP position, ETP fastest: one count exchange serves both dispatches
        groups["ep_etp"] = along((2, 3), expert)
    # The first and last pipeline stage ranks with the same in-stage position share the embedding.
    groups["embed"] = [sorted({int(a), int(b)}) for a, b in zip(grid[0].reshape(-1), grid[-1].reshape(-1))]
    # Ranks of the middle stages (pp > 2) hold no embedding: a group of their own keeps "embed" defined.
    groups["embed"] += [[int(r)] for r in grid[1:-1].reshape(-1)]
    if ranks_per_node is not None:
        local = min(ranks_per_node, parallel.ep)
        ep_grid = np.array(groups["ep"]).reshape(-1, parallel.ep // local, local)  # [group, node, local]
        groups["ep_intra"] = along((2,), ep_grid)
        groups["ep_inter"] = along((1,), ep_grid)
    return groups


@dataclass
class ParallelDims:
    """This process's place in the layout and its process groups (built once, passed explicitly)."""

    parallel: ParallelConfig
    rank: int
    ranks_per_node: int | None = None
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, parallel: ParallelConfig, rank: int, ranks_per_node: int | None = None,
              rank_offset: int = 0) -> ParallelDims:
        """Create every group of every axis. Every process of the default group must call this, in the
        same order, members of the layout or not (``torch.distributed.new_group``'s contract)."""
        # lazy, torch: the layout's arithmetic stays torch-free for the run checks (train.checks)
        from moetrain.distributed.world import new_group

        dims = cls(parallel, rank, ranks_per_node)
        for axis, all_groups in rank_groups(parallel, ranks_per_node, rank_offset).items():
            for ranks in all_groups:
                group = new_group(ranks)
                if rank in ranks:
                    dims.groups[axis] = group
                    dims.group_ranks[axis] = ranks
        return dims

    @property
    def is_member(self) -> bool:
        return "world" in self.groups

    def get_group(self, axis: str) -> dist.ProcessGroup:
        if axis not in self.groups:
            raise KeyError(f"no process group for axis {axis!r}; known: {sorted(self.groups)}")
        return self.groups[axis]

    def local_rank(self, axis: str) -> int:
        """Position of this rank inside its group of ``axis``."""
        return self.group_ranks[axis].index(self.rank)

    def size(self, axis: str) -> int:
        return len(self.group_ranks[axis])

    @property
    def pp_rank(self) -> int:
        return self.local_rank("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1
