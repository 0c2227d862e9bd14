"""Training steps of one layout, and the single-process reference they must equal.

Batch semantics are the same in every layout: a step consumes ``global_batch`` sequences in
micro-batches of ``micro_batch``; data-parallel replica d takes sequences
``[d·G/dp, (d+1)·G/dp)``. Each label token's loss is divided by the global batch's label-token count
(summed over replicas on the device, no host read), and each micro-batch's balance loss by the global
micro-batch count, so the summed gradient is that of the whole batch whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ModelConfig, TrainingConfig
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import StageModel, parallelize
from moetrain.distributed.pipeline import Executor, MicroBatch, StepContext
from moetrain.distributed.schedules import interleaved_1f1b, overlapped
from moetrain.distributed.trace import Tracer, span
from moetrain.distributed.zero import ZeroAdamW
from moetrain.models.attention import AttentionBackend
from moetrain.models.transformer import IGNORE_INDEX, build_model
from moetrain.train.optim import build_optimizer, lr_multiplier


def synthetic_batch(step: int, cfg: TrainingConfig, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch (input ids, labels) for ``step``: counting sequences (each token
    the previous plus one, modulo a small vocabulary) from random starts, so the loss falls within a
    few steps; a few labels are ignored so the normaliser is not simply B·S."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    period = min(vocab_size, 64)
    starts = torch.randint(0, period, (cfg.global_batch, 1), generator=gen)
    tokens = (starts + torch.arange(cfg.seq_len + 1)) % period
    labels = tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.1] = IGNORE_INDEX
    return tokens[:, :-1].contiguous(), labels


def reference_losses(model_cfg: ModelConfig, cfg: TrainingConfig, steps: int,
                     backend: AttentionBackend = "eager",
                     after_step: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None) -> list[float]:
    """One process, the whole model: the losses every layout must reproduce. ``after_step(completed
    steps, model, optimizer)`` runs after each optimizer step (tests save checkpoints there)."""
    model = build_model(model_cfg, "cpu", backend=backend, seed=cfg.seed)
    optimizer = build_optimizer(model, cfg)
    num_micro = cfg.global_batch // cfg.micro_batch
    losses = []
    for step in range(steps):
        input_ids, labels = synthetic_batch(step, cfg, model_cfg.vocab_size)
        normalizer = (labels != IGNORE_INDEX).sum()
        total = torch.zeros(())
        for m in range(num_micro):
            rows = slice(m * cfg.micro_batch, (m + 1) * cfg.micro_batch)
            out = model(input_ids[rows], labels[rows], loss_normalizer=normalizer, aux_loss_scale=1.0 / num_micro)
            out.loss.backward()
            total += out.loss.detach()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * lr_multiplier(step, cfg)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        if after_step is not None:
            after_step(step + 1, model, optimizer)
    return losses


@dataclass
class LayoutRun:
    stage: StageModel
    optimizer: ZeroAdamW
    executor: Executor


def build_layout(dims: ParallelDims, model_cfg: ModelConfig, cfg: TrainingConfig,
                 device: torch.device, backend: AttentionBackend = "eager") -> LayoutRun:
    model = build_model(model_cfg, device, backend=backend, seed=cfg.seed)
    stage = parallelize(model, dims)
    return LayoutRun(stage, ZeroAdamW(stage.model, dims, cfg, stage.tp_kinds), Executor(stage))


def train_step(run: LayoutRun, step: int, cfg: TrainingConfig, device: torch.device,
               tracer: Tracer | None = None) -> float:
    """One optimizer step of this rank; returns the global batch loss (identical on every rank)."""
    dims = run.stage.dims
    parallel = dims.parallel
    model_cfg = run.stage.model.cfg
    input_ids, labels = synthetic_batch(step, cfg, model_cfg.vocab_size)
    per_replica = cfg.global_batch // parallel.dp
    rows = slice(dims.local_rank("dp") * per_replica, (dims.local_rank("dp") + 1) * per_replica)
    input_ids, labels = input_ids[rows].to(device), labels[rows].to(device)
    normalizer = (labels != IGNORE_INDEX).sum()
    dist.all_reduce(normalizer, group=dims.get_group("dp"))
    num_micro = per_replica // cfg.micro_batch
    micro_batches = [
        MicroBatch(input_ids[m * cfg.micro_batch:(m + 1) * cfg.micro_batch],
                   labels[m * cfg.micro_batch:(m + 1) * cfg.micro_batch])
        for m in range(num_micro)
    ]
    ctx = StepContext(
        loss_normalizer=normalizer, aux_loss_scale=1.0 / (num_micro * parallel.dp), micro_batches=micro_batches,
        hidden_shape=(cfg.micro_batch, cfg.seq_len // (parallel.tp * parallel.cp), model_cfg.hidden_size),
        dtype=torch.float32, device=device,
        loss_sum=torch.zeros((), device=device),
        tp_group=dims.get_group("tp") if parallel.tp > 1 else None,
    )
    schedule = overlapped if parallel.overlap else interleaved_1f1b
    actions = schedule(parallel.pp, parallel.vpp, num_micro, dims.pp_rank)
    run.optimizer.zero_grad()
    run.executor.run(actions, ctx)
    with span("optimizer", "compute"):
        run.optimizer.step(cfg.lr * lr_multiplier(step, cfg))
    loss = ctx.loss_sum.clone()
    dist.all_reduce(loss, group=dims.get_group("world"))
    # Every rank of a TP group reports the same micro-batches: count them once.
    return float(loss) / parallel.tp
