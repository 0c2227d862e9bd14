"""``moetrain simulate``: predict one layout's step time, MFU, breakdown and memory per device."""

from __future__ import annotations

import argparse
import json

HELP = "predict step time, tokens/s, MFU, time breakdown and memory per device for one parallel layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from moetrain.cli.common import add_strategy_args
    from moetrain.cli.workload import add_workload_args

    add_workload_args(parser)
    add_strategy_args(parser)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per model replica")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--timeline", metavar="PNG", help="write a Gantt chart of the pipeline schedule")


def simulate_layout(args: argparse.Namespace) -> dict:
    """The prediction as a plain mapping (what --json prints)."""
    import numpy as np

    from moetrain.cli.common import output_file
    from moetrain.cli.workload import build_workload, parallel_from_args
    from moetrain.errors import UserError
    from moetrain.planner.costmodel import evaluate
    from moetrain.planner.search import step_after_pipeline, timeline_step
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.timeline import gantt_png, simulate_timeline, stage_costs_from_model

    if args.timeline:
        output_file(args.timeline, "--timeline", "timeline.png")
    workload, calibration = build_workload(args)
    eff = calibration.for_device(workload.cluster.device)
    parallel = parallel_from_args(args, workload, args.devices)
    strategies = Strategies.from_parallel([parallel])
    out = evaluate(workload, strategies, eff)
    num_micro = int(round(float(out["num_micro_batches"][0])))
    if parallel.vpp > 1 and num_micro % parallel.pp:
        raise UserError(f"the interleaved schedule needs micro-batches per pipeline ({num_micro}) divisible by "
                        f"pp ({parallel.pp}); change --global-batch or --micro-batch")
    stage = stage_costs_from_model(out, 0, parallel.pp, parallel.vpp)
    timeline = simulate_timeline(parallel.pp, parallel.vpp, num_micro, stage, parallel.overlap,
                                 record_spans=bool(args.timeline))
    get = lambda key: float(out[key][0])  # noqa: E731
    step = step_after_pipeline(timeline.step_time_s, out, 0, eff)
    tokens = workload.global_batch * workload.seq_len
    mfu = get("mfu") * get("step_time_s") / step
    busiest = int(np.argmax(timeline.busy_s))
    compute = {k.removeprefix("compute_").removesuffix("_s"): get(k) for k in out if k.startswith("compute_")}
    comm = {
        "tensor_parallel": {"total_s": get("tp_comm_s"), "exposed_s": get("tp_exposed_s")},
        "all_to_all": {"total_s": timeline.a2a_total_s, "exposed_s": timeline.a2a_exposed_s},
        "data_parallel": {"total_s": get("dp_comm_s"), "exposed_s": get("dp_exposed_s")},
        "context_parallel": {"exposed_s": get("cp_exposed_s")},
        "pipeline_p2p": {"total_s": get("p2p_s"), "exposed_s": get("p2p_s")},
    }
    memory = {k.removeprefix("memory_"): get(k) / 2**30 for k in
              ("memory_weights", "memory_grads", "memory_optimizer", "memory_activations", "memory_buffers")}
    memory_total = get("memory_bytes") / 2**30
    result = {
        "model": workload.model.name,
        "cluster": workload.cluster.name,
        "devices": args.devices,
        "seq_len": workload.seq_len,
        "global_batch": workload.global_batch,
        "parallel": parallel.model_dump(),
        "micro_batches_per_pipeline": num_micro,
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_device": tokens / step / args.devices,
        "mfu": mfu,
        "bubble_s": timeline.step_time_s - timeline.busy_s[busiest],
        "bubble_fraction": timeline.bubble_fraction[busiest],
        "optimizer_s": get("optimizer_s"),
        "host_wait_s": get("host_wait_s"),
        "compute_s": compute,
        "communication_s": comm,
        "memory_gib": {**memory, "total": memory_total},
        "hbm_gib": workload.cluster.hbm_bytes / 2**30,
        "fits_memory": memory_total * 2**30 <= workload.cluster.hbm_bytes,
        "calibration_accuracy": dict(calibration.accuracy),
        # The same layout under each fit of the calibration's cross-validation (one source left out):
        # how far the prediction moves with the sources it was fitted on.
        "step_time_s_held_out_fits": {
            family: timeline_step(evaluate(workload, strategies, fit_eff), strategies, 0, fit_eff)
            for family, fit_eff in calibration.held_out_for_device(workload.cluster.device).items()},
    }
    if args.timeline:
        gantt_png(timeline, args.timeline, f"{workload.model.name} on {args.devices} × {workload.cluster.name}: "
                  f"step {step:.3f} s")
        result["timeline_png"] = args.timeline
    return result


def run(args: argparse.Namespace) -> int:
    from moetrain.planner.calibration import accuracy_line

    result = simulate_layout(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    p = result["parallel"]
    print(f"{result['model']} on {result['devices']} × {result['cluster']}, seq {result['seq_len']}, "
          f"global batch {result['global_batch']}")
    print("layout: " + " ".join(f"{k}={v}" for k, v in p.items()) + f"  (m={result['micro_batches_per_pipeline']})")
    print(f"step time   {result['step_time_s']:.4g} s    tokens/s {result['tokens_per_s']:.4g} "
          f"({result['tokens_per_s_per_device']:.4g} per device)    MFU {result['mfu']:.1%}")
    if line := accuracy_line(result["calibration_accuracy"]):
        print(line)
    if held := result["step_time_s_held_out_fits"]:
        low, high = min(held, key=held.__getitem__), max(held, key=held.__getitem__)
        print(f"step time under the {len(held)} fits that each leave one source of published runs out: "
              f"{held[low]:.4g}-{held[high]:.4g} s (without {low} and without {high})")
    print("\ncompute (per step, busiest stage)      seconds")
    for name, value in result["compute_s"].items():
        print(f"  {name:34s} {value:10.4g}")
    print("\ncommunication                         total       exposed")
    for name, value in result["communication_s"].items():
        total = value.get("total_s")
        print(f"  {name:34s} {'' if total is None else f'{total:10.4g}':>10s}  {value['exposed_s']:10.4g}")
    print(f"  {'pipeline bubble':34s} {'':10s}  {result['bubble_s']:10.4g}  ({result['bubble_fraction']:.1%})")
    print(f"  {'optimizer step':34s} {'':10s}  {result['optimizer_s']:10.4g}")
    if result["host_wait_s"] > 0:
        print(f"  {'device waiting for the host':34s} {'':10s}  {result['host_wait_s']:10.4g}")
    print("\nmemory per device (GiB)")
    for name, value in result["memory_gib"].items():
        print(f"  {name:34s} {value:10.2f}")
    verdict = "fits" if result["fits_memory"] else "DOES NOT FIT"
    print(f"  {'HBM':34s} {result['hbm_gib']:10.2f}  ({verdict})")
    if "timeline_png" in result:
        print(f"\ntimeline written to {result['timeline_png']}")
    return 0
