"""The one training loop of moetrain, for every layout: one process is the layout whose degrees are all 1.

``Trainer(spec)`` joins the process group torchrun set up (or, in one process, makes a one-rank group
of its own), builds this rank's share of the model with its sharded optimizer
(``moetrain.distributed.step.build_layout``), installs the memory policy and, when asked, the online
expert balancer, then ``train()`` repeats: next batch → ``train_step`` → metrics row → checkpoint.
The same metrics rows, routing trace, checkpoints and resume serve every layout; the layout's first
rank writes files and talks to the console, and every rank keeps the rows in memory (they are
identical: the step's metrics are all-reduced).

Batches are a function of the step (``PackedDataset.step_batch``), so a resumed run reads exactly the
data the uninterrupted one would have, under any layout.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from moetrain.config import ClusterConfig, ModelConfig, load_cluster_config, load_model_config
from moetrain.config.run import RunSpec
from moetrain.costs.flops import training_flops_per_token
from moetrain.costs.params import count_params
from moetrain.data import PreparedData, StepBatch, prepare_data
from moetrain.data.synthetic import SyntheticDataset
from moetrain.distributed.checkpoint import load_checkpoint, read_expert_placement, save_checkpoint
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import LayoutRun, StepResult, build_layout, train_step
from moetrain.distributed.trace import Tracer
from moetrain.distributed.world import join_world
from moetrain.errors import UserError
from moetrain.models.transformer import MoETransformer
from moetrain.train.checkpoint import is_model_only, latest_checkpoint, read_marker, run_identity, should_save
from moetrain.train.checks import check_run
from moetrain.train.host_memory import keep_freed_host_memory
from moetrain.train.metrics import (
    MetricsLogger,
    RoutingTraceWriter,
    TrainingProgress,
    keep_rows_through,
    summary_table,
)
from moetrain.train.precision import autocast_dtype


def resolve_device(device: str) -> torch.device:
    """auto → cuda when available; each rank of a multi-rank CUDA run takes its local GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {device} but no CUDA device is visible; use --device cpu")
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return torch.device(device)


class Trainer:
    def __init__(self, spec: RunSpec, *, dims: ParallelDims | None = None, model_cfg: ModelConfig | None = None,
                 model: MoETransformer | None = None, console: Console | None = None) -> None:
        """``dims``: this rank's place in a layout built by the caller (tests run several layouts side by
        side in one world); ``model_cfg``/``model``: instead of ``spec.model`` (a model the caller built
        from the seed, e.g. with a skewed router)."""
        self.spec, self.cfg = spec, spec.training
        self.model_cfg = model_cfg or load_model_config(spec.model)
        check_run(spec, self.model_cfg)  # the same checks as before any rank started (cheap, torch-free)
        self.device = resolve_device(spec.run.device)
        if spec.run.threads is not None:
            torch.set_num_threads(spec.run.threads)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # activations live in host memory: reuse it step after step
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            # With several threads the CPU backward of the token permutation (an accumulating
            # index_put) adds in thread order; deterministic mode fixes the order so that a resumed run
            # replays the uninterrupted one bit for bit. One thread is deterministic without it.
            torch.use_deterministic_algorithms(True, warn_only=True)
        self._own_world = contextlib.ExitStack()
        if dims is None:
            rank = self._own_world.enter_context(join_world(self.device, spec.run.timeout_s))
            world_size = dist.get_world_size()
            if world_size != spec.world_size:
                self._own_world.close()
                raise UserError(f"the layout needs {spec.world_size} ranks (tp·cp·pp·dp) but {world_size} run it; "
                                "start it with moetrain train --nproc N or torchrun --nproc-per-node N")
            dims = ParallelDims.build(spec.parallel, rank, spec.run.ranks_per_node)
        self.dims = dims
        self.is_reporter = dims.rank == dims.group_ranks["world"][0]
        """The layout's first rank writes the files and the console lines."""
        self.console = console or Console(quiet=not self.is_reporter)
        try:
            self._build(model)
        except BaseException:
            self._own_world.close()
            raise

    def _build(self, model: MoETransformer | None) -> None:
        spec, cfg = self.spec, self.cfg
        if spec.world_size == 1:
            self.check_memory()
        self.data = self.prepare_data()
        self.dataset = self.data.dataset if self.data is not None else SyntheticDataset(
            self.model_cfg.vocab_size, cfg.seq_len, cfg.seed)
        self.cluster = self.resolve_cluster()
        self.balancer = None
        self.run = self.build_run(model)
        self.run.autocast_dtype = autocast_dtype(cfg.dtype, self.device.type)
        self.memory_policy = self.apply_memory_policy()
        self.compiled_layers = self.apply_compile()
        self.step = 0
        """Optimizer steps completed; also the data position (batches are a function of the step)."""
        self.flops_per_token = float(training_flops_per_token(self.model_cfg, cfg.seq_len))
        self.peak_flops = self.cluster.peak_flops("bf16") * spec.world_size
        paths = spec.run
        if paths.resume and self.is_reporter:
            self.drop_rows_after_checkpoint()
        self.metrics = MetricsLogger(Path(paths.metrics_out) if paths.metrics_out and self.is_reporter else None,
                                     resume=paths.resume,
                                     tensorboard_dir=Path(paths.tensorboard) if paths.tensorboard and self.is_reporter
                                     else None)
        self.routing_trace = None
        if paths.trace_routing and self.is_reporter:
            self.routing_trace = RoutingTraceWriter(Path(paths.trace_routing), self.run.moe_layers, resume=paths.resume)
        self.tracer = Tracer(self.dims.rank)
        self.fault = _injected_fault(self.dims.rank)

    # ----- building -----
    def check_memory(self) -> None:
        """Refuse, before allocating, a model whose fp32 weights, gradients and AdamW moments (16 bytes
        per parameter) exceed the one device's memory."""
        needed = 16 * count_params(self.model_cfg).total_with_mtp
        if self.device.type == "cuda":
            available = torch.cuda.mem_get_info(self.device)[1]
        else:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if needed > available:
            raise UserError(
                f"model {self.model_cfg.name} needs about {needed / 1e9:,.0f} GB for weights, gradients and "
                f"optimizer state but this {self.device.type} has {available / 1e9:,.0f} GB; train a tiny preset "
                "(tiny-pangu, tiny-qwen3, tiny-mixtral) or shard it over several ranks (--nproc with a layout)"
            )

    def prepare_data(self) -> PreparedData | None:
        """The layout's first rank builds (or reads) the cached tokenizer and token stream first; the
        others then read the cache, so no two ranks write the same cache file."""
        if self.spec.run.synthetic_data:
            return None
        args = (self.spec.run.data, self.model_cfg.vocab_size, self.cfg.seq_len, self.cfg.seed)
        status = None if self.spec.run.quiet else self.console  # the first run's download and tokenizer say so
        data = prepare_data(*args, console=status) if self.is_reporter else None
        dist.barrier(group=self.dims.get_group("world"))
        return data if data is not None else prepare_data(*args)

    def resolve_cluster(self) -> ClusterConfig:
        name = self.spec.run.cluster
        if name == "auto":
            name = "h100-sxm-80gb" if self.device.type == "cuda" else "cpu"
        return load_cluster_config(name)

    def build_run(self, model: MoETransformer | None) -> LayoutRun:
        if not self.spec.balance.enabled:
            return build_layout(self.dims, self.model_cfg, self.cfg, self.device, model=model)
        from moetrain.distributed.balancing import build_balanced_run

        balance = self.spec.balance
        tuning = {name: value for name, value in (("interval", balance.interval), ("horizon", balance.horizon))
                  if value is not None}
        run, self.balancer = build_balanced_run(self.dims, self.model_cfg, self.cfg, self.device, self.cluster,
                                                model=model, slots_per_rank=balance.slots_per_rank, **tuning)
        return run

    def apply_memory_policy(self):
        """Install the recompute/swap options of the layers this rank holds (``moetrain.memory``)."""
        options = self.spec.memory
        if options.policy == "none":
            return None
        from moetrain.memory.options import choose_plan, held_layers_plan
        from moetrain.memory.runtime import apply_memory_policy

        model = self.run.stage.model
        dtype_bytes = 2.0 if self.run.autocast_dtype is not None else 4.0
        result = choose_plan(self.model_cfg, options, self.cfg.seq_len, self.cfg.micro_batch, dtype_bytes,
                             self.device.type)
        held = [int(index) for index in model.layers] + [self.model_cfg.num_layers + j for j in range(len(model.mtp))]
        applied = apply_memory_policy(model, held_layers_plan(result.plan, held))
        chosen = ", ".join(f"{name}×{count}" for name, count in sorted(result.options.items())) or "nothing"
        self.console.print(f"memory policy {options.policy}: {chosen}; activations "
                           f"{result.activation_bytes / 2**20:,.1f} of {result.baseline_bytes / 2**20:,.1f} MiB "
                           "per micro-batch (analytic, whole model)")
        return applied

    def apply_compile(self) -> int:
        """Compile the layers this rank holds when the spec asks (default: on CUDA); after the memory
        policy, whose recompute wrappers the compiled layers then trace through."""
        wanted = self.spec.run.compile
        if not (self.device.type == "cuda" if wanted is None else wanted):
            return 0
        if self.spec.memory.policy in ("selective", "auto"):
            # the default on CUDA yields to these policies (an explicit --compile is refused by check_run)
            self.console.print(f"not compiling: the {self.spec.memory.policy} memory policy's saved-tensor hooks "
                               "cannot be compiled yet")
            return 0
        from moetrain.distributed.parallelize import apply_compile

        return apply_compile(self.run.stage.model)

    def drop_rows_after_checkpoint(self) -> None:
        """Rows logged after the newest checkpoint (a run interrupted between saves) are replayed by the
        resumed run: drop them first, so the metrics file and the routing trace keep one row per step."""
        path = latest_checkpoint(Path(self.spec.run.save_dir)) if self.spec.run.save_dir else None
        step = read_marker(path)["step"] if path is not None and not is_model_only(path) else 0
        for file in (self.spec.run.metrics_out, self.spec.run.trace_routing):
            if file and (dropped := keep_rows_through(Path(file), step)):
                self.console.print(f"dropped {dropped} rows after step {step} from {file} (the resumed run "
                                   "writes them again)")

    @property
    def dp_rank(self) -> int:
        return self.dims.local_rank("dp")

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of this run may be resumed into (``run_identity``): model, training, corpus."""
        corpus = self.data.corpus_hash if self.data is not None else "synthetic"
        return run_identity(self.model_cfg, self.cfg, corpus)

    # ----- one step -----
    def next_batch(self) -> StepBatch:
        return self.dataset.step_batch(self.step, self.cfg.global_batch, self.cfg.micro_batch, self.dp_rank,
                                       self.spec.parallel.dp)

    # ----- around the steps -----
    def log(self, result: StepResult, tokens: int, step_time_s: float, extra: dict[str, Any]) -> dict[str, Any]:
        if self.routing_trace is not None:
            self.routing_trace.write(self.step, result.tokens_per_expert)
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else 0.0
        row = {"step": self.step, **result.metrics(), "tokens": tokens, "step_time_s": step_time_s,
               "tokens_per_s": tokens_per_s, "mfu": mfu,
               "layout": {**self.spec.parallel.model_dump(), "global_batch": self.cfg.global_batch}, **extra}
        self.metrics.log(row)
        if not (row["loss"] == row["loss"] and abs(row["loss"]) != float("inf")):
            raise UserError(f"loss became {row['loss']} at step {self.step}; lower --lr or raise --warmup")
        return row

    def save(self) -> Path | None:
        if self.spec.run.save_dir is None:
            return None
        self.fault(self.step, "save")
        placement = self.balancer.state_dict() if self.balancer is not None else None
        return save_checkpoint(Path(self.spec.run.save_dir), self.step, self.run, self.model_cfg, self.cfg,
                               identity=self.identity(), expert_placement=placement)

    def load(self) -> bool:
        """Resume from the newest complete checkpoint in ``save_dir``; False when there is none."""
        assert self.spec.run.save_dir is not None
        path = latest_checkpoint(Path(self.spec.run.save_dir))
        if path is None:
            return False
        if self.balancer is not None:  # adopt the saved placement first: slots then load their experts
            saved = read_expert_placement(path)
            restored = saved is not None and self.balancer.load_state_dict(saved)
            self.console.print("restored the saved expert placement" if restored else
                               "no expert placement of this EP size in the checkpoint; starting from the "
                               "contiguous one")
        self.step = load_checkpoint(path, self.run, self.model_cfg, identity=self.identity())
        self.console.print(f"resumed from {path} (step {self.step})")
        return True

    def train(self) -> list[dict[str, Any]]:
        """The loop: run (or resume) until ``steps`` or ``stop_at``; returns the metrics rows of this run."""
        run_options = self.spec.run
        show = self.is_reporter and not run_options.quiet
        try:
            if run_options.resume and not self.load():
                self.console.print(f"no checkpoint in {run_options.save_dir}; starting from step 0")
            last_step = min(self.cfg.steps, run_options.stop_at or self.cfg.steps)
            self.run.stage.model.train()
            with TrainingProgress(self.console, self.cfg.steps, self.step, enabled=show) as progress:
                self._steps(last_step, progress)
            if self.balancer is not None:
                self.balancer.finish_migration()  # the last step's move, if any, lands before the ranks part
            if run_options.trace_dir:
                self.tracer.save(Path(run_options.trace_dir) / f"rank{self.dims.rank}.json")
                self.console.print(f"a2a_hidden_fraction {self.tracer.a2a_hidden_fraction():.3f} (this rank)")
        finally:
            self.close()
        return self.metrics.rows

    def _steps(self, last_step: int, progress: TrainingProgress) -> None:
        """Step until ``last_step``: batch → the step → metrics row → checkpoint."""
        while self.step < last_step:
            self.fault(self.step, "step")
            start = time.perf_counter()
            batch = self.next_batch()
            batch_done = time.perf_counter()
            with self.tracer.active():
                result = train_step(self.run, self.step, batch)
            self.step += 1
            step_done = time.perf_counter()
            extra = self.after_step()
            # the step's parts as the host sees them (no added sync: on an accelerator the host may run ahead)
            extra.update(batch_time_s=batch_done - start, train_step_time_s=step_done - batch_done,
                         after_step_time_s=time.perf_counter() - step_done)
            row = self.log(result, batch.global_tokens, time.perf_counter() - start, extra)
            progress.update(self.step, row)
            if should_save(self.step, last_step, self.spec.run.save_every):
                self.save()

    def after_step(self) -> dict[str, Any]:
        """The balancer's decision after the step (its metrics join the row)."""
        if self.balancer is None:
            return {}
        decisions = self.balancer.after_step(self.step - 1)
        for line in self.balancer.describe(decisions):
            self.console.print(line)
        return self.balancer.step_metrics(decisions)

    def close(self) -> None:
        self.metrics.close()
        if self.routing_trace is not None:
            self.routing_trace.close()
        self._own_world.close()

    def describe(self) -> str:
        """One line on what is about to run: data, model, batch, layout and device."""
        counts = count_params(self.model_cfg)
        if self.data is not None:
            dataset = self.data.dataset
            data = (f"data {self.data.corpus_name}: {self.data.num_documents} documents, "
                    f"{len(dataset.stream.tokens):,} tokens, {dataset.num_samples:,} sequences of {dataset.seq_len}")
        else:
            data = f"synthetic counting sequences of {self.cfg.seq_len}"
        num_threads = torch.get_num_threads()
        threads = f", {num_threads} thread{'s' * (num_threads > 1)}" if self.device.type == "cpu" else ""
        p = self.spec.parallel
        degrees = [f"{axis}{getattr(p, axis)}" for axis in ("tp", "cp", "pp", "vpp", "dp", "ep", "etp")
                   if getattr(p, axis) > 1]
        layout = (f" · {self.spec.world_size} ranks: {'×'.join(degrees)}, ZeRO-{max(p.zero, 1)}"
                  f"{', overlapped' if p.overlap else ''}") if self.spec.world_size > 1 else ""
        return (f"{data} · model {self.model_cfg.name}: {counts.total / 1e6:.2f}M parameters "
                f"({counts.active / 1e6:.2f}M active) · {self.cfg.steps} steps × {self.cfg.global_batch} sequences · "
                f"{self.device.type}{threads}{', compiled' if self.compiled_layers else ''}{layout}")

    def print_summary(self) -> None:
        title = f"{self.model_cfg.name}: {len(self.metrics.rows)} steps on {self.device.type}"
        if self.spec.world_size > 1:
            title += f" × {self.spec.world_size} ranks"
        # no MFU on a CPU: the cpu preset's peak is nominal (the metrics rows keep the relative figure)
        self.console.print(summary_table(self.metrics.rows, title, model_cfg=self.model_cfg,
                                         show_mfu=self.device.type != "cpu"))


def _injected_fault(rank: int):
    """``MOETRAIN_FAULT=rank:step:raise|kill[:save]`` fails one rank at one step, before it (default) or
    as it saves the checkpoint after it (tests of the failure path)."""
    spec = os.environ.get("MOETRAIN_FAULT")
    if not spec:
        return lambda step, phase: None
    fault_rank, fault_step, kind, *where = spec.split(":")
    fault_phase = where[0] if where else "step"

    def fault(step: int, phase: str) -> None:
        if int(fault_rank) == rank and int(fault_step) == step and phase == fault_phase:
            if kind == "kill":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault at step {step}")

    return fault


__all__ = ["Trainer", "resolve_device"]
