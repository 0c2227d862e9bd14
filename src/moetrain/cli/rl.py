"""``moetrain rl``: SFT warm-up on a task's format, then GRPO with router replay, on the training runtime.

Two runs of the runtime's ``Trainer`` in one process: the warm-up (``moetrain.rl.loop.SFTTrainer``) and
GRPO (``RLTrainer``), each with its own ``RunSpec`` built from these flags and checked by ``check_run``
before anything heavy starts. With ``--save-dir D`` the warm-up saves under ``D/sft`` (a later run
reuses it instead of training again) and GRPO under ``D/rl``; ``--resume`` continues GRPO from its newest
checkpoint and appends to the metrics file, so the reward curve is one curve.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moetrain.config import limits
from moetrain.errors import UserError
from moetrain.rl.config import WarmupCriterion

HELP = ("post-train with RL: SFT warm-up on a verifiable task, then GRPO with router replay; one process, "
        "or --nproc N ranks (RL Fusion) and --staleness K (StaleSync)")

DEFAULT_MODEL = "tiny-pangu"
DEFAULT_SFT_STEPS = 600
"""The warm-up's step cap (and the horizon of its learning-rate schedule); the criterion stops it sooner."""
DEFAULT_STEPS = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetrain.config import TrainingConfig

    parser.add_argument("--task", default="addition", help="addition, sort or countdown")
    parser.add_argument("--model", help="model preset name or YAML file (default tiny-pangu, or the model of --from)")
    parser.add_argument("--from", dest="from_path", metavar="PATH",
                        help="start from these weights: a moetrain checkpoint (save dir or step folder; its model is "
                             "the model.yaml beside it or --model) or a Hugging Face model folder")
    s = parser.add_argument_group("SFT warm-up (on reference answers of the training split)")
    s.add_argument("--sft-steps", type=int, default=DEFAULT_SFT_STEPS,
                   help="most SFT steps: the warm-up stops sooner when it reaches --sft-target; 0 skips it")
    s.add_argument("--sft-target", type=float, default=WarmupCriterion().target,
                   help="greedy validation accuracy at which the warm-up stops (0: every --sft-steps step)")
    s.add_argument("--sft-check-every", type=int, default=WarmupCriterion().check_every,
                   help="SFT steps between validation checks")
    s.add_argument("--sft-batch", type=int, default=64, help="examples per SFT step")
    s.add_argument("--sft-lr", type=float, default=3e-3, help="peak SFT learning rate")
    g = parser.add_argument_group("GRPO")
    g.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="GRPO optimizer steps")
    g.add_argument("--prompts", type=int, default=32, help="prompts per step")
    g.add_argument("--group-size", type=int, default=8, help="samples per prompt, G")
    g.add_argument("--micro-batch", type=int, help="samples per forward/backward (default: all of a step's)")
    g.add_argument("--lr", type=float, default=3e-4, help="peak GRPO learning rate")
    g.add_argument("--warmup", type=int, default=5, help="GRPO warm-up steps")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: all)")
    g.add_argument("--max-new-tokens", type=int, help="per sample (default: the task's longest answer + 2)")
    g.add_argument("--clip-low", type=float, default=0.2, help="ε_low of the ratio clip")
    g.add_argument("--clip-high", type=float, default=0.28, help="ε_high of the ratio clip")
    g.add_argument("--is-cap", type=float, default=2.0, help="truncation of the importance weights")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL to the warm-up model (0: no reference)")
    g.add_argument("--filter-groups", action=argparse.BooleanOptionalAction, default=True,
                   help="train only on groups whose rewards differ: the others have zero advantage (DAPO's "
                        "dynamic-sampling filter, without over-sampling) (default: on)")
    g.add_argument("--no-replay", action="store_true", help="train with the routers' own experts")
    g.add_argument("--replay-stats-every", type=int, default=10,
                   help="steps between forwards without replay that measure routing mismatch (0: never)")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                   help="micro-batches of samples of like length, each cut to its longest (default: on)")
    g.add_argument("--eval-every", type=int, default=20, help="held-out accuracy every N steps (0: at the end only)")
    g.add_argument("--eval-size", type=int, default=256, help="held-out problems")
    r = parser.add_argument_group("run")
    r.add_argument("--seed", type=int,
                   help=f"seed of weights, problems and sampling (default: {TrainingConfig().seed})")
    r.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: auto, cuda when available)")
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
    r.add_argument("--quiet", action="store_true", default=None, help="no progress bar")
    add_fusion_arguments(parser)
    add_stalesync_arguments(parser)


def add_fusion_arguments(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("RL Fusion across ranks (docs/rl_fusion.md): training layout, generation layout")
    f.add_argument("--nproc", type=int, help="ranks on this node (= tp·pp·dp); above 1 starts torchrun")
    for axis, text in (("tp", "tensor parallel, with sequence parallelism"), ("pp", "pipeline stages"),
                       ("ep", "expert parallel (inside dp)"), ("etp", "expert tensor parallel")):
        f.add_argument(f"--{axis}", type=int, help=f"training: {text} (default: 1)")
    f.add_argument("--gen-ep", type=int, default=1,
                   help="generation: expert-parallel degree; nproc/gen-ep whole-model replicas (1: every rank)")
    f.add_argument("--sync-bucket-mib", type=float, default=32.0, help="weight-sync bucket size (32 MiB)")
    f.add_argument("--offload", choices=("auto", "always", "never"), default="auto",
                   help="optimizer state and gradients to host while generating (auto: when it does not fit)")
    f.add_argument("--log-dir", help="torchrun's log and the ranks' errors (default: a temp folder)")


def add_stalesync_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument_group("StaleSync: asynchronous rollout and training (docs/rl_stalesync.md)")
    a.add_argument("--staleness", type=int, help="K: train on samples at most K weight versions old, generation "
                   "running beside training (--placement); 0: they alternate, as in one process")
    a.add_argument("--placement", choices=("colocated", "disaggregated"),
                   help="with --staleness: separate rollout and training ranks (disaggregated, the default), or "
                        "the same ranks, generating the next batch during each update (colocated)")
    a.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="with --staleness: worker processes on torch.distributed (local) or Ray actors")
    a.add_argument("--stale-loss", choices=("tis", "decoupled"), default="tis",
                   help="staleness correction: truncated importance weights (tis) or decoupled PPO's proximal policy")
    a.add_argument("--reward-worker", action="store_true",
                   help="disaggregated: score on a rank of its own (with --kl-coef the reference model always "
                        "runs on one)")


def stalesync_options(args: argparse.Namespace):
    """The StaleSync options of ``--staleness`` (None without it, or for the colocated K = 0 that is the
    synchronous loop); refuses what is not built yet."""
    from moetrain.rl.config import StaleSyncOptions

    k = args.staleness
    if k is None:
        if args.placement is not None or args.engine != "local" or args.reward_worker:
            raise UserError("--placement, --engine and --reward-worker choose how StaleSync runs: give --staleness K")
        return None
    if k < 0:
        raise UserError(f"--staleness {k} must be ≥ 0")
    if args.engine == "ray":
        if args.placement == "colocated":
            raise UserError("--engine ray runs the disaggregated placement (a rollout actor and a trainer actor); "
                            "--placement colocated runs in one process: drop --engine ray")
        from moetrain.rl.ray_engine import import_ray

        import_ray()  # before the warm-up: a missing Ray is one line, not a failure after minutes
    placement = args.placement or "disaggregated"
    if args.reward_worker and placement == "colocated":
        raise UserError("--reward-worker is a rank of the disaggregated pipeline: drop it or use --placement "
                        "disaggregated")
    if placement == "colocated" and not k:
        return None  # the synchronous loop
    if placement == "disaggregated" and (args.nproc or 1) > 1:
        raise UserError("--nproc with the disaggregated --staleness: not built yet (the pipeline runs on ranks of "
                        "its own: rollout worker, reward and reference workers, trainer); drop --nproc")
    stale = StaleSyncOptions(staleness=k, placement=placement, loss=args.stale_loss, bucket_mib=args.sync_bucket_mib,
                             reward_worker=args.reward_worker)
    if placement == "colocated":
        from moetrain.rl.colocated import check_colocated
        from moetrain.rl.config import FusionOptions

        check_colocated(stale, FusionOptions(gen_ep=args.gen_ep, offload=args.offload))
    return stale


FIELD_FLAGS = {
    "task": "--task", "prompts_per_step": "--prompts", "grpo.group_size": "--group-size",
    "grpo.clip_low": "--clip-low", "grpo.clip_high": "--clip-high", "grpo.is_cap": "--is-cap",
    "grpo.kl_coef": "--kl-coef", "grpo.temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
    "max_new_tokens": "--max-new-tokens", "replay_stats_every": "--replay-stats-every",
    "eval_every": "--eval-every", "eval_size": "--eval-size",
}
"""RL option → the flag that sets it, so a refusal names what the user typed."""


def warmup_criterion(args: argparse.Namespace) -> WarmupCriterion:
    """When the SFT warm-up stops (``--sft-target``, ``--sft-check-every``; ``--sft-steps`` is the cap)."""
    from pydantic import ValidationError

    try:
        return WarmupCriterion(target=args.sft_target, check_every=args.sft_check_every)
    except ValidationError as exc:
        flags = {"target": "--sft-target", "check_every": "--sft-check-every"}
        raise UserError("; ".join(f"{flags[str(item['loc'][0])]}: {item['msg']}" for item in exc.errors())) from None


def _options(args: argparse.Namespace):
    from pydantic import ValidationError

    from moetrain.rl.config import RLOptions

    grpo = {"group_size": args.group_size, "clip_low": args.clip_low, "clip_high": args.clip_high,
            "is_cap": args.is_cap, "kl_coef": args.kl_coef, "temperature": args.temperature}
    try:
        return RLOptions(task=args.task, prompts_per_step=args.prompts, grpo=grpo, top_k=args.top_k,
                         top_p=args.top_p, max_new_tokens=args.max_new_tokens, replay=not args.no_replay,
                         filter_groups=args.filter_groups,
                         replay_stats_every=args.replay_stats_every, group_by_length=args.group_by_length,
                         eval_every=args.eval_every, eval_size=args.eval_size)
    except ValidationError as exc:
        parts = []
        for item in exc.errors():
            field = ".".join(str(x) for x in item["loc"])
            parts.append(f"{FIELD_FLAGS.get(field, field)}: {item['msg'].removeprefix('Value error, ')}")
        raise UserError("; ".join(parts)) from None


def _spec(args: argparse.Namespace, training: dict[str, Any], run: dict[str, Any]):
    from moetrain.config.run import resolve_run_spec

    common = {"device": args.device, "threads": args.threads, "seed": args.seed}
    run = {k: v for k, v in {**run, "device": common["device"], "threads": common["threads"],
                             "compile": args.compile}.items() if v is not None}
    training = {k: v for k, v in {**training, "seed": common["seed"]}.items() if v is not None}
    parallel = {axis: getattr(args, axis) for axis in ("tp", "pp", "ep", "etp") if getattr(args, axis) is not None}
    model = args.model or (args.from_path and str(Path(args.from_path).resolve())) or DEFAULT_MODEL
    return resolve_run_spec([{"model": model, "training": training, "run": run, "parallel": parallel}],
                            world_size=args.nproc or 1)


def fusion_options(args: argparse.Namespace):
    """The generation layout and switch of ``--nproc`` > 1 (None in one process); refuses a generation
    layout that does not divide the world."""
    from moetrain.rl.config import FusionOptions

    nproc = args.nproc or 1
    if nproc < 1:
        raise UserError(f"--nproc {nproc} must be ≥ 1")
    limits.check_processes(nproc, "--nproc", "ranks (processes)")
    given = [f"--{axis} {getattr(args, axis)}" for axis in ("tp", "pp", "ep", "etp") if (getattr(args, axis) or 1) > 1]
    if nproc == 1:
        if given:
            raise UserError(f"{' '.join(given)} needs several ranks: give --nproc N (= tp·pp·dp)")
        return None
    if args.gen_ep < 1 or args.sync_bucket_mib <= 0:
        raise UserError(f"--gen-ep {args.gen_ep} must be ≥ 1 and --sync-bucket-mib {args.sync_bucket_mib} > 0")
    fusion = FusionOptions(gen_ep=args.gen_ep, bucket_mib=args.sync_bucket_mib, offload=args.offload)
    fusion.replicas(nproc)
    return fusion


def _fusion_layout(args: argparse.Namespace, seq_len: int) -> tuple[int, int]:
    """(sequence length rounded up to a multiple of tp, for sequence parallelism; data-parallel degree)."""
    tp, pp = args.tp or 1, args.pp or 1
    nproc = args.nproc or 1
    if nproc % (tp * pp):
        raise UserError(f"{nproc} ranks are not a multiple of tp·pp = {tp * pp}; run tp·pp·dp ranks (--nproc)")
    return -(-seq_len // tp) * tp, nproc // (tp * pp)


def build_specs(args: argparse.Namespace):
    """(SFT spec or None, GRPO spec, RL options, policy model config), every check done."""
    from moetrain.config import load_model_config
    from moetrain.rl.loop import policy_config
    from moetrain.rl.sft import sequence_len_for
    from moetrain.rl.tasks import get_task
    from moetrain.rl.tokenizer import CharTokenizer
    from moetrain.train.checks import check_run

    fusion = fusion_options(args)
    options = _options(args)
    task = get_task(options.task)
    if args.from_path:
        from moetrain.rl.start import starting_config

        model_cfg = policy_config(starting_config(Path(args.from_path), args.model))
    else:
        model_cfg = policy_config(load_model_config(args.model or DEFAULT_MODEL))
    CharTokenizer().check_fits(model_cfg.vocab_size, model_cfg.name)
    max_new = options.max_new_tokens or task.max_answer_chars + 2
    seq_len, dp = _fusion_layout(args, sequence_len_for(task, max_new))
    save = Path(args.save_dir).resolve() if args.save_dir else None
    if args.sft_steps < 0:
        raise UserError(f"--sft-steps {args.sft_steps} must be ≥ 0")
    sft = None
    if args.sft_steps:
        sft_save = save / "sft" if save else None
        sft = _spec(args, {"steps": args.sft_steps, "global_batch": args.sft_batch,
                           "micro_batch": max(args.sft_batch // dp, 1),
                           "seq_len": seq_len, "lr": args.sft_lr, "warmup_steps": min(20, args.sft_steps)},
                    {"save_dir": str(sft_save) if sft_save else None, "quiet": args.quiet, "cluster": "cpu"})
        check_run(sft, model_cfg)
    batch = options.prompts_per_step * options.grpo.group_size
    metrics = str(Path(args.metrics_out).resolve()) if args.metrics_out else None
    micro = args.micro_batch or max(batch // dp, 1)
    rl = _spec(args, {"steps": args.steps, "global_batch": batch, "micro_batch": micro,
                      "seq_len": seq_len, "lr": args.lr, "warmup_steps": args.warmup},
               {"save_dir": str(save / "rl") if save else None, "save_every": args.save_every,
                "stop_at": args.stop_at, "resume": args.resume, "quiet": args.quiet, "metrics_out": metrics,
                "cluster": "cpu"})
    check_run(rl, model_cfg)
    if fusion is not None:
        _check_split(batch, fusion.replicas(rl.world_size))
        experts = model_cfg.moe.num_experts if model_cfg.moe is not None else 0
        if fusion.gen_ep > 1 and experts % fusion.gen_ep:
            raise UserError(f"--gen-ep {fusion.gen_ep}: {model_cfg.name}'s {experts} experts do not divide by it")
    return sft, rl, options, model_cfg


def _check_split(samples: int, replicas: int) -> None:
    if samples % replicas:
        raise UserError(f"{samples} samples per step (--prompts × --group-size) do not split over {replicas} "
                        "generation replicas; make them a multiple")



def _plot_path(args: argparse.Namespace) -> Path | None:
    if args.plot:
        return Path(args.plot)
    if args.metrics_out:
        return Path(args.metrics_out).with_suffix(".png")
    if args.save_dir:
        return Path(args.save_dir) / "reward.png"
    return None


def _starting_model(args: argparse.Namespace, model_cfg, seed: int):
    """A fresh policy: the weights of ``--from``, else initialised from the run's seed."""
    from moetrain.models.transformer import build_model

    model = build_model(model_cfg, "cpu", seed=seed)
    if args.from_path:
        from moetrain.rl.start import starting_weights

        model.load_state_dict(starting_weights(Path(args.from_path), model_cfg))
    return model


def _warm_up(spec, task, model_cfg, console, model, criterion, eval_size: int):
    """The warm-up's weights: trained now, or read back from the finished warm-up in its save dir."""
    from moetrain.rl.loop import SFTTrainer
    from moetrain.status import say
    from moetrain.train.checkpoint import latest_checkpoint

    if spec.run.save_dir and latest_checkpoint(Path(spec.run.save_dir)) is not None:
        spec = spec.model_copy(update={"run": spec.run.model_copy(update={"resume": True})})
    trainer = SFTTrainer(spec, task, model_cfg=model_cfg, model=model, console=console, criterion=criterion,
                         eval_size=eval_size)
    console.print(trainer.describe())
    rows = trainer.train()
    if rows:
        console.print(f"SFT: loss {rows[0]['loss']:.3f} → {rows[-1]['loss']:.3f} in "
                      f"{sum(r['step_time_s'] for r in rows) / 60:.1f} min")
    if trainer.decision is not None:
        say(console, trainer.decision.describe())  # one line, never wrapped: what the criterion decided
    return {name: value.detach().clone() for name, value in trainer.run.stage.model.state_dict().items()}


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

    from moetrain.status import say, status_console

    stale = stalesync_options(args)
    fusion_options(args)  # the flag checks that need no torch, before the line below
    warmup_criterion(args)
    # importing torch, the checks that need it and building the policy take seconds (a minute when busy)
    say(status_console(bool(args.quiet)), "setting up: torch, the run's checks, the policy model…")
    from moetrain.models.transformer import build_model
    from moetrain.rl.colocated import rl_trainer
    from moetrain.rl.plot import plot_reward_curve
    from moetrain.rl.tasks import get_task

    sft_spec, rl_spec, options, model_cfg = build_specs(args)
    if stale is not None and stale.placement == "disaggregated":
        return _launch_stalesync(args, (sft_spec, rl_spec, options, model_cfg), stale)
    if rl_spec.world_size > 1:
        return _launch(args, sft_spec, rl_spec, options, model_cfg, stale)
    console = Console(quiet=bool(args.quiet))
    start = time.perf_counter()
    # Each trainer parallelizes (rewrites) the module it is given: one model each. With a warm-up, the
    # GRPO model's weights are all the warm-up's, so only the warm-up's model reads --from.
    if sft_spec is None:
        model = _starting_model(args, model_cfg, rl_spec.training.seed)
    else:
        model = build_model(model_cfg, "cpu", seed=rl_spec.training.seed)
        model.load_state_dict(_warm_up(sft_spec, get_task(options.task), model_cfg, console,
                                       _starting_model(args, model_cfg, rl_spec.training.seed),
                                       warmup_criterion(args), options.eval_size))
    reference = None
    if options.grpo.kl_coef:
        reference = build_model(model_cfg, "cpu")
        reference.load_state_dict(model.state_dict())
    trainer = rl_trainer(rl_spec, options, stale, model_cfg=model_cfg, model=model, reference=reference,
                         console=console)
    console.print(trainer.describe())
    rows = trainer.train()
    trainer.print_summary()
    if args.metrics_out and Path(args.metrics_out).is_file():  # after a resume: the whole curve
        rows = [json.loads(line) for line in Path(args.metrics_out).read_text().splitlines() if line.strip()]
    plot = _plot_path(args)
    if plot is not None:
        plot_reward_curve(rows, plot, f"GRPO on {options.task} ({model_cfg.name})")
        console.print(f"reward curve: {plot}")
    console.print(f"total {(time.perf_counter() - start) / 60:.1f} min")
    return 0


def _launch(args: argparse.Namespace, sft_spec, rl_spec, options, model_cfg, stale) -> int:
    """RL Fusion on ``--nproc`` ranks: torchrun (``moetrain.distributed.launch``) starts
    ``moetrain.rl.worker`` on each, which reads the checked specs from a file (``MOETRAIN_RL_RUN``)."""
    import json
    import tempfile

    from moetrain.distributed.launch import launch

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="moetrain-rl-")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    plot = _plot_path(args)
    run = {"sft": sft_spec.to_json() if sft_spec is not None else None, "rl": rl_spec.to_json(),
           "warmup": warmup_criterion(args).model_dump_json(),
           "options": options.model_dump_json(), "model": model_cfg.model_dump_json(),
           "fusion": fusion_options(args).model_dump_json(), "plot": str(plot.resolve()) if plot else None,
           "stale": stale.model_dump_json() if stale is not None else None,
           "from": {"path": str(Path(args.from_path).resolve())} if args.from_path else None}
    payload = log_dir / "rl_run.json"
    payload.write_text(json.dumps(run), encoding="utf-8")
    return launch(rl_spec, log_dir, entry="moetrain.rl.worker", env={"MOETRAIN_RL_RUN": str(payload)}, command="rl")


def _launch_stalesync(args: argparse.Namespace, specs, stale) -> int:
    """StaleSync, disaggregated: the warm-up here (one process), then two ranks (rollout worker, trainer)
    run ``moetrain.rl.stalesync_worker.run_rank`` from its weights: processes that torchrun starts
    (``--engine local``), or Ray actors (``--engine ray``, ``moetrain.rl.ray_engine``)."""
    import json
    import tempfile

    import torch
    from rich.console import Console

    from moetrain.distributed.launch import launch
    from moetrain.rl.tasks import get_task

    sft_spec, rl_spec, options, model_cfg = specs
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="moetrain-rl-")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    initial = None
    if sft_spec is not None:
        initial = log_dir / "initial_policy.pt"
        torch.save(_warm_up(sft_spec, get_task(options.task), model_cfg, Console(quiet=bool(args.quiet)),
                            _starting_model(args, model_cfg, rl_spec.training.seed), warmup_criterion(args),
                            options.eval_size), initial)
    elif args.from_path:
        initial = log_dir / "initial_policy.pt"
        torch.save(_starting_model(args, model_cfg, rl_spec.training.seed).state_dict(), initial)
    plot = _plot_path(args)
    run = {"rl": rl_spec.to_json(), "options": options.model_dump_json(), "stale": stale.model_dump_json(),
           "model": model_cfg.model_dump_json(), "initial": str(initial) if initial else None,
           "plot": str(plot.resolve()) if plot else None}
    payload = log_dir / "stalesync_run.json"
    payload.write_text(json.dumps(run), encoding="utf-8")
    if args.engine == "ray":  # the actors get the payload itself (the warm-up weights stay a file: shared disk)
        from moetrain.rl import ray_engine
        from moetrain.status import say, status_console

        say(status_console(bool(args.quiet)), "starting Ray and its actors (rollout worker, trainer)…")

        return ray_engine.launch(run, rl_spec.run.timeout_s)
    from moetrain.rl.stalesync import Pipeline

    return launch(rl_spec, log_dir, entry="moetrain.rl.stalesync_worker", env={"MOETRAIN_STALESYNC_RUN": str(payload)},
                  command="rl", nproc=Pipeline.of(stale, options).world_size)
