"""Differentiable collectives with host-known split sizes.

``all_to_all`` sends ``in_splits[r]`` rows to rank r of ``group`` and receives ``out_splits[r]`` from
it; its backward is the same exchange with the splits swapped. Exchanges are asynchronous (work
handles): ``all_to_all_start`` issues one and returns a ``PendingExchange`` to wait on. Split sizes are Python ints: the
dispatcher reads them from the device once per MoE layer (see ``moetrain.distributed.ep``).
Every exchange is recorded on the ``Tracer`` when one is active, so the trace shows where
communication time goes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetrain.distributed.overlap import flush_weight_grads, wait_comm
from moetrain.distributed.trace import record_async, span


class PendingExchange:
    """An all-to-all in flight: ``wait()`` returns its output (letting the other task of an overlapped
    pair compute first, see ``moetrain.distributed.overlap``)."""

    def __init__(self, out: torch.Tensor, work: dist.Work, name: str, source: torch.Tensor) -> None:
        self.out, self.work, self.name = out, work, name
        self.source = source
        """The sent tensor, kept alive until the exchange is done."""

    def wait(self) -> torch.Tensor:
        wait_comm(self.work, self.name)
        return self.out


def _start_exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
                    name: str) -> PendingExchange:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    source = x.contiguous()
    work = dist.all_to_all_single(out, source, out_splits, in_splits, group=group, async_op=True)
    record_async(name, work)
    return PendingExchange(out, work, name, source)


class _AllToAll(torch.autograd.Function):
    """Forward issues the exchange and returns its (not yet filled) output buffer; the caller waits on
    the ``PendingExchange`` before reading it. Backward is the reverse exchange, during which queued
    expert weight gradients are computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup, name: str, handle: list) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.name = (out_splits, in_splits), group, name
        pending = _start_exchange(x, out_splits, in_splits, group, name)
        handle.append(pending)
        return pending.out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        pending = _start_exchange(grad, in_splits, out_splits, ctx.group, ctx.name + "_bwd")
        flush_weight_grads()
        return pending.wait(), None, None, None, None, None


def all_to_all_start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
                     name: str = "a2a") -> PendingExchange:
    """Issue an uneven all-to-all along dim 0 (differentiable when ``x`` requires grad); wait on the
    returned exchange before using its output."""
    if not x.requires_grad:
        return _start_exchange(x, out_splits, in_splits, group, name)
    handle: list[PendingExchange] = []
    out = _AllToAll.apply(x, out_splits, in_splits, group, name, handle)
    return PendingExchange(out, handle[0].work, name, handle[0].source)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,
               name: str = "a2a") -> torch.Tensor:
    """Uneven all-to-all along dim 0; differentiable when ``x`` requires grad."""
    return all_to_all_start(x, out_splits, in_splits, group, name).wait()


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce(sum) backward: a value replicated over ``group`` whose uses on each
    rank contribute gradient (Megatron's ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        with span("allreduce_bwd", "comm"):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce(sum) forward, identity backward (Megatron's ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        with span("allreduce", "comm"):
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def owned_chunk(x: torch.Tensor, chunks: int, index: int, dim: int) -> torch.Tensor:
    """Chunk ``index`` of ``x`` along ``dim`` in storage of its own, for an ``autograd.Function``'s forward to
    return. Not the chunk's view, even where ``.contiguous()`` would hand it back as it is: torch 2.11's Dynamo
    gives a compiled Function whose forward returns such a tensor (a view, or a no-op ``.contiguous()`` /
    ``.to``) a zero gradient (2.13 does not), and micro-batch 1 makes a sequence chunk contiguous."""
    return x.chunk(chunks, dim=dim)[index].clone(memory_format=torch.contiguous_format)


def _all_gather_cat(x: torch.Tensor, group: dist.ProcessGroup, dim: int, name: str) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    with span(name, "comm"):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along ``dim`` forward, keep this rank's slice backward (the gradient of a gathered
    value that every rank then uses identically is already complete on each rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _all_gather_cat(x, group, dim, "allgather")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


class _GatherReduceScatter(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter backward: sequence-parallel entry into a
    tensor-parallel region (Korthikanti et al. 2022, "Reducing activation recomputation")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        return _all_gather_cat(x, group, dim, "sp_allgather")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = grad.contiguous()
        with span("sp_reduce_scatter_bwd", "comm"):
            dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter; same result
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward: sequence-parallel exit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.dim = group, dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        out = x.contiguous().clone()
        with span("sp_reduce_scatter", "comm"):
            dist.all_reduce(out, group=group)
        # A copy, not the chunk itself: see ``owned_chunk``.
        return owned_chunk(out, size, rank, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        with span("sp_allgather_bwd", "comm"):
            dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return _GatherFromGroup.apply(x, group, dim)


def sp_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return _GatherReduceScatter.apply(x, group, dim)


def sp_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, group, dim)
