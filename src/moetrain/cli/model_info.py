"""``moetrain model-info``: parameters (counted on the meta device and by formula) and FLOPs per token."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from moetrain.cli.common import add_model_arg
from moetrain.config import load_model_config, model_presets
from moetrain.costs.flops import model_forward_flops
from moetrain.costs.params import count_params
from moetrain.errors import UserError

HELP = "total and activated parameters (meta-device count, no memory), FLOPs per token, per-part breakdown"
# A typical pre-training length. Counting at the model's max_seq_len (131,072 for Pangu) would make
# attention's quadratic term hide every other part of the FLOPs.
DEFAULT_SEQ_LEN = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser, default="")
    parser.add_argument("--list", action="store_true", help="list the model presets and exit")
    parser.add_argument("--seq-len", type=int,
                        help=f"sequence length the FLOPs are counted at (default {DEFAULT_SEQ_LEN}, or the model's "
                             "max_seq_len when shorter)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def model_info(model_name: str, seq_len: int | None = None) -> dict[str, Any]:
    """The report as a dict. Counts come from ``moetrain.costs`` and from the module built on meta;
    ``parts_disagree`` lists the parts where they differ (empty when the contract holds)."""
    cfg = load_model_config(model_name)  # before torch loads: a bad model file is refused in a moment
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, cfg.max_seq_len)
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise UserError(f"--seq-len {seq_len} must lie in 1..{cfg.max_seq_len:,} (the max_seq_len of {cfg.name}); "
                        "give a length the model can run")
    from moetrain.models import build_model, param_counts_by_part  # lazy, heavy: torch (the parser loads every command)

    analytic = count_params(cfg)
    meta_parts = param_counts_by_part(build_model(cfg, device="meta"))
    analytic_parts = analytic.as_dict()
    disagree = sorted(p for p in analytic_parts.keys() | meta_parts.keys()
                      if analytic_parts.get(p, 0) != meta_parts.get(p, 0))
    meta_total = sum(v for k, v in meta_parts.items() if k != "mtp")
    routed_share = cfg.moe.router.top_k / cfg.moe.num_experts if cfg.moe else 0.0
    # Same convention as ParamCounts.active: no MTP, no input embedding (a lookup), top-k of the experts.
    meta_active = meta_total - meta_parts.get("embedding", 0) - round(meta_parts.get("experts", 0) * (1 - routed_share))
    flops = model_forward_flops(cfg, seq_len)
    flops_no_mtp = model_forward_flops(cfg, seq_len, include_mtp=False)
    return {
        "model": cfg.name,
        "total_params": meta_total,
        "active_params": meta_active,
        "total_params_with_mtp": meta_total + meta_parts.get("mtp", 0),
        "analytic_total_params": analytic.total,
        "analytic_active_params": analytic.active,
        "params_by_part": {part: meta_parts.get(part, 0) for part in analytic_parts},
        "parts_disagree": disagree,
        "seq_len": seq_len,
        "max_seq_len": cfg.max_seq_len,
        "forward_flops_per_token": flops.forward,
        "training_flops_per_token": flops.training,
        "training_flops_per_token_without_mtp": flops_no_mtp.training,
        "forward_flops_by_part": flops.as_dict(),
    }


def _short(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def _print_tables(info: dict[str, Any]) -> None:
    # lazy: rich loads for the tables only (--json prints without it)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    params = Table(title=f"{info['model']}: parameters (meta-device count)", header_style="bold")
    params.add_column("part")
    params.add_column("parameters", justify="right")
    for part, count in info["params_by_part"].items():
        params.add_row(part, f"{count:,}")
    params.add_row("[bold]total (without MTP)", f"[bold]{info['total_params']:,} ({_short(info['total_params'])})")
    params.add_row("[bold]active (without MTP)", f"[bold]{info['active_params']:,} ({_short(info['active_params'])})")
    params.add_row("total with MTP", f"{info['total_params_with_mtp']:,}")
    console.print(params)
    flops = Table(title=f"forward FLOPs/token at seq_len {info['seq_len']:,}", header_style="bold")
    flops.add_column("part")
    flops.add_column("GFLOPs", justify="right")
    for part, value in info["forward_flops_by_part"].items():
        flops.add_row(part, f"{value / 1e9:.4f}")
    flops.add_row("[bold]forward", f"[bold]{info['forward_flops_per_token'] / 1e9:.4f}")
    flops.add_row("[bold]training (3 × forward)", f"[bold]{info['training_flops_per_token'] / 1e9:.4f}")
    console.print(flops)
    console.print(f"FLOPs at seq_len {info['seq_len']:,} (--seq-len N for another, up to max_seq_len "
                  f"{info['max_seq_len']:,})")


def run(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(model_presets()))
        return 0
    if not args.model:
        raise UserError("give --model NAME (a preset or a YAML file); `moetrain model-info --list` shows presets")
    info = model_info(args.model, args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_tables(info)
    if info["parts_disagree"]:
        # Not the user's fault: the module and moetrain.costs.params must agree for every preset.
        print(f"moetrain model-info: error: the built module and moetrain.costs.params disagree on "
              f"{', '.join(info['parts_disagree'])}; this is a bug in moetrain, please report it", file=sys.stderr)
        return 1
    return 0
