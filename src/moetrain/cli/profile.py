"""``moetrain profile``: measure GEMM, grouped GEMM, attention, memory bandwidth and collectives on
the local device and write a calibration file the simulator loads with ``--calibration``."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from moetrain.cli.common import output_file, yaml_source
from moetrain.config import limits
from moetrain.config.run import DEVICES, is_device
from moetrain.errors import UserError
from moetrain.rl.spec import check_spec_kind, resolve_rl_spec

HELP = "measure GEMM/grouped-GEMM/attention/collective speed here and write a simulator calibration file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default=None,
                        help="cluster preset whose peaks the efficiencies refer to (default: cpu, or the "
                             "closest preset to the local GPU)")
    parser.add_argument("--model", default="tiny-pangu", help="model whose expert shapes the grouped GEMM uses")
    parser.add_argument("--out", default="calibration.yaml", help="calibration file to write (.yaml or .json)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per measurement")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (use what the training run uses)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("--comm-ranks", type=int,
                        help="also time gloo collectives on this many local ranks of one thread each (even) and the "
                             "weight sync's copy and CRC-32 rates; fit the planner's link formulas to them")
    parser.add_argument("--comm-out", default=None,
                        help="with --comm-ranks: write the cluster with the fitted in-node link to this YAML "
                             "(use it as --cluster; the calibration then counts the link at bus efficiency 1)")
    parser.add_argument("--rl-out", default=None,
                        help="CPU only: also time the RL step's host work on --model's policy (a layer's forward on "
                             "one token, the sampler, the rollout engine, the weight sync) and write it to this "
                             "YAML for `moetrain simulate --rl --rl-rates`")
    parser.add_argument("--rl-job", action="append", default=None, metavar="RL_YAML",
                        help="with --rl-out: also probe each process's CPU-seconds per step of this job (an rl.yaml "
                             "as `moetrain rl --config` takes it): a disaggregated StaleSync job of one-rank "
                             "replicas, its roles apart, into --rl-out's role_cpu; a colocated job, each rank as it "
                             "runs, into rank_cpu. `moetrain simulate --rl` and `plan --rl` then share them over "
                             "this machine's cores (docs/rl_simulate.md). Give it twice for one job of each placement")


def run(args: argparse.Namespace) -> int:
    if not is_device(args.device):  # as train and rl refuse it (RunOptions.device), before torch loads
        raise UserError(f"--device: Input should be {DEVICES}, got {json.dumps(args.device)}")
    limits.check_repeats(args.repeats)
    # here, not at the top: ``moetrain --help`` stays torch-free
    import torch

    from moetrain.train.calibrate import profile_calibration, resolve_device

    if args.comm_ranks is not None and (args.comm_ranks < 2 or args.comm_ranks % 2):
        raise UserError(f"--comm-ranks must be an even number of ranks, 2 or more (got {args.comm_ranks})")
    if args.comm_out is not None and args.comm_ranks is None:
        raise UserError("--comm-out needs --comm-ranks (the ranks whose collectives give the link)")
    output_file(args.out, "--out", "calibration.yaml")
    if args.comm_out is not None:
        output_file(args.comm_out, "--comm-out", "cluster.yaml")
    if args.rl_out is not None:
        output_file(args.rl_out, "--rl-out", "rl_rates.yaml")
        if resolve_device(args.device) != "cpu":
            raise UserError("--rl-out measures a CPU's RL host rates (the host is the device there); add --device cpu")
    jobs = _rl_jobs(args)
    if args.threads is not None:
        if args.threads <= 0:
            raise UserError(f"--threads must be positive (got {args.threads})")
        torch.set_num_threads(args.threads)
    result = profile_calibration(args.cluster, args.model, args.device, args.repeats, args.comm_ranks)
    result.calibration.save(args.out)
    if args.comm_out is not None:
        result.write_link_cluster(args.comm_out)
    rl_rates = None
    if args.rl_out is not None:
        from moetrain.rl.rates import measure_rl_rates  # the RL side: only with --rl-out

        rl_rates = measure_rl_rates(result.model, args.repeats)
        for path, job in jobs:
            rl_rates = _with_probe(rl_rates, path, job, args.repeats)
        rl_rates.save(args.rl_out)
    if args.json:
        print(json.dumps({"measurements": result.measured, "efficiencies": result.efficiencies, "out": args.out}
                         | ({"rl_rates": rl_rates.to_dict(), "rl_out": args.rl_out} if rl_rates else {}), indent=2))
    else:
        _print_summary(result, args)
        if rl_rates is not None:
            host, sync = rl_rates.host, rl_rates.sync
            print(f"RL host rates: a layer's forward on one token {host.layer_forward_us:.0f} µs, the sampler "
                  f"{host.sample_ns_per_logit:.3g} ns per logit, the rollout engine {host.engine_step_us:.0f} µs per "
                  f"step + {host.engine_row_us:.0f} µs per row; the weight sync {sync.host_bytes_per_s / 1e9:.3g} GB/s "
                  f"packed or written; written to {args.rl_out}")
            if rl_rates.role_cpu is not None:
                print(_role_cpu_summary(rl_rates.role_cpu))
            if rl_rates.rank_cpu is not None:
                print(_rank_cpu_summary(rl_rates.rank_cpu))
    return 0


def _with_probe(rl_rates, path: str, job, tries: int):
    """``rl_rates`` with ``job``'s probed CPU-seconds in the section of its placement."""
    from moetrain.rl.role_probe import probe_cpu  # the RL runtime: only with --rl-job

    probed = probe_cpu(job, tries)
    section = "role_cpu" if job.disaggregated else "rank_cpu"
    return replace(rl_rates, **{section: probed},
                   measured_on=f"{rl_rates.measured_on}; {section.replace('_', ' ')} of --rl-job {path}")


def _rl_jobs(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(path, RL run spec) of each ``--rl-job``, checked before the probes start (none without the flag): at
    most one job per placement (a rates file holds one probe of each)."""
    if not args.rl_job:
        return []
    if args.rl_out is None:
        raise UserError("--rl-job needs --rl-out (the rates file its probed CPU-seconds go into)")
    from moetrain.rl.role_probe import check_probed_job  # torch: after run's own import of it, only with --rl-job

    jobs = []
    for path in args.rl_job:
        source = yaml_source(path, "--rl-job", "model, sft, rl, trainer, generation, rollout, stalesync")
        check_spec_kind(source, f"--rl-job {path}")
        spec = resolve_rl_spec([source], [Path(path).name])
        check_probed_job(spec)  # a job the probe cannot measure is refused before minutes of calibration
        jobs.append((path, spec))
    placements = [spec.disaggregated for _, spec in jobs]
    if len(placements) != len(set(placements)):
        raise UserError("--rl-job: give at most one disaggregated and one colocated job (a rates file holds one "
                        "probe of each)")
    return jobs


def _role_cpu_summary(probed) -> str:
    work = probed.work
    rollout = ", ".join(f"{w:.3g}" for w in work.rollout_s)
    trainer = ", ".join(f"{w:.3g}" for w in work.trainer_s)
    return (f"role CPU per step, roles apart: replicas {rollout} s, trainer ranks {trainer} s; overlapped "
            f"×{work.overlap[0]:.2f} and ×{work.overlap[1]:.2f}; {probed.cores:g} cores")


def _rank_cpu_summary(probed) -> str:
    ranks = ", ".join(f"{w:.3g}" for w in probed.work.rank_s)
    return (f"rank CPU per step, colocated at k = {probed.work.staleness}: ranks {ranks} s; {probed.cores:g} cores")


def _print_summary(result, args: argparse.Namespace) -> None:
    """The efficiencies, one a line, then the file written and (with collectives) the link's summary."""
    for name, value in result.efficiencies.items():
        print(f"{name:20s} {value:.4g}")
    print(f"calibration for {result.cluster.device} ({result.arch}) written to {args.out}")
    if result.link is None:
        return
    link, sync, shared = result.link, result.measured["weight_sync"], result.measured.get("shared_host")
    kinds = ", ".join(f"{kind} {fit.latency_us:.0f} µs and {fit.gbps:.3g} GB/s" for kind, fit in link.kinds.items())
    print(f"gloo on {args.comm_ranks} ranks: {link.latency_us:.0f} µs per message step, {link.gbps:.3g} GB/s "
          f"({kinds}); "
          + (f"{shared['ranks']} ranks computing at once: {shared['slowdown']:.2f}× their time alone; "
             if shared else "")
          + f"weight sync per core: copy {sync['copy_bytes_per_s'] / 1e9:.3g} GB/s, CRC-32 "
          f"{sync['crc_bytes_per_s'] / 1e9:.3g} GB/s"
          + (f"; cluster written to {args.comm_out}" if args.comm_out else ""))
