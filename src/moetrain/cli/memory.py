"""``moetrain memory``: activation bytes per layer part, and the recompute/swap options a budget needs."""

from __future__ import annotations

import argparse
import json

from moetrain.cli.common import add_memory_policy_args, add_model_arg, memory_options
from moetrain.config import limits, load_model_config
from moetrain.costs.activations import activation_bytes_per_layer
from moetrain.costs.flops import training_flops_per_token
from moetrain.errors import UserError
from moetrain.memory.options import activation_shape, choose_plan
from moetrain.memory.policy import DeviceSpeed

HELP = "activation memory per layer part; choose recompute/swap options under a budget (--measure to check)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    add_memory_policy_args(parser)
    parser.add_argument("--measure", action="store_true",
                        help="build the model here (CPU, fp32) and measure saved bytes and step time")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per measurement (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.seq_len <= 0 or args.micro_batch <= 0:
        raise UserError(f"--seq-len {args.seq_len} and --micro-batch {args.micro_batch} must be positive")
    options = memory_options(args)
    try:
        cfg = load_model_config(args.model)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    limits.check_seq_len(args.seq_len, cfg.max_seq_len, cfg.name)
    limits.check_step_tokens(args.micro_batch * args.seq_len, f"--micro-batch {args.micro_batch} × --seq-len "
                             f"{args.seq_len}", "lower --micro-batch")
    limits.check_repeats(args.repeats)
    dtype_bytes = 4.0  # the CPU runs (and --measure) are fp32
    report: dict = {"model": cfg.name, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
                    "policy": options.policy, "dtype_bytes": dtype_bytes}
    speed = DeviceSpeed(flops_per_s=5e10, bytes_per_s=1e10)
    measured = None
    if args.measure:
        measured = _measure(cfg, args)
        speed = measured.pop("speed")
    shape = activation_shape(cfg, args.seq_len, args.micro_batch, dtype_bytes, "cpu")
    result = choose_plan(shape, options, speed)
    last = cfg.num_layers - 1
    report["per_layer_part_bytes"] = {k: float(v) for k, v in activation_bytes_per_layer(
        shape, moe_layer=cfg.is_moe_layer(last)).items()}
    report.update(
        baseline_activation_bytes=result.baseline_bytes,
        activation_bytes=result.activation_bytes,
        predicted_activation_bytes=result.activation_bytes,
        budget_bytes=result.budget_bytes,
        fits=result.fits,
        predicted_added_time_s=result.added_time_s,
        options=result.options,
        step_time_s=None,
        baseline_step_time_s=None,
    )
    if measured is not None:
        after = _measure(cfg, args, result.plan)
        report.update(
            baseline_activation_bytes=measured["bytes"], activation_bytes=after["bytes"],
            baseline_step_time_s=measured["step_time_s"], step_time_s=after["step_time_s"],
            predicted_baseline_activation_bytes=result.baseline_bytes,
        )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    _print(report)
    return 0


def _measure(cfg, args: argparse.Namespace, plan=None) -> dict:
    # lazy, heavy: torch and the model load when the command runs, not when the parser imports every command
    # module (``moetrain.cli``)
    import torch

    from moetrain.memory.measure import measure_activations, time_steps
    from moetrain.memory.runtime import apply_memory_policy
    from moetrain.models import build_model

    torch.set_num_threads(1)  # small models: one thread times steadily on a shared machine
    model = build_model(cfg, seed=0)
    if plan is not None and any(plan.layer_options):
        apply_memory_policy(model, plan)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    saved = measure_activations(model, ids, ids)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    seconds = time_steps(step, repeats=args.repeats)
    out = {"bytes": saved.total_bytes, "step_time_s": seconds}
    if plan is None:
        flops = training_flops_per_token(cfg, args.seq_len) * args.micro_batch * args.seq_len
        buffer = torch.ones(1 << 22)
        bandwidth = 2 * buffer.nbytes / time_steps(lambda: buffer.mul_(1.0), repeats=5)
        out["speed"] = DeviceSpeed(flops_per_s=flops / seconds, bytes_per_s=bandwidth)
    return out


def _print(report: dict) -> None:
    mib = 1024**2
    print(f"{report['model']}: seq {report['seq_len']}, micro-batch {report['micro_batch']}, "
          f"policy {report['policy']}")
    print("one decoder layer (the last), bytes kept for backward:")
    for part, nbytes in report["per_layer_part_bytes"].items():
        if nbytes:
            print(f"  {part:<15} {nbytes / mib:10.3f} MiB")
    print(f"options: {report['options'] or 'none'}")
    line = (f"activation bytes: {report['activation_bytes'] / mib:.2f} MiB of "
            f"{report['baseline_activation_bytes'] / mib:.2f}")
    ratio = report["activation_bytes"] / report["baseline_activation_bytes"]
    print(f"{line} MiB baseline ({ratio:.1%})" + ("" if report["fits"] else " — budget not met"))
    if report["step_time_s"] is not None:
        print(f"step time: {report['step_time_s'] * 1e3:.1f} ms vs {report['baseline_step_time_s'] * 1e3:.1f} ms "
              f"baseline ({report['step_time_s'] / report['baseline_step_time_s'] - 1:+.1%})")
    else:
        print(f"predicted added time per micro-batch: {report['predicted_added_time_s'] * 1e3:.2f} ms")
