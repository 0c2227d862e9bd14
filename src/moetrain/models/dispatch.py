"""Token dispatch: permute tokens into expert order once, unpermute them with one weighted scatter.

``permute`` sorts the T·k (token, expert) assignments by expert id with one stable argsort, so each
expert's tokens sit in one contiguous block, in token order; ``unpermute`` multiplies each expert
output row by its gating weight and scatter-adds it back to its token. No host sync: block sizes
stay on the device (``tokens_per_expert``) for the grouped GEMM.

A dispatcher turns a ``Routing`` into the tokens the local experts compute and back, in stages:
``start_dispatch`` issues the exchange and returns a pending object whose ``finish()`` waits for it,
so the MoE block computes the shared expert while tokens are in flight. ``LocalDispatcher``
serves one process (all experts local); the expert-parallel dispatchers in ``moetrain.distributed``
have the same two methods. ``dispatch`` returns frozen metadata that ``combine`` consumes, so one
dispatcher can have several micro-batches in flight (no per-call state on ``self``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.models.router import Routing


@dataclass(frozen=True)
class PermuteMeta:
    token_index_P: torch.Tensor
    """For each permuted row (P = T·k rows, sorted by expert), the token it came from."""
    weights_P: torch.Tensor
    """Gating weight of each permuted row (fp32)."""
    num_tokens: int


def permute(x_TD: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, PermuteMeta]:
    """Rows of ``x`` in expert order: [T·k, D], block e holding expert e's tokens."""
    top_k = routing.expert_ids_TK.shape[1]
    order_P = torch.argsort(routing.expert_ids_TK.reshape(-1), stable=True)
    token_index_P = order_P // top_k
    weights_P = routing.weights_TK.reshape(-1)[order_P]
    return x_TD[token_index_P], PermuteMeta(token_index_P, weights_P, x_TD.shape[0])


def unpermute(y_PD: torch.Tensor, meta: PermuteMeta) -> torch.Tensor:
    """Σ_k weight·expert_output back at each token: one weighted ``index_add`` (fp32 weights)."""
    weighted = (y_PD.float() * meta.weights_P.unsqueeze(-1)).to(y_PD.dtype)
    out = y_PD.new_zeros(meta.num_tokens, y_PD.shape[1])
    return out.index_add_(0, meta.token_index_P, weighted)


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
