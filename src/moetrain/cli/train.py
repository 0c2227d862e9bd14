"""``moetrain train``: train a preset on CPU or one GPU, with metrics, checkpoints and resume."""

from __future__ import annotations

import argparse
from pathlib import Path

from moetrain.cli.common import add_cluster_arg, add_model_arg
from moetrain.errors import UserError

HELP = "train a model (single process: CPU or one GPU); resumable, with per-step metrics"

# flag name → TrainingConfig field; unset flags keep the config's defaults (one source of truth)
_TRAINING_FLAGS = {
    "steps": "steps", "global_batch": "global_batch", "micro_batch": "micro_batch", "seq_len": "seq_len",
    "lr": "lr", "warmup": "warmup_steps", "seed": "seed", "dtype": "dtype",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser, default="tiny-pangu")
    add_cluster_arg(parser, default="auto")
    g = parser.add_argument_group("schedule and batch (defaults: moetrain.config.TrainingConfig)")
    g.add_argument("--steps", type=int, help="total optimizer steps of the run (sets the lr schedule)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    g.add_argument("--micro-batch", type=int, help="sequences per forward/backward (gradient accumulation)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup", type=int, help="linear warm-up steps before the cosine decay")
    g.add_argument("--seed", type=int, help="seed of the weights and the data order")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16"], help="auto: bf16 autocast on GPU, fp32 on CPU")
    r = parser.add_argument_group("run")
    r.add_argument("--data", help="your own .txt / .jsonl (field 'text') file or folder; default: Shakespeare")
    r.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    r.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    r.add_argument("--plan", help="a plan.yaml written by `moetrain plan` (parallel layout)")
    r.add_argument("--metrics-out", help="write one JSON row per step to this file")
    r.add_argument("--save-dir", help="folder for checkpoints (step-NNNNNN/)")
    r.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only at the end)")
    r.add_argument("--stop-at", type=int, help="end after step K as if interrupted, saving a checkpoint")
    r.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --save-dir")
    r.add_argument("--quiet", action="store_true", help="no progress bar")


def _training_config(args: argparse.Namespace):
    from pydantic import ValidationError

    from moetrain.config import TrainingConfig
    from moetrain.errors import describe_validation_error

    overrides = {field: getattr(args, flag) for flag, field in _TRAINING_FLAGS.items()
                 if getattr(args, flag) is not None}
    try:
        return TrainingConfig(**overrides)
    except ValidationError as exc:
        raise UserError(describe_validation_error("train flags", exc)) from None


def _check_run_flags(args: argparse.Namespace, steps: int) -> None:
    if args.stop_at is not None and not 0 < args.stop_at <= steps:
        raise UserError(f"--stop-at {args.stop_at} must lie in 1..--steps ({steps})")
    if args.stop_at is not None and not args.save_dir:
        raise UserError("--stop-at saves a checkpoint to resume from: give --save-dir too")
    if args.save_every < 0:
        raise UserError(f"--save-every {args.save_every} must be ≥ 0")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads} must be ≥ 1")


def run(args: argparse.Namespace) -> int:
    import torch

    from moetrain.config import load_cluster_config, load_model_config, load_plan_file
    from moetrain.train import RunOptions, Trainer

    model_cfg = load_model_config(args.model)
    cfg = _training_config(args)
    _check_run_flags(args, cfg.steps)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} but no CUDA device is visible; use --device cpu")
    cluster_name = args.cluster if args.cluster != "auto" else ("h100-sxm-80gb" if device.startswith("cuda") else "cpu")
    cluster = load_cluster_config(cluster_name)
    parallel = None
    if args.plan:
        parallel = load_plan_file(args.plan)["parallel"]
        if args.micro_batch is None:  # the plan's micro-batch unless the flag overrides it
            cfg = cfg.model_copy(update={"micro_batch": parallel.micro_batch})
        else:
            parallel = parallel.model_copy(update={"micro_batch": cfg.micro_batch})
    if args.threads:
        torch.set_num_threads(args.threads)
    options = RunOptions(
        device=device, cluster=cluster, data=args.data,
        metrics_out=Path(args.metrics_out) if args.metrics_out else None,
        save_dir=Path(args.save_dir) if args.save_dir else None,
        save_every=args.save_every, stop_at=args.stop_at, resume=args.resume, show_progress=not args.quiet,
    )
    trainer = Trainer(model_cfg, cfg, options, parallel=parallel)
    trainer.console.print(trainer.describe())
    trainer.train()
    trainer.print_summary()
    return 0
