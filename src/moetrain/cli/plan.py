"""``moetrain plan``: search the parallel layout (or, with --search-model, the model shape)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import yaml

from moetrain.cli import plan_rl
from moetrain.cli.common import output_file
from moetrain.cli.workload import add_workload_args, build_workload, require_batch
from moetrain.config.parallel import runtime_limits
from moetrain.errors import UserError
from moetrain.planner.calibration import accuracy_line

HELP = "search TP/SP/PP/VPP/EP/ETP/CP/DP, ZeRO, micro-batch, recompute, all-to-all and overlap; write a plan"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("moetrain plan --model M --cluster C --devices N (--seq-len L --global-batch B | --rl "
                    "--prompt-len P --response-len R) [--top K] [--out FILE] [--json]")
    add_workload_args(parser, batch_required=False)
    parser.add_argument("--top", type=int, default=5, help="how many layouts to print")
    parser.add_argument("--out", help="where to write the winner's plan file (default: plan.yaml; with --rl, "
                        f"{plan_rl.DEFAULT_OUT})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--any-layout", action="store_true",
                        help="rank every layout the cost model prices, also those `moetrain train` cannot run yet")
    parser.add_argument("--search-model", action="store_true",
                        help="compare model shapes (experts, hidden, depth) near --param-budget by throughput")
    parser.add_argument("--param-budget", type=float,
                        help="total parameters in billions for --search-model (default: the model's own)")
    plan_rl.add_arguments(parser)


def plan_layouts(args: argparse.Namespace) -> tuple[dict, dict]:
    """(the --json mapping, the plan file mapping)."""
    # lazy: the search and rich load when the command runs, not when the parser imports every command module
    from moetrain.planner.search import SearchOptions, search
    from moetrain.status import say, status_console

    workload, calibration = build_workload(args)
    device = workload.cluster.device
    # a search of a large model takes seconds; with --json, stdout is the answer alone
    say(status_console(quiet=args.json), f"searching the layouts of {workload.model.name} on {args.devices:,} × "
        f"{workload.cluster.name}…")
    options = SearchOptions(top_k=max(args.top, 1), held_out=calibration.held_out_for_device(device),
                            runnable_only=not args.any_layout)
    result = search(workload, args.devices, calibration.for_device(device), options)
    if len(result.top) == 0:
        where = (f"{args.devices} × {workload.cluster.name} at seq {workload.seq_len}, "
                 f"batch {workload.global_batch}")
        if result.excluded is not None:
            raise UserError(f"no layout of {workload.model.name} that the runtime can run fits {where} (the fastest "
                            f"that fits is not runnable: {result.excluded.reasons[0]}); --any-layout ranks it anyway, "
                            "or add devices")
        raise UserError(f"no layout of {workload.model.name} fits {where}; add devices or memory")
    rows = [{**asdict(layout), "parallel": layout.parallel.model_dump()} for layout in result.ranked]
    winner = rows[0]
    parallel = result.ranked[0].parallel
    check = result.calibration_check.summary() if result.calibration_check else None
    plan = {
        "model": args.model,
        "cluster": args.cluster,
        "devices": args.devices,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "parallel": winner["parallel"],
        "predicted": {k: winner[k] for k in ("step_time_s", "mfu", "tokens_per_s", "memory_gib")},
        "runtime_support": runtime_limits(parallel, workload.model.num_layers, workload.global_batch,
                                          workload.cluster.devices_per_node)
        or ["every dimension of this layout is executed by the runtime"],
    }
    if check:
        plan["calibration_check"] = {k: v for k, v in check.items() if k != "seconds"}
    limit_line = result.excluded.line() if result.excluded is not None else None
    if limit_line:
        plan["runtime_limits"] = limit_line
    summary = {
        "device": workload.cluster.device,
        "candidates_evaluated": result.candidates_evaluated,
        "feasible": result.feasible,
        "seconds": result.seconds,
        "candidates_per_minute": result.candidates_per_minute,
        "top": rows,
        "why": result.explanation,
        "plan_file": args.out,
        "calibration_accuracy": dict(calibration.accuracy),
        "calibration_check": check,
        "calibration_check_line": result.calibration_check.line() if result.calibration_check else None,
        "runnable_only": not args.any_layout,
        "not_runnable_left_out": result.not_runnable,
        "runtime_limits_line": limit_line,
    }
    return summary, plan


def on_off(flag: bool) -> str:
    """A switch of the layout as the tables print it (sequence parallelism, overlap)."""
    return "on" if flag else "off"


def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UserError(f"--top {args.top} must be at least 1 (how many of the best layouts to print); give --top 1 "
                        "or more")
    if args.rl:
        if args.search_model:
            raise UserError("--search-model compares pre-training model shapes: drop it or --rl")
        return plan_rl.run(args)
    require_batch(args)
    if args.search_model:
        return _run_model_search(args)
    args.out = args.out or "plan.yaml"
    output_file(args.out, "--out", "plan.yaml")
    summary, plan = plan_layouts(args)
    with open(args.out, "w") as f:
        yaml.safe_dump(plan, f, sort_keys=False)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    runnable = (f", {summary['not_runnable_left_out']:,} more that the runtime cannot run left out (--any-layout)"
                if summary["runnable_only"] and summary["not_runnable_left_out"] else "")
    print(f"evaluated {summary['candidates_evaluated']:,} layouts in {summary['seconds']:.2f} s "
          f"({summary['feasible']:,} fit memory{' and run' if summary['runnable_only'] else ''}{runnable})")
    if line := accuracy_line(summary["calibration_accuracy"]):
        print(line)
    # a CPU's peak FLOP/s is only nominal: its rows say tokens/s, not an MFU against it
    cpu = summary["device"] == "cpu"
    print(f"{'#':>2} {'tp':>3} {'sp':>3} {'pp':>3} {'vpp':>3} {'ep':>4} {'etp':>3} {'cp':>3} {'dp':>5} {'zero':>4} "
          f"{'mb':>3} {'recompute':>9} {'a2a':>12} {'ovl':>4} {'step s':>9} {'tokens/s' if cpu else 'MFU':>8} "
          f"{'GiB':>6}")
    for i, row in enumerate(summary["top"], 1):
        p = row["parallel"]
        rate = f"{row['tokens_per_s']:>8,.0f}" if cpu else f"{row['mfu']:>8.1%}"
        print(f"{i:>2} {p['tp']:>3} {on_off(p['sp']):>3} {p['pp']:>3} {p['vpp']:>3} {p['ep']:>4} {p['etp']:>3} "
              f"{p['cp']:>3} {p['dp']:>5} {p['zero']:>4} {p['micro_batch']:>3} {p['recompute']:>9} {p['a2a']:>12} "
              f"{on_off(p['overlap']):>4} {row['step_time_s']:>9.4g} {rate} {row['memory_gib']:>6.1f}")
    print("\nwhy the winner wins:")
    for line in summary["why"]:
        print(f"  {line}")
    if summary["calibration_check_line"]:
        print(f"  {summary['calibration_check_line']}")
    if summary["runtime_limits_line"]:
        print(f"  {summary['runtime_limits_line']}")
    print(f"\nplan written to {args.out}")
    for note in plan["runtime_support"]:
        print(f"  runtime: {note}")
    return 0


def _run_model_search(args: argparse.Namespace) -> int:
    from moetrain.planner.model_search import search_model_shapes  # lazy: loads when the command runs

    workload, calibration = build_workload(args)
    budget = args.param_budget * 1e9 if args.param_budget else None
    result = search_model_shapes(workload, args.devices, calibration.for_device(workload.cluster.device),
                                 budget).to_dict()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"compared {len(result['shapes'])} shapes with {result['budget_params_b']:.0f}B ±"
          f"{result['tolerance']:.0%} parameters in {result['seconds']:.1f} s "
          f"({result['candidates_evaluated']:,} layouts scored)")
    print(f"{'experts':>7} {'hidden':>6} {'layers':>6} {'total B':>8} {'active B':>8} {'tokens/s':>10} "
          f"{'MFU':>6}  layout")
    for s in result["shapes"]:
        p = s["parallel"]
        layout = f"tp{p['tp']} pp{p['pp']} vpp{p['vpp']} ep{p['ep']} cp{p['cp']} mb{p['micro_batch']} {p['recompute']}"
        print(f"{s['experts']:>7} {s['hidden']:>6} {s['layers']:>6} {s['total_params_b']:>8.1f} "
              f"{s['active_params_b']:>8.1f} {s['tokens_per_s']:>10.4g} {s['mfu']:>6.1%}  {layout}")
    return 0
