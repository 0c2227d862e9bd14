"""``moetrain simulate``: predict one layout's step time, MFU, breakdown and memory per device."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetrain.cli.common import add_strategy_args, output_file
from moetrain.cli.plan import on_off
from moetrain.cli.simulate_rl import add_rl_arguments, run_rl
from moetrain.cli.workload import add_workload_args, build_workload, parallel_from_args, require_batch
from moetrain.errors import UserError
from moetrain.planner.calibration import accuracy_line
from moetrain.rl.plot import check_figure_file

HELP = "predict step time, tokens/s, MFU, time breakdown and memory per device for one parallel layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --seq-len and --global-batch are required unless --rl derives them: say so in the usage line, which
    # argparse would otherwise print with both in brackets, as if they were optional.
    parser.usage = ("moetrain simulate --model M --cluster C --devices N (--seq-len L --global-batch B | --rl "
                    "--prompt-len P --response-len R) [layout flags] [--json] [--timeline PNG]")
    add_workload_args(parser, batch_required=False)
    add_strategy_args(parser)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per model replica")
    parser.add_argument("--recompute-share", type=float, default=1.0, metavar="F",
                        help="share of the layers that run --recompute (0 < F <= 1): with selective, the selective "
                        "set on that share only (a stack that recomputes what memory needs, Pangu's Selective R/S); "
                        "with full, whole layers on that share and the selective set on the others (Megatron's "
                        "--recompute-num-layers); validate prices a row's unstated recompute this way (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--timeline", metavar="PNG", help="write a Gantt chart of the pipeline schedule")
    add_rl_arguments(parser)


def simulate_layout(args: argparse.Namespace) -> dict:
    """The prediction as a plain mapping (what --json prints)."""
    # lazy: the simulator and matplotlib load when the command runs, not when the parser imports every command
    from moetrain.planner.simulate import simulate_layout as predict
    from moetrain.planner.timeline import gantt_png

    require_batch(args)
    if args.timeline:
        if not Path(args.timeline).is_dir():  # a folder: output_file's refusal names the mend
            check_figure_file(args.timeline, "--timeline")
        output_file(args.timeline, "--timeline", "timeline.png")
    workload, calibration = build_workload(args)
    parallel = parallel_from_args(args, workload, args.devices)
    if not 0.0 < args.recompute_share <= 1.0:
        raise UserError(f"--recompute-share {args.recompute_share} is not a share of the layers; give a value in "
                        "(0, 1], e.g. --recompute-share 0.35")
    if args.recompute_share < 1.0 and parallel.recompute == "none":
        raise UserError("--recompute-share applies to a recompute level; add --recompute selective or full")
    p = predict(workload, parallel, args.devices, calibration, record_spans=bool(args.timeline),
                recompute_share=args.recompute_share)
    result = {
        "model": workload.model.name,
        "cluster": workload.cluster.name,
        "device": workload.cluster.device,
        "devices": args.devices,
        "seq_len": workload.seq_len,
        "global_batch": workload.global_batch,
        "parallel": p.parallel.model_dump(),
        "recompute_share": args.recompute_share,
        "split_wgrad": workload.split_weight_grad,
        "micro_batches_per_pipeline": p.micro_batches_per_pipeline,
        "step_time_s": p.step_time_s,
        "tokens_per_s": p.tokens_per_s,
        "tokens_per_s_per_device": p.tokens_per_s_per_device,
        "mfu": p.mfu,
        "bubble_s": p.bubble_s,
        "bubble_fraction": p.bubble_fraction,
        "optimizer_s": p.optimizer_s,
        "optimizer_device_s": p.optimizer_device_s,
        "host_wait_s": p.host_wait_s,
        "host_is_device": workload.cluster.host_is_device,
        "compute_s": p.compute_s,
        "attention_core_s": p.attention_core_s,
        "communication_s": {name: ({} if t.total_s is None else {"total_s": t.total_s}) | {"exposed_s": t.exposed_s}
                            for name, t in p.communication_s.items()},
        "memory_gib": p.memory_gib,
        "hbm_gib": p.hbm_gib,
        "fits_memory": p.fits_memory,
        "calibration_accuracy": dict(calibration.accuracy),
        "step_time_s_held_out_fits": p.step_time_s_held_out_fits,
    }
    if args.timeline:
        from moetrain.status import phase, status_console  # lazy: rich, for the timeline's status line only

        # stderr with --json, whose stdout is the answer alone
        with phase(status_console(stderr=args.json), f"rendering the timeline ({len(p.timeline.spans):,} spans) to "
                   f"{args.timeline}", "rendered the timeline"):
            gantt_png(p.timeline, args.timeline, f"{workload.model.name} on {args.devices} × "
                      f"{workload.cluster.name}: step {p.step_time_s:.3f} s")
        result["timeline_png"] = args.timeline
    return result


def run(args: argparse.Namespace) -> int:
    if args.rl:
        return run_rl(args)
    result = simulate_layout(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    p = result["parallel"]
    print(f"{result['model']} on {result['devices']} × {result['cluster']}, seq {result['seq_len']}, "
          f"global batch {result['global_batch']}")
    layout = " ".join(f"{k}={on_off(v) if isinstance(v, bool) else v}" for k, v in p.items())
    stack = ((f" recompute_share={result['recompute_share']:g}" if result["recompute_share"] < 1 else "")
             + (" split_wgrad=on" if result["split_wgrad"] else ""))
    print(f"layout: {layout}{stack}  (m={result['micro_batches_per_pipeline']})")
    print(f"step time   {result['step_time_s']:.4g} s    tokens/s {result['tokens_per_s']:.4g} "
          f"({result['tokens_per_s_per_device']:.4g} per device)"
          + ("" if result.get("device") == "cpu" else f"    MFU {result['mfu']:.1%}"))  # a CPU's peak is nominal
    if line := accuracy_line(result["calibration_accuracy"]):
        print(line)
    if held := result["step_time_s_held_out_fits"]:
        low, high = min(held, key=held.__getitem__), max(held, key=held.__getitem__)
        print(f"step time under the {len(held)} fits that each leave one source of published runs out: "
              f"{held[low]:.4g}-{held[high]:.4g} s (without {low} and without {high})")
    print("\ncompute (per step, busiest stage)      seconds")
    for name, value in result["compute_s"].items():
        print(f"  {name:34s} {value:10.4g}")
        if name == "attention":
            print(f"  {'  of which the fused core':34s} {result['attention_core_s']:10.4g}")
    print("\ncommunication                         total       exposed")
    for name, value in result["communication_s"].items():
        total = value.get("total_s")
        print(f"  {name:34s} {'' if total is None else f'{total:10.4g}':>10s}  {value['exposed_s']:10.4g}")
    print(f"  {'pipeline bubble':34s} {'':10s}  {result['bubble_s']:10.4g}  ({result['bubble_fraction']:.1%})")
    # the device's part: what the host adds is in the next line, with the layers' wait for it
    print(f"  {'optimizer step':34s} {'':10s}  {result['optimizer_device_s']:10.4g}")
    if result["host_wait_s"] > 0:
        # on a CPU the host's own work (Python, dispatch, autograd) adds to the kernels' instead of idling them
        host = "host work beyond the kernels" if result["host_is_device"] else "device waiting for the host"
        print(f"  {host:34s} {'':10s}  {result['host_wait_s']:10.4g}")
    print("\nmemory per device (GiB)")
    for name, value in result["memory_gib"].items():
        print(f"  {name:34s} {value:10.2f}")
    verdict = "fits" if result["fits_memory"] else "DOES NOT FIT"
    print(f"  {'HBM':34s} {result['hbm_gib']:10.2f}  ({verdict})")
    if "timeline_png" in result:
        print(f"\ntimeline written to {result['timeline_png']}")
    return 0
