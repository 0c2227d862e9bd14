"""``moetrain train``: train a preset on CPU or one GPU, or hand a multi-rank layout to the distributed launcher.

One process (the default): the single-process trainer (``moetrain.train``), with metrics, checkpoints,
resume, a memory policy (recompute/swap) and routing traces. More than one rank (``--nproc N`` with
``--tp/--pp/--vpp/--ep``, or a plan whose world size is above 1): the layout is validated here, then
``moetrain.distributed.launch`` starts the ranks under torchrun. Flags the distributed worker does not
take yet are refused by name rather than dropped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moetrain.cli.common import add_cluster_arg, add_model_arg
from moetrain.errors import UserError
from moetrain.memory.args import add_memory_policy_args, budget_bytes_from_args
from moetrain.memory.policy import POLICIES

HELP = "train a model (one process on CPU/GPU, or --nproc N ranks); resumable, with per-step metrics"

# flag name → TrainingConfig field; unset flags keep the config's defaults (one source of truth)
_TRAINING_FLAGS = {
    "steps": "steps", "global_batch": "global_batch", "micro_batch": "micro_batch", "seq_len": "seq_len",
    "lr": "lr", "warmup": "warmup_steps", "seed": "seed", "dtype": "dtype",
}
_LAYOUT_AXES = ("tp", "pp", "vpp", "ep", "etp", "cp")

# Flags of the single-process trainer with the value that means "not given". A multi-rank run passes
# each given one on to the launcher when the launcher takes it, and otherwise refuses it by name.
_RUN_FLAGS_UNSET = {
    "lr": None, "warmup": None, "seed": None, "dtype": None, "data": None, "device": "auto", "threads": None,
    "cluster": "auto", "save_dir": None, "save_every": 0, "stop_at": None, "resume": False, "trace_routing": None,
    "policy": "none", "budget_fraction": None, "budget_gib": None, "online_balance": False,
    "balance_interval": None, "balance_horizon": None, "slots_per_rank": None,
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
    r.add_argument("--plan", help="a plan.yaml written by `moetrain plan` (parallel layout; world size > 1 launches)")
    r.add_argument("--metrics-out", help="write one JSON row per step to this file")
    r.add_argument("--trace-routing", help="write per step and MoE layer the tokens routed to each expert (JSONL)")
    r.add_argument("--save-dir", help="folder for checkpoints (step-NNNNNN/)")
    r.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only at the end)")
    r.add_argument("--stop-at", type=int, help="end after step K as if interrupted, saving a checkpoint")
    r.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --save-dir")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    d = parser.add_argument_group("multi-rank layout (one node, under torchrun; see docs/distributed.md)")
    d.add_argument("--nproc", type=int,
                   help="processes on this node (= tp·cp·pp·dp); above 1 runs the distributed worker")
    for axis, text in (("tp", "tensor parallel (with sequence parallel)"), ("pp", "pipeline stages"),
                       ("vpp", "virtual stages per pipeline rank"), ("ep", "expert parallel (inside dp)"),
                       ("etp", "expert tensor parallel (splits each expert's FFN)"),
                       ("cp", "context parallel (splits each sequence)")):
        d.add_argument(f"--{axis}", type=int, help=f"{text} (default 1)")
    d.add_argument("--hierarchical-a2a", action="store_true", help="two-hop expert all-to-all (inter-node, intra-node)")
    d.add_argument("--ranks-per-node", type=int, help="node size for the hierarchical all-to-all")
    d.add_argument("--overlap", action="store_true",
                   help="overlapped schedule: one micro-batch's forward paired with another's backward")
    d.add_argument("--online-balance", action="store_true",
                   help="migrate and replicate hot experts across EP ranks while training (needs --ep > 1)")
    d.add_argument("--balance-interval", type=int, help="with --online-balance: steps between full re-plans (10)")
    d.add_argument("--balance-horizon", type=int,
                   help="with --online-balance: steps over which a migration must repay its cost (50)")
    d.add_argument("--slots-per-rank", type=int,
                   help="with --online-balance: expert slots per EP rank (experts/ep + 1)")
    add_memory_policy_args(parser)
    # A bad --policy is a UserError (one line, exit 2) like every other bad value, not an argparse usage dump.
    policy = parser._option_string_actions["--policy"]
    policy.choices, policy.metavar = None, "{" + ",".join(POLICIES) + "}"


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
    if args.policy not in POLICIES:
        raise UserError(f"--policy {args.policy!r} is not a memory policy; choose one of {', '.join(POLICIES)}")
    budget_bytes_from_args(args, baseline_bytes=1.0)  # checks the budget flags before any data or model is built
    if args.stop_at is not None and not 0 < args.stop_at <= steps:
        raise UserError(f"--stop-at {args.stop_at} must lie in 1..--steps ({steps})")
    if args.stop_at is not None and not args.save_dir:
        raise UserError("--stop-at saves a checkpoint to resume from: give --save-dir too")
    if args.save_every < 0:
        raise UserError(f"--save-every {args.save_every} must be ≥ 0")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads} must be ≥ 1")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc {args.nproc} must be ≥ 1")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _layout_args(args: argparse.Namespace, plan_parallel) -> tuple[int, argparse.Namespace]:
    """(nproc, the launcher's layout flags) from --tp/--pp/--vpp/--ep/--nproc or from the plan."""
    given_axes = [axis for axis in _LAYOUT_AXES if getattr(args, axis) is not None]
    layout = argparse.Namespace(**{axis: getattr(args, axis) or 1 for axis in _LAYOUT_AXES},
                                hierarchical_a2a=args.hierarchical_a2a, overlap=args.overlap)
    if plan_parallel is None:
        nproc = args.nproc if args.nproc is not None else 1
        if nproc == 1 and any(getattr(layout, axis) > 1 for axis in _LAYOUT_AXES):
            raise UserError(f"{' '.join(f'--{a} {getattr(layout, a)}' for a in given_axes)} needs several ranks: "
                            "give --nproc N (= tp·cp·pp·dp)")
        return nproc, layout
    if given_axes:
        raise UserError(f"--plan already sets the layout; drop {', '.join('--' + a for a in given_axes)} "
                        "(or drop --plan)")
    if plan_parallel.tp > 1 and not plan_parallel.sp:
        raise UserError("the plan has tp > 1 without sequence parallel; the distributed runtime always shards "
                        "the sequence with tp: set sp: true in the plan")
    if plan_parallel.zero != 1:
        raise UserError(f"the plan asks for ZeRO stage {plan_parallel.zero}; the distributed runtime runs ZeRO-1: "
                        "set zero: 1 in the plan")
    nproc = plan_parallel.world_size
    if args.nproc is not None and args.nproc != nproc:
        raise UserError(f"--nproc {args.nproc} but the plan's tp·cp·pp·dp is {nproc}; drop --nproc or make them equal")
    layout = argparse.Namespace(tp=plan_parallel.tp, pp=plan_parallel.pp, vpp=plan_parallel.vpp, ep=plan_parallel.ep,
                                etp=plan_parallel.etp, cp=plan_parallel.cp,
                                hierarchical_a2a=args.hierarchical_a2a or plan_parallel.a2a == "hierarchical",
                                overlap=args.overlap or plan_parallel.overlap)
    return nproc, layout


def _run_distributed(args: argparse.Namespace, cfg, nproc: int, layout: argparse.Namespace, plan_parallel) -> int:
    """Pass the run to ``moetrain.distributed.launch`` (which validates the layout before any process
    starts); a given flag the launcher does not take is refused by name, never dropped."""
    from moetrain.config import load_model_config
    from moetrain.distributed import launch as launcher
    from moetrain.distributed.layout import validate_layout

    # Parse with the launcher's own parser, so its defaults (and the flags it gains later) stay its own.
    parser = argparse.ArgumentParser(prog="moetrain train")
    launcher.add_arguments(parser)
    launcher_dests = set(vars(parser.parse_args(["--nproc", str(nproc)])))
    argv = ["--nproc", str(nproc), "--model", args.model, "--steps", str(cfg.steps),
            "--global-batch", str(cfg.global_batch), "--micro-batch", str(cfg.micro_batch),
            "--seq-len", str(cfg.seq_len)]
    argv += [item for axis in _LAYOUT_AXES for item in (f"--{axis}", str(getattr(layout, axis)))]
    argv += ["--hierarchical-a2a"] * layout.hierarchical_a2a + ["--overlap"] * layout.overlap
    if args.ranks_per_node is not None:
        argv += ["--ranks-per-node", str(args.ranks_per_node)]
    if args.metrics_out:
        argv += ["--metrics-out", str(Path(args.metrics_out).resolve())]
    for dest, unset in _RUN_FLAGS_UNSET.items():
        value = getattr(args, dest)
        if value == unset:
            continue
        if dest not in launcher_dests:
            raise UserError(f"{_flag(dest)} is not supported by the distributed runtime yet; "
                            "drop it or train in one process (--nproc 1)")
        argv += [_flag(dest)] if value is True else [_flag(dest), str(value)]
    if plan_parallel is not None:
        # the plan's own axes (cp, etp, ...) are checked as written, before the launcher rebuilds the layout
        validate_layout(plan_parallel.model_copy(update={"micro_batch": cfg.micro_batch}),
                        load_model_config(args.model), nproc, cfg.global_batch, cfg.micro_batch, args.ranks_per_node)
    return launcher.launch(nproc, parser.parse_args(argv))


def _apply_memory_policy(trainer, args: argparse.Namespace) -> None:
    """Install the recompute/swap plan the flags ask for on the built model (``moetrain.memory``)."""
    from moetrain.memory import apply_memory_policy_from_args

    result, trainer.memory_policy = apply_memory_policy_from_args(trainer.model, args, trainer.cfg.seq_len,
                                                                  trainer.parallel.micro_batch)
    if args.policy == "none":
        return
    options = ", ".join(f"{name}×{count}" for name, count in sorted(result.options.items())) or "nothing"
    trainer.console.print(f"memory policy {args.policy}: {options}; activations {result.activation_bytes / 2**20:,.1f}"
                          f" of {result.baseline_bytes / 2**20:,.1f} MiB per micro-batch (analytic)")


def run(args: argparse.Namespace) -> int:
    from moetrain.config import load_plan_file

    cfg = _training_config(args)
    _check_run_flags(args, cfg.steps)
    plan_parallel = load_plan_file(args.plan)["parallel"] if args.plan else None
    if plan_parallel is not None and args.micro_batch is None:  # the plan's micro-batch unless the flag overrides it
        cfg = cfg.model_copy(update={"micro_batch": plan_parallel.micro_batch})
    nproc, layout = _layout_args(args, plan_parallel)
    if nproc > 1:
        return _run_distributed(args, cfg, nproc, layout, plan_parallel)
    for dest in ("hierarchical_a2a", "overlap", "ranks_per_node", "online_balance", "balance_interval",
                 "balance_horizon", "slots_per_rank"):
        if getattr(args, dest) not in (None, False):
            raise UserError(f"{_flag(dest)} shapes a multi-rank run; give --nproc N and a layout, or drop it")
    return _run_single_process(args, cfg, plan_parallel)


def _run_single_process(args: argparse.Namespace, cfg, plan_parallel) -> int:
    import torch

    from moetrain.config import load_cluster_config, load_model_config
    from moetrain.train import RunOptions, Trainer

    model_cfg = load_model_config(args.model)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} but no CUDA device is visible; use --device cpu")
    cluster_name = args.cluster if args.cluster != "auto" else ("h100-sxm-80gb" if device.startswith("cuda") else "cpu")
    cluster = load_cluster_config(cluster_name)
    parallel = None
    if plan_parallel is not None:
        parallel = plan_parallel.model_copy(update={"micro_batch": cfg.micro_batch})
    if args.threads:
        torch.set_num_threads(args.threads)
    options = RunOptions(
        device=device, cluster=cluster, data=args.data,
        metrics_out=Path(args.metrics_out) if args.metrics_out else None,
        trace_routing=Path(args.trace_routing) if args.trace_routing else None,
        save_dir=Path(args.save_dir) if args.save_dir else None,
        save_every=args.save_every, stop_at=args.stop_at, resume=args.resume, show_progress=not args.quiet,
    )
    trainer = Trainer(model_cfg, cfg, options, parallel=parallel)
    _apply_memory_policy(trainer, args)
    trainer.console.print(trainer.describe())
    trainer.train()
    trainer.print_summary()
    return 0
