"""One RL run from its spec: what every process of ``moetrain rl`` builds.

``build_rl_run(spec)`` turns an ``RLRunSpec`` into the run every process of it runs: the policy's model
config, the warm-up's and GRPO's ``RunSpec``s (each checked by ``check_run``) and every other check that
needs no process group. The CLI's process (``moetrain.rl.launch.run_rl``) and every rank
(``moetrain.rl.worker.run_rank``, which torchrun's ranks and Ray's actors run) build it here, with the
pieces they share: the starting policy, the warm-up and GRPO.

This module starts no process: the launcher imports it, the ranks import it, and it imports neither
(the imports run one way: launch → ray_engine → worker → run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetrain.config import ModelConfig, limits, load_model_config
from moetrain.config.run import RunSpec, resolve_run_spec
from moetrain.errors import UserError
from moetrain.rl.config import FusionOptions, RLOptions, StaleSyncOptions
from moetrain.rl.spec import DEFAULT_MODEL, RLRunSpec
from moetrain.rl.tasks import Task, get_task, heldout_problems, new_tokens_for
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.status import say
from moetrain.train.checks import check_run

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from moetrain.models.transformer import MoETransformer
    from moetrain.train.trainer import Trainer

SFT_RUN_FIELDS = ("device", "threads", "cluster", "quiet", "compile", "timeout_s", "startup_timeout_s", "document_mask",
                  "ranks_per_node")
"""The trainer's run options the warm-up runs with too (its outputs, checkpoints and resume are GRPO's)."""


@dataclass(frozen=True)
class RLRun:
    """A checked run: its spec, the policy's model config, the warm-up's run (None: no warm-up) and GRPO's."""

    spec: RLRunSpec
    model_cfg: ModelConfig
    sft: RunSpec | None
    grpo: RunSpec

    @property
    def options(self) -> RLOptions:
        return self.spec.rl

    @property
    def fusion(self) -> FusionOptions | None:
        """The generation layout of a multi-rank colocated run (None in one process)."""
        return self.spec.generation if self.grpo.world_size > 1 else None

    @property
    def stale(self) -> StaleSyncOptions | None:
        """StaleSync's options; None for the synchronous loop (which colocated k = 0 is)."""
        stale = self.spec.stalesync
        if stale is None or (stale.placement == "colocated" and not stale.staleness):
            return None
        return stale


def build_rl_run(spec: RLRunSpec) -> RLRun:
    """The run of ``spec``, every check done: what each process of the run builds first."""
    warms_up = bool(spec.sft.steps) and spec.initial_weights is None
    if spec.start_from:
        from moetrain.rl.start import starting_config  # lazy, heavy: torch; --start-from only

        base_cfg = starting_config(Path(spec.start_from), spec.model)
    else:
        base_cfg = load_model_config(spec.model or DEFAULT_MODEL)
    check_rl_sizes(spec, base_cfg, warms_up)  # before the imports below, which take seconds

    from moetrain.rl.loop import policy_config  # lazy, heavy: torch (the launcher imports this module torch-free)

    stale = spec.stalesync
    if stale is not None and stale.placement == "colocated" and stale.staleness:
        from moetrain.rl.colocated import check_colocated  # lazy, heavy: torch; colocated StaleSync only

        check_colocated(stale, spec.generation)
    model_cfg = policy_config(base_cfg)
    CharTokenizer().check_fits(model_cfg.vocab_size, model_cfg.name)
    sft = _sft_spec(spec) if warms_up else None
    if sft is not None:
        check_run(sft, model_cfg)
    grpo = _grpo_spec(spec)
    check_run(grpo, model_cfg)
    if grpo.world_size > 1:
        replicas = spec.rollout.replicas
        assert replicas is not None  # the spec fills the pool in
        if spec.samples_per_step % replicas:
            raise UserError(f"{spec.samples_per_step} samples per step (--prompts × --group-size) do not split over "
                            f"{replicas} generation replicas; make them a multiple")
        experts = model_cfg.moe.num_experts if model_cfg.moe is not None else 0
        gen_ep = spec.generation.gen_ep
        if gen_ep > 1 and experts % gen_ep:
            raise UserError(f"--gen-ep {gen_ep}: {model_cfg.name}'s {experts} experts do not divide by it")
    return RLRun(spec, model_cfg, sft, grpo)


def check_rl_sizes(spec: RLRunSpec, model_cfg: ModelConfig, warms_up: bool) -> None:
    """The sizes ``check_run`` bounds (``moetrain.config.limits``), named by the flags of ``moetrain rl``,
    which has no --seq-len or --global-batch: the task and --max-new-tokens set a sample's positions,
    --prompts × --group-size (GRPO) and --sft-batch (the warm-up) the samples of a step. Then the
    evaluation set, which a task with few distinct held-out problems cannot fill."""
    task = get_task(spec.rl.task)
    positions = spec.trainer.training.seq_len
    if positions > model_cfg.max_seq_len:
        raise UserError(_positions_beyond_the_model(spec, model_cfg, task))
    prompts, group = spec.rl.prompts_per_step, spec.rl.grpo.group_size
    grpo = f"--prompts {prompts} × --group-size {group} samples × {positions:,} positions"
    limits.check_step_tokens(spec.samples_per_step * positions, grpo, "lower --prompts or --group-size")
    steps = spec.trainer.training.steps
    limits.check_total_tokens(steps * spec.samples_per_step * positions, f"--steps {steps} × {grpo}", "lower --steps")
    if warms_up:
        sft = f"--sft-batch {spec.sft.batch} examples × {positions:,} positions"
        limits.check_step_tokens(spec.sft.batch * positions, sft, "lower --sft-batch")
        limits.check_total_tokens(spec.sft.steps * spec.sft.batch * positions, f"--sft-steps {spec.sft.steps} × {sft}",
                                  "lower --sft-steps")
    if spec.rl.eval_size > limits.MAX_EVAL_PROBLEMS:
        raise UserError(f"--eval-size {spec.rl.eval_size} is more than {limits.MAX_EVAL_PROBLEMS:,} held-out problems "
                        "(each evaluation generates an answer to every one); lower --eval-size")
    heldout_problems(task, spec.trainer.training.seed, spec.rl.eval_size)  # refuses a set the task cannot fill


def _positions_beyond_the_model(spec: RLRunSpec, model_cfg: ModelConfig, task: Task) -> str:
    new_tokens = new_tokens_for(task, spec.rl.max_new_tokens)
    tp = spec.trainer.parallel.tp
    most = model_cfg.max_seq_len // tp * tp - task.max_prompt_chars  # positions are rounded up to a multiple of tp
    given = f"--max-new-tokens {new_tokens}: " if spec.rl.max_new_tokens else ""
    mend = (f"give --max-new-tokens {most} or less" if most > 0 else
            "its prompts alone fill them: use a model whose max_seq_len is longer (--model)")
    return (f"{given}the {task.name} task's longest prompt ({task.max_prompt_chars} characters) and {new_tokens:,} new "
            f"tokens span {spec.trainer.training.seq_len:,} positions, beyond {model_cfg.name}'s max_seq_len "
            f"{model_cfg.max_seq_len} (its rotary range); {mend}")


def _sft_spec(spec: RLRunSpec) -> RunSpec:
    """The warm-up's run: the trainer's layout, device and seed, the warm-up's own batch and schedule. A
    disaggregated run warms up in the CLI's one process, before its ranks start: a one-rank layout."""
    trainer, sft = spec.trainer, spec.sft
    run: dict[str, Any] = {field: getattr(trainer.run, field) for field in SFT_RUN_FIELDS}
    if trainer.run.save_dir:
        run["save_dir"] = str(Path(trainer.run.save_dir) / "sft")
    dp = 1 if spec.disaggregated else trainer.parallel.dp
    training = {"steps": sft.steps, "global_batch": sft.batch, "micro_batch": max(sft.batch // dp, 1),
                "seq_len": trainer.training.seq_len, "lr": sft.lr, "warmup_steps": min(20, sft.steps),
                "seed": trainer.training.seed, "dtype": trainer.training.dtype}
    parallel = {} if spec.disaggregated else trainer.parallel.model_dump(exclude={"sp", "micro_batch"})
    return resolve_run_spec([{"model": trainer.model, "training": training, "run": run, "parallel": parallel}])


def _grpo_spec(spec: RLRunSpec) -> RunSpec:
    """The trainer's run, saving under ``save_dir/rl`` (the warm-up saves beside it)."""
    trainer = spec.trainer
    if not trainer.run.save_dir:
        return trainer
    return trainer.model_copy(update={"run": trainer.run.model_copy(
        update={"save_dir": str(Path(trainer.run.save_dir) / "rl")})})


def starting_model(run: RLRun, device: str | torch.device = "cpu") -> MoETransformer:
    """A fresh policy: the spec's initial weights, else ``start_from``'s, else initialised from the seed."""
    import torch  # lazy, heavy: this module stays torch-free to import

    from moetrain.models.transformer import build_model  # lazy, heavy: torch

    model = build_model(run.model_cfg, device, seed=run.grpo.training.seed)
    if run.spec.initial_weights:
        model.load_state_dict(torch.load(run.spec.initial_weights, weights_only=True))
    elif run.spec.start_from:
        from moetrain.rl.start import starting_weights  # lazy, heavy: torch; --start-from only

        model.load_state_dict(starting_weights(Path(run.spec.start_from), run.model_cfg))
    return model


def pipeline_weights(run: RLRun, console: Console | None = None) -> dict[str, torch.Tensor] | None:
    """The weights every rank of a StaleSync pipeline starts from, made in one process before the ranks
    start: the warm-up's, else ``start_from``'s; None where the ranks initialise from the seed."""
    if run.sft is None and not run.spec.start_from:
        return None
    model = starting_model(run)
    if run.sft is not None:
        model = warm_up(run, model, console).run.stage.model
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def stalesync_job(run: RLRun, initial: dict[str, torch.Tensor] | None):
    """The StaleSync job of ``run``'s disaggregated spec, its ranks starting from ``initial``
    (``pipeline_weights``; None: from the seed)."""
    from moetrain.rl.stalesync_job import StaleSyncJob  # lazy, heavy: torch

    assert run.stale is not None  # a disaggregated spec has its StaleSync options
    roles = run.spec.roles
    return StaleSyncJob(run.grpo, run.options, run.stale, run.model_cfg, initial, replicas=roles.replicas,
                        ranks_per_replica=roles.ranks_per_replica, replica_tp=roles.replica_tp)


def warm_up(run: RLRun, model: MoETransformer | None, console: Console | None = None):
    """The SFT warm-up trainer of ``run`` after training (or reading back the finished warm-up in its save
    dir) from ``model`` (None: initialised from the seed)."""
    from moetrain.rl.loop import SFTWarmup  # lazy, heavy: torch
    from moetrain.runtime_base.checkpoint_files import latest_checkpoint  # lazy, heavy: torch
    from moetrain.train.trainer import SuppliedParts, Trainer  # lazy, heavy: torch

    spec = run.sft
    assert spec is not None
    if spec.run.save_dir and latest_checkpoint(Path(spec.run.save_dir)) is not None:
        # a finished warm-up in the save dir is read back, not trained again
        spec = spec.model_copy(update={"run": spec.run.model_copy(update={"resume": True})})
    hooks = SFTWarmup(spec, get_task(run.options.task), criterion=run.spec.sft.criterion,
                      eval_size=run.options.eval_size)
    trainer = Trainer(spec, SuppliedParts(model_cfg=run.model_cfg, model=model, console=console, batches=hooks.examples,
                                          hooks=hooks))
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    if rows:
        trainer.console.print(f"SFT: loss {rows[0]['loss']:.3f} → {rows[-1]['loss']:.3f} in "
                              f"{sum(r['step_time_s'] for r in rows) / 60:.1f} min")
    if hooks.decision is not None:
        say(trainer.console, hooks.decision.describe())  # one line, never wrapped: what the criterion decided
    return trainer


def train_grpo(run: RLRun, model: MoETransformer | None, reference: MoETransformer | None,
               console: Console | None = None) -> Trainer:
    """GRPO, synchronous or colocated StaleSync, from ``model``; the summary and, on the reporting rank, the
    reward curve (the whole curve after a resume)."""
    from moetrain.rl.colocated import rl_hooks  # lazy, heavy: torch
    from moetrain.rl.plot import plot_reward_curve  # lazy: matplotlib, only for the curve
    from moetrain.train.trainer import SuppliedParts, Trainer  # lazy, heavy: torch

    hooks = rl_hooks(run.grpo, run.options, run.stale, reference=reference, fusion=run.fusion)
    trainer = Trainer(run.grpo, SuppliedParts(model_cfg=run.model_cfg, model=model, console=console, hooks=hooks))
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    trainer.print_summary()
    if run.spec.plot and trainer.is_reporter:
        plot_reward_curve(whole_curve(rows, run.grpo), Path(run.spec.plot),
                          f"GRPO on {run.options.task} ({run.model_cfg.name})")
        trainer.console.print(f"reward curve: {run.spec.plot}")
    return trainer


def whole_curve(rows: list[dict[str, Any]], grpo: RunSpec) -> list[dict[str, Any]]:
    """The rows of the metrics file when there is one (after a resume it holds the earlier steps too)."""
    metrics = grpo.run.metrics_out
    if metrics and Path(metrics).is_file():
        return [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    return rows
