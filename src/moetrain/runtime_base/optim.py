"""AdamW and the warm-up + cosine learning-rate schedule.

Weight decay applies to matrices only (projections, experts, embeddings); gains of norms, biases and
other 1-D parameters are not decayed, the usual practice since GPT-2 / nanoGPT.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.config import TrainingConfig


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return adamw(groups, cfg)


def adamw(groups: list[dict], cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over ``groups`` with the kernels the trainer steps it with. On CUDA the fused kernel: one pass
    over parameters, gradients and moments, its step counter on the device (no host scalar). Elsewhere the
    foreach path, which the CPU parity tests replay bit for bit. ``moetrain profile`` times this update, so
    it must be the trainer's."""
    on_cuda = all(g["params"][0].is_cuda for g in groups if g["params"])
    kernels = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernels)


def clip_gradients(params, max_norm: float) -> torch.Tensor:
    """The total gradient norm of ``params`` (those with a gradient), before clipping; the gradients are
    scaled down to ``max_norm`` when above it (``max_norm`` 0: no clipping)."""
    with_grad = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)
    return norm


def lr_multiplier(step: int, cfg: TrainingConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based) over the peak ``cfg.lr``.

    Linear warm-up from lr/warmup to lr over ``warmup_steps`` steps, then cosine decay to
    ``min_lr_ratio·lr`` at the last step (Loshchilov & Hutter 2017, SGDR, without restarts).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
