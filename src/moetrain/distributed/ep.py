"""Expert parallelism: dropless token dispatch across ranks, flat or hierarchical.

Legend: T tokens on this rank, K top-k, D hidden, E logical experts, R EP ranks, S expert slots per
rank, P = R·S physical slots, N nodes in the EP group, n EP ranks per node.

Where an expert lives is a table, not arithmetic: ``ExpertTable.slot_of_expert[e]`` is the physical
slot ``rank·S + local_slot`` of logical expert e, built from ``moetrain.balance.ExpertPlacement``.
A hot expert may have replicas on other ranks; ``ExpertTable.physical_slots`` then sends each of its
assignments to one replica by the token's position and the replicas' shares (on the device).
The dispatcher reads the table on every call, so a later step can move experts (and their weights)
and swap the table between steps (``moetrain.distributed.balancing``).

One host read per MoE layer. Right after routing, each rank counts its assignments per physical slot
(and, for the hierarchical path, per destination node) on the device and starts an asynchronous
all-gather of these counts over the EP group. While that runs, the rows are permuted into
destination order. Then the [R, P(+N)] count matrix is read to the host once; every split size of
every exchange of the layer (forward and backward, both hops) is derived from it on the host.

Both paths deliver, on each rank, its tokens in one canonical order: by local slot, then by source
rank, then by token order at the source. So flat and hierarchical dispatch give identical results,
which ``tests/distributed/test_dispatch.py`` checks directly.

Hierarchical (Pangu "Adaptive Pipe", MindSpeed ``--moe-hierarchical-alltoallv``, Tutel 2DH): hop 1
sends each token once per destination node (not once per expert) to the peer with the same position
in that node, with its expert ids and gating weights; hop 2 is an all-to-all inside the node that
expands each token to its experts there. Combine runs the hops backwards and sums each token's
experts of one node at the peer, so the inter-node return traffic is one row per (token, node) too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moetrain.balance.placement import ExpertPlacement
from moetrain.distributed.comm import PendingExchange, all_to_all, all_to_all_start
from moetrain.distributed.host_reads import host_read
from moetrain.distributed.overlap import wait_comm
from moetrain.distributed.trace import record_async, span
from moetrain.models.dispatch import PermuteMeta, in_dtype, permute_by, sum_gathered_rows, unpermute
from moetrain.models.experts import GroupedExperts
from moetrain.models.router import Routing, count_tokens_per_expert
from moetrain.runtime_base.eager_only import eager_only

# Fractional part of t·(√5−1)/2: a low-discrepancy sequence, so any subset of a rank's tokens (those
# routed to one hot expert) splits among the expert's replicas close to their shares.
_GOLDEN_FRACTION = 0.6180339887498949


@dataclass(frozen=True)
class ExpertTable:
    """Logical expert → physical slot(s), on the device the dispatcher runs on.

    A hot expert may have several replicas (on distinct ranks). Each of its assignments goes to one
    replica, chosen by the token's position on its rank: ``u_t = frac(t·0.618…)`` against the
    replicas' cumulative shares, so the split is deterministic and needs no communication; which
    replica computes a token does not change the math as long as replicas hold equal weights (their
    gradients are summed before the optimizer step, ``moetrain.distributed.migration.sum_replica_gradients``).
    """

    slot_of_expert: torch.Tensor
    """int64 [E]: first replica's slot (the whole table when nothing is replicated)."""
    num_ranks: int
    slots_per_rank: int
    experts_by_rank: tuple[tuple[int, ...], ...]
    """Logical expert held in each local slot of each rank (-1 for an empty slot)."""
    replica_slots: torch.Tensor | None = None
    """int64 [E, W] every replica's slot (padded with the last one); None when nothing is replicated."""
    replica_cum_share: torch.Tensor | None = None
    """float64 [E, W] cumulative token shares of the replicas (padded with 1.0)."""

    @classmethod
    def from_placement(cls, placement: ExpertPlacement, device: torch.device | str = "cpu") -> ExpertTable:
        slots = torch.as_tensor(placement.slot_of_logical(), dtype=torch.int64, device=device)
        by_rank = tuple(tuple(int(e) for e in placement.experts_on_rank(r)) for r in range(placement.num_ranks))
        if int(placement.num_replicas().max()) == 1:
            return cls(slots, placement.num_ranks, placement.slots_per_rank, by_rank)
        replica_slots, counts, cum_share = placement.logical_to_physical()
        # pad with the last replica so that a gather never reads -1, even at u rounding to 1.0
        last = replica_slots[np.arange(placement.num_experts), counts - 1]
        replica_slots = np.where(replica_slots < 0, last[:, None], replica_slots)
        return cls(slots, placement.num_ranks, placement.slots_per_rank, by_rank,
                   torch.as_tensor(replica_slots, dtype=torch.int64, device=device),
                   torch.as_tensor(cum_share, dtype=torch.float64, device=device))

    @property
    def num_slots(self) -> int:
        return self.num_ranks * self.slots_per_rank

    def physical_slots(self, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """[T, K] physical slot of each assignment (on the device, no host read)."""
        if self.replica_slots is None or self.replica_cum_share is None:
            return self.slot_of_expert[expert_ids_TK]
        num_tokens = expert_ids_TK.shape[0]
        u_T = torch.frac(torch.arange(num_tokens, device=expert_ids_TK.device, dtype=torch.float64)
                         * _GOLDEN_FRACTION)
        cum_TKW = self.replica_cum_share[expert_ids_TK]
        replica_TK = (u_T.view(-1, 1, 1) >= cum_TKW).sum(-1).clamp_(max=cum_TKW.shape[-1] - 1)
        return self.replica_slots[expert_ids_TK, replica_TK]


def regroup_index(lengths: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Rows stored as consecutive blocks in C order of ``lengths`` (one block per cell); the row index
    that lists them block by block in the C order of ``lengths.transpose(axes)`` (each block's rows
    keep their order)."""
    flat = lengths.reshape(-1)
    starts = (np.cumsum(flat) - flat).reshape(lengths.shape)
    block_starts = starts.transpose(axes).reshape(-1)
    block_lengths = lengths.transpose(axes).reshape(-1)
    new_starts = np.cumsum(block_lengths) - block_lengths
    return np.arange(int(block_lengths.sum()), dtype=np.int64) + np.repeat(block_starts - new_starts, block_lengths)


def inverse_permutation(index: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(index)
    inverse[index] = np.arange(index.size, dtype=index.dtype)
    return inverse


def _start_count_exchange(counts: torch.Tensor, group: dist.ProcessGroup) -> tuple[list[torch.Tensor], dist.Work]:
    parts = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, counts, group=group, async_op=True)
    record_async("counts_allgather", work)
    return parts, work


def _read_counts(parts: list[torch.Tensor], work: dist.Work) -> np.ndarray:
    """Wait for the count exchange and read it to the host: the layer's one device→host read."""
    # A few bytes, started before the permutation: no turn for the other micro-batch here.
    wait_comm(work, "counts_allgather", hand_over=False)
    with span("counts_d2h", "comm"), host_read("expert counts"):
        return torch.stack(parts).cpu().numpy()


def _to_device(index: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(index).to(device, non_blocking=True)


@dataclass(frozen=True)
class PendingDispatch:
    """A dispatch whose last exchange is in flight; ``finish()`` waits for it and returns what
    ``dispatch`` returns (tokens for the local experts, tokens per local slot, metadata for ``combine``)."""

    exchange: PendingExchange
    reorder: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, object]]
    tokens_per_local: torch.Tensor | None = None
    """Tokens per local slot, known before the exchange completes (expert tensor parallelism starts
    exchanging them over its group at once, ``moetrain.distributed.etp``)."""
    member_counts_GS: np.ndarray | None = None
    """With a count exchange over the EP × ETP ranks: tokens per local slot received by each ETP member
    (this rank's included), already on the host, so the ETP gather needs no exchange of its own."""

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def finish(self) -> tuple[torch.Tensor, torch.Tensor, object]:
        return self.reorder(self.exchange.wait())


@dataclass(frozen=True)
class FlatDispatchMeta:
    permute: PermuteMeta
    in_splits: list[int]
    out_splits: list[int]
    to_canonical: torch.Tensor
    from_canonical: torch.Tensor


class AllToAllDispatcher:
    """Flat dropless dispatch: one uneven all-to-all over the EP group each way."""

    def __init__(self, group: dist.ProcessGroup, table: ExpertTable,
                 count_group: dist.ProcessGroup | None = None) -> None:
        """``count_group``: with expert tensor parallelism, the EP × ETP ranks of this rank's EDP position
        (ETP fastest). The per-slot counts are then exchanged over it once, giving both this EP group's
        splits and every ETP member's received counts: one host read per layer for both dispatches."""
        self.group, self.table = group, table
        self.ep_rank = dist.get_rank(group)
        self.count_group = count_group
        # the count group holds every ETP position's copy of this EP group
        self.etp = dist.get_world_size(count_group) // dist.get_world_size(group) if count_group is not None else 1
        self.etp_rank = dist.get_rank(count_group) % self.etp if count_group is not None else 0

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, FlatDispatchMeta]:
        return self.start_dispatch(x_TD, routing).finish()

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def start_dispatch(self, x_TD: torch.Tensor, routing: Routing) -> PendingDispatch:
        table, rank = self.table, self.ep_rank
        num_ranks, slots = table.num_ranks, table.slots_per_rank
        phys_TK = table.physical_slots(routing.expert_ids_TK)
        counts = count_tokens_per_expert(phys_TK, table.num_slots)
        parts, work = _start_count_exchange(counts, self.count_group or self.group)
        with span("permute"):
            rows_PD, permuted = permute_by(x_TD, phys_TK, routing.weights_TK)
        member_counts_GS = None
        if self.count_group is None:
            slot_counts = _read_counts(parts, work).reshape(num_ranks, num_ranks, slots)  # [src, dst, slot]
        else:
            # [src EP rank, src ETP position, dst EP rank, slot]: our EP group is our ETP position's column
            every = _read_counts(parts, work).reshape(num_ranks, self.etp, num_ranks, slots)
            slot_counts = np.ascontiguousarray(every[:, self.etp_rank])
            member_counts_GS = every[:, :, rank].sum(0)  # [ETP member, local slot], received by each
        in_splits = slot_counts[rank].sum(-1).tolist()
        out_splits = slot_counts[:, rank].sum(-1).tolist()
        exchange = all_to_all_start(rows_PD, out_splits, in_splits, self.group, "a2a_dispatch")
        to_canonical = regroup_index(slot_counts[:, rank], (1, 0))  # (src, slot) blocks → (slot, src)
        to_canonical_t = _to_device(to_canonical, x_TD.device)
        from_canonical_t = _to_device(inverse_permutation(to_canonical), x_TD.device)
        tokens_per_local = torch.from_numpy(slot_counts[:, rank].sum(0)).to(x_TD.device)
        meta = FlatDispatchMeta(
            permuted,
            in_splits, out_splits, to_canonical_t, from_canonical_t,
        )
        return PendingDispatch(exchange, lambda received: (received[to_canonical_t], tokens_per_local, meta),
                               tokens_per_local, member_counts_GS)

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def combine(self, y_PD: torch.Tensor, meta: FlatDispatchMeta) -> torch.Tensor:
        returned = all_to_all(y_PD[meta.from_canonical], meta.in_splits, meta.out_splits, self.group, "a2a_combine")
        with span("unpermute"):
            return unpermute(returned, meta.permute)


@dataclass(frozen=True)
class HierarchicalDispatchMeta:
    token_index: torch.Tensor
    """Source token of each hop-1 row sent (one per token and destination node)."""
    row_of_token_node: torch.Tensor
    """[T, N]: the hop-1 row sent for (token, node), or the row count where the token skips the node."""
    inter_in: list[int]
    inter_out: list[int]
    expand_row: torch.Tensor
    """At the peer: the hop-1 row each expanded (token, expert) row came from."""
    expand_weights: torch.Tensor
    row_of_assignment: torch.Tensor
    """At the peer, [received hop-1 rows, K]: the expanded row of each assignment a hop-1 row carries,
    or the expanded row count where the assignment is for another node."""
    intra_in: list[int]
    intra_out: list[int]
    to_canonical: torch.Tensor
    from_canonical: torch.Tensor


def _row_at(positions: torch.Tensor, num_positions: int) -> torch.Tensor:
    """The inverse of ``positions`` (row r sits at position ``positions[r]``) over ``num_positions``
    positions: the row at each, or ``len(positions)`` (the zero row after the rows) where
    no row is."""
    row_at = torch.full((num_positions,), positions.numel(), dtype=positions.dtype, device=positions.device)
    row_at[positions] = torch.arange(positions.numel(), device=positions.device)
    return row_at


def _with_zero_row(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(1, rows.shape[1])])


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _CombineInNode(torch.autograd.Function):
    """At the peer, each hop-1 row's experts in this node, weighted and summed:
    out_s = Σ_j w_sj · y[row of (s, j)], in fp32 and rounded once (a gather: no atomics). Keeps one
    copy of the returned rows (the weights' gradient reads them), their weights and hop-1 rows, where
    autograd through a multiply and an index_add would keep the rows in fp32 and weighted too. Both
    gradients are gathers: a row's w · g_s, its weight's ⟨g_s, y_row⟩ (as ``dispatch._WeightedCombine``)."""

    @staticmethod
    def forward(ctx, y_XD: torch.Tensor, weights_X: torch.Tensor, expand_row_X: torch.Tensor,
                row_of_assignment_SK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_XD, weights_X, expand_row_X)
        # the weighted rows in fp32 with the zero row after them, written in place: one copy, not two
        rows, width = y_XD.shape
        weighted_XD = y_XD.new_zeros(rows + 1, width, dtype=torch.promote_types(y_XD.dtype, torch.float32))
        torch.mul(y_XD, weights_X.unsqueeze(-1), out=weighted_XD[:rows])
        return in_dtype(sum_gathered_rows(weighted_XD, row_of_assignment_SK), y_XD.dtype)

    @staticmethod
    def backward(ctx, grad_SD: torch.Tensor):
        y_XD, weights_X, expand_row_X = ctx.saved_tensors
        grad_XD = _at_least_fp32(grad_SD[expand_row_X])
        grad_weights_X = (_at_least_fp32(y_XD) * grad_XD).sum(-1).to(weights_X.dtype)
        return (grad_XD * weights_X.unsqueeze(-1)).to(y_XD.dtype), grad_weights_X, None, None


class _SumOverNodes(torch.autograd.Function):
    """Each token's rows back from the nodes it went to, summed in fp32 and rounded once (a gather).
    The gradient copies g_t to each of its rows, so only their token index is kept (an index_add
    would keep the rows, for their shape)."""

    @staticmethod
    def forward(ctx, rows_SD: torch.Tensor, token_index_S: torch.Tensor,
                row_of_token_node_TN: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_index_S)
        return in_dtype(sum_gathered_rows(_with_zero_row(rows_SD), row_of_token_node_TN), rows_SD.dtype)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        (token_index_S,) = ctx.saved_tensors
        return grad_TD[token_index_S], None, None


class HierarchicalDispatcher:
    """Two-hop dispatch: across nodes once per (token, node), then inside the node."""

    def __init__(self, ep_group: dist.ProcessGroup, intra_group: dist.ProcessGroup,
                 inter_group: dist.ProcessGroup, table: ExpertTable) -> None:
        self.ep_group, self.intra_group, self.inter_group, self.table = ep_group, intra_group, inter_group, table
        self.ep_rank = dist.get_rank(ep_group)
        self.ranks_per_node = dist.get_world_size(intra_group)
        self.num_nodes = dist.get_world_size(inter_group)
        assert self.ranks_per_node * self.num_nodes == table.num_ranks, "EP group must be nodes × ranks per node"
        assert dist.get_rank(intra_group) == self.ep_rank % self.ranks_per_node
        assert dist.get_rank(inter_group) == self.ep_rank // self.ranks_per_node

    def dispatch(self, x_TD: torch.Tensor,
                 routing: Routing) -> tuple[torch.Tensor, torch.Tensor, HierarchicalDispatchMeta]:
        return self.start_dispatch(x_TD, routing).finish()

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def start_dispatch(self, x_TD: torch.Tensor, routing: Routing) -> PendingDispatch:
        """Runs hop 1 and issues hop 2 (what can overlap the caller's next work)."""
        table, rank = self.table, self.ep_rank
        n, num_nodes, slots = self.ranks_per_node, self.num_nodes, table.slots_per_rank
        node, local = divmod(rank, n)
        num_tokens, top_k = routing.expert_ids_TK.shape
        phys_TK = table.physical_slots(routing.expert_ids_TK)
        node_TK = phys_TK // (n * slots)
        goes_to_node_NT = torch.zeros(num_nodes, num_tokens, dtype=torch.bool, device=x_TD.device)
        goes_to_node_NT.scatter_(0, node_TK.t(), True)
        counts = torch.cat([count_tokens_per_expert(phys_TK, table.num_slots), goes_to_node_NT.sum(1)])
        parts, work = _start_count_exchange(counts, self.ep_group)
        with span("permute"):
            # (node, token) pairs, node-major then token order, without knowing their number yet.
            pair_order = torch.argsort((~goes_to_node_NT).reshape(-1).to(torch.int8), stable=True)
        all_counts = _read_counts(parts, work)
        slot_counts = all_counts[:, : table.num_slots].reshape(table.num_ranks, table.num_ranks, slots)
        node_counts = all_counts[:, table.num_slots:]  # [src, node]

        # Hop 1: to the peer with my position in each node, one row per (token, node).
        inter_in = node_counts[rank].tolist()
        inter_out = [int(node_counts[src_node * n + local, node]) for src_node in range(num_nodes)]
        with span("permute"):
            pairs = pair_order[: sum(inter_in)]
            token_index, dest_node = pairs % num_tokens, pairs // num_tokens
            row_of_token_node = _row_at(pairs, num_nodes * num_tokens).view(num_nodes, num_tokens).t()
            in_node = node_TK[token_index] == dest_node.unsqueeze(1)
            rows = x_TD[token_index]
            ids = torch.where(in_node, phys_TK[token_index], -1)
            weights = torch.where(in_node, routing.weights_TK[token_index], 0.0)
        hop1 = [all_to_all_start(rows, inter_out, inter_in, self.inter_group, "a2a_dispatch_inter"),
                all_to_all_start(ids, inter_out, inter_in, self.inter_group, "a2a_dispatch_inter_ids"),
                all_to_all_start(weights, inter_out, inter_in, self.inter_group, "a2a_dispatch_inter_weights")]
        rows, ids, weights = (exchange.wait() for exchange in hop1)

        # Hop 2: expand each row to its experts in this node, ordered by (dest rank, slot), then
        # (source node, token) as received.
        node_slot_lo = node * n * slots
        from_my_position = slot_counts[local::n]  # [src node, dst, slot] for sources at my position
        num_expanded = int(from_my_position[:, node * n:(node + 1) * n].sum())
        with span("permute"):
            key = torch.where(ids >= 0, ids - node_slot_lo, n * slots).reshape(-1)
            expand_order = torch.argsort(key, stable=True)[:num_expanded]
            expand_row = expand_order // top_k
            expanded = rows[expand_row]
            expand_weights = weights.reshape(-1)[expand_order]
            row_of_assignment = _row_at(expand_order, ids.numel()).view(ids.shape)
        intra_in = from_my_position[:, node * n:(node + 1) * n].sum(axis=(0, 2)).tolist()
        to_me = slot_counts[:, rank]  # [src, slot], src = source node · n + position
        intra_out = to_me.reshape(num_nodes, n, slots).sum(axis=(0, 2)).tolist()
        exchange = all_to_all_start(expanded, intra_out, intra_in, self.intra_group, "a2a_dispatch_intra")
        # Received blocks are (peer position, slot, source node); canonical is (slot, source node, position).
        blocks = to_me.reshape(num_nodes, n, slots).transpose(1, 2, 0)
        to_canonical = regroup_index(blocks, (1, 2, 0))
        to_canonical_t = _to_device(to_canonical, x_TD.device)
        tokens_per_local = torch.from_numpy(to_me.sum(0)).to(x_TD.device)
        meta = HierarchicalDispatchMeta(
            token_index, row_of_token_node, inter_in, inter_out, expand_row, expand_weights, row_of_assignment,
            intra_in, intra_out, to_canonical_t, _to_device(inverse_permutation(to_canonical), x_TD.device),
        )
        return PendingDispatch(exchange, lambda received: (received[to_canonical_t], tokens_per_local, meta),
                               tokens_per_local)

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def combine(self, y_PD: torch.Tensor, meta: HierarchicalDispatchMeta) -> torch.Tensor:
        back = all_to_all(y_PD[meta.from_canonical], meta.intra_in, meta.intra_out, self.intra_group,
                          "a2a_combine_intra")
        with span("unpermute"):
            per_node = _CombineInNode.apply(back, meta.expand_weights, meta.expand_row, meta.row_of_assignment)
        home = all_to_all(per_node, meta.inter_in, meta.inter_out, self.inter_group, "a2a_combine_inter")
        with span("unpermute"):
            return _SumOverNodes.apply(home, meta.token_index, meta.row_of_token_node)


def shard_experts(experts: GroupedExperts, table: ExpertTable, ep_rank: int, etp_rank: int = 0,
                  etp: int = 1) -> GroupedExperts:
    """This rank's slots of the full expert stack (weights copied; ``-1`` slots start at zero). With
    expert tensor parallelism (``etp`` > 1) each slot keeps FFN columns ``[etp_rank·F/etp, (etp_rank+1)·F/etp)``
    of its gate and up projections and the same rows of its down projection (``moetrain.distributed.etp``)."""
    held = list(table.experts_by_rank[ep_rank])
    full = experts
    ffn_hidden = full.w_gate_EDF.shape[2]
    assert ffn_hidden % etp == 0, f"expert FFN width {ffn_hidden} does not split over etp={etp}"
    width = ffn_hidden // etp
    columns = slice(etp_rank * width, (etp_rank + 1) * width)
    local = GroupedExperts(len(held), full.w_gate_EDF.shape[1], width, device=full.w_gate_EDF.device)
    with torch.no_grad():
        for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
            src, dst = getattr(full, name), getattr(local, name)
            # the FFN dimension: last of gate/up [E, D, F], middle of down [E, F, D]
            src = src[:, :, columns] if name != "w_down_EFD" else src[:, columns, :]
            dst.zero_()
            for slot, expert in enumerate(held):
                if expert >= 0:
                    dst[slot].copy_(src[expert])
    return local
