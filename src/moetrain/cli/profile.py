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
    parser.add_argument("--comm-ranks", type=int,
                        help="also time gloo collectives on this many local ranks of one thread each (even) and the "
                             "weight sync's copy and CRC-32 rates; fit the planner's link formulas to them")
    parser.add_argument("--comm-out", default=None,
                        help="with --comm-ranks: write the cluster with the fitted in-node link to this YAML "
                             "(use it as --cluster; the calibration then counts the link at bus efficiency 1)")


def run(args: argparse.Namespace) -> int:
    import torch

    from moetrain.cli.common import output_file
    from moetrain.config import cluster_for_device, load_cluster_config, load_model_config
    from moetrain.errors import UserError
    from moetrain.planner.calibration import Calibration, arch_of, load_calibration
    from moetrain.train.profiler import profile_device

    if args.repeats <= 0:
        raise UserError(f"--repeats must be positive (got {args.repeats})")
    if args.comm_ranks is not None and (args.comm_ranks < 2 or args.comm_ranks % 2):
        raise UserError(f"--comm-ranks must be an even number of ranks, 2 or more (got {args.comm_ranks})")
    if args.comm_out is not None and args.comm_ranks is None:
        raise UserError("--comm-out needs --comm-ranks (the ranks whose collectives give the link)")
    output_file(args.out, "--out", "calibration.yaml")
    if args.comm_out is not None:
        output_file(args.comm_out, "--comm-out", "cluster.yaml")
    if args.threads is not None:
        if args.threads <= 0:
            raise UserError(f"--threads must be positive (got {args.threads})")
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no GPU; use --device cpu")
    cluster_name = args.cluster or cluster_for_device(
        "cpu" if device == "cpu" else torch.cuda.get_device_name(torch.device(device)))
    cluster = load_cluster_config(cluster_name)
    model = load_model_config(args.model)
    measured, efficiencies = profile_device(cluster, model, device, args.repeats)
    if args.comm_ranks is not None:
        link = _profile_link(args, cluster, model, measured)
        efficiencies["bus_intra"] = 1.0  # the fitted bandwidth is what the collectives reached
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
        if args.comm_ranks is not None:
            sync = measured["weight_sync"]
            kinds = ", ".join(f"{kind} {fit.latency_us:.0f} µs and {fit.gbps:.3g} GB/s"
                              for kind, fit in link.kinds.items())
            shared = measured.get("shared_host")
            print(f"gloo on {args.comm_ranks} ranks: {link.latency_us:.0f} µs per message step, {link.gbps:.3g} GB/s "
                  f"({kinds}); "
                  + (f"{shared['ranks']} ranks computing at once: {shared['slowdown']:.2f}× their time alone; "
                     if shared else "")
                  + f"weight sync per core: copy {sync['copy_bytes_per_s'] / 1e9:.3g} GB/s, CRC-32 "
                  f"{sync['crc_bytes_per_s'] / 1e9:.3g} GB/s"
                  + (f"; cluster written to {args.comm_out}" if args.comm_out else ""))
    return 0


def _profile_link(args: argparse.Namespace, cluster, model, measured: dict):
    """Collectives, the sync's rates and (ranks on a CPU host) how the ranks slow each other into
    ``measured``; the fitted link (and its cluster file)."""
    from dataclasses import asdict

    import yaml

    from moetrain.planner.comm import fit_link
    from moetrain.train.profiler import profile_collectives, profile_shared_host, profile_sync_rates

    collectives = profile_collectives(args.comm_ranks, repeats=args.repeats)
    link = fit_link([m for m in collectives if m["kind"] != "send_recv"])  # sends stream: no round trip
    measured.update(collectives=collectives, link=asdict(link), weight_sync=profile_sync_rates(args.repeats))
    update = {"name": f"{cluster.name}-{args.comm_ranks}-ranks"}
    if cluster.host_cores is not None:  # ranks computing on one host's cores
        measured["shared_host"] = profile_shared_host(model, min(args.comm_ranks, cluster.host_cores), args.repeats)
        update["shared_host_slowdown"] = measured["shared_host"]["slowdown"]
    if args.comm_out is not None:
        fitted = link.cluster(cluster).model_copy(update=update)
        with open(args.comm_out, "w", encoding="utf-8") as f:
            f.write(f"# {cluster.name} with its in-node link fitted to gloo collectives on {args.comm_ranks} local "
                    "ranks (moetrain profile --comm-ranks)\n")
            yaml.safe_dump(fitted.model_dump(mode="json"), f, sort_keys=False)
    return link
