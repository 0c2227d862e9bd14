"""The training step of every layout: one process (every degree 1) is the layout it reduces to.

A ``LayoutRun`` is this rank's share of the model (pipeline chunks, tensor/expert shards), its sharded
optimizer (ZeRO-1 by default, ZeRO-2/3 through FSDP2) and the executor of its schedule. ``train_step``
runs one optimizer step on this rank's ``StepBatch``:

Batch semantics, the same for every layout: ``global_batch`` sequences per optimizer step, split over
the data-parallel replicas (replica d takes sequences ``[d·G/dp, (d+1)·G/dp)``) and their
micro-batches. Each label token's loss is divided by the label tokens of the whole global batch and
each micro-batch's balance loss weighted by its share of the batch, so the summed gradient is the
whole batch's, whatever the layout. The step ends with one all-reduce over the layout's world of a
packed vector (loss and its parts, tokens routed to each expert of every MoE layer) and one host read
of it (with the gradient norm and the per-layer load), so its metrics are identical on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist

from moetrain.config import ModelConfig, TrainingConfig
from moetrain.config.model import moe_layer_indices
from moetrain.data import StepBatch, boundary_rows
from moetrain.distributed.host_reads import host_read
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import StageModel, model_moe_blocks, parallelize
from moetrain.distributed.pipeline import Executor, MicroBatch, StepContext
from moetrain.distributed.trace import span
from moetrain.distributed.zero import build_sharded_optimizer
from moetrain.models.attention import DocumentMask
from moetrain.models.transformer import MoETransformer, build_model
from moetrain.runtime_base.optim import lr_multiplier
from moetrain.schedules import interleaved_1f1b, overlapped


@dataclass
class LayoutRun:
    """What one rank needs to step its layout."""

    stage: StageModel
    optimizer: object
    """``ZeroAdamW`` or the FSDP2 optimizer (``zero_grad``, ``step(lr)``, ``moments_by_name``...), or a
    balancer's wrapper of one."""
    executor: Executor
    cfg: TrainingConfig
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    moe_layers: list[int] = field(default_factory=list)
    """MoE layer indices in count-row order (``moe_layer_indices``)."""
    document_mask: DocumentMask = "dense"
    """How attention masks packed documents: a dense boolean mask or FlexAttention tiles (CUDA)."""

    @property
    def dims(self) -> ParallelDims:
        return self.stage.dims

    @property
    def model_cfg(self) -> ModelConfig:
        return self.stage.model.cfg

    @cached_property
    def held_moe_blocks(self) -> list[tuple[int, torch.nn.Module]]:
        """(row in the [layers, experts] count matrix, MoE block) for each MoE layer this rank holds;
        found once, not in every step (balancing moves experts inside the blocks, never the blocks)."""
        model = self.stage.model
        row_of = {layer: row for row, layer in enumerate(self.moe_layers)}
        held = [(row_of[int(index)], layer.moe) for index, layer in model.layers.items() if layer.is_moe]
        held += [(row_of[model.cfg.num_layers + j], module.layer.moe) for j, module in enumerate(model.mtp)
                 if module.layer.is_moe]
        assert len(held) == len(model_moe_blocks(model))
        return held


def build_layout(dims: ParallelDims, model_cfg: ModelConfig, cfg: TrainingConfig, device: torch.device,
                 model: MoETransformer | None = None) -> LayoutRun:
    """Every rank builds the same full model from the seed, with sdpa attention (or takes ``model``), keeps
    its part. The run computes in fp32 until its owner sets ``autocast_dtype`` (the trainer does)."""
    if model is None:
        model = build_model(model_cfg, device, backend="sdpa", seed=cfg.seed)
    stage = parallelize(model, dims)
    optimizer = build_sharded_optimizer(stage.model, dims, cfg, stage.tp_kinds)
    return LayoutRun(stage, optimizer, Executor(stage), cfg, torch.device(device),
                     moe_layers=moe_layer_indices(model_cfg))


@dataclass(frozen=True)
class StepResult:
    """One step's metrics, identical on every rank of the layout."""

    loss: float
    lm_loss: float
    mtp_loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    expert_load_max_over_mean: list[float]
    """Per MoE layer: the most-loaded expert's tokens over the mean."""
    tokens_per_expert: list[list[int]]
    """Per MoE layer (``LayoutRun.moe_layers`` order): the global batch's tokens routed to each expert."""
    skipped: bool = False
    """The loss or the gradient norm was not finite: the step changed nothing (``train_step``)."""

    def metrics(self) -> dict[str, float | list[float]]:
        """The fields of a metrics row (``tokens_per_expert`` goes to the routing trace instead)."""
        return {"loss": self.loss, "lm_loss": self.lm_loss, "mtp_loss": self.mtp_loss, "aux_loss": self.aux_loss,
                "lr": self.lr, "grad_norm": self.grad_norm,
                "expert_load_max_over_mean": self.expert_load_max_over_mean}


def _step_context(run: LayoutRun, batch: StepBatch, loss_scale: float = 1.0) -> StepContext:
    parallel, device = run.dims.parallel, run.device
    micro_batches = [
        MicroBatch(m.input_ids.to(device, non_blocking=True), m.labels.to(device, non_blocking=True),
                   None if m.document_ids is None else m.document_ids.to(device, non_blocking=True),
                   None if m.objective is None else m.objective.to(device),  # RL (moetrain.rl)
                   None if m.expert_ids is None else m.expert_ids.to(device, non_blocking=True),
                   # found before the copy, on the host's ids: no device value is waited for
                   None if m.document_ids is None else boundary_rows(m.document_ids).to(device, non_blocking=True))
        for m in batch.micro_batches
    ]
    normalizer: float = max(batch.global_label_tokens, 1)
    if loss_scale != 1.0:  # an injected fault (``moetrain.train.faults``): NaN, or a spike, in loss and gradient
        normalizer = normalizer / loss_scale
    return StepContext(
        # a fill, not torch.tensor(...): a copy from pageable host memory would wait for the device
        loss_normalizer=torch.full((), normalizer, device=device),
        aux_loss_scale=1.0 / (len(micro_batches) * parallel.dp), micro_batches=micro_batches,
        hidden_shapes=[(rows, positions // (parallel.tp * parallel.cp), run.model_cfg.hidden_size)
                       for rows, positions in (m.input_ids.shape for m in micro_batches)],
        dtype=torch.float32, device=device, loss_sum=torch.zeros((), device=device),
        tp_group=run.dims.get_group("tp") if parallel.tp > 1 else None,
        loss_parts=torch.zeros(3, device=device), tokens_per_expert={},
        autocast_dtype=run.autocast_dtype, document_mask=run.document_mask,
    )


def train_step(run: LayoutRun, step: int, batch: StepBatch, loss_scale: float = 1.0) -> StepResult:
    """Optimizer step ``step`` (0-based: it sets the learning rate) of this rank on its ``batch``.

    A step whose loss or gradient norm is not finite changes nothing (``StepResult.skipped``): no
    update of the weights, the AdamW moments or the routers' biases. ``loss_scale`` multiplies this
    rank's loss (fault injection only: NaN, or a spike)."""
    dims, cfg = run.dims, run.cfg
    parallel = dims.parallel
    ctx = _step_context(run, batch, loss_scale)
    schedule = overlapped if parallel.overlap else interleaved_1f1b
    actions = schedule(parallel.pp, parallel.vpp, len(ctx.micro_batches), dims.pp_rank)
    lr = cfg.lr * lr_multiplier(step, cfg)
    run.optimizer.zero_grad()
    # A balancer's optimizer starts the replicated experts' gradient rings under the backward; it must know
    # how many backward passes (one per micro-batch) make a layer's gradients final.
    expect_backward = getattr(run.optimizer, "expect_backward", None)
    if expect_backward is not None:
        expect_backward(len(ctx.micro_batches))
    run.executor.run(actions, ctx)
    with span("optimizer", "compute"):
        grad_norm = run.optimizer.reduce_gradients()
    # Each rank counts the tokens it routed (its replica, its sequence shard under TP/CP, its stage's
    # layers): the world sum is the global count. Loss terms are computed whole on every TP rank.
    layers = run.moe_layers
    num_experts = run.model_cfg.moe.num_experts if run.model_cfg.moe is not None else 0
    counts = torch.zeros(len(layers), num_experts, dtype=torch.float64, device=run.device)
    row_of = {layer: row for row, layer in enumerate(layers)}
    assert ctx.tokens_per_expert is not None and ctx.loss_parts is not None
    for layer, layer_counts in ctx.tokens_per_expert.items():
        counts[row_of[layer]] += layer_counts.double()
    packed = torch.cat([ctx.loss_sum.double().reshape(1), ctx.loss_parts.double(), counts.flatten()])
    dist.all_reduce(packed, group=dims.get_group("world"))
    global_counts = packed[4:].view(len(layers), num_experts)
    load = global_counts.amax(-1) / global_counts.mean(-1).clamp(min=1e-9) if layers else packed.new_zeros(0)
    # The step's one read comes before the update, which it decides: the host waits for the backward
    # here rather than after the update (on a GPU the update's launch is no longer hidden behind it).
    with host_read("step metrics"):
        values = torch.cat([packed, grad_norm.double().reshape(1).to(packed.device), load]).tolist()
    loss, lm_loss, mtp_loss, aux_loss = (v / parallel.tp for v in values[:4])
    num_counts = len(layers) * num_experts
    # Both values are world sums (a non-finite term on any rank makes the sum non-finite), read from the
    # same all-reduced tensors on every rank: the ranks take the same decision and never diverge.
    skipped = not (math.isfinite(loss) and math.isfinite(values[4 + num_counts]))
    if skipped:
        run.optimizer.discard_update()
    else:
        with span("optimizer", "compute"):
            run.optimizer.apply_update(lr, grad_norm)
        # The aux-loss-free bias step (a no-op for routers without a score bias), from global counts.
        for row, block in run.held_moe_blocks:
            block.router.update_bias(global_counts[row])
    flat_counts = [int(v) for v in values[4:4 + num_counts]]
    return StepResult(
        loss=loss, lm_loss=lm_loss, mtp_loss=mtp_loss, aux_loss=aux_loss, lr=lr,
        grad_norm=values[4 + num_counts], expert_load_max_over_mean=values[5 + num_counts:],
        tokens_per_expert=[flat_counts[i * num_experts:(i + 1) * num_experts] for i in range(len(layers))],
        skipped=skipped,
    )
