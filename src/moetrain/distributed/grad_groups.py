"""What every sharded AdamW shares: which group sums each gradient and holds its optimizer state, and the
update's preamble (the global gradient norm, the clip, the step's learning rate).

``zero.ZeroAdamW`` (stages 0 and 1) and ``fsdp.FullyShardedAdamW`` (stages 2 and 3) both build on these
rules, so a parameter's gradient is reduced over the same ranks and clipped by the same norm whichever
stage runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.tp import ParamKind
from moetrain.models.transformer import is_routed_expert

MOMENTS = ("exp_avg", "exp_avg_sq")


def kind_rules(dims: ParallelDims) -> dict[str, tuple[str, str | None, int]]:
    """Gradient kind → (group whose ranks sum the gradient and share the optimizer state, pre-reduce
    group, number of copies of each shard outside that group: its weight in the global norm is 1/copies)."""
    return {
        "expert": ("edp", None, 1),
        "embed": ("stage", "embed", dims.size("embed")),
        "partial": ("stage", None, 1),
        "complete": ("dp_cp", None, dims.parallel.tp),
        "sharded": ("dp_cp", None, 1),
    }


def param_kind(name: str, dims: ParallelDims, tp_kinds: dict[str, ParamKind] | None,
               shared_embedding: bool = True) -> str:
    """The gradient kind of parameter ``name`` of a parallelized stage model (a key of ``kind_rules``).
    ``shared_embedding``: the last pipeline stage holds an embedding too (``last_stage_holds_embedding``);
    without one, the first stage's embedding is an ordinary parameter (no ``embed`` partner to wait for)."""
    if is_routed_expert(name):
        return "expert"
    if name.startswith("embed.") and dims.size("embed") > 1 and shared_embedding:
        return "embed"
    return (tp_kinds or {}).get(name, "partial")


def world_norm(squares: list[torch.Tensor], norm_sq_correction: torch.Tensor | None, group) -> torch.Tensor:
    """The global gradient norm from this rank's weighted squared norms (float64), summed over ``group``."""
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if norm_sq_correction is not None:
        total_sq = total_sq + norm_sq_correction
    dist.all_reduce(total_sq, group=group)
    return total_sq.sqrt().float()


def clip_and_set_lr(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor], grad_norm: torch.Tensor,
                    max_norm: float, lr: float) -> None:
    """Scale ``grads`` by the global ``grad_norm`` as ``torch.nn.utils.clip_grad_norm_`` does
    (max_norm/(norm + 1e-6), at most 1; 0: no clipping) and set the step's learning rate: the update's
    preamble in every sharded optimizer (``zero.ZeroAdamW``, ``fsdp.FullyShardedAdamW``)."""
    if max_norm > 0 and grads:
        scale = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    for group in optimizer.param_groups:
        group["lr"] = lr
