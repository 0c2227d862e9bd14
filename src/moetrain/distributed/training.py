"""The distributed training loop on real data, with the single-process trainer's metrics and checkpoints.

Each data-parallel replica takes its slice of the global batch from the same ``PackedDataset`` the
single-process trainer reads (``step_batch(step, G, micro, dp_rank, dp)``), so any layout trains on
exactly the tokens of ``moetrain train``. A step ends with one all-reduce over the world of a packed
vector (loss and its parts, tokens routed to each expert of every MoE layer) and one host read of it;
rank 0 writes the metrics row (``moetrain.train.metrics`` format) and the routing trace. Checkpoints
are ``moetrain.distributed.checkpoint``'s, sealed with the single-process trainer's ``config_hash`` so
either runtime resumes the other's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig
from moetrain.data import PreparedData, StepBatch
from moetrain.distributed.pipeline import MicroBatch, StepContext
from moetrain.distributed.schedules import interleaved_1f1b, overlapped
from moetrain.distributed.step import LayoutRun
from moetrain.distributed.trace import span
from moetrain.models.transformer import IGNORE_INDEX
from moetrain.train.optim import lr_multiplier


def moe_layer_indices(model_cfg: ModelConfig) -> list[int]:
    """The single-process trainer's MoE layer order (decoder layers, then MTP blocks as num_layers + j)."""
    from moetrain.train.trainer import Trainer

    return Trainer.moe_layer_indices(SimpleNamespace(model_cfg=model_cfg))  # type: ignore[arg-type]


def trainer_config_hash(model_cfg: ModelConfig, cfg: TrainingConfig, data: PreparedData) -> str:
    """The single-process trainer's own ``config_hash`` (called, not re-derived), so the checkpoints of
    both runtimes carry the same hash for the same model, training config and corpus."""
    from moetrain.train.trainer import Trainer

    return Trainer.config_hash(SimpleNamespace(model_cfg=model_cfg, cfg=cfg, data=data))  # type: ignore[arg-type]


def synthetic_step_batch(step: int, cfg: TrainingConfig, vocab_size: int, dp_rank: int, dp_size: int) -> StepBatch:
    """``moetrain.distributed.step.synthetic_batch`` as a ``StepBatch`` (counting sequences, no documents)."""
    from moetrain.data import MicroBatch as HostMicroBatch
    from moetrain.distributed.step import synthetic_batch

    input_ids, labels = synthetic_batch(step, cfg, vocab_size)
    per_replica = cfg.global_batch // dp_size
    micro_batches = []
    for start in range(dp_rank * per_replica, (dp_rank + 1) * per_replica, cfg.micro_batch):
        rows = slice(start, start + cfg.micro_batch)
        micro_batches.append(HostMicroBatch(input_ids[rows], labels[rows], None,  # type: ignore[arg-type]
                                            int((labels[rows] != IGNORE_INDEX).sum())))
    return StepBatch(micro_batches, int((labels != IGNORE_INDEX).sum()), cfg.global_batch * cfg.seq_len)


@dataclass
class StepResult:
    """One step's metrics, identical on every rank (read from the all-reduced vector)."""

    stats: dict[str, Any]
    tokens_per_expert: list[list[int]]


def _held_moe_blocks(run: LayoutRun, layers: list[int]) -> list[tuple[int, torch.nn.Module]]:
    """(row in the [layers, experts] count matrix, MoE block) for each MoE layer this rank holds."""
    model = run.stage.model
    held = []
    for row, layer in enumerate(layers):
        if layer < model.cfg.num_layers:
            if str(layer) in model.layers:
                held.append((row, model.layers[str(layer)].moe))
        elif layer - model.cfg.num_layers < len(model.mtp):
            held.append((row, model.mtp[layer - model.cfg.num_layers].layer.moe))
    return held


def data_train_step(run: LayoutRun, step: int, batch: StepBatch, cfg: TrainingConfig, device: torch.device,
                    layers: list[int]) -> StepResult:
    """One optimizer step of this rank on its ``batch`` (its replica's micro-batches)."""
    dims = run.stage.dims
    parallel = dims.parallel
    model_cfg = run.stage.model.cfg
    micro_batches = [
        MicroBatch(m.input_ids.to(device), m.labels.to(device),
                   None if m.document_ids is None else m.document_ids.to(device))
        for m in batch.micro_batches
    ]
    num_micro = len(micro_batches)
    num_experts = model_cfg.moe.num_experts if model_cfg.moe is not None else 0
    ctx = StepContext(
        loss_normalizer=torch.tensor(max(batch.global_label_tokens, 1), device=device),
        aux_loss_scale=1.0 / (num_micro * parallel.dp), micro_batches=micro_batches,
        hidden_shape=(cfg.micro_batch, cfg.seq_len // (parallel.tp * parallel.cp), model_cfg.hidden_size),
        dtype=torch.float32, device=device, loss_sum=torch.zeros((), device=device),
        tp_group=dims.get_group("tp") if parallel.tp > 1 else None,
        loss_parts=torch.zeros(3, device=device), tokens_per_expert={},
    )
    schedule = overlapped if parallel.overlap else interleaved_1f1b
    actions = schedule(parallel.pp, parallel.vpp, num_micro, dims.pp_rank)
    lr = cfg.lr * lr_multiplier(step, cfg)
    run.optimizer.zero_grad()
    run.executor.run(actions, ctx)
    with span("optimizer", "compute"):
        grad_norm = run.optimizer.step(lr)
    # Each rank counts the tokens it routed (its replica, its sequence shard under TP, its stage's
    # layers): the world sum is the global count. Loss terms are computed whole on every TP rank.
    counts = torch.zeros(len(layers), num_experts, dtype=torch.float64, device=device)
    row_of = {layer: row for row, layer in enumerate(layers)}
    assert ctx.tokens_per_expert is not None and ctx.loss_parts is not None
    for layer, layer_counts in ctx.tokens_per_expert.items():
        counts[row_of[layer]] += layer_counts.double()
    packed = torch.cat([ctx.loss_sum.double().reshape(1), ctx.loss_parts.double(), counts.flatten()])
    dist.all_reduce(packed, group=dims.get_group("world"))
    global_counts = packed[4:].view(len(layers), num_experts)
    if layers:
        # The aux-loss-free bias step of the single-process trainer (no-op for routers without a bias).
        for row, block in _held_moe_blocks(run, layers):
            block.router.update_bias(global_counts[row])
        load = global_counts.amax(-1) / global_counts.mean(-1).clamp(min=1e-9)
    else:
        load = packed.new_zeros(0)
    values = torch.cat([packed, grad_norm.double().reshape(1).to(packed.device), load]).tolist()  # the one read
    loss, lm_loss, mtp_loss, aux_loss = (v / parallel.tp for v in values[:4])
    num_counts = len(layers) * num_experts
    flat_counts = [int(v) for v in values[4:4 + num_counts]]
    stats = {"loss": loss, "lm_loss": lm_loss, "mtp_loss": mtp_loss, "aux_loss": aux_loss, "lr": lr,
             "grad_norm": values[4 + num_counts], "expert_load_max_over_mean": values[5 + num_counts:]}
    per_layer = [flat_counts[i * num_experts:(i + 1) * num_experts] for i in range(len(layers))]
    return StepResult(stats, per_layer)


def metrics_row(step: int, result: StepResult, tokens: int, step_time_s: float, flops_per_token: float,
                peak_flops_total: float, parallel: ParallelConfig, global_batch: int) -> dict[str, Any]:
    """The single-process trainer's JSONL row (``Trainer.log``); MFU over the peak of all ranks."""
    tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
    mfu = tokens_per_s * flops_per_token / peak_flops_total if peak_flops_total else 0.0
    return {"step": step, **result.stats, "tokens": tokens, "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s, "mfu": mfu,
            "layout": {**parallel.model_dump(), "global_batch": global_batch}}


def should_save(step: int, last_step: int, save_every: int) -> bool:
    """The single-process trainer's rule: at the last step of this run and every ``save_every`` steps."""
    return step == last_step or (save_every > 0 and step % save_every == 0)


def check_finite(loss: float, step: int) -> None:
    from moetrain.errors import UserError

    if not math.isfinite(loss):
        raise UserError(f"loss became {loss} at step {step}; lower --lr or raise --warmup")


def resolve_path(value: str | None) -> Path | None:
    return Path(value) if value else None
