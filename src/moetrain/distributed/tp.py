"""Tensor parallelism with sequence parallelism (Megatron-LM: Shoeybi et al. 2019; Korthikanti et al. 2022).

The residual stream is split along the sequence across the TP group ([B, S/tp, D] per rank). Attention
and the dense FFN gather the sequence on entry (all-gather; reduce-scatter in backward), compute on
their share of heads / FFN columns (column-parallel q_up, kv_up, q_proj/k_proj/v_proj, gate, up;
row-parallel o_proj, down) and reduce-scatter their partial sums back to sequence shards. The entry
and exit are forward hooks on the unchanged modules, so parameter names stay those of the full model.

MoE layers run on each rank's sequence shard: routing is per token, experts are replicated over the
TP group (or split across it by EP). The balance losses are functions of statistics over all the
micro-batch's tokens, so the router computes them from the TP group's gathered scores: identical on
every TP rank and identical to the single-process value.

Each parameter then falls in one of three gradient kinds (``ParamKind``):
- ``sharded``: a distinct slice on each TP rank, its gradient complete;
- ``partial``: replicated, each TP rank holds the gradient of its own tokens (norms, latent
  projections, router, experts, embedding): summed over the TP group too;
- ``complete``: replicated and computed on gathered data identically on every TP rank (final norm,
  output head): summed over data-parallel replicas only.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from moetrain.distributed.comm import gather_from_group, owned_chunk, sp_gather, sp_scatter
from moetrain.models.attention import GQA, MLA
from moetrain.models.experts import SwiGLU
from moetrain.models.router import Router

ParamKind = Literal["sharded", "partial", "complete"]


class _SplitSequence(torch.autograd.Function):
    """Keep this rank's sequence shard of a replicated tensor; backward pads the gradient with zeros
    (the other ranks' shards carry theirs), so the producer's parameter gradient is partial."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.full, ctx.rank, ctx.dim = x.shape, rank, dim
        return owned_chunk(x, size, rank, dim)  # a copy: see ``owned_chunk``

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        full = grad.new_zeros(ctx.full)
        full.narrow(ctx.dim, ctx.rank * grad.shape[ctx.dim], grad.shape[ctx.dim]).copy_(grad)
        return full, None, None


def split_sequence(x_BSD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _SplitSequence.apply(x_BSD, group, 1)


def gather_sequence(x_BSD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Full sequence for a computation every TP rank then repeats identically (the output head)."""
    return gather_from_group(x_BSD, group, 1)


def _rows(linear: nn.Linear, parts: int, rank: int, block: int) -> None:
    """Keep output rows of head blocks ``rank::`` (blocks of ``block`` rows, ``parts`` shares)."""
    weight = linear.weight.data.view(-1, block, linear.in_features)
    share = weight.shape[0] // parts
    linear.weight = nn.Parameter(weight[rank * share:(rank + 1) * share].reshape(-1, linear.in_features).clone())
    linear.out_features = linear.weight.shape[0]


def _columns(linear: nn.Linear, parts: int, rank: int) -> None:
    share = linear.in_features // parts
    linear.weight = nn.Parameter(linear.weight.data[:, rank * share:(rank + 1) * share].clone())
    linear.in_features = share


def _sp_region(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Gather the sequence on entry, reduce-scatter the partial output on exit."""
    module.register_forward_pre_hook(lambda _m, args: (sp_gather(args[0], group, 1), *args[1:]))
    module.register_forward_hook(lambda _m, _args, out: sp_scatter(out, group, 1))


def _shard_attention(attention: nn.Module, tp: int, rank: int) -> None:
    cfg = attention.cfg
    local_heads = cfg.num_heads // tp
    if isinstance(attention, MLA):
        if cfg.q_lora_rank:
            _rows(attention.q_up, tp, rank, cfg.qk_head_dim)
        else:
            _rows(attention.q_proj, tp, rank, cfg.qk_head_dim)
        _rows(attention.kv_up, tp, rank, cfg.qk_nope_head_dim + cfg.v_head_dim)
    elif isinstance(attention, GQA):
        _rows(attention.q_proj, tp, rank, cfg.head_dim)
        _rows(attention.k_proj, tp, rank, cfg.head_dim)
        _rows(attention.v_proj, tp, rank, cfg.head_dim)
        attention.cfg = cfg.model_copy(update={"num_kv_heads": cfg.num_kv_heads // tp})
        cfg = attention.cfg
    else:
        raise TypeError(f"no tensor-parallel rule for {type(attention).__name__}")
    _columns(attention.o_proj, tp, rank)
    attention.cfg = cfg.model_copy(update={"num_heads": local_heads})


def _shard_ffn(ffn: SwiGLU, tp: int, rank: int) -> None:
    _rows(ffn.gate, tp, rank, 1)
    _rows(ffn.up, tp, rank, 1)
    _columns(ffn.down, tp, rank)


def _tp_balance_losses(router: Router, group: dist.ProcessGroup, logits_TE: torch.Tensor,
                       scores_TE: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    counts = tokens_per_expert.clone()
    dist.all_reduce(counts, group=group)
    return Router.balance_losses(router, gather_from_group(logits_TE, group, 0),
                                 gather_from_group(scores_TE, group, 0), counts)


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    return list(layers) + [m.layer for m in model.mtp]


def shard_tensor_parallel(model: nn.Module, tp: int, rank: int) -> dict[str, ParamKind]:
    """Keep this TP rank's share of every attention layer's heads and dense FFN's columns, nothing wired
    around them (no collective: the caller decides how the partial outputs are summed); each parameter's
    gradient kind."""
    sharded: set[int] = set()
    for layer in _layers(model):
        _shard_attention(layer.attention, tp, rank)
        sharded.update(id(p) for name, p in layer.attention.named_parameters()
                       if name.split(".")[0] in {"q_up", "q_proj", "k_proj", "v_proj", "kv_up", "o_proj"})
        if not layer.is_moe:
            _shard_ffn(layer.ffn, tp, rank)
            sharded.update(id(p) for p in layer.ffn.parameters())
    complete = set()
    for name in ("final_norm", "head"):
        if hasattr(model, name):
            complete.update(id(p) for p in getattr(model, name).parameters())
    complete.update(id(p) for m in model.mtp for p in m.final_norm.parameters())
    kinds: dict[str, ParamKind] = {}
    for name, param in model.named_parameters():
        kinds[name] = "sharded" if id(param) in sharded else "complete" if id(param) in complete else "partial"
    return kinds


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup) -> dict[str, ParamKind]:
    """Shard attention and dense FFNs over ``group``, wrap them as sequence-parallel regions, make the
    routers' balance losses group-wide (the sequence length must divide by the group size); returns
    each parameter's gradient kind."""
    kinds = shard_tensor_parallel(model, dist.get_world_size(group), dist.get_rank(group))
    for layer in _layers(model):
        _sp_region(layer.attention, group)
        if layer.is_moe:
            router = layer.moe.router
            router.balance_losses = functools.partial(_tp_balance_losses, router, group)
            # The shared expert stays whole: it runs on the rank's own tokens, like the routed ones.
        else:
            _sp_region(layer.ffn, group)
    return kinds
