"""``moetrain rl``: SFT warm-up on a task's format, then GRPO with router replay, on the training runtime.

The flags, an optional ``--config rl.yaml`` and an optional ``--plan rl.yaml`` (what ``moetrain plan --rl``
writes) become one validated ``RLRunSpec`` (``moetrain.rl.spec``): defaults < config file < plan < flags,
field by field, as for ``moetrain train`` (whose layout flags a plan also refuses). This module only parses: the
run is built from the spec and run by ``moetrain.rl.launch.run_rl``, in this process or on the ranks it
starts, each of which reads the same spec. With ``--save-dir D`` the warm-up saves under ``D/sft`` (a
later run reuses it instead of training again) and GRPO under ``D/rl``; ``--resume`` continues GRPO from
its newest checkpoint and appends to the metrics file, so the reward curve is one curve.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetrain.cli.common import (
    add_node_args,
    check_plan_ranks,
    log_dir_setting,
    node_flags,
    output_file,
    refuse_one_process_log_dir,
    yaml_source,
)
from moetrain.cli.parsing import format_default
from moetrain.cli.plan_rl import NOT_RUNNABLE
from moetrain.config import limits, load_cluster_config
from moetrain.config.run import merge_sources
from moetrain.errors import UserError
from moetrain.rl.config import StaleSyncOptions
from moetrain.rl.node_placement import node_problems
from moetrain.rl.plot import check_figure_file
from moetrain.rl.spec import (
    PLAN_SECTIONS,
    RLRunSpec,
    check_spec_kind,
    default_plot,
    pipeline_ranks,
    plan_source,
    resolve_rl_spec,
)

HELP = ("post-train with RL: SFT warm-up on a verifiable task, then GRPO with router replay; one process, "
        "or --nproc N ranks (RL Fusion) and --staleness K (StaleSync)")

# flag → the RL run spec's field it sets; every flag defaults to None ("not given") so that a config file can
# set the field and the spec's own defaults stay the one source of truth (``--help`` shows them).
FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "task": ("rl", "task"), "model": ("model",), "from_path": ("start_from",),
    "sft_steps": ("sft", "steps"), "sft_target": ("sft", "criterion", "target"),
    "sft_check_every": ("sft", "criterion", "check_every"), "sft_batch": ("sft", "batch"), "sft_lr": ("sft", "lr"),
    "steps": ("trainer", "training", "steps"), "prompts": ("rl", "prompts_per_step"),
    "group_size": ("rl", "grpo", "group_size"), "micro_batch": ("trainer", "training", "micro_batch"),
    "lr": ("trainer", "training", "lr"), "warmup": ("trainer", "training", "warmup_steps"),
    "temperature": ("rl", "grpo", "temperature"), "top_k": ("rl", "top_k"), "top_p": ("rl", "top_p"),
    "max_new_tokens": ("rl", "max_new_tokens"), "clip_low": ("rl", "grpo", "clip_low"),
    "clip_high": ("rl", "grpo", "clip_high"), "is_cap": ("rl", "grpo", "is_cap"), "kl_coef": ("rl", "grpo", "kl_coef"),
    "filter_groups": ("rl", "filter_groups"), "replay_stats_every": ("rl", "replay_stats_every"),
    "group_by_length": ("rl", "group_by_length"), "eval_every": ("rl", "eval_every"), "eval_size": ("rl", "eval_size"),
    "seed": ("trainer", "training", "seed"), "device": ("trainer", "run", "device"),
    "threads": ("trainer", "run", "threads"), "compile": ("trainer", "run", "compile"),
    "metrics_out": ("trainer", "run", "metrics_out"), "plot": ("plot",), "save_dir": ("trainer", "run", "save_dir"),
    "save_every": ("trainer", "run", "save_every"), "stop_at": ("trainer", "run", "stop_at"),
    "resume": ("trainer", "run", "resume"), "quiet": ("trainer", "run", "quiet"),
    "log_dir": ("trainer", "run", "log_dir"), "max_restarts": ("trainer", "run", "max_restarts"),
    "tp": ("trainer", "parallel", "tp"), "pp": ("trainer", "parallel", "pp"), "ep": ("trainer", "parallel", "ep"),
    "etp": ("trainer", "parallel", "etp"),
    "gen_ep": ("generation", "gen_ep"), "gen_tp": ("generation", "gen_tp"),
    "sync_bucket_mib": ("generation", "bucket_mib"), "offload": ("generation", "offload"),
    "staleness": ("stalesync", "staleness"), "placement": ("stalesync", "placement"),
    "stale_loss": ("stalesync", "loss"), "reward_worker": ("stalesync", "reward_worker"), "engine": ("engine",),
    "rollout_replicas": ("rollout", "replicas"), "partial_rollouts": ("stalesync", "partial_rollouts"),
}
STALESYNC_FLAGS = ("placement", "engine", "stale_loss", "reward_worker", "rollout_replicas", "partial_rollouts")
"""Flags that choose how StaleSync runs: they need ``--staleness`` (or a config's stalesync section)."""
FLAGS_SOURCE = "flags"
"""How ``resolve_rl_spec`` names the flags' values in an error; ``_named_by_flag`` then names the flag."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="an rl.yaml: the RL run spec's sections (model, sft, rl, trainer, "
                        "generation, rollout, stalesync, engine, plot); flags override it (docs/rl.md)")
    parser.add_argument("--plan", help="an rl.yaml written by `moetrain plan --rl` (trainer layout, generation "
                        "layout, rollout pool, placement and k); other flags override it (docs/rl_plan.md)")
    parser.add_argument("--task", help="addition, sort, countdown or rg:<reasoning-gym dataset>")
    parser.add_argument("--model", help="model preset name or YAML file (default tiny-pangu, or the model of --from)")
    parser.add_argument("--from", dest="from_path", metavar="PATH",
                        help="start from these weights: a moetrain checkpoint (save dir or step folder; its model is "
                             "the model.yaml beside it or --model) or a Hugging Face model folder")
    s = parser.add_argument_group("SFT warm-up (on reference answers of the training split)")
    s.add_argument("--sft-steps", type=int,
                   help="most SFT steps: the warm-up stops sooner when it reaches --sft-target; 0 skips it")
    s.add_argument("--sft-target", type=float,
                   help="greedy validation accuracy at which the warm-up stops (0: every --sft-steps step)")
    s.add_argument("--sft-check-every", type=int, help="SFT steps between validation checks")
    s.add_argument("--sft-batch", type=int, help="examples per SFT step")
    s.add_argument("--sft-lr", type=float, help="peak SFT learning rate")
    g = parser.add_argument_group("GRPO")
    g.add_argument("--steps", type=int, help="GRPO optimizer steps")
    g.add_argument("--prompts", type=int, help="prompts per step")
    g.add_argument("--group-size", type=int, help="samples per prompt, G")
    g.add_argument("--micro-batch", type=int, help="samples per forward/backward (default: all of a step's)")
    g.add_argument("--lr", type=float, help="peak GRPO learning rate")
    g.add_argument("--warmup", type=int, help="GRPO warm-up steps")
    g.add_argument("--temperature", type=float, help="sampling temperature")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass (1.0: all)")
    g.add_argument("--max-new-tokens", type=int, help="per sample (default: the task's longest answer + 2)")
    g.add_argument("--clip-low", type=float, help="ε_low of the ratio clip")
    g.add_argument("--clip-high", type=float, help="ε_high of the ratio clip")
    g.add_argument("--is-cap", type=float, help="truncation of the importance weights")
    g.add_argument("--kl-coef", type=float, help="KL to the warm-up model (0: no reference)")
    g.add_argument("--filter-groups", action=argparse.BooleanOptionalAction,
                   help="train only on groups whose rewards differ: the others have zero advantage (DAPO's "
                        "dynamic-sampling filter, without over-sampling)")
    g.add_argument("--no-replay", action="store_true", default=None, help="train with the routers' own experts")
    g.add_argument("--replay-stats-every", type=int,
                   help="steps between forwards without replay that measure routing mismatch (0: never)")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction,
                   help="micro-batches of samples of like length, each cut to its longest")
    g.add_argument("--eval-every", type=int, help="held-out accuracy every N steps (0: at the end only)")
    g.add_argument("--eval-size", type=int, help="held-out problems")
    _add_run_arguments(parser)
    _add_fusion_arguments(parser)
    _add_stalesync_arguments(parser)
    _show_spec_defaults(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group("run")
    r.add_argument("--seed", type=int, help="seed of weights, problems and sampling")
    r.add_argument("--device", help="cpu, cuda, cuda:N or auto (cuda when available)")
    r.add_argument("--threads", type=int,
                   help="CPU threads for torch (default: the free cores, shared among the ranks)")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each decoder layer of the trained model (default: on for CUDA, off for CPU)")
    r.add_argument("--metrics-out", help="write one JSON row per GRPO step (step, reward, accuracy, ...)")
    r.add_argument("--plot", help="reward-curve PNG (default: beside --metrics-out, else in --save-dir)")
    r.add_argument("--save-dir", help="checkpoints: DIR/sft (warm-up) and DIR/rl (GRPO)")
    r.add_argument("--save-every", type=int, help="save GRPO every K steps (0: only at the end)")
    r.add_argument("--stop-at", type=int, help="end GRPO after step K as if interrupted, saving a checkpoint")
    r.add_argument("--resume", action="store_true", default=None, help="continue GRPO from its newest checkpoint")
    r.add_argument("--max-restarts", type=int,
                   help="torchrun restarts the ranks after a failure up to N times, each resuming from the newest "
                        "GRPO checkpoint (needs --save-dir; default 0)")
    r.add_argument("--quiet", action="store_true", default=None, help="no progress bar")


def _add_fusion_arguments(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("RL Fusion across ranks (docs/rl_fusion.md): training layout, generation layout")
    f.add_argument("--nproc", type=int, help="ranks on this node (= tp·pp·dp; disaggregated --staleness: the "
                   "rollout replicas' ranks + the trainer's tp·pp·dp; with --nnodes M: M·nproc); above 1 starts "
                   "torchrun")
    add_node_args(f)
    for axis, text in (("tp", "tensor parallel, with sequence parallelism"), ("pp", "pipeline stages"),
                       ("ep", "expert parallel (inside dp)"), ("etp", "expert tensor parallel")):
        f.add_argument(f"--{axis}", type=int, help=f"training: {text}")
    f.add_argument("--gen-ep", type=int,
                   help="generation: expert-parallel degree; nproc/gen-ep replicas of gen-ep ranks (1: every rank a "
                        "whole model); disaggregated --staleness: the ranks of each rollout replica")
    f.add_argument("--gen-tp", type=int,
                   help="disaggregated --staleness: each rollout replica's ranks, its attention heads and dense FFN "
                        "columns split over them (tensor parallel; the experts whole on each, or with --gen-ep E "
                        "split over E such groups: replicas of gen-tp·gen-ep ranks)")
    f.add_argument("--sync-bucket-mib", type=float, help="weight-sync bucket size in MiB")
    f.add_argument("--offload", choices=("auto", "always", "never"),
                   help="optimizer state and gradients to host while generating (auto: when it does not fit)")
    f.add_argument("--log-dir", help="torchrun's log and the ranks' errors (default: a temp folder)")


def _add_stalesync_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("StaleSync: asynchronous rollout and training (docs/rl_stalesync.md)")
    a.add_argument("--staleness", type=int, help="K: train on samples at most K weight versions old, generation "
                   "running beside training (--placement); 0: they alternate, as in one process (default: none, the "
                   "synchronous loop)")
    a.add_argument("--placement", choices=("colocated", "disaggregated"),
                   help="with --staleness: separate rollout and training ranks (disaggregated), or the same ranks, "
                        "generating the next batch during each update (colocated)")
    a.add_argument("--engine", choices=("local", "ray"),
                   help="with --staleness: worker processes on torch.distributed (local) or Ray actors")
    a.add_argument("--stale-loss", choices=("tis", "decoupled"),
                   help="staleness correction: truncated importance weights (tis) or decoupled PPO's proximal policy")
    a.add_argument("--rollout-replicas", type=int,
                   help="disaggregated: rollout replicas of --gen-ep ranks each (1: a whole model on one rank), "
                        "beside the trainer's ranks")
    a.add_argument("--partial-rollouts", action="store_true", default=None,
                   help="disaggregated: interrupt a generation halfway when newer weights are due and resume it on "
                        "them; samples are admitted by their oldest token's version")
    a.add_argument("--reward-worker", action="store_true", default=None,
                   help="disaggregated: score on a rank of its own (with --kl-coef the reference model always "
                        "runs on one)")


def _show_spec_defaults(parser: argparse.ArgumentParser) -> None:
    """Write the RL spec's defaults into the help of the flags that set its fields: the flags themselves
    default to "not given", so that a config file can set the field first."""
    defaults = RLRunSpec().model_dump()
    defaults["stalesync"] = StaleSyncOptions().model_dump()  # what --staleness K starts from
    for action in parser._actions:
        path = FLAG_FIELDS.get(action.dest)
        value: Any = defaults
        for key in path or ():
            value = value.get(key) if isinstance(value, dict) else None
        shown = value is not None and (value is not False or isinstance(action, argparse.BooleanOptionalAction))
        if path and shown and "default" not in (action.help or ""):
            action.help = f"{action.help} (default: {format_default(value)})"


def _flag_source(args: argparse.Namespace) -> dict[str, Any]:
    """The given flags as RL-spec fields (after the checks that are about the flags themselves)."""
    for flag in ("sft_steps", "staleness", "max_restarts"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise UserError(f"--{flag.replace('_', '-')} {value} must be ≥ 0")
    source: dict[str, Any] = {}
    for flag, path in FLAG_FIELDS.items():
        value = getattr(args, flag)
        if value is not None:
            node = source
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
    if args.no_replay:
        source.setdefault("rl", {})["replay"] = False
    return source


def build_rl_spec(args: argparse.Namespace):
    """The RL run spec of these flags, ``--config`` and ``--plan``: defaults < config < plan < flags."""
    sources, names = [], []
    if args.config:
        sources.append(yaml_source(args.config, "--config", "model, sft, rl, trainer, generation, rollout, ..."))
        names.append(Path(args.config).name)
        check_spec_kind(sources[0], f"--config {args.config}")
    if args.plan:
        sources.append(_plan_source(args, sources[0] if sources else {}))
        names.append(Path(args.plan).name)
    has_stalesync = args.staleness is not None or any(source.get("stalesync") is not None for source in sources)
    given = [f"--{flag.replace('_', '-')}" for flag in STALESYNC_FLAGS if getattr(args, flag) not in (None, "local")]
    if given and not has_stalesync:
        raise UserError(f"{', '.join(given)} choose{'s' * (len(given) == 1)} how StaleSync runs: give --staleness K")
    sources.append(_flag_source(args))
    names.append(FLAGS_SOURCE)
    nproc = args.nproc
    if nproc is not None:
        if nproc < 1:
            raise UserError(f"--nproc {nproc} must be ≥ 1")
        limits.check_processes(nproc, "--nproc", "ranks (processes)")  # this node's
        nproc *= node_flags(args).count  # the whole run's ranks: --nproc on each of --nnodes nodes
        if args.plan:
            trainer = sources[-2].get("trainer")  # the plan's
            check_plan_ranks(args.plan, trainer.get("parallel") if isinstance(trainer, dict) else None, nproc,
                             args.nproc, pipeline_ranks(merge_sources(*sources)))
    if (nproc or 1) == 1 and not args.config:
        layout = [f"--{axis} {getattr(args, axis)}" for axis in ("tp", "pp", "ep", "etp")
                  if (getattr(args, axis) or 1) > 1]
        if layout:
            raise UserError(f"{' '.join(layout)} needs several ranks: give --nproc N (= tp·pp·dp)")
    try:
        spec = resolve_rl_spec(sources, names, world_size=nproc)
    except UserError as exc:
        raise UserError(_named_by_flag(str(exc))) from None
    _check_warmup_flags(spec, args)
    return spec


SFT_TUNING = ("sft_target", "sft_check_every", "sft_batch", "sft_lr")
"""The flags that tune the SFT warm-up: they mean nothing when ``--sft-steps 0`` skips it."""


def _check_warmup_flags(spec: RLRunSpec, args: argparse.Namespace) -> None:
    """Refuse warm-up flags the run would ignore (tuning a skipped warm-up, spacing checks that are off) and a
    warm-up batch that does not split over the data-parallel ranks."""
    if spec.sft.steps == 0:
        given = [f"--{flag.replace('_', '-')}" for flag in SFT_TUNING if getattr(args, flag) is not None]
        if given:
            skip = "--sft-steps 0" if args.sft_steps is not None else f"--config {args.config}'s sft.steps 0"
            them = "it" if len(given) == 1 else "them"
            raise UserError(f"{', '.join(given)} tune{'s' * (len(given) == 1)} the SFT warm-up, which {skip} skips; "
                            f"drop {them}, or give --sft-steps N")
    dp = spec.trainer.parallel.dp
    if spec.sft.steps and spec.initial_weights is None and not spec.disaggregated and spec.sft.batch % dp:
        # the warm-up trains on the trainer's data-parallel ranks (a disaggregated run's in one process): else
        # its run spec fails later on a micro-batch nobody chose (global_batch=64 ... micro_batch=21)
        raise UserError(f"--sft-batch {spec.sft.batch} (sft.batch) examples do not split over the trainer's {dp} "
                        f"data-parallel ranks; give --sft-batch a multiple of {dp}")
    if args.sft_check_every is not None and not spec.sft.criterion.enabled:
        off = "--sft-target 0" if args.sft_target is not None else f"--config {args.config}'s sft.criterion.target 0"
        raise UserError(f"--sft-check-every spaces the warm-up's validation checks, which {off} turns off (every "
                        "--sft-steps step runs); drop it, or give --sft-target T above 0")


PLAN_FLAGS = ("tp", "pp", "ep", "etp", "gen_ep", "gen_tp", "offload", "placement", "staleness")
"""Flags that set what an RL plan sets (the layout): refused beside ``--plan``, as ``moetrain train`` refuses its
layout flags beside a plan."""


def _plan_source(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """``--plan``'s sections, after refusing the flags and the ``--config`` sections that set the layout too."""
    given = [f"--{flag.replace('_', '-')}" for flag in PLAN_FLAGS if getattr(args, flag) is not None]
    if given:
        raise UserError(f"--plan already sets the layout; drop {', '.join(given)} (or drop --plan)")
    plan = plan_source(yaml_source(args.plan, "--plan", "model, rl, trainer, generation, rollout, stalesync"),
                       f"--plan {args.plan}")

    header = Path(args.plan).read_text(encoding="utf-8").splitlines()
    missing = [line.removeprefix("# " + NOT_RUNNABLE) for line in header if line.startswith("# " + NOT_RUNNABLE)]
    if missing:
        raise UserError(f"--plan {args.plan} is not runnable yet: {missing[0]}"
                        f"{f' (and {len(missing) - 1} more, in its header)' if len(missing) > 1 else ''}; "
                        "moetrain plan --rl planned it all the same")
    trainer = config.get("trainer")
    both = [name for name in PLAN_SECTIONS if name in config and name != "trainer" and name in plan]
    if isinstance(trainer, dict) and "parallel" in trainer and "trainer" in plan:
        both.insert(0, "trainer.parallel")
    if both:
        raise UserError(f"--plan and {args.config}'s {', '.join(both)} both set the layout; drop one")
    return plan


def _named_by_flag(message: str) -> str:
    """``flags: rl.grpo.group_size: ...`` → ``--group-size: ...``: name the flag the user typed."""
    for flag, path in FLAG_FIELDS.items():
        message = message.replace(f"{FLAGS_SOURCE}: {'.'.join(path)}:", f"--{flag.replace('_', '-')}:")
    return message.replace(f"{FLAGS_SOURCE}: ", "RL run spec: ")


def run(args: argparse.Namespace) -> int:
    from moetrain.status import say, status_console  # lazy: rich loads when a run starts, not with the parser

    nodes = node_flags(args)
    spec = build_rl_spec(args)
    _check_log_dir(spec, args)
    _check_plot(spec, args)
    if args.plan and nodes.count == 1:
        _check_plan_fits_a_node(spec, args.plan)
    if nodes.count > 1:
        _check_nodes(spec, args.nproc)
    # importing torch, the checks that need it and building the policy take seconds (a minute when busy)
    say(status_console(spec.trainer.run.quiet), "setting up: torch, the run's checks, the policy model…")
    from moetrain.rl.launch import run_rl  # lazy, heavy: torch and the RL runtime

    return run_rl(spec, nodes)


def _check_plot(spec: RLRunSpec, args: argparse.Namespace) -> None:
    """The reward curve's file, before any training: matplotlib would refuse its suffix only after the run,
    and a missing folder is created now, as ``--save-dir`` is."""
    if spec.plot is None:
        return
    if args.plot is None and spec.plot == default_plot(spec.trainer):
        # beside --metrics-out or in --save-dir: a path that cannot be is refused naming that flag, not --plot
        from moetrain.train.checks import check_output_paths  # lazy: the data-size checks it imports take 0.4 s

        check_output_paths(spec.trainer)
    path, flag = (args.plot, "--plot") if args.plot is not None else \
        (spec.plot, f"--config {args.config}: plot" if args.config else "--plot")
    if not Path(path).is_dir():  # a folder: output_file's refusal names the mend
        check_figure_file(path, flag)
    output_file(path, flag, "reward.png")


def _check_log_dir(spec: RLRunSpec, args: argparse.Namespace) -> None:
    """``--log-dir`` holds torchrun's log and the ranks' errors: a one-process run would ignore it, and a
    file in its way would fail only once the ranks start (after a disaggregated run's warm-up)."""
    log_dir = spec.trainer.run.log_dir
    if log_dir is None:
        return
    flag = log_dir_setting(args, "trainer.run.log_dir", log_dir)
    if not spec.disaggregated and spec.trainer.world_size == 1:
        refuse_one_process_log_dir(flag)
    existing = next(folder for folder in (Path(log_dir), *Path(log_dir).parents) if folder.exists())
    if not existing.is_dir():
        raise UserError(f"{flag}: {existing} is a file, not a folder; name a folder")


def _check_plan_fits_a_node(spec: RLRunSpec, plan: str) -> None:
    """A plan of more ranks than its cluster's node holds runs on several nodes: say how to start it."""
    world = spec.roles.world_size if spec.disaggregated else spec.trainer.world_size
    per_node = load_cluster_config(spec.trainer.run.cluster).devices_per_node if spec.trainer.run.cluster else world
    if world > per_node and world % per_node == 0:
        raise UserError(f"--plan {plan} runs {world} ranks on nodes of {per_node}: start it on each of its "
                        f"{world // per_node} nodes with --nnodes {world // per_node} --nproc {per_node} "
                        "--rdzv-endpoint HOST:PORT (docs/training.md, Several nodes)")


def _check_nodes(spec: RLRunSpec, ranks_per_node: int) -> None:
    """A run on several nodes: torchrun's agents on each (not Ray's cluster), its groups placed on whole nodes."""
    if spec.engine == "ray":
        raise UserError("--nnodes starts torchrun on each node; a Ray run spans the nodes of its Ray cluster "
                        "already: drop --nnodes and --rdzv-endpoint (docs/rl_ray.md)")
    problems = node_problems(spec, ranks_per_node)
    if problems:
        raise UserError(problems[0])
