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

A run of another objective (the RL warm-up and GRPO, StaleSync's trainer side) is the same ``Trainer`` given
two objects: a batch source and one ``TrainerHooks`` (``Trainer(spec, SuppliedParts(batches=...,
hooks=...))``), whose methods the loop calls at fixed points, passing the trainer and what the point knows
(the step, its batch, the checkpoint's folder). One hooks object rather than a list: the RL objectives
differ inside (where samples come from, which policies the loss compares), not by stacking independent
callbacks, and with one object there is no rule to learn for which of several hooks makes the batch, names
the run or prints its summary. A hooks object keeps its own state (GRPO's step statistics, StaleSync's
queues); the trainer keeps none of it. The call order, for a run that resumes and saves:

    attach → loaded → per step: finished → next_batch → after_step → finished → saved → ... → close

(``finished`` is asked before each step and after it, where a True also saves; ``saved`` follows every
checkpoint written, ``loaded`` a resume; ``describe``/``summary`` when the caller prints them.)
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from rich.console import Console, RenderableType

from moetrain.balance.online import BALANCE_DEFAULTS
from moetrain.config import ClusterConfig, ModelConfig, cluster_for_device, load_cluster_config, load_model_config
from moetrain.config.run import RunSpec
from moetrain.costs.flops import training_flops_per_token
from moetrain.costs.params import count_params
from moetrain.data import PreparedData, StepBatch, prepare_data
from moetrain.data.synthetic import SyntheticDataset
from moetrain.distributed.checkpoint import checkpoint_state, load_checkpoint, read_expert_placement
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import apply_compile, compile_events
from moetrain.distributed.step import LayoutRun, StepResult, build_layout, train_step
from moetrain.distributed.trace import Tracer
from moetrain.distributed.world import (
    collective_timeout_s,
    end_startup_timeout,
    join_world,
    restore_collective_timeout,
)
from moetrain.errors import UserError
from moetrain.memory.measure import host_link_bytes_per_s
from moetrain.memory.options import (
    activation_shape,
    choose_plan,
    excluded_options,
    held_layers_plan,
    nominal_speed,
)
from moetrain.memory.runtime import apply_memory_policy
from moetrain.models.transformer import MoETransformer
from moetrain.runtime_base.checkpoint_files import (
    checkpoint_step,
    is_model_only,
    latest_checkpoint,
    read_marker,
    run_identity,
    should_save,
)
from moetrain.runtime_base.host_memory import keep_freed_host_memory
from moetrain.runtime_base.precision import autocast_dtype
from moetrain.runtime_base.recovery import (
    Restart,
    attempt,
    last_progress,
    note_restart,
    previous_failure,
    record_progress,
)
from moetrain.threads import ThreadChoice, choose_threads
from moetrain.train.checks import check_run
from moetrain.train.faults import injected_faults
from moetrain.train.guards import BadStepGuard, Verdict
from moetrain.train.metrics import (
    MetricsLogger,
    RoutingTraceWriter,
    TrainingProgress,
    keep_rows_through,
    summary_table,
)
from moetrain.train.saver import CheckpointSaver, SavePolicy


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


def resolve_document_mask(choice: str, device: torch.device, compiled: bool) -> str:
    """auto → FlexAttention tiles in compiled CUDA layers, a dense mask elsewhere: FlexAttention's fused
    kernel is generated by the compiler (eagerly it materialises the scores) and has no CPU backward."""
    if choice == "auto":
        return "block" if device.type == "cuda" and compiled else "dense"
    if choice == "block" and device.type != "cuda":
        raise UserError(f"--document-mask block runs FlexAttention, which has no backward on {device.type}; "
                        "use --document-mask dense (or auto)")
    if choice == "block" and not compiled:
        raise UserError("--document-mask block needs compiled layers (the compiler generates FlexAttention's "
                        "kernel); drop --no-compile or use --document-mask dense")
    return choice


class BatchSource(Protocol):
    """Where the step's batches come from: a function of the step (so a resume reads what the
    uninterrupted run would have), cut into this data-parallel rank's micro-batches."""

    def step_batch(self, step: int, global_batch: int, micro_batch: int, dp_rank: int = 0,
                   dp_size: int = 1) -> StepBatch: ...


class TrainerHooks:
    """What a run of another objective adds to the loop, called by ``Trainer`` at fixed points (the module's
    docstring gives the order). This base does nothing: a plain run. Every method gets the trainer, whose
    public attributes (``run``, ``dims``, ``device``, ``step``, ``metrics``, ``console``) a hook reads, and
    whose ``note(**fields)`` adds a hook's measurements to the current step's metrics row."""

    makes_batches = False
    """True: ``next_batch`` makes every step's batch, so no corpus is read."""

    def attach(self, trainer: Trainer) -> None:
        """Once, when the trainer has built this rank's layout (before a resume's load): build what runs on
        the trained model (a rollout engine, RL Fusion)."""

    def next_batch(self, trainer: Trainer, step: int) -> StepBatch | None:
        """Step ``step``'s batch (0-based: the optimizer steps taken so far); None: the batch source's."""
        return None

    def after_step(self, trainer: Trainer, step: int, batch: StepBatch) -> dict[str, Any]:
        """After the optimizer step ``step`` (1-based now) on ``batch``: evaluation, a weight push; the
        fields it returns join the step's metrics row (after the balancer's)."""
        return {}

    def finished(self, trainer: Trainer) -> bool:
        """A measured stopping criterion: whether the run is done before its last step."""
        return False

    def identity(self, trainer: Trainer) -> str | None:
        """What the run learns from, in the checkpoint's identity (``run_identity``); None: the corpus."""
        return None

    def saved(self, trainer: Trainer, path: Path) -> None:
        """After the checkpoint at ``path`` is written: what the hooks keep beside it."""

    def loaded(self, trainer: Trainer, path: Path) -> None:
        """After a resume loaded the checkpoint at ``path`` (``trainer.step`` is its step)."""

    def describe(self, trainer: Trainer) -> str | None:
        """The console's first line; None: the trainer's."""
        return None

    def summary(self, trainer: Trainer) -> RenderableType | None:
        """The console's summary after the run; None: the trainer's table."""
        return None

    def ranks_in_run(self, trainer: Trainer) -> int | None:
        """Every rank torchrun starts, when other workers run beside the trainer; None: the layout's."""
        return None

    def close(self, trainer: Trainer) -> None:
        """When the run ends or fails, before the trainer releases its own: what the hooks release."""


@dataclass(frozen=True)
class SuppliedParts:
    """What a caller hands the trainer in place of what it would build from the spec. Every field is
    optional; an empty one (the default) is a plain run of ``spec``."""

    dims: ParallelDims | None = None
    """This rank's place in a layout the caller built (tests run several layouts side by side in one
    world); None: the trainer joins the world torchrun set up and places itself by ``spec.parallel``."""
    model_cfg: ModelConfig | None = None
    """Instead of loading ``spec.model``."""
    model: MoETransformer | None = None
    """A model the caller built from the seed (e.g. with a skewed router); None: built from ``model_cfg``."""
    console: Console | None = None
    """Where the reporter's lines go; None: the terminal, quiet on every rank but the reporter."""
    batches: BatchSource | None = None
    """The batch source instead of ``spec.run.data`` (no corpus is read then)."""
    hooks: TrainerHooks | None = None
    """The objective's hooks (``TrainerHooks``); None: a plain run."""


class Trainer:
    """The step loop. A run of another objective changes it only through the objects it is given: its
    batch source and its ``TrainerHooks`` (``SuppliedParts.batches``, ``SuppliedParts.hooks``)."""

    def __init__(self, spec: RunSpec, supplied: SuppliedParts | None = None) -> None:
        """``supplied``: the parts the caller built itself (``SuppliedParts``); the spec gives the rest."""
        supplied = SuppliedParts() if supplied is None else supplied
        dims, console = supplied.dims, supplied.console
        self.spec, self.cfg = spec, spec.training
        self.hooks = supplied.hooks if supplied.hooks is not None else TrainerHooks()
        self.model_cfg = supplied.model_cfg or load_model_config(spec.model)
        check_run(spec, self.model_cfg)  # the same checks as before any rank started (cheap, torch-free)
        self.device = resolve_device(spec.run.device)
        self.threads: ThreadChoice | None = None
        if self.device.type == "cpu" and dims is None:
            # a lone process chooses here; the ranks of a launch get theirs from the launcher
            self.threads = choose_threads(spec.run.threads, ranks=spec.world_size)
            if not self.threads.from_environment:
                torch.set_num_threads(self.threads.threads)
        elif spec.run.threads is not None:
            torch.set_num_threads(spec.run.threads)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # activations live in host memory: reuse it step after step
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            # With several threads the CPU backward of the token permutation (an accumulating
            # index_put) adds in thread order; deterministic mode fixes the order so that a resumed run
            # replays the uninterrupted one bit for bit. One thread is deterministic without it.
            torch.use_deterministic_algorithms(True, warn_only=True)
        self._leave_world = contextlib.ExitStack()
        if dims is None:
            rank = self._leave_world.enter_context(join_world(self.device, spec.run.first_step_timeout_s))
            world_size = dist.get_world_size()
            if world_size != spec.world_size:
                self._leave_world.close()
                raise UserError(f"the layout needs {spec.world_size} ranks (tp·cp·pp·dp) but {world_size} run it; "
                                "start it with moetrain train --nproc N or torchrun --nproc-per-node N")
            dims = ParallelDims.build(spec.parallel, rank, spec.run.ranks_per_node)
        # The timeouts the first step lowers go back as they were when the run ends: the world may outlive it
        # (spawn's, several layouts side by side), and a rank done first then waits for its peers as long as
        # the world's owner asked. Pushed after the join, so it runs before a world of this run's own ends.
        self._leave_world.callback(restore_collective_timeout, collective_timeout_s())
        self.dims = dims
        self.is_reporter = dims.rank == dims.group_ranks["world"][0]
        """The layout's first rank writes the files and the console lines."""
        self.console = console or Console(quiet=not self.is_reporter)
        self.step_fields: dict[str, Any] = {}
        """The current step's metrics row fields noted so far (``note``); the loop starts each step empty."""
        try:
            self._build(supplied.model, supplied.batches)
            self.hooks.attach(self)
        except BaseException:
            self._leave_world.close()
            raise

    def _build(self, model: MoETransformer | None, batches: BatchSource | None) -> None:
        spec, cfg = self.spec, self.cfg
        if spec.world_size == 1:
            self.check_memory()
        self.data = self.prepare_data() if batches is None and not self.hooks.makes_batches else None
        self.dataset: BatchSource = batches if batches is not None else (
            self.data.dataset if self.data is not None else SyntheticDataset(
            self.model_cfg.vocab_size, cfg.seq_len, cfg.seed))
        self.cluster = self.resolve_cluster()
        self.balancer = None
        self.run = self.build_run(model)
        self.run.autocast_dtype = autocast_dtype(cfg.dtype, self.device.type)
        self.run.document_mask = resolve_document_mask(spec.run.document_mask, self.device, self.will_compile())
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
        self.fault = injected_faults(self.dims.rank)
        self.guard = BadStepGuard(spec.guards)
        self.saver = None if paths.save_dir is None else CheckpointSaver(
            Path(paths.save_dir), self.dims.get_group("world"), self.dims.group_ranks["world"], SavePolicy.of(paths),
            console=self.console)

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
            name = cluster_for_device(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu")
        return load_cluster_config(name)

    def build_run(self, model: MoETransformer | None) -> LayoutRun:
        if not self.spec.balance.enabled:
            return build_layout(self.dims, self.model_cfg, self.cfg, self.device, model=model)
        # lazy, heavy: scipy's solvers, --balance only
        from moetrain.distributed.balancing import BalancedRunSetup, BalancerTuning, build_balanced_run

        balance = self.spec.balance
        tuning = BalancerTuning(interval=BALANCE_DEFAULTS.interval if balance.interval is None else balance.interval,
                                horizon=BALANCE_DEFAULTS.horizon if balance.horizon is None else balance.horizon)
        setup = BalancedRunSetup(model=model, slots_per_rank=balance.slots_per_rank, tuning=tuning)
        run, self.balancer = build_balanced_run(self.dims, self.model_cfg, self.cfg, self.device, self.cluster, setup)
        return run

    def will_compile(self) -> bool:
        """``--compile`` as asked; by default on CUDA only."""
        wanted = self.spec.run.compile
        return self.device.type == "cuda" if wanted is None else wanted

    def apply_memory_policy(self):
        """Install the recompute/swap options of the layers this rank holds (``moetrain.memory``): the
        checkpoint wrappers (and ``swap_layer``'s hooks) when the layers will be compiled, else the eager hooks.
        The policy prices swap at the host link measured here (``auto`` on CUDA), the rest at nominal speeds."""
        options = self.spec.memory
        if options.policy == "none":
            return None
        model = self.run.stage.model
        compiled = self.will_compile()
        dtype_bytes = 2.0 if self.run.autocast_dtype is not None else 4.0
        excluded = excluded_options(compiled, self.spec.parallel.ep > 1)
        shape = activation_shape(self.model_cfg, self.cfg.seq_len, self.cfg.micro_batch, dtype_bytes,
                                 self.device.type)
        speed = nominal_speed(self.device.type)
        link = host_link_bytes_per_s(self.device, mib=64, repeats=3) if options.policy == "auto" else None
        if link is not None:
            speed = replace(speed, host_link_bytes_per_s=link)
        result = choose_plan(shape, options, speed, excluded)
        held = [int(index) for index in model.layers] + [self.model_cfg.num_layers + j for j in range(len(model.mtp))]
        applied = apply_memory_policy(model, held_layers_plan(result.plan, held), compiled=compiled)
        chosen = ", ".join(f"{name}×{count}" for name, count in sorted(result.options.items())) or "nothing"
        kept, baseline = result.activation_bytes / 2**20, result.baseline_bytes / 2**20
        self.console.print(f"memory policy {options.policy}{' (compiled layers)' if compiled else ''}: {chosen}; "
                           f"activations {kept:,.1f} of {baseline:,.1f} MiB per micro-batch, predicted "
                           f"+{result.added_time_s * 1e3:,.1f} ms per micro-batch (analytic, whole model, nominal "
                           f"device speed{f', host link {link / 1e9:,.1f} GB/s measured' if link else ''})")
        return applied

    def apply_compile(self) -> int:
        """Compile the layers this rank holds when the spec asks (default: on CUDA); after the memory
        policy, whose checkpoint wrappers the compiled layers then trace through."""
        if not self.will_compile():
            return 0
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
        return run_identity(self.model_cfg, self.cfg, self.hooks.identity(self) or corpus)

    # ----- one step -----
    def next_batch(self) -> StepBatch:
        batch = self.hooks.next_batch(self, self.step)
        if batch is not None:
            return batch
        return self.dataset.step_batch(self.step, self.cfg.global_batch, self.cfg.micro_batch, self.dp_rank,
                                       self.spec.parallel.dp)

    def note(self, **fields: Any) -> None:
        """Add ``fields`` to this step's metrics row (a hook's measurements: the batch's, the update's)."""
        self.step_fields.update(fields)

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
        return row

    def save(self) -> Path | None:
        """Save the checkpoint after this step (``CheckpointSaver``: in the background with --async-save);
        its folder, or None when there is no --save-dir or the save failed and the run goes on. What the
        save cost the loop joins the step's metrics row."""
        if self.saver is None:
            return None
        self.fault(self.step, "save")
        placement = self.balancer.state_dict() if self.balancer is not None else None
        start = time.perf_counter()
        state = checkpoint_state(self.run, self.step)
        path, cost = self.saver.save(self.step, state, self.identity(), placement, self.fault.save_error(self.step))
        if self.metrics.rows and self.metrics.rows[-1].get("step") == self.step:
            cost = type(cost)(cost.mode, time.perf_counter() - start, cost.wait_s)  # the state's copy included
            self.metrics.amend_last(cost.fields())
        if path is not None:
            self.hooks.saved(self, path)
        return path

    def load(self) -> bool:
        """Resume from the newest complete checkpoint in ``save_dir``; False when there is none."""
        assert self.spec.run.save_dir is not None
        path = latest_checkpoint(Path(self.spec.run.save_dir))
        if path is None:
            return False
        self.restore(path)
        self.console.print(f"resumed from {path} (step {self.step})")
        self.hooks.loaded(self, path)
        return True

    def restore(self, path: Path) -> None:
        """Load the checkpoint at ``path`` (a resume, or a rollback): weights, moments, step."""
        if self.balancer is not None:  # adopt the saved placement first: slots then load their experts
            saved = read_expert_placement(path)
            restored = saved is not None and self.balancer.load_state_dict(saved)
            self.console.print("restored the saved expert placement" if restored else
                               "no expert placement of this EP size in the checkpoint; starting from the "
                               "contiguous one")
        if (step := checkpoint_step(path)) is not None:
            self.fault(step, "load")
        self.step = load_checkpoint(path, self.run, self.model_cfg, identity=self.identity())

    def train(self) -> list[dict[str, Any]]:
        """The loop: run (or resume) until ``steps`` or ``stop_at``; returns the metrics rows of this run."""
        run_options = self.spec.run
        show = self.is_reporter and not run_options.quiet
        try:
            failed_at = last_progress() if attempt() > 0 else None
            if run_options.resume and not self.load():
                self.console.print(f"no checkpoint in {run_options.save_dir}; starting from step 0")
            if attempt() > 0:
                self.report_restart(failed_at)
            last_step = min(self.cfg.steps, run_options.stop_at or self.cfg.steps)
            self.run.stage.model.train()
            with TrainingProgress(self.console, self.cfg.steps, self.step, enabled=show) as progress:
                self._steps(last_step, progress)
            if self.saver is not None and (waited := self.saver.finish()) and show:
                self.console.print(f"the last checkpoint finished writing {waited:.2f} s after the last step")
            if self.balancer is not None:
                self.balancer.finish_migration()  # the last step's move, if any, lands before the ranks part
            if run_options.trace_dir:
                self.tracer.save(Path(run_options.trace_dir) / f"rank{self.dims.rank}.json")
                self.console.print(f"a2a_hidden_fraction {self.tracer.a2a_hidden_fraction():.3f} (this rank)")
        finally:
            self.close()
        return self.metrics.rows

    def _steps(self, last_step: int, progress: TrainingProgress) -> None:
        """Step until ``last_step`` or until ``finished()``: batch → the step → metrics row → checkpoint."""
        while self.step < last_step and not self.finished():
            self.fault(self.step, "step")
            self.step_fields = {}
            start, compiled_before = time.perf_counter(), compile_events()
            batch = self.next_batch()
            batch_done = time.perf_counter()
            with self.tracer.active():
                result = train_step(self.run, self.step, batch, self.fault.loss_scale(self.step))
            end_startup_timeout(self.spec.run.timeout_s)  # loaded and compiled: a late peer is now a hung one
            self.step += 1
            step_done = time.perf_counter()
            extra = {**self.after_step(), **self.hooks.after_step(self, self.step, batch), **self.step_fields}
            # the step's parts as the host sees them (no added sync: on an accelerator the host may run ahead)
            extra.update(batch_time_s=batch_done - start, train_step_time_s=step_done - batch_done,
                         after_step_time_s=time.perf_counter() - step_done,
                         compiled=compile_events() > compiled_before)
            verdict = self.guard.judge(self.step, result.loss, result.grad_norm, result.skipped)
            extra.update(self.verdict_fields(verdict, result.skipped))
            row = self.log(result, batch.global_tokens, time.perf_counter() - start, extra)
            progress.update(self.step, row)
            if self.is_reporter:
                record_progress(self.step)  # under --max-restarts: what a failure now would lose
            if verdict.action == "roll_back":
                self.roll_back(verdict)  # it saves the rolled-back state under the current step
                continue
            if should_save(self.step, last_step, self.spec.run.save_every) or self.finished():
                self.save()

    def verdict_fields(self, verdict: Verdict, skipped: bool) -> dict[str, Any]:
        """A bad step's fields of the metrics row, and its console line."""
        fields: dict[str, Any] = {}
        if skipped:
            count = self.guard.skipped_steps
            # the batch (0-based, ``PackedDataset.step_batch``) is consumed: the next step reads the next one
            fields.update(skipped=True, batch=self.step - 1, skipped_steps=count)
            self.console.print(f"step {self.step} skipped ({verdict.reason}): no update from batch {self.step - 1}; "
                               f"{count} step{'s' * (count > 1)} skipped so far", markup=False, highlight=False)
        if verdict.action == "roll_back":
            fields["roll_back"] = verdict.reason
        return fields

    def roll_back(self, verdict: Verdict) -> None:
        """Restore the newest complete checkpoint and move the data position past the batches trained on
        since: the next step reads the batch after the bad step's, from the checkpoint's weights. The
        learning rate follows the data position (the schedule is a function of the batches consumed,
        as a skipped step's is). The rolled-back state is saved at once under the current step, so a
        restart resumes past the skipped batches instead of training on them again."""
        bad_step = self.step
        save_dir = self.spec.run.save_dir
        if self.saver is not None:
            self.saver.finish()  # a checkpoint still being written is complete, or known to have failed
        path = latest_checkpoint(Path(save_dir)) if save_dir else None
        if path is None or is_model_only(path):
            raise UserError(f"step {bad_step}: {verdict.reason}; no checkpoint to roll back to (save some with "
                            "--save-dir and --save-every K, or lower --lr)")
        self.restore(path)
        restored = self.step
        self.guard.rolled_back(restored)
        self.step = bad_step
        self.console.print(f"step {bad_step}: {verdict.reason}; rolled back to {path.name} (step {restored}), "
                           f"skipping batches {restored}–{bad_step - 1}", markup=False, highlight=False)
        self.save()

    def report_restart(self, failed_at: int | None) -> None:
        """After torchrun restarted the group: one line on the failure and the steps it lost (those the
        failed attempt completed after the checkpoint this attempt resumed from), kept for the launcher's
        summary."""
        if not self.is_reporter:
            return
        error_dir = os.environ.get("MOETRAIN_ERROR_DIR")
        cause = previous_failure(Path(error_dir) if error_dir else None, attempt() - 1, self.ranks_in_run)
        restart = Restart(attempt(), self.step, failed_at, cause)
        note_restart(restart)
        self.console.print(restart.line(self.spec.run.max_restarts), markup=False, highlight=False)

    @property
    def ranks_in_run(self) -> int:
        """Every rank torchrun starts (more than the layout's when other workers run beside the trainer)."""
        return self.hooks.ranks_in_run(self) or self.spec.world_size

    def finished(self) -> bool:
        """Whether the run is done before its last step (the hooks' measured stopping criterion; checked
        before each step and after it, where a True also saves the checkpoint)."""
        return self.hooks.finished(self)

    def after_step(self) -> dict[str, Any]:
        """The balancer's decision after the step (its metrics join the row)."""
        if self.balancer is None:
            return {}
        decisions = self.balancer.after_step(self.step - 1)
        for line in self.balancer.describe(decisions):
            self.console.print(line)
        return self.balancer.step_metrics(decisions)

    def close(self) -> None:
        try:
            self.hooks.close(self)
        finally:
            if getattr(self, "saver", None) is not None:
                self.saver.close()
            self.metrics.close()
            if self.routing_trace is not None:
                self.routing_trace.close()
            self._leave_world.close()

    def describe(self) -> str:
        """One line on what is about to run: data, model, batch, layout and device (or the hooks' line)."""
        if (line := self.hooks.describe(self)) is not None:
            return line
        counts = count_params(self.model_cfg)
        if self.data is not None:
            dataset = self.data.dataset
            data = (f"data {self.data.corpus_name}: {self.data.num_documents} documents, "
                    f"{len(dataset.stream.tokens):,} tokens, {dataset.num_samples:,} sequences of {dataset.seq_len}")
        else:
            data = f"synthetic counting sequences of {self.cfg.seq_len}"
        p = self.spec.parallel
        degrees = [f"{axis}{getattr(p, axis)}" for axis in ("tp", "cp", "pp", "vpp", "dp", "ep", "etp")
                   if getattr(p, axis) > 1]
        layout = (f" · {self.spec.world_size} ranks: {'×'.join(degrees)}, ZeRO-{max(p.zero, 1)}"
                  f"{', overlapped' if p.overlap else ''}") if self.spec.world_size > 1 else ""
        return (f"{data} · model {self.model_cfg.name}: {counts.total / 1e6:.2f}M parameters "
                f"({counts.active / 1e6:.2f}M active) · {self.cfg.steps} steps × {self.cfg.global_batch} sequences · "
                f"{self.device_text()}{', compiled' if self.compiled_layers else ''}{layout}")

    def device_text(self) -> str:
        """Where the run computes: the device, and on a CPU the threads and why that many."""
        if self.device.type != "cpu":
            return self.device.type
        num_threads = torch.get_num_threads()
        why = f" ({self.threads.reason})" if self.threads is not None else ""
        return f"cpu, {num_threads} thread{'s' * (num_threads > 1)}{why}"

    def print_summary(self) -> None:
        if (summary := self.hooks.summary(self)) is not None:
            self.console.print(summary)
            return
        title = f"{self.model_cfg.name}: {len(self.metrics.rows)} steps on {self.device.type}"
        if self.spec.world_size > 1:
            title += f" × {self.spec.world_size} ranks"
        # no MFU on a CPU: the cpu preset's peak is nominal (the metrics rows keep the relative figure)
        self.console.print(summary_table(self.metrics.rows, title, model_cfg=self.model_cfg,
                                         show_mfu=self.device.type != "cpu"))


__all__ = ["BatchSource", "Trainer", "TrainerHooks", "resolve_device", "resolve_document_mask"]
