"""Arguments shared by several commands, so each flag means the same thing everywhere."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from moetrain.config.run import MemoryOptions
from moetrain.errors import UserError
from moetrain.memory.policy import POLICIES
from moetrain.textfile import read_text, require_file


def add_model_arg(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument(
        "--model",
        default=default,
        required=default is None,
        help="model preset name (see `moetrain model-info --list`) or a YAML file",
    )


def add_cluster_arg(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument(
        "--cluster",
        default=default,
        required=default is None,
        help="cluster preset name (atlas-800t-a2, h100-sxm-80gb, ..., cpu) or a YAML file",
    )


def add_strategy_args(parser: argparse.ArgumentParser) -> None:
    """The parallel-strategy flags common to simulate, plan (as fixed values) and train."""
    g = parser.add_argument_group("parallel strategy")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallel (default: on when tp > 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    g.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank (interleaved 1F1B)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    g.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size")
    g.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage over data parallel")
    g.add_argument("--recompute", default="none", help="none | selective | full (or a memory policy)")
    g.add_argument("--a2a", choices=["flat", "hierarchical"], default="flat", help="expert all-to-all kind")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="pair forward and backward of two micro-batches to hide all-to-all")


def add_node_args(group: argparse._ArgumentGroup) -> None:
    """``--nnodes`` and ``--rdzv-endpoint``: the same command on every node (docs/training.md, Several nodes)."""
    group.add_argument("--nnodes", type=int, help="nodes of the run: start this same command on each node, with "
                       "--nproc N ranks per node and --rdzv-endpoint; torchrun's agents join there (default 1)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="several nodes: where torchrun's agents meet (c10d rendezvous), a host every node "
                            "reaches, e.g. the first node, and a free port")


def node_flags(args: argparse.Namespace):
    """The ``Nodes`` of ``--nnodes`` and ``--rdzv-endpoint`` (one node when neither is given)."""
    from moetrain.distributed.nodes import Nodes  # lazy: the torchrun side loads when a run starts

    nodes = Nodes(args.nnodes if args.nnodes is not None else 1, args.rdzv_endpoint)
    if nodes.count > 1 and args.nproc is None:
        raise UserError(f"--nnodes {nodes.count} needs --nproc N: the ranks on each node")
    return nodes


def log_dir_setting(args: argparse.Namespace, field: str, log_dir: str) -> str:
    """How a refusal names the run's log folder: the flag as typed, else the config file's field."""
    return f"--log-dir {args.log_dir}" if args.log_dir is not None else f"--config {args.config}: {field} {log_dir}"


def refuse_one_process_log_dir(setting: str) -> None:
    """``train`` and ``rl`` alike: without torchrun nothing writes into the log folder."""
    raise UserError(f"{setting} holds torchrun's log and the ranks' errors, but this run is one process: drop it, "
                    "or give --nproc N")


def check_plan_ranks(plan: str, parallel: object, world_size: int, nproc: int | None,
                     beside: dict[str, int] | None = None) -> None:
    """Refuse ``world_size`` ranks for the plan file ``plan`` whose trainer layout is ``parallel`` (plus the
    ``beside`` ranks of other roles, by role), naming the mend for how the ranks were counted: torchrun's
    (``nproc`` None, a worker), ``--nproc``, or nodes × ``--nproc``. The plan's layout is the planner's choice,
    so the mend is the rank count, not a degree to drop. A plan without dp (written by hand, dp follows the
    ranks) or with a count that is no positive whole number (the spec's own check names it) passes here."""
    if not isinstance(parallel, dict) or "dp" not in parallel:
        return
    axes = [parallel.get(axis, 1) for axis in ("tp", "cp", "pp", "dp")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in axes):
        return
    beside = {role: count for role, count in (beside or {}).items() if count}
    ranks = math.prod(axes) + sum(beside.values())
    if ranks == world_size:
        return
    roles = "".join(f" + {count} {role}" for role, count in beside.items())
    layout = (f"{plan} lays out {ranks} ranks ({'trainer ' * bool(roles)}tp·cp·pp·dp = "
              f"{'·'.join(map(str, axes))}{roles})")
    if nproc is None:
        raise UserError(f"torchrun started {world_size} ranks but {layout}; start {ranks} ranks")
    if world_size == nproc:
        raise UserError(f"--nproc {nproc} but {layout}; give --nproc {ranks}, or drop --nproc (the plan sets it)")
    nodes = world_size // nproc
    per_node = f" (--nproc {ranks // nodes})" if ranks % nodes == 0 else ""
    raise UserError(f"--nnodes {nodes} × --nproc {nproc} = {world_size} ranks but {layout}; give --nnodes × "
                    f"--nproc = {ranks}{per_node}")


def output_file(path: str, flag: str, example_name: str) -> str:
    """Check a file a command will write before the work that fills it: a folder where a file is meant is
    refused, and missing parent folders are created (as ``train --save-dir`` creates its folder)."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} {path} is a folder; name a file, e.g. {target / example_name}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot create its folder ({exc.strerror}); choose a writable path") from exc
    return path


def add_memory_policy_args(parser: argparse.ArgumentParser) -> None:
    """The memory-policy flags of ``moetrain memory`` and ``moetrain train`` (``MemoryOptions``)."""
    g = parser.add_argument_group("memory policy (recompute and swap)")
    # No argparse choices: a bad --policy is a one-line UserError (exit 2) like every other bad value.
    g.add_argument("--policy", metavar="{" + ",".join(POLICIES) + "}",
                   help="none | full (whole layers) | selective (fine-grained recompute) | auto (budgeted greedy) "
                        "(default: none)")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--budget-fraction", type=float, default=None,
                        help="activation budget as a fraction of the no-recompute activation bytes")
    budget.add_argument("--budget-gib", type=float, default=None, help="activation budget in GiB")


def memory_flags(args: argparse.Namespace) -> dict:
    """The memory flags the user gave, as ``MemoryOptions`` fields (with their own flag names in errors)."""
    given = {}
    if args.policy is not None:
        if args.policy not in POLICIES:
            raise UserError(f"--policy {args.policy!r} is not a memory policy; choose one of {', '.join(POLICIES)}")
        given["policy"] = args.policy
    if args.budget_fraction is not None:
        if not 0 < args.budget_fraction <= 1:
            raise UserError(f"--budget-fraction {args.budget_fraction} must be in (0, 1]")
        given["budget_fraction"] = args.budget_fraction
    if args.budget_gib is not None:
        if args.budget_gib <= 0:
            raise UserError(f"--budget-gib {args.budget_gib} must be positive")
        given["budget_gib"] = args.budget_gib
    return given


def memory_options(args: argparse.Namespace):
    """``MemoryOptions`` from the flags alone (``moetrain memory``)."""
    try:
        return MemoryOptions(**memory_flags(args))
    except ValidationError as exc:  # the validator's own line ("--policy auto needs a budget: ...")
        raise UserError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


def yaml_source(path: str, flag: str, sections: str) -> dict[str, Any]:
    """The mapping of sections in the YAML file ``path`` (given by ``flag``); unreadable is one line."""
    file, source = Path(path), f"{flag} {path}"
    require_file(file, source, f"give a YAML file with {sections}")
    text = read_text(file, source, "save it as UTF-8 YAML")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{flag} {path} is not readable YAML ({first}); fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{flag} {path} must hold a mapping of sections ({sections})")
    return data
