"""Token dispatch: permute tokens into expert order once, unpermute them with one weighted scatter.

``permute`` sorts the T·k (token, expert) assignments by expert id with one stable argsort, so each
expert's tokens sit in one contiguous block, in token order; ``unpermute`` reads each token's k expert
outputs back through the inverse permutation and sums them weighted by the gates, in fp32. Both
directions of both are gathers: no scatter-add, so no atomics (an index_add of bf16 rows ran 27 ms of
an H100 step) and the same sums in every run. No host sync: block sizes stay on the device
(``tokens_per_expert``) for the grouped GEMM.

A dispatcher turns a ``Routing`` into the tokens the local experts compute and back, in stages:
``start_dispatch`` issues the exchange and returns a pending object whose ``finish()`` waits for it,
so the MoE block computes the shared expert while tokens are in flight. ``LocalDispatcher``
serves one process (all experts local); the expert-parallel dispatchers in ``moetrain.distributed``
have the same two methods. ``dispatch`` returns frozen metadata that ``combine`` consumes, so one
dispatcher can have several micro-batches in flight (no per-call state on ``self``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetrain.models.router import Routing


@dataclass(frozen=True)
class PermuteMeta:
    order_P: torch.Tensor
    """For each permuted row (P = T·k rows, sorted by expert), its (token, choice) assignment as the flat
    index t·k + j; the row's token is ``order_P // k``."""
    inverse_P: torch.Tensor
    """The inverse permutation: for assignment t·k + j, the permuted row holding it."""
    weights_TK: torch.Tensor
    """Gating weights in token order (fp32)."""

    @property
    def token_index_P(self) -> torch.Tensor:
        return self.order_P // self.weights_TK.shape[1]


def expert_order(expert_ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) of the T·k assignments sorted by expert id (stable: token order within an expert)."""
    order_P = torch.argsort(expert_ids_TK.reshape(-1), stable=True)
    inverse_P = torch.empty_like(order_P)
    inverse_P[order_P] = torch.arange(order_P.numel(), device=order_P.device)
    return order_P, inverse_P


def in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, for an ``autograd.Function``'s forward to return: ``x`` itself where it already
    has it, never a no-op ``.to``. torch 2.11's Dynamo gives a compiled Function whose forward returns a no-op
    ``.to``/``.float``/``.contiguous`` (the same tensor object) a zero gradient, every backend (fixed by
    2.13); in fp32 that cut every expert and gating gradient of a compiled MoE layer (tests/gpu on the
    H200; benchmarks/notes/training.md)."""
    return x if x.dtype == dtype else x.to(dtype)


def sum_gathered_rows(rows_RD: torch.Tensor, index_TJ: torch.Tensor,
                      weights_TJ: torch.Tensor | None = None) -> torch.Tensor:
    """out_t = Σ_j w_tj · rows[index_tj] (w = 1 without ``weights_TJ``) in fp32 (float64 stays float64; the
    caller rounds once): a gather, so no scatter-add, no atomics and the same sums in every run."""
    dtype = torch.promote_types(rows_RD.dtype, torch.float32)
    if torch.compiler.is_compiling():
        def term(j: int) -> torch.Tensor:
            row_TD = rows_RD[index_TJ[:, j]].to(dtype)
            return row_TD if weights_TJ is None else row_TD * weights_TJ[:, j, None]
        return _sum_of_terms(term, index_TJ.shape[1])
    if weights_TJ is None:
        return rows_RD[index_TJ].sum(1, dtype=dtype)
    return (rows_RD[index_TJ].to(dtype) * weights_TJ.unsqueeze(-1)).sum(1)


def _sum_of_terms(term: Callable[[int], torch.Tensor], count: int) -> torch.Tensor:
    """term(0) + term(1) + ... + term(count − 1), written out for the compiler.

    Compiled, a sum over the j of a gathered [T, J, D] block is a reduction over its middle, strided
    dimension; on the H200 the compiled step's two such kernels (the token gradients of the dispatch, the
    weighted combine) ran at about a sixth of the memory bandwidth, a quarter of the dispatch's plain
    gather's rate (benchmarks/notes/training.md, "One GPU slot"). Written as J gathered terms added in
    turn, the sum is element-wise over [T, D]: one kernel whose J loads each read a row along its length.
    Eager keeps the gather and one sum (two kernels, where the terms would take 2·J)."""
    total = term(0)
    for j in range(1, count):
        total = total + term(j)
    return total


class _CopyRows(torch.autograd.Function):
    """``x_TD[token_index_P]``, each token copied to its k rows, with a gather for backward too: the
    gradient of token t is the sum of its k rows' gradients, read through the inverse permutation
    (no scatter-add, so no atomics and the same sums in every run)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, token_index_P: torch.Tensor, inverse_P: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse_P)
        ctx.num_tokens = x_TD.shape[0]
        return x_TD[token_index_P]

    @staticmethod
    def backward(ctx, grad_PD: torch.Tensor):
        (inverse_P,) = ctx.saved_tensors
        grad_TD = sum_gathered_rows(grad_PD, inverse_P.view(ctx.num_tokens, -1))
        return grad_TD.to(grad_PD.dtype), None, None


class _WeightedCombine(torch.autograd.Function):
    """out_t = Σ_j w_tj · y[row of (t, j)], summed in fp32 and rounded once; both gradients are gathers
    (the rows' gradient w_tj·g_t read back in expert order, the weights' ⟨g_t, y_row⟩)."""

    @staticmethod
    def forward(ctx, y_PD: torch.Tensor, weights_TK: torch.Tensor, order_P: torch.Tensor,
                inverse_P: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_PD, weights_TK, order_P, inverse_P)
        return in_dtype(sum_gathered_rows(y_PD, inverse_P.view(weights_TK.shape), weights_TK), y_PD.dtype)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_PD, weights_TK, order_P, inverse_P = ctx.saved_tensors
        tokens, top_k = weights_TK.shape
        grad_rows_TKD = (grad_TD.float().unsqueeze(1) * weights_TK.unsqueeze(-1)).to(y_PD.dtype)
        grad_y_PD = grad_rows_TKD.view(tokens * top_k, -1)[order_P]
        rows_TKD = y_PD[inverse_P].view(tokens, top_k, y_PD.shape[-1])
        grad_weights_TK = (rows_TKD.float() * grad_TD.float().unsqueeze(1)).sum(-1)
        return grad_y_PD, grad_weights_TK, None, None


def gather_token_rows(x_TD: torch.Tensor, token_index_P: torch.Tensor, inverse_P: torch.Tensor) -> torch.Tensor:
    """``x_TD[token_index_P]`` (each token copied to its rows) whose backward is a gather too."""
    return _CopyRows.apply(x_TD, token_index_P, inverse_P)


def permute(x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, PermuteMeta]:
    """Rows of ``x`` in expert order: [T·k, D], block e holding expert e's tokens."""
    return permute_by(x_TD, routing.expert_ids_TK, routing.weights_TK)


def permute_by(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> tuple[torch.Tensor, PermuteMeta]:
    """``permute`` by any per-assignment ids (expert parallelism sorts by physical slot)."""
    order_P, inverse_P = expert_order(ids_TK)
    tokens_PD = gather_token_rows(x_TD, order_P // ids_TK.shape[1], inverse_P)
    return tokens_PD, PermuteMeta(order_P, inverse_P, weights_TK)


def unpermute(y_PD: torch.Tensor, meta: PermuteMeta) -> torch.Tensor:
    """Σ_k weight·expert_output back at each token (rows in ``permute``'s order)."""
    return _WeightedCombine.apply(y_PD, meta.weights_TK, meta.order_P, meta.inverse_P)


@dataclass(frozen=True)
class LocalDispatchMeta:
    permute: PermuteMeta
    tokens_per_expert: torch.Tensor


@dataclass(frozen=True)
class ReadyDispatch:
    """A dispatch with nothing in flight: ``finish()`` returns ``dispatch``'s result at once."""

    result: tuple[torch.Tensor, torch.Tensor, object]

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, object]:
        return self.result


class LocalDispatcher:
    """All experts live in this process: dispatch is a permutation, combine its weighted inverse."""

    def start_dispatch(self, x_TD: torch.Tensor, routing: Routing) -> ReadyDispatch:
        return ReadyDispatch(self.dispatch(x_TD, routing))

    def dispatch(self, x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchMeta]:
        """Returns (permuted tokens, tokens per local expert, metadata for ``combine``)."""
        tokens_PD, meta = permute(x_TD, routing)
        return tokens_PD, routing.tokens_per_expert_E, LocalDispatchMeta(meta, routing.tokens_per_expert_E)

    def combine(self, y_PD: torch.Tensor, meta: LocalDispatchMeta) -> torch.Tensor:
        return unpermute(y_PD, meta.permute)
