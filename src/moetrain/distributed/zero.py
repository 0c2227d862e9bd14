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

AdamW is elementwise, so updating flat shards is the same arithmetic as updating each parameter.
Gradient clipping uses the global norm over every distinct parameter element exactly once
(a bucket replicated on ``r`` ranks outside its group contributes 1/r on each), matching
``torch.nn.utils.clip_grad_norm_`` on the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import TrainingConfig
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.tp import ParamKind
from moetrain.distributed.trace import span


@dataclass
class _Bucket:
    names: list[str]
    params: list[nn.Parameter]
    group: dist.ProcessGroup
    pre_reduce: dist.ProcessGroup | None
    norm_share: float
    shard: nn.Parameter
    numel: int
    shard_size: int
    rank_in_group: int
    group_size: int


def _flat(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.nn.functional.pad(flat, (0, padded - flat.numel()))


class ZeroAdamW:
    def __init__(self, model: nn.Module, dims: ParallelDims, cfg: TrainingConfig,
                 tp_kinds: dict[str, ParamKind] | None = None) -> None:
        self.dims, self.cfg = dims, cfg
        embed_shared = dims.size("embed") > 1
        tp = dims.parallel.tp
        # kind → (group whose ranks sum the gradient and share the optimizer state, pre-reduce group,
        # number of copies of each shard outside that group: its weight in the global norm is 1/copies)
        rules: dict[str, tuple[str, str | None, int]] = {
            "expert": ("edp", None, 1),
            "embed": ("stage", "embed", dims.size("embed")),
            "partial": ("stage", None, 1),
            "complete": ("dp_cp", None, tp),
            "sharded": ("dp_cp", None, 1),
        }
        kinds: dict[tuple[str, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, param in model.named_parameters():
            if ".moe.experts." in f".{name}":
                kind = "expert"
            elif name.startswith("embed.") and embed_shared:
                kind = "embed"
            else:
                kind = (tp_kinds or {}).get(name, "partial")
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
            with torch.no_grad():
                flat = _flat([p.detach() for p in params], shard_size * size)
                shard = nn.Parameter(flat[rank * shard_size:(rank + 1) * shard_size].clone())
            self.buckets.append(_Bucket(
                names, params, group, dims.get_group(pre_axis) if pre_axis else None, 1.0 / copies,
                shard, numel, shard_size, rank, size,
            ))
            groups.append({"params": [shard], "weight_decay": cfg.weight_decay if decay else 0.0})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           foreach=True)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None

    @torch.no_grad()
    def step(self, lr: float, norm_sq_correction: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce gradients, clip by the global norm, update this rank's shards, gather the parameters.
        Returns the global gradient norm (on device). ``norm_sq_correction`` (this rank's share, float64)
        is added to the squared norm before it is summed over ranks: expert replicas hold the same
        summed gradient, so all but one are taken back out (``moetrain.distributed.balancing``)."""
        squares = []
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            flat = _flat(grads, bucket.shard_size * bucket.group_size)
            with span("grad_allreduce", "comm"):
                if bucket.pre_reduce is not None:
                    dist.all_reduce(flat, group=bucket.pre_reduce)
                # gloo has no reduce-scatter; an all-reduce then keeping our shard gives the same sums.
                dist.all_reduce(flat, group=bucket.group)
            lo = bucket.rank_in_group * bucket.shard_size
            bucket.shard.grad = flat[lo:lo + bucket.shard_size].clone()
            squares.append(bucket.shard.grad.double().pow(2).sum() * bucket.norm_share)
        total_sq = torch.stack(squares).sum()
        if norm_sq_correction is not None:
            total_sq = total_sq + norm_sq_correction
        dist.all_reduce(total_sq, group=self.dims.get_group("world"))
        grad_norm = total_sq.sqrt().float()
        if self.cfg.grad_clip > 0:
            # Same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm/(norm + 1e-6), at most 1.
            scale = (self.cfg.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
            for bucket in self.buckets:
                bucket.shard.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for bucket in self.buckets:
            parts = [torch.empty_like(bucket.shard) for _ in range(bucket.group_size)]
            with span("param_allgather", "comm"):
                dist.all_gather(parts, bucket.shard.detach(), group=bucket.group)
            flat = torch.cat(parts)
            offset = 0
            for p in bucket.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return grad_norm

    def params_by_name(self) -> dict[str, torch.Tensor]:
        """Each parameter in its local shape (what a checkpoint writes): the parameters themselves."""
        return {name: p.detach() for bucket in self.buckets for name, p in zip(bucket.names, bucket.params)}

    @torch.no_grad()
    def load_params(self, values: dict[str, torch.Tensor]) -> None:
        """Set the parameters (and this rank's flat shards) from ``values`` in local shape."""
        for bucket in self.buckets:
            for name, p in zip(bucket.names, bucket.params):
                if values[name] is not p:
                    p.copy_(values[name])
            size = bucket.shard_size * bucket.group_size
            lo = bucket.rank_in_group * bucket.shard_size
            bucket.shard.copy_(_flat([p.detach() for p in bucket.params], size)[lo:lo + bucket.shard_size])

    @torch.no_grad()
    def moments_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        """The AdamW moments of every local parameter, in its local shape (gathered from the bucket
        shards over each bucket's group), and the step count: what a checkpoint saves."""
        moments: dict[str, dict[str, torch.Tensor]] = {}
        step = torch.zeros(())
        for bucket in self.buckets:
            state = self.optimizer.state.get(bucket.shard, {})
            if "step" in state:
                step = state["step"].detach().cpu().float()
            for key in ("exp_avg", "exp_avg_sq"):
                shard = state.get(key, torch.zeros_like(bucket.shard)).detach()
                parts = [torch.empty_like(shard) for _ in range(bucket.group_size)]
                dist.all_gather(parts, shard.contiguous(), group=bucket.group)
                flat = torch.cat(parts)
                offset = 0
                for name, p in zip(bucket.names, bucket.params):
                    moments.setdefault(name, {})[key] = flat[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
        return moments, step

    @torch.no_grad()
    def load_moments(self, moments: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Rebuild this rank's shards (parameters and AdamW state) from the parameters just loaded and
        the moments of every local parameter."""
        for bucket in self.buckets:
            size = bucket.shard_size * bucket.group_size
            lo, hi = bucket.rank_in_group * bucket.shard_size, (bucket.rank_in_group + 1) * bucket.shard_size
            bucket.shard.copy_(_flat([p.detach() for p in bucket.params], size)[lo:hi])
            state = {"step": torch.tensor(float(step))}
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = _flat([moments[name][key] for name in bucket.names], size)[lo:hi].clone()
            self.optimizer.state[bucket.shard] = state


def build_sharded_optimizer(model: nn.Module, dims: ParallelDims, cfg: TrainingConfig,
                            tp_kinds: dict[str, ParamKind] | None = None) -> ZeroAdamW:
    """The optimizer of the layout's ZeRO stage (stage 0 runs as stage 1)."""
    if dims.parallel.zero >= 2:
        from moetrain.errors import UserError

        raise UserError(f"ZeRO-{dims.parallel.zero} is not available in this build; use zero 1")
    return ZeroAdamW(model, dims, cfg, tp_kinds)
