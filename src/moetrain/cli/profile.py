"""``moetrain profile``: measure GEMM, grouped GEMM, attention, memory bandwidth and collectives on
the local device and write a calibration file the simulator loads with ``--calibration``."""

from __future__ import annotations

import argparse
import json

HELP = "measure GEMM/grouped-GEMM/attention/collective speed here and write a simulator calibration file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default=None,
                        help="cluster preset whose peaks the efficiencies refer to (default: cpu, or the "
                             "closest preset to the local GPU)")
    parser.add_argument("--model", default="tiny-pangu", help="model whose expert shapes the grouped GEMM uses")
    parser.add_argument("--out", default="calibration.yaml", help="calibration file to write (.yaml or .json)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (use what the training run uses)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    from moetrain.cli.common import output_file
    from moetrain.config import load_cluster_config, load_model_config
    from moetrain.errors import UserError
    from moetrain.planner.calibration import Calibration, arch_of, load_calibration
    from moetrain.train.profiler import profile_device

    if args.repeats <= 0:
        raise UserError(f"--repeats must be positive (got {args.repeats})")
    output_file(args.out, "--out", "calibration.yaml")
    if args.threads is not None:
        if args.threads <= 0:
            raise UserError(f"--threads must be positive (got {args.threads})")
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no GPU; use --device cpu")
    cluster_name = args.cluster or ("cpu" if device == "cpu" else "h100-sxm-80gb")
    cluster = load_cluster_config(cluster_name)
    model = load_model_config(args.model)
    measured, efficiencies = profile_device(cluster, model, device, args.repeats)
    base = load_calibration()
    per_arch = dict(base.per_arch)
    per_arch[arch_of(cluster.device)] = efficiencies
    calibration = Calibration(base.global_params, per_arch,
                              f"moetrain profile --cluster {cluster_name} --device {device} on this machine")
    calibration.save(args.out)
    if args.json:
        print(json.dumps({"measurements": measured, "efficiencies": efficiencies, "out": args.out}, indent=2))
    else:
        for name, value in efficiencies.items():
            print(f"{name:20s} {value:.4g}")
        print(f"calibration for {cluster.device} ({arch_of(cluster.device)}) written to {args.out}")
    return 0
