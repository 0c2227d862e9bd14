"""Expert tensor parallelism (ETP): each routed expert's FFN split over the ``etp`` group.

The idea is Megatron-Core's (``--expert-tensor-parallel-size``): an expert's gate and up projections
are column-parallel (each ETP rank holds ``expert_ffn_hidden / etp`` of their output columns) and its
down projection row-parallel (the matching rows), so one ETP rank computes a partial sum of every
token's expert output and the ETP group's partial sums add up to the whole expert.

Legend: D hidden, S local expert slots, G etp ranks, P_r rows rank r received from the EP dispatch.

The ranks of one ETP group hold the same expert slots (the expert grid is ``[edp, ep, etp]``, and the
EP all-to-all runs among the ranks with the same ETP position). Per MoE layer:
1. the EP dispatcher (flat, or the local one when ep = 1) delivers each rank its own tokens for its
   slots, in the canonical order (slot, source rank, token);
2. the ETP group exchanges its per-slot token counts (an all-gather of S integers, issued when the
   dispatch starts and read when it finishes) and all-gathers the tokens: every rank then holds the
   G·ΣP_r rows of the group ordered by (slot, ETP member, canonical order), so the grouped GEMM sees
   every token of each expert in one block;
3. the experts compute their partial outputs on their FFN slice;
4. a reduce-scatter over the group sums the partial outputs and returns each rank the rows of its own
   tokens, which the EP dispatcher then combines as usual.
Both collectives are uneven (the members received different token counts), so they are built from
the differentiable all-to-all of ``moetrain.distributed.comm``: the all-gather sends G copies of the
rank's rows, one to each member, and its backward receives the members' partial input gradients of
those rows and sums them; the reduce-scatter is its transpose. Every exchange is asynchronous and
waited on with ``overlap.wait_comm``, so the overlapped schedule hides it like the EP exchanges.

Expert weight gradients are complete on each ETP rank for its slice (it saw every token of its
experts in the group) and are summed over ``edp``, the ranks holding the same slice
(``moetrain.distributed.zero``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moetrain.distributed.comm import all_to_all
from moetrain.distributed.ep import ExpertTable, PendingDispatch, inverse_permutation, regroup_index
from moetrain.distributed.host_reads import host_read
from moetrain.distributed.overlap import wait_comm
from moetrain.distributed.trace import record_async, span
from moetrain.models.dispatch import ReadyDispatch
from moetrain.models.moe import Dispatcher
from moetrain.models.router import Routing
from moetrain.runtime_base.eager_only import eager_only


@dataclass(frozen=True)
class ExpertTensorParallelMeta:
    inner: object
    """What the EP dispatcher's ``combine`` needs."""
    own_rows: int
    member_rows: list[int]
    """Rows each ETP member contributed to the gathered block (this rank's is ``own_rows``)."""
    from_canonical: torch.Tensor
    """Gathered row order (slot, member, …) → member-major order (member, slot, …)."""


def gather_expert_tokens(tokens_PD: torch.Tensor, counts_GS: np.ndarray, group: dist.ProcessGroup,
                         name: str = "etp_gather") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All-gather the ETP group's expert tokens: ``counts_GS[g, s]`` rows of slot s came from member g,
    each member's rows sorted by slot. Returns (gathered rows sorted by (slot, member), rows per slot,
    index turning the gathered order back into the member-major one). Backward sums the members'
    gradients of each rank's rows (a reduce-scatter)."""
    members, rank = dist.get_world_size(group), dist.get_rank(group)
    member_rows = counts_GS.sum(1).tolist()
    own_rows = member_rows[rank]
    assert tokens_PD.shape[0] == own_rows, f"{tokens_PD.shape[0]} rows but the counts say {own_rows}"
    # One copy for each member (ourselves included); expand's backward sums the members' gradients.
    copies = tokens_PD.unsqueeze(0).expand(members, *tokens_PD.shape).reshape(-1, *tokens_PD.shape[1:])
    received = all_to_all(copies, member_rows, [own_rows] * members, group, name)
    to_slot_major = regroup_index(counts_GS, (1, 0))
    index = torch.from_numpy(to_slot_major).to(tokens_PD.device, non_blocking=True)
    from_slot_major = torch.from_numpy(inverse_permutation(to_slot_major)).to(tokens_PD.device, non_blocking=True)
    rows_per_slot = torch.from_numpy(counts_GS.sum(0)).to(tokens_PD.device)
    return received[index], rows_per_slot, from_slot_major


def reduce_scatter_expert_outputs(partial_PD: torch.Tensor, meta: ExpertTensorParallelMeta,
                                  group: dist.ProcessGroup, name: str = "etp_reduce_scatter") -> torch.Tensor:
    """Sum the ETP members' partial outputs of the gathered rows; return this rank's own rows (in the
    order it contributed them). Backward all-gathers the gradient of the own rows."""
    members = len(meta.member_rows)
    member_major = partial_PD[meta.from_canonical]
    received = all_to_all(member_major, [meta.own_rows] * members, meta.member_rows, group, name)
    parts = received.view(members, meta.own_rows, *partial_PD.shape[1:])
    # Sum in fp32 (bf16 partial sums would lose the precision the single matmul keeps); same member
    # order on every rank.
    return parts.float().sum(0).to(partial_PD.dtype)


def _counts_known_at_start(pending: object) -> torch.Tensor | None:
    """Tokens per local slot when the EP dispatcher knows them before its exchange completes."""
    if isinstance(pending, ReadyDispatch):
        return pending.result[1]
    if isinstance(pending, PendingDispatch):
        return pending.tokens_per_local
    return None


class _PendingCounts:
    """An all-gather of the per-slot counts over the ETP group, started early, read at ``finish``."""

    def __init__(self, counts_S: torch.Tensor, group: dist.ProcessGroup) -> None:
        counts_S = counts_S.to(torch.int64).contiguous()
        self.parts = [torch.empty_like(counts_S) for _ in range(dist.get_world_size(group))]
        self.work = dist.all_gather(self.parts, counts_S, group=group, async_op=True)
        record_async("etp_counts_allgather", self.work)

    def read(self) -> np.ndarray:
        # A few bytes: no turn handed to the other micro-batch for it.
        wait_comm(self.work, "etp_counts_allgather", hand_over=False)
        with span("etp_counts_d2h", "comm"), host_read("expert counts (ETP)"):
            return torch.stack(self.parts).cpu().numpy()


@dataclass(frozen=True)
class _KnownCounts:
    """Members' per-slot counts that the EP count exchange already brought to the host."""

    counts_GS: np.ndarray

    def read(self) -> np.ndarray:
        return self.counts_GS


@dataclass(frozen=True)
class PendingExpertTensorParallelDispatch:
    inner: object
    counts: _PendingCounts | _KnownCounts | None
    group: dist.ProcessGroup

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def finish(self) -> tuple[torch.Tensor, torch.Tensor, ExpertTensorParallelMeta]:
        tokens_PD, tokens_per_local, inner_meta = self.inner.finish()  # type: ignore[attr-defined]
        counts = self.counts if self.counts is not None else _PendingCounts(tokens_per_local, self.group)
        counts_GS = counts.read()
        gathered, rows_per_slot, from_canonical = gather_expert_tokens(tokens_PD, counts_GS, self.group)
        own = int(counts_GS[dist.get_rank(self.group)].sum())
        meta = ExpertTensorParallelMeta(inner_meta, own, counts_GS.sum(1).tolist(), from_canonical)
        return gathered, rows_per_slot, meta


class ExpertTensorParallelDispatcher:
    """Wraps an EP dispatcher (or the local one): its tokens are all-gathered over the ETP group after
    dispatch, the experts' partial outputs reduce-scattered before combine."""

    def __init__(self, inner: Dispatcher, group: dist.ProcessGroup, table: ExpertTable) -> None:
        self.inner, self.group, self._table = inner, group, table

    @property
    def table(self) -> ExpertTable:
        """The expert table of the EP dispatcher inside (with ep = 1: one rank holding every expert)."""
        return getattr(self.inner, "table", self._table)

    @table.setter
    def table(self, table: ExpertTable) -> None:
        """A new placement (online balancing): the EP dispatcher inside routes by it; the ETP exchange
        works on slots and needs nothing else."""
        self._table = table
        if hasattr(self.inner, "table"):
            self.inner.table = table

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def start_dispatch(self, x_TD: torch.Tensor, routing: Routing) -> PendingExpertTensorParallelDispatch:
        pending = self.inner.start_dispatch(x_TD, routing)
        members = getattr(pending, "member_counts_GS", None)
        if members is not None:  # the EP count exchange already gave every member's counts
            return PendingExpertTensorParallelDispatch(pending, _KnownCounts(members), self.group)
        known = _counts_known_at_start(pending)
        counts = _PendingCounts(known, self.group) if known is not None else None
        return PendingExpertTensorParallelDispatch(pending, counts, self.group)

    def dispatch(self, x_TD: torch.Tensor,
                 routing: Routing) -> tuple[torch.Tensor, torch.Tensor, ExpertTensorParallelMeta]:
        return self.start_dispatch(x_TD, routing).finish()

    @eager_only  # host-side split sizes: stays eager under a compiled block
    def combine(self, y_PD: torch.Tensor, meta: ExpertTensorParallelMeta) -> torch.Tensor:
        own_PD = reduce_scatter_expert_outputs(y_PD, meta, self.group)
        return self.inner.combine(own_PD, meta.inner)

