"""``moetrain train``: one run spec, one loop, any layout.

The flags, an optional ``--config run.yaml`` and an optional ``--plan plan.yaml`` (what ``moetrain
plan --out`` writes) become one validated ``RunSpec`` (``moetrain.config.run``): defaults < config
file < plan < flags. ``check_run`` refuses what cannot run before anything starts. A spec of one rank
trains here; several ranks start under torchrun (``moetrain.distributed.launch``), each reading the
same spec from a file. The worker users start with torchrun on several nodes
(``-m moetrain.cli.worker``) takes these same flags and builds the spec here too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from moetrain.balance.online import PAYBACK_HORIZON, REPLAN_INTERVAL
from moetrain.cli.common import (
    add_memory_policy_args,
    add_node_args,
    check_plan_ranks,
    log_dir_setting,
    memory_flags,
    node_flags,
    refuse_one_process_log_dir,
    yaml_source,
)
from moetrain.cli.parsing import CommandParser, DefaultsFormatter, format_default
from moetrain.config import limits, load_model_config, load_plan_file
from moetrain.config.run import RunSpec, resolve_run_spec, spec_source_from_plan
from moetrain.errors import UserError
from moetrain.rl.spec import RLRunSpec
from moetrain.textfile import require_file

HELP = "train a model (one process on CPU/GPU, or --nproc N ranks in any layout); resumable, with per-step metrics"

# flag → (run-spec section, field); every flag defaults to None ("not given") so that a config file or a
# plan can set the field and the spec's own defaults stay the one source of truth.
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "steps": ("training", "steps"), "global_batch": ("training", "global_batch"),
    "micro_batch": ("training", "micro_batch"), "seq_len": ("training", "seq_len"), "lr": ("training", "lr"),
    "warmup": ("training", "warmup_steps"), "seed": ("training", "seed"), "dtype": ("training", "dtype"),
    "device": ("run", "device"), "threads": ("run", "threads"), "cluster": ("run", "cluster"),
    "data": ("run", "data"), "tensorboard": ("run", "tensorboard"), "synthetic_data": ("run", "synthetic_data"),
    "metrics_out": ("run", "metrics_out"),
    "trace_routing": ("run", "trace_routing"), "save_dir": ("run", "save_dir"), "save_every": ("run", "save_every"),
    "stop_at": ("run", "stop_at"), "resume": ("run", "resume"), "quiet": ("run", "quiet"),
    "max_restarts": ("run", "max_restarts"), "async_save": ("run", "async_save"), "keep_last": ("run", "keep_last"),
    "on_save_error": ("run", "on_save_error"),
    "ranks_per_node": ("run", "ranks_per_node"), "trace_dir": ("run", "trace_dir"), "log_dir": ("run", "log_dir"),
    "compile": ("run", "compile"), "document_mask": ("run", "document_mask"),
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "vpp": ("parallel", "vpp"), "ep": ("parallel", "ep"),
    "etp": ("parallel", "etp"), "cp": ("parallel", "cp"), "zero": ("parallel", "zero"),
    "overlap": ("parallel", "overlap"),
    "online_balance": ("balance", "enabled"), "balance_interval": ("balance", "interval"),
    "balance_horizon": ("balance", "horizon"), "slots_per_rank": ("balance", "slots_per_rank"),
    "spike_factor": ("guards", "spike_factor"), "spike_window": ("guards", "spike_window"),
    "max_bad_steps": ("guards", "max_bad_steps"),
}
PATH_FLAGS = ("data", "metrics_out", "tensorboard", "trace_routing", "save_dir", "trace_dir", "log_dir")
"""Made absolute, so every rank (and a resumed run started elsewhere) reads the same files."""
LAYOUT_FLAGS = ("tp", "pp", "vpp", "ep", "etp", "cp", "zero", "overlap", "hierarchical_a2a")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a run.yaml with model, training, parallel, run, memory, balance, guards "
                        "sections")
    parser.add_argument("--plan", help="a plan.yaml written by `moetrain plan --out` (layout, micro-batch, recompute)")
    parser.add_argument("--model", help="model preset name or YAML file")
    parser.add_argument("--cluster", help="cluster preset for MFU (default: cpu on CPU, else the GPU's own preset)")
    g = parser.add_argument_group("schedule and batch (defaults: moetrain.config.TrainingConfig)")
    g.add_argument("--steps", type=int, help="total optimizer steps of the run (sets the lr schedule)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    g.add_argument("--micro-batch", type=int, help="sequences per forward/backward (gradient accumulation)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup", type=int, help="linear warm-up steps before the cosine decay")
    g.add_argument("--seed", type=int, help="seed of the weights and the data order")
    g.add_argument("--dtype", help="auto (bf16 autocast on GPU, fp32 on CPU), fp32 or bf16")
    r = parser.add_argument_group("run")
    r.add_argument("--data", help="your own .txt / .jsonl (field 'text') file or folder; default: Shakespeare")
    r.add_argument("--synthetic-data", action="store_true", default=None,
                   help="counting sequences instead of a corpus (benchmarks)")
    r.add_argument("--device", help="cpu, cuda, cuda:N or auto (cuda when available)")
    r.add_argument("--threads", type=int,
                   help="CPU threads for torch in each rank (default: the free cores, shared among the ranks)")
    r.add_argument("--metrics-out", help="write one JSON row per step to this file")
    r.add_argument("--tensorboard", metavar="DIR",
                   help="also write the metrics as TensorBoard scalars here (pip install 'moetrain[tensorboard]')")
    r.add_argument("--trace-routing", help="write per step and MoE layer the tokens routed to each expert (JSONL)")
    r.add_argument("--save-dir", help="folder for checkpoints (step-NNNNNN/)")
    r.add_argument("--save-every", type=int, help="save every K steps (0, the default: only at the end)")
    r.add_argument("--stop-at", type=int, help="end after step K as if interrupted, saving a checkpoint")
    r.add_argument("--resume", action="store_true", default=None, help="continue from the newest checkpoint")
    r.add_argument("--quiet", action="store_true", default=None, help="no progress bar")
    f = parser.add_argument_group("recovery and checkpoints (docs/training.md, Recovery)")
    f.add_argument("--max-restarts", type=int,
                   help="restart every rank after a failure, up to N times, each resuming from the newest complete "
                        "checkpoint (needs --save-dir; runs under torchrun, one process included)")
    f.add_argument("--async-save", action="store_true", default=None,
                   help="write checkpoints in the background from a host copy (DCP async_save); training goes on")
    f.add_argument("--keep-last", type=int,
                   help="keep the newest K complete checkpoints; older ones go once a newer one is complete "
                        "(default: keep all)")
    f.add_argument("--on-save-error", choices=["continue", "stop"],
                   help="after a failed save (a full disk, a permission), which keeps the previous checkpoint")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each decoder layer (default: on for CUDA, off for CPU)")
    r.add_argument("--document-mask", choices=["auto", "dense", "block"],
                   help="how attention masks packed documents: block = FlexAttention tiles (compiled CUDA layers), "
                        "dense = a boolean mask (default auto: block where layers compile on CUDA, else dense)")
    r.add_argument("--trace-dir", help="write each rank's compute/communication timeline (Chrome trace) here")
    d = parser.add_argument_group("layout (see docs/distributed.md); one process when every degree is 1")
    d.add_argument("--log-dir", help="several ranks: torchrun's log and the ranks' errors (default: a temp folder)")
    d.add_argument("--nproc", type=int, help="ranks on this node (= tp·cp·pp·dp; with --nnodes M: M·nproc); "
                   "above 1 starts torchrun")
    add_node_args(d)
    for axis, text in (("tp", "tensor parallel, with sequence parallelism"), ("pp", "pipeline stages"),
                       ("vpp", "virtual stages per pipeline rank"), ("ep", "expert parallel (inside dp)"),
                       ("etp", "expert tensor parallel (splits each expert's FFN)"),
                       ("cp", "context parallel (splits each sequence)")):
        d.add_argument(f"--{axis}", type=int, help=text)
    d.add_argument("--zero", type=int, help="ZeRO stage over data parallelism: 1, 2 or 3 (FSDP2)")
    d.add_argument("--hierarchical-a2a", action="store_true", default=None,
                   help="two-hop expert all-to-all (inter-node, intra-node)")
    d.add_argument("--ranks-per-node", type=int, help="node size for the hierarchical all-to-all")
    d.add_argument("--overlap", action="store_true", default=None,
                   help="overlapped schedule: one micro-batch's forward paired with another's backward")
    b = parser.add_argument_group("online expert balancing (docs/balance.md)")
    b.add_argument("--online-balance", action="store_true", default=None,
                   help="migrate and replicate hot experts across EP ranks while training (needs --ep > 1)")
    b.add_argument("--balance-interval", type=int, help=f"steps between full re-plans (default: {REPLAN_INTERVAL})")
    b.add_argument("--balance-horizon", type=int,
                   help=f"steps over which a migration must repay its cost (default: {PAYBACK_HORIZON})")
    b.add_argument("--slots-per-rank", type=int, help="expert slots per EP rank (default: experts/ep + 1)")
    s = parser.add_argument_group("bad steps (docs/training.md); a non-finite loss or gradient norm is always skipped")
    s.add_argument("--spike-factor", type=float,
                   help="roll back to the last checkpoint when a loss exceeds F × the median of recent ones "
                        "(default: off)")
    s.add_argument("--spike-window", type=int, help="recent finite losses the spike median is taken over")
    s.add_argument("--max-bad-steps", type=int, help="roll back after this many skipped steps in a row")
    add_memory_policy_args(parser)
    _show_spec_defaults(parser)


def _show_spec_defaults(parser: argparse.ArgumentParser) -> None:
    """Write the run spec's defaults into the help of the flags that set its fields: the flags themselves
    default to "not given", so that a config file or a plan can set the field first."""
    spec = RunSpec()
    defaults = {flag: getattr(getattr(spec, section), field) for flag, (section, field) in FLAG_FIELDS.items()}
    defaults["model"] = spec.model
    for action in parser._actions:
        value = defaults.get(action.dest)
        if value is not None and value is not False and "default" not in (action.help or ""):
            action.help = f"{action.help} (default: {format_default(value)})"


def _flag_source(args: argparse.Namespace) -> dict[str, Any]:
    """The given flags as run-spec fields."""
    source: dict[str, Any] = {}
    if args.model is not None:
        source["model"] = args.model
    for flag, (section, field) in FLAG_FIELDS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if flag in PATH_FLAGS:
            value = str(Path(value).resolve())
        source.setdefault(section, {})[field] = value
    if args.hierarchical_a2a:
        source.setdefault("parallel", {})["a2a"] = "hierarchical"
    if args.policy is not None or args.budget_fraction is not None or args.budget_gib is not None:
        source["memory"] = memory_flags(args)
    return source


def build_spec(args: argparse.Namespace, world_size: int | None = None):
    """The run spec of these flags (plus ``--config`` and ``--plan``); ``world_size``: torchrun's, for
    the worker (``--nproc`` otherwise)."""
    sources = [yaml_source(args.config, "--config", "model, training, parallel, run, ...")] if args.config else []
    if sources:
        _refuse_rl_spec(sources[0], args.config)
    names = [Path(args.config).name] if args.config else []
    flags = _flag_source(args)
    plan = _plan_source(args, sources[0] if sources else {}) if args.plan else None
    if plan is not None:
        sources.append(plan)
        names.append(Path(args.plan).name)
    sources.append(flags)
    names.append(FLAGS_SOURCE)
    if args.nproc is not None:
        if args.nproc < 1:
            raise UserError(f"--nproc {args.nproc} must be ≥ 1")
        nodes = node_flags(args).count
        limits.check_processes(args.nproc, "--nproc", "ranks (processes)")  # this node's
        if world_size is not None and world_size != args.nproc:
            raise UserError(f"--nproc {args.nproc} but torchrun started {world_size} ranks; drop --nproc")
        world_size = args.nproc * nodes
        if nodes > 1 and args.ranks_per_node is None:  # the node size the layout's groups are placed by
            flags.setdefault("run", {})["ranks_per_node"] = args.nproc
    if world_size is None and not args.config and not args.plan:
        given = [f"--{axis} {getattr(args, axis)}" for axis in ("tp", "pp", "vpp", "ep", "etp", "cp")
                 if (getattr(args, axis) or 1) > 1]
        if given:
            raise UserError(f"{' '.join(given)} needs several ranks: give --nproc N (= tp·cp·pp·dp)")
    if plan is not None and world_size is not None:
        check_plan_ranks(args.plan, plan["parallel"], world_size, args.nproc)  # nproc None: torchrun's
    try:
        spec = resolve_run_spec(sources, world_size, names)
    except UserError as exc:
        raise UserError(_named_by_flag(str(exc))) from None
    return spec


def _plan_source(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """The run-spec fields of ``--plan``, which sets the layout alone."""
    given = [f"--{name.replace('_', '-')}" for name in LAYOUT_FLAGS if getattr(args, name) is not None]
    if given:
        raise UserError(f"--plan already sets the layout; drop {', '.join(given)} (or drop --plan)")
    if "parallel" in config:
        raise UserError(f"--plan and {args.config}'s parallel section both set the layout; drop one")
    return spec_source_from_plan(_read_plan(args.plan))


def _read_plan(path: str) -> dict[str, Any]:
    """``load_plan_file``, with a folder (or another non-file) named as what it is and what --plan takes."""
    if Path(path).exists():  # a missing file keeps load_plan_file's mend: write it with `moetrain plan --out`
        require_file(Path(path), f"--plan {path}", "--plan takes a plan YAML file, the one `moetrain plan --out "
                     "FILE` writes")
    return load_plan_file(path)


def _refuse_rl_spec(data: dict[str, Any], path: str) -> None:
    """An RL run spec (``moetrain rl --config``) given to ``moetrain train`` is one line naming its kind."""
    rl_only = sorted(set(data) & (set(RLRunSpec.model_fields) - {"model"}))
    if rl_only and not set(data) & {"training", "parallel", "run", "memory", "balance"}:
        raise UserError(f"--config {path} is an RL run spec (its {', '.join(rl_only)}: moetrain rl --config), not a "
                        "training run spec; moetrain train --config takes sections model, training, parallel, run, "
                        "memory, balance")


FLAGS_SOURCE = "flags"
"""How ``resolve_run_spec`` names the flags' values in an error; ``_named_by_flag`` then names the flag."""


def _named_by_flag(message: str) -> str:
    """``flags: balance.interval: ...`` → ``--balance-interval: ...``: name the flag the user typed."""
    for flag, (section, field) in FLAG_FIELDS.items():
        message = message.replace(f"{FLAGS_SOURCE}: {section}.{field}:", f"--{flag.replace('_', '-')}:")
    return message.replace(f"{FLAGS_SOURCE}: ", "run spec: ")  # a section the flags filled (batch arithmetic)


def checked_spec(args: argparse.Namespace, world_size: int | None = None):
    """``build_spec`` and every check that needs no process group (``moetrain.train.checks``)."""
    from moetrain.train.checks import check_corpus, check_run  # lazy: the corpus code loads when a run starts

    spec = build_spec(args, world_size)
    if world_size is None and spec.run.log_dir and not _launches_torchrun(spec):  # before check_run makes it
        refuse_one_process_log_dir(log_dir_setting(args, "run.log_dir", spec.run.log_dir))
    model_cfg = load_model_config(spec.model)
    check_run(spec, model_cfg)
    check_corpus(spec, model_cfg)
    return spec


def _launches_torchrun(spec: RunSpec) -> bool:
    """Several ranks, or restarts: torchrun's agent restarts a failed group."""
    return spec.world_size > 1 or spec.run.max_restarts > 0


def run(args: argparse.Namespace) -> int:
    # lazy (here and below), heavy: rich, torch and the runtime load when a run starts, not when the parser
    # imports every command module (``moetrain.cli``)
    from moetrain.status import say, status_console

    nodes = node_flags(args)
    spec = checked_spec(args)
    if _launches_torchrun(spec):
        from moetrain.distributed.launch import launch  # lazy, heavy: torch

        return launch(spec, Path(spec.run.log_dir) if spec.run.log_dir else None, nodes=nodes)
    say(status_console(spec.run.quiet), "setting up: torch, the data, the model…")
    from moetrain.train.trainer import Trainer  # lazy, heavy: torch

    trainer = Trainer(spec)
    trainer.console.print(trainer.describe())
    trainer.train()
    trainer.print_summary()
    return 0


def worker_main(argv: list[str] | None = None) -> int:
    """One rank under torchrun: the spec the launcher wrote (``MOETRAIN_RUN_SPEC``), or these flags."""
    from moetrain.train.rank import run_rank  # lazy, heavy: torch

    payload = os.environ.get("MOETRAIN_RUN_SPEC")
    try:
        if payload:
            spec = RunSpec.model_validate_json(Path(payload).read_text(encoding="utf-8"))
        else:
            parser = CommandParser(prog="python -m moetrain.cli.worker", formatter_class=DefaultsFormatter,
                                   description="one rank of a moetrain run (started by torchrun)")
            add_arguments(parser)
            spec = checked_spec(parser.parse_args(argv), world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except UserError as exc:
        print(f"moetrain worker: error: {exc}", file=sys.stderr)
        return 2
    return run_rank(spec)
