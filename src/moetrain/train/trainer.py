"""The single-process trainer (CPU or one GPU), written to be subclassed by the distributed runtime.

Phases are named methods (torchtitan style): ``build_model``, ``build_optimizer``, ``next_batch``,
``forward_backward_step``, ``optimizer_step``, ``log``, ``save``, ``load``; ``train()`` only strings
them together. A step makes no host-device synchronisation except one read of the step's metrics at
its end (a single ``.tolist()``), which is also what times the step.

Batch semantics, shared by every layout: ``global_batch`` sequences per optimizer step, split over
data-parallel ranks and micro-batches; each micro-batch's summed token loss is divided by the label
tokens of the whole global batch, so gradient accumulation and any parallel layout compute the same
gradient. Router auxiliary losses are per-micro-batch statistics, weighted by the micro-batch's share
of the global batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from moetrain.config import ClusterConfig, ModelConfig, ParallelConfig, TrainingConfig
from moetrain.costs.flops import training_flops_per_token
from moetrain.costs.params import count_params
from moetrain.data import MicroBatch, PreparedData, StepBatch, prepare_data
from moetrain.errors import UserError
from moetrain.models import ModelOutput, build_model
from moetrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moetrain.train.metrics import MetricsLogger, RoutingTraceWriter, progress_bar, summary_table
from moetrain.train.optim import build_lr_scheduler, build_optimizer, clip_gradients
from moetrain.train.precision import autocast, autocast_dtype


@dataclass(frozen=True)
class RunOptions:
    """How to run (not what to learn): device, cluster for MFU, data and the checkpoint/metrics paths."""

    device: str = "cpu"
    cluster: ClusterConfig | None = None
    """Peak FLOP/s for MFU; None reports MFU as 0."""
    data: str | None = None
    """The user's .txt/.jsonl file or folder; None uses the embedded Shakespeare corpus."""
    metrics_out: Path | None = None
    trace_routing: Path | None = None
    """Write the tokens routed to each expert, per step and MoE layer, to this JSONL file."""
    save_dir: Path | None = None
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end and at --stop-at)."""
    stop_at: int | None = None
    """End after this step as if interrupted (saving a checkpoint); the schedule still spans all steps."""
    resume: bool = False
    show_progress: bool = True


class Trainer:
    def __init__(self, model_cfg: ModelConfig, cfg: TrainingConfig, run: RunOptions,
                 parallel: ParallelConfig | None = None, console: Console | None = None) -> None:
        self.model_cfg, self.cfg, self.run = model_cfg, cfg, run
        self.parallel = parallel or ParallelConfig(micro_batch=cfg.micro_batch)
        self.check_layout()
        self.console = console or Console()
        self.device = torch.device(run.device)
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            # With several threads the CPU backward of the token permutation (an accumulating
            # index_put) adds in thread order; deterministic mode fixes the order so that a resumed run
            # replays the uninterrupted one bit for bit. One thread is deterministic without it.
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.autocast_dtype = self.resolve_autocast_dtype()
        self.check_memory()
        self.data: PreparedData = prepare_data(run.data, model_cfg.vocab_size, cfg.seq_len, cfg.seed)
        self.model = self.build_model()
        self.optimizer = self.build_optimizer()
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.step = 0
        """Optimizer steps completed; also the data position (batches are a function of the step)."""
        self.flops_per_token = float(training_flops_per_token(model_cfg, cfg.seq_len))
        self.peak_flops = run.cluster.peak_flops("bf16") if run.cluster else 0.0
        self.metrics = MetricsLogger(run.metrics_out, resume=run.resume)
        self.routing_trace = self.build_routing_trace()
        self.memory_policy: Any = None
        """The installed recompute/swap handle (``moetrain.memory.AppliedPolicy``), if any; ``remove()`` undoes it."""

    # ----- building: separable so a distributed subclass can shard each piece -----
    def check_layout(self) -> None:
        if self.parallel.world_size != 1:
            raise UserError(
                f"the plan needs {self.parallel.world_size} ranks (tp·cp·pp·dp) but this trainer runs in one "
                "process; use a plan with every degree 1"
            )
        if self.cfg.global_batch % self.parallel.micro_batch:
            raise UserError(f"--global-batch {self.cfg.global_batch} is not a multiple of the micro-batch "
                            f"{self.parallel.micro_batch}; make it one")

    def check_memory(self) -> None:
        """Refuse, before allocating, a model whose fp32 weights, gradients and AdamW moments (16 bytes
        per parameter) exceed the device's memory; a sharded runtime overrides this."""
        needed = 16 * count_params(self.model_cfg).total_with_mtp
        if self.device.type == "cuda":
            available = torch.cuda.mem_get_info(self.device)[1]
        else:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if needed > available:
            raise UserError(
                f"model {self.model_cfg.name} needs about {needed / 1e9:,.0f} GB for weights, gradients and "
                f"optimizer state but this {self.device.type} has {available / 1e9:,.0f} GB; train a tiny preset "
                "(tiny-pangu, tiny-qwen3, tiny-mixtral) or shard it with the distributed runtime"
            )

    @property
    def dp_rank_and_size(self) -> tuple[int, int]:
        return 0, self.parallel.dp

    def resolve_autocast_dtype(self) -> torch.dtype | None:
        """bf16 autocast on GPU by default, none (fp32) on CPU."""
        return autocast_dtype(self.cfg.dtype, self.device.type)

    def build_model(self) -> nn.Module:
        return build_model(self.model_cfg, device=self.device, seed=self.cfg.seed)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg)

    def moe_layer_indices(self) -> list[int]:
        """Layer index of each MoE block, in the order of ``ModelOutput.tokens_per_expert`` rows: decoder
        layers by their position, then the MTP modules' blocks as ``num_layers + j``."""
        cfg = self.model_cfg
        if cfg.moe is None:
            return []
        decoder = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        return decoder + [cfg.num_layers + j for j in range(cfg.num_mtp_layers)]

    def build_routing_trace(self) -> RoutingTraceWriter | None:
        if self.run.trace_routing is None:
            return None
        layers = self.moe_layer_indices()
        if not layers:
            raise UserError(f"--trace-routing needs an MoE model; {self.model_cfg.name} has no MoE layers")
        blocks = getattr(self.model, "moe_blocks", None)
        assert blocks is None or len(blocks()) == len(layers), "MoE block count differs from the config's"
        return RoutingTraceWriter(self.run.trace_routing, layers, resume=self.run.resume)

    def config_hash(self) -> str:
        """Identifies what a checkpoint may be resumed into: model, training config and corpus."""
        key = "|".join([self.model_cfg.model_dump_json(), self.cfg.model_dump_json(), self.data.corpus_hash])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    # ----- one step -----
    def next_batch(self) -> StepBatch:
        dp_rank, dp_size = self.dp_rank_and_size
        return self.data.dataset.step_batch(self.step, self.cfg.global_batch, self.parallel.micro_batch,
                                            dp_rank, dp_size)

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.autocast_dtype, self.device.type)

    def aux_loss_scale(self, micro: MicroBatch) -> float:
        """Router balance losses are per-micro-batch statistics: weight each by its share of the batch."""
        return micro.input_ids.shape[0] / self.cfg.global_batch

    def forward_backward_step(self, micro: MicroBatch, batch: StepBatch) -> ModelOutput:
        """Forward and backward of one micro-batch; gradients accumulate in ``.grad``."""
        to_device = lambda t: t.to(self.device, non_blocking=True)
        with self.autocast():
            out = self.model(
                to_device(micro.input_ids), labels=to_device(micro.labels),
                document_ids=to_device(micro.document_ids),
                loss_normalizer=max(batch.global_label_tokens, 1),
                aux_loss_scale=self.aux_loss_scale(micro),
            )
        out.loss.backward()
        return out

    def optimizer_step(self, tokens_per_expert: torch.Tensor | None) -> torch.Tensor:
        """Clip, step, advance the schedule and the router biases; returns the pre-clip grad norm."""
        grad_norm = clip_gradients(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        if tokens_per_expert is not None:
            self.model.update_router_biases(tokens_per_expert)
        return grad_norm

    def train_step(self, batch: StepBatch) -> dict[str, Any]:
        """One optimizer step; returns its metrics after the step's single device read."""
        lr = self.optimizer.param_groups[0]["lr"]
        sums: torch.Tensor | None = None  # [loss, lm, mtp, aux] summed over micro-batches, on device
        tokens_per_expert: torch.Tensor | None = None
        for micro in batch.micro_batches:
            out = self.forward_backward_step(micro, batch)
            parts = torch.stack([out.loss.detach(), out.lm_loss.detach(), out.mtp_loss.detach(),
                                 out.aux_loss.detach() * self.aux_loss_scale(micro)]).float()
            sums = parts if sums is None else sums + parts
            if out.tokens_per_expert is not None:
                counts = out.tokens_per_expert.detach()
                tokens_per_expert = counts if tokens_per_expert is None else tokens_per_expert + counts
        assert sums is not None
        grad_norm = self.optimizer_step(tokens_per_expert)
        load = torch.zeros(0, device=sums.device)
        if tokens_per_expert is not None:
            load_f = tokens_per_expert.float()
            load = load_f.amax(-1) / load_f.mean(-1).clamp(min=1e-9)
        parts = [sums, grad_norm.float().reshape(1).to(sums.device), load]
        trace = self.routing_trace is not None and tokens_per_expert is not None
        if trace:
            # the counts ride in the same read; float64 holds every count exactly (and the fp32 values too)
            parts = [part.double() for part in parts] + [tokens_per_expert.double().flatten()]
        values = torch.cat(parts).tolist()  # the one sync
        loss, lm_loss, mtp_loss, aux_loss, norm = values[:5]
        num_layers = load.numel()
        stats = {"loss": loss, "lm_loss": lm_loss, "mtp_loss": mtp_loss, "aux_loss": aux_loss, "lr": lr,
                 "grad_norm": norm, "expert_load_max_over_mean": values[5:5 + num_layers]}
        if trace:
            counts = [int(v) for v in values[5 + num_layers:]]
            num_experts = len(counts) // num_layers
            stats["tokens_per_expert"] = [counts[i * num_experts:(i + 1) * num_experts] for i in range(num_layers)]
        return stats

    # ----- around the steps -----
    def log(self, stats: dict[str, Any], tokens: int, step_time_s: float) -> dict[str, Any]:
        tokens_per_expert = stats.pop("tokens_per_expert", None)
        if self.routing_trace is not None and tokens_per_expert is not None:
            self.routing_trace.write(self.step, tokens_per_expert)
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else 0.0
        row = {"step": self.step, **stats, "tokens": tokens, "step_time_s": step_time_s,
               "tokens_per_s": tokens_per_s, "mfu": mfu,
               "layout": {**self.parallel.model_dump(), "global_batch": self.cfg.global_batch}}
        self.metrics.log(row)
        if not math.isfinite(stats["loss"]):
            raise UserError(f"loss became {stats['loss']} at step {self.step}; lower --lr or raise --warmup")
        return row

    def save(self) -> Path | None:
        if self.run.save_dir is None:
            return None
        return save_checkpoint(self.run.save_dir, self.step, self.model, self.optimizer,
                               self.trainer_state(), self.config_hash())

    def trainer_state(self) -> dict[str, Any]:
        scheduler_state = {k: v for k, v in self.lr_scheduler.state_dict().items() if k != "lr_lambdas"}
        return {"step": self.step, "lr_scheduler": scheduler_state}

    def load(self) -> bool:
        """Resume from the newest complete checkpoint in ``save_dir``; False when there is none."""
        assert self.run.save_dir is not None
        path = latest_checkpoint(self.run.save_dir)
        if path is None:
            return False
        state = load_checkpoint(path, self.model, self.optimizer, self.config_hash())
        self.step = int(state["step"])
        self.lr_scheduler.load_state_dict({**state["lr_scheduler"], "lr_lambdas": [None]})
        self.console.print(f"resumed from {path} (step {self.step})")
        return True

    def should_save(self, last_step: int) -> bool:
        every = self.run.save_every
        return self.step == last_step or (every > 0 and self.step % every == 0)

    def train(self) -> list[dict[str, Any]]:
        """Run (or resume) until ``steps`` or ``stop_at``; returns the metrics rows of this run."""
        if self.run.resume:
            if self.run.save_dir is None:
                raise UserError("--resume needs --save-dir (the folder holding the checkpoints)")
            if not self.load():
                self.console.print(f"no checkpoint in {self.run.save_dir}; starting from step 0")
        last_step = min(self.cfg.steps, self.run.stop_at or self.cfg.steps)
        self.model.train()
        bar = progress_bar(self.console)
        task = bar.add_task("train", total=self.cfg.steps, completed=self.step, loss=float("nan"),
                            lr=0.0, tokens_per_s=0.0)
        try:
            with bar if self.run.show_progress else contextlib.nullcontext():
                while self.step < last_step:
                    start = time.perf_counter()
                    batch = self.next_batch()
                    stats = self.train_step(batch)
                    self.step += 1
                    row = self.log(stats, batch.global_tokens, time.perf_counter() - start)
                    bar.update(task, completed=self.step, loss=row["loss"], lr=row["lr"],
                               tokens_per_s=row["tokens_per_s"])
                    if self.should_save(last_step):
                        self.save()
        finally:
            self.metrics.close()
            if self.routing_trace is not None:
                self.routing_trace.close()
        return self.metrics.rows

    def describe(self) -> str:
        """One line on what is about to run: data, model, batch and device."""
        dataset, counts = self.data.dataset, count_params(self.model_cfg)
        num_threads = torch.get_num_threads()
        threads = f", {num_threads} thread{'s' * (num_threads > 1)}" if self.device.type == "cpu" else ""
        return (f"data {self.data.corpus_name}: {self.data.num_documents} documents, {len(dataset.stream.tokens):,} "
                f"tokens, {dataset.num_samples:,} sequences of {dataset.seq_len} · model {self.model_cfg.name}: "
                f"{counts.total / 1e6:.2f}M parameters ({counts.active / 1e6:.2f}M active) · "
                f"{self.cfg.steps} steps × {self.cfg.global_batch} sequences · {self.device}{threads}")

    def print_summary(self) -> None:
        title = f"{self.model_cfg.name}: {len(self.metrics.rows)} steps on {self.device.type}"
        self.console.print(summary_table(self.metrics.rows, title))
