"""Context parallelism: each sequence split over the ``cp`` ranks of one data-parallel replica.

The ideas are Megatron-Core's context parallelism (load-balanced causal chunks) and Llama 3's
all-gather CP (Dubey et al. 2024, "The Llama 3 Herd of Models" §3.3.2: gather the keys and values,
keep the queries local), written for this runtime:

- Load balance. The sequence is cut into ``2·cp`` equal chunks; CP rank i holds chunks i and
  ``2·cp−1−i``. Under a causal mask the work of a query grows with its index, so pairing an early
  chunk with a late one gives every rank the same attention work.
- Every token keeps its true sequence index: RoPE positions and the causal + document mask are built
  from the full sequence and then indexed (``build_attention_context`` with token indices), so a rank's
  tokens see exactly what they see in one process.
- Attention all-gathers the keys' sources over the CP group (for MLA the compressed latent c_kv and the
  shared rotary key, before the up-projection; for GQA the projected keys and values); the backward
  of the gather is a reduce-scatter, returning each rank the summed gradient of its own tokens.
  Queries stay local.
- Everything else (norms, FFN, MoE routing and dispatch, the head and the loss) is per token and runs
  on the rank's own tokens. The loss is divided by the global batch's label count as in every layout;
  the routers' balance losses are statistics over the whole micro-batch, so they are computed on the
  CP group's gathered scores (as under sequence parallelism, ``moetrain.distributed.tp``) and divided
  by ``cp``: the CP ranks' shares sum to the single-process value, and the gather's reduce-scatter
  backward gives each rank the full gradient of its tokens.
- Dense parameters then hold partial gradients on each CP rank and are summed over the ``dp_cp`` (or
  whole stage) group by ``ZeroAdamW``; pipeline stages exchange the CP-local activations.

Multi-token prediction shifts labels and input ids along the sequence: the shift is done on the full
sequence, then each rank takes its tokens (``local_tokens``), so chunk boundaries see the right
neighbours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed.comm import sp_gather
from moetrain.distributed.layout import ParallelDims
from moetrain.models.attention import AttentionContext, build_attention_context


def load_balanced_index(seq_len: int, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sequence indices held by CP rank ``cp_rank``: chunks ``cp_rank`` and ``2·cp−1−cp_rank`` of ``2·cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2·cp = {2 * cp} chunks")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


@dataclass
class ContextParallel:
    """This rank's place in its CP group and the operations that split and gather the sequence."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> ContextParallel | None:
        if dims.parallel.cp == 1:
            return None
        return cls(dims.get_group("cp"), dims.size("cp"), dims.local_rank("cp"))

    def local_index(self, seq_len: int, device: torch.device | str) -> torch.Tensor:
        return load_balanced_index(seq_len, self.size, self.rank, device)

    def key_index(self, seq_len: int, device: torch.device | str) -> torch.Tensor:
        """Sequence index of each gathered key: the ranks' local indices, rank after rank."""
        return torch.cat([load_balanced_index(seq_len, self.size, r, device) for r in range(self.size)])

    def local_tokens(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor (ids, labels), in its local order."""
        return t_BS.index_select(1, self.local_index(t_BS.shape[1], t_BS.device))

    def gather_kv(self, x_BSX: torch.Tensor) -> torch.Tensor:
        """All-gather along the sequence over the CP group; backward sums every rank's gradient of
        this rank's tokens (reduce-scatter)."""
        return sp_gather(x_BSX, self.group, 1)

    def attention_context(self, input_ids_BS: torch.Tensor, document_ids_BS: torch.Tensor | None) -> AttentionContext:
        """The context of this rank's queries, from the full sequences (ids and documents)."""
        seq, device = input_ids_BS.shape[1], input_ids_BS.device
        return build_attention_context(input_ids_BS, document_ids_BS, self.local_index(seq, device),
                                       self.key_index(seq, device), self.gather_kv)


def _cp_balance_losses(inner: Callable[..., torch.Tensor], group: dist.ProcessGroup, size: int,
                       logits_TE: torch.Tensor, scores_TE: torch.Tensor,
                       tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The micro-batch's balance losses from the CP group's gathered statistics, divided by ``cp`` so
    the CP ranks' shares sum to the single-process value. ``inner`` is the router's previous rule
    (the TP group's gathered losses under tensor parallelism, else ``Router.balance_losses``)."""
    counts = tokens_per_expert.clone()
    dist.all_reduce(counts, group=group)
    return inner(sp_gather(logits_TE, group, 0), sp_gather(scores_TE, group, 0), counts) / size


def apply_context_parallel(model: nn.Module, dims: ParallelDims) -> ContextParallel | None:
    """Make every router's balance losses CP-group-wide (after tensor parallelism, whose rule it wraps);
    returns the ``ContextParallel`` the executor splits and gathers with (None when cp = 1)."""
    cp = ContextParallel.from_dims(dims)
    if cp is None:
        return None
    layers = list(model.layers.values()) + [m.layer for m in model.mtp]
    for layer in layers:
        if not layer.is_moe:
            continue
        router = layer.moe.router
        coefs = router.cfg
        if coefs.expert_balance_coef or coefs.device_balance_coef or coefs.z_loss_coef:
            router.balance_losses = functools.partial(_cp_balance_losses, router.balance_losses, cp.group, cp.size)
    return cp
