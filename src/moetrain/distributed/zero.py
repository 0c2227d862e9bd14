"""ZeRO-1 AdamW: gradients summed over the data-parallel replicas, optimizer state sharded across them.

(Rajbhandari et al. 2020, "ZeRO", stage 1.) Parameters are packed into flat buckets by who holds a
replica of them:
- replicated dense parameters (norms, router, latent projections...): the whole stage (``dp·cp·tp``
  ranks), as under sequence parallelism each TP rank holds the gradient of its own tokens;
- tensor-parallel shards, and replicated parameters computed identically by every TP rank (head):
  the ``dp_cp`` group;
- routed-expert parameters: the ``edp`` group (the ranks holding the same expert slots, and under
  expert tensor parallelism the same FFN slice of them), so expert gradients are never reduced across
  different experts or slices;
- the embedding, when the first and last pipeline stage both hold it: first summed over ``embed``.
Each rank of a bucket's group owns ``1/size`` of the flat bucket: it keeps the AdamW moments of that
shard only, updates it, and the updated shards are all-gathered back into the parameters.

A bucket whose group is this rank alone (and needs no pre-reduce) is not flattened: its parameters
are the optimizer's own, their gradients are clipped in place, and nothing is communicated. A
single-process run is then exactly ``runtime_base.optim.adamw`` (fused on CUDA, foreach elsewhere) after
``torch.nn.utils.clip_grad_norm_``, norm included, so it can use this same optimizer.

AdamW is elementwise, so updating flat shards is the same arithmetic as updating each parameter.
Gradient clipping uses the global norm over every distinct parameter element exactly once
(a bucket replicated on ``r`` ranks outside its group contributes 1/r on each), matching
``torch.nn.utils.clip_grad_norm_`` on the single-process model.

``build_sharded_optimizer`` picks this class for ZeRO stages 0 and 1 and the FSDP2-based
``moetrain.distributed.fsdp.FullyShardedAdamW`` for stages 2 and 3; both have the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import TrainingConfig
from moetrain.distributed.fsdp import FullyShardedAdamW
from moetrain.distributed.grad_groups import MOMENTS, clip_and_set_lr, kind_rules, param_kind, world_norm
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import last_stage_holds_embedding
from moetrain.distributed.tp import ParamKind
from moetrain.distributed.trace import span
from moetrain.errors import UserError
from moetrain.runtime_base.optim import adamw


@dataclass
class _Bucket:
    names: list[str]
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    pre_reduce: dist.ProcessGroup | None
    norm_share: float
    shard: nn.Parameter | None
    """This rank's slice of the flat bucket; None for a one-rank bucket (the parameters are updated)."""
    numel: int
    shard_size: int
    rank_in_group: int
    group_size: int


def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.nn.functional.pad(flat, (0, padded - flat.numel()))


def _unflatten(flat: torch.Tensor, names: list[str], params: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, p in zip(names, params):
        out[name] = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return out



class ZeroAdamW:
    def __init__(self, model: nn.Module, dims: ParallelDims, cfg: TrainingConfig,
                 tp_kinds: dict[str, ParamKind] | None = None, keep_flat: bool = False) -> None:
        """``keep_flat``: flatten one-rank buckets too (online expert balancing moves ZeRO shards by
        their flat offsets)."""
        self.dims, self.cfg = dims, cfg
        rules = kind_rules(dims)
        self.named = list(model.named_parameters())
        kinds: dict[tuple[str, bool], list[tuple[str, nn.Parameter]]] = {}
        # a model without a config (a test's plain module) shares no embedding across stages
        shared_embedding = hasattr(model, "cfg") and last_stage_holds_embedding(model.cfg)
        for name, param in self.named:
            kind = param_kind(name, dims, tp_kinds, shared_embedding)
            kinds.setdefault((kind, param.ndim >= 2), []).append((name, param))
        self.buckets: list[_Bucket] = []
        groups = []
        for (kind, decay), named in sorted(kinds.items()):
            names, params = [n for n, _ in named], [p for _, p in named]
            axis, pre_axis, copies = rules[kind]
            group = dims.get_group(axis)
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            numel = sum(p.numel() for p in params)
            shard_size = -(-numel // size)
            shard = None
            if size > 1 or pre_axis is not None or keep_flat:
                with torch.no_grad():
                    flat = _flat([p.detach() for p in params], shard_size * size)
                    shard = nn.Parameter(flat[rank * shard_size:(rank + 1) * shard_size].clone())
            self.buckets.append(_Bucket(
                names, params, group, dims.get_group(pre_axis) if pre_axis else None, 1.0 / copies,
                shard, numel, shard_size, rank, size,
            ))
            groups.append({"params": [shard] if shard is not None else params,
                           "weight_decay": cfg.weight_decay if decay else 0.0})
        self.optimizer = adamw(groups, cfg)  # fused on CUDA, foreach elsewhere
        # One process holds everything: take the norm exactly as clip_grad_norm_ does (float32,
        # parameters in model order), so the run is bit for bit the single-process trainer's.
        self.local_only = dist.get_world_size(dims.get_group("world")) == 1 and not any(
            b.shard is not None for b in self.buckets)
        self._pending_grads: list[torch.Tensor] = []
        """The gradients ``reduce_gradients`` reduced, which ``apply_update`` clips and applies."""

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None

    def _reduce(self, bucket: _Bucket) -> list[torch.Tensor]:
        """This rank's summed gradient of ``bucket`` (its flat shard, or the parameters' own gradients)."""
        if bucket.shard is None:
            return [p.grad for p in bucket.params if p.grad is not None]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = _flat(grads, bucket.shard_size * bucket.group_size)
        with span("grad_allreduce", "comm"):
            if bucket.pre_reduce is not None:
                dist.all_reduce(flat, group=bucket.pre_reduce)
            # gloo has no reduce-scatter; an all-reduce then keeping our shard gives the same sums.
            dist.all_reduce(flat, group=bucket.group)
        lo = bucket.rank_in_group * bucket.shard_size
        bucket.shard.grad = flat[lo:lo + bucket.shard_size].clone()
        return [bucket.shard.grad]

    @torch.no_grad()
    def step(self, lr: float, norm_sq_correction: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce gradients, clip by the global norm, update this rank's shards, gather the parameters.
        Returns the global gradient norm (on device). ``norm_sq_correction``: as ``reduce_gradients``."""
        grad_norm = self.reduce_gradients(norm_sq_correction)
        self.apply_update(lr, grad_norm)
        return grad_norm

    @torch.no_grad()
    def reduce_gradients(self, norm_sq_correction: torch.Tensor | None = None) -> torch.Tensor:
        """The first half of ``step``: reduce the gradients and return the global gradient norm (on
        device, the same on every rank), so that the caller can decide whether to update at all (the
        trainer skips a step whose norm is not finite). ``norm_sq_correction`` (this rank's share,
        float64) is added to the squared norm before it is summed over ranks: expert replicas hold the
        same summed gradient, so all but one are taken back out (``moetrain.distributed.balancing``)."""
        grads, squares = [], []
        for bucket in self.buckets:
            reduced = self._reduce(bucket)
            grads += reduced
            if not self.local_only and reduced:  # one process takes the norm of its own gradients below
                # one fused norm per tensor, squared and summed in float64 (not a float64 copy of every gradient)
                norms = torch.stack(torch._foreach_norm(reduced)).double()
                squares.append(norms.pow(2).sum() * bucket.norm_share)
        self._pending_grads = grads
        if self.local_only:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for _, p in self.named if p.grad is not None])
            if norm_sq_correction is not None:
                grad_norm = (grad_norm.double().pow(2) + norm_sq_correction).sqrt().float()
            return grad_norm
        return world_norm(squares, norm_sq_correction, self.dims.get_group("world"))

    @torch.no_grad()
    def apply_update(self, lr: float, grad_norm: torch.Tensor) -> None:
        """The second half of ``step``: clip the reduced gradients by ``grad_norm``, update this rank's
        shards, gather the parameters."""
        grads, self._pending_grads = self._pending_grads, []
        clip_and_set_lr(self.optimizer, grads, grad_norm, self.cfg.grad_clip, lr)
        self.optimizer.step()
        for bucket in self.buckets:
            if bucket.shard is None:
                continue
            parts = [torch.empty_like(bucket.shard) for _ in range(bucket.group_size)]
            with span("param_allgather", "comm"):
                dist.all_gather(parts, bucket.shard.detach(), group=bucket.group)
            for p, value in zip(bucket.params, _unflatten(torch.cat(parts), bucket.names, bucket.params).values()):
                p.copy_(value)

    def discard_update(self) -> None:
        """Instead of ``apply_update``: drop the reduced gradients; parameters and moments stay as they were."""
        self._pending_grads = []

    def _gathered(self, bucket: _Bucket, shard: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = [torch.empty_like(shard) for _ in range(bucket.group_size)]
        dist.all_gather(parts, shard.contiguous(), group=bucket.group)
        return {n: t.clone() for n, t in _unflatten(torch.cat(parts), bucket.names, bucket.params).items()}

    @torch.no_grad()
    def moments_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        """The AdamW moments of every local parameter, in its local shape (gathered from the bucket
        shards over each bucket's group), and the step count: what a checkpoint saves."""
        moments: dict[str, dict[str, torch.Tensor]] = {}
        step = torch.zeros(())
        for bucket in self.buckets:
            holders = [bucket.shard] if bucket.shard is not None else bucket.params
            for holder in holders:
                if "step" in self.optimizer.state.get(holder, {}):
                    step = self.optimizer.state[holder]["step"].detach().cpu().float()
            for key in MOMENTS:
                if bucket.shard is not None:
                    state = self.optimizer.state.get(bucket.shard, {})
                    by_name = self._gathered(bucket, state.get(key, torch.zeros_like(bucket.shard)).detach())
                else:
                    by_name = {n: self.optimizer.state.get(p, {}).get(key, torch.zeros_like(p)).detach().clone()
                               for n, p in zip(bucket.names, bucket.params)}
                for name, value in by_name.items():
                    moments.setdefault(name, {})[key] = value
        return moments, step

    def _bucket_slice(self, bucket: _Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
        lo = bucket.rank_in_group * bucket.shard_size
        return _flat(tensors, bucket.shard_size * bucket.group_size)[lo:lo + bucket.shard_size].clone()

    @torch.no_grad()
    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Rebuild this rank's shards (parameters and AdamW state) from the parameters just loaded and
        the moments of every local parameter."""
        for bucket in self.buckets:
            if bucket.shard is None:
                for name, p in zip(bucket.names, bucket.params):
                    self.optimizer.state[p] = {"step": torch.tensor(float(step)),
                                               **{k: moments[name][k].to(p).clone() for k in MOMENTS}}
                continue
            bucket.shard.copy_(self._bucket_slice(bucket, [p.detach() for p in bucket.params]))
            state = {"step": torch.tensor(float(step))}
            for key in MOMENTS:
                state[key] = self._bucket_slice(bucket, [moments[name][key] for name in bucket.names])
            self.optimizer.state[bucket.shard] = state

    @torch.no_grad()
    def params_by_name(self) -> dict[str, torch.Tensor]:
        """Every local parameter's value in its local (TP/EP-sharded) shape: what a checkpoint saves.
        The parameters are whole between steps (the update all-gathers them), so no communication."""
        return {name: p.detach().clone() for name, p in self.named}

    @torch.no_grad()
    def load_params(self, values: dict[str, torch.Tensor]) -> None:
        """Set every local parameter from ``values`` (the inverse of ``params_by_name``) and this
        rank's flat shards from them."""
        for name, p in self.named:
            p.copy_(values[name])
        for bucket in self.buckets:
            if bucket.shard is not None:
                bucket.shard.copy_(self._bucket_slice(bucket, [p.detach() for p in bucket.params]))


def build_sharded_optimizer(model: nn.Module, dims: ParallelDims, cfg: TrainingConfig,
                            tp_kinds: dict[str, ParamKind] | None = None) -> ZeroAdamW | FullyShardedAdamW:
    """The optimizer of ZeRO stage ``dims.parallel.zero``: ``ZeroAdamW`` for 0 and 1 (stage 0 runs as
    stage 1: the same sums, the state sharded anyway), ``FullyShardedAdamW`` (FSDP2) for 2 and 3. Build
    it before the model's first forward: stages 2 and 3 install FSDP on the model's modules."""
    parallel = dims.parallel
    if parallel.zero <= 1:
        return ZeroAdamW(model, dims, cfg, tp_kinds)
    if parallel.overlap:
        raise UserError("ZeRO-2/3 do not run with --overlap yet; use zero 1 or drop --overlap")
    return FullyShardedAdamW(model, dims, cfg, tp_kinds, stage=parallel.zero)
