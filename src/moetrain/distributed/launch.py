"""Start a one-node distributed run under torchrun, and turn a failure into one line.

``launch`` validates the layout first (nothing starts for a layout that does not divide the model or
the world), then runs ``torchrun --standalone --nproc-per-node N --max-restarts 0`` on
``moetrain.distributed.worker``. With no restarts, torchrun's agent stops every rank as soon as one
exits non-zero or dies from a signal; collectives also time out (60 s by default) so no rank waits
for ever on a dead peer. The launcher then prints the failing rank's own line (``rank R failed:
cause``), or, for a rank killed by a signal, the rank and the signal from torchrun's report; the full
torchrun log is kept on disk.

Multi-node runs call torchrun directly with its usual flags (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``), ``-m moetrain.distributed.worker`` and the same worker flags (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import ValidationError

from moetrain.balance.online import PAYBACK_HORIZON, REPLAN_INTERVAL, check_online_balance
from moetrain.config import ParallelConfig, load_model_config
from moetrain.distributed.layout import validate_layout
from moetrain.errors import UserError, describe_validation_error


def parallel_config(args: argparse.Namespace, nproc: int) -> ParallelConfig:
    etp, cp = getattr(args, "etp", 1), getattr(args, "cp", 1)
    base = args.tp * cp * args.pp
    if nproc % base:
        raise UserError(f"--nproc {nproc} is not a multiple of tp·cp·pp = {base}; pick --nproc = tp·cp·pp·dp")
    try:
        return ParallelConfig(tp=args.tp, sp=args.tp > 1, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=etp, cp=cp,
                              dp=nproc // base, a2a="hierarchical" if args.hierarchical_a2a else "flat",
                              overlap=args.overlap)
    except ValidationError as exc:
        raise UserError(describe_validation_error(f"layout tp={args.tp} pp={args.pp} ep={args.ep} on {nproc} ranks",
                                                  exc)) from exc


def worker_args(args: argparse.Namespace, parallel: ParallelConfig) -> list[str]:
    out = ["--model", args.model, "--tp", str(parallel.tp), "--pp", str(parallel.pp), "--vpp", str(parallel.vpp),
           "--ep", str(parallel.ep), "--etp", str(parallel.etp), "--cp", str(parallel.cp), "--dp", str(parallel.dp),
           "--a2a", parallel.a2a,
           "--steps", str(args.steps), "--global-batch", str(args.global_batch),
           "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len)]
    if args.ranks_per_node:
        out += ["--ranks-per-node", str(args.ranks_per_node)]
    if parallel.overlap:
        out += ["--overlap"]
    if args.trace_dir:
        out += ["--trace-dir", args.trace_dir]
    if args.metrics_out:
        out += ["--metrics-out", _absolute(args.metrics_out)]
    # Flags added with the real-data loop; read with defaults so a namespace built without them still works.
    for flag, value in (("--seed", getattr(args, "seed", None)), ("--lr", getattr(args, "lr", None)),
                        ("--warmup", getattr(args, "warmup", None)), ("--save-every", getattr(args, "save_every", 0)),
                        ("--stop-at", getattr(args, "stop_at", None)), ("--cluster", getattr(args, "cluster", None))):
        if value:
            out += [flag, str(value)]
    for flag, path in (("--data", getattr(args, "data", None)),
                       ("--trace-routing", getattr(args, "trace_routing", None)),
                       ("--save-dir", getattr(args, "save_dir", None))):
        if path:
            out += [flag, _absolute(path)]
    if getattr(args, "synthetic_data", False):
        out += ["--synthetic-data"]
    if getattr(args, "resume", False):
        out += ["--resume"]
    if getattr(args, "online_balance", False):
        out += ["--online-balance"]
        for flag, value in (("--balance-interval", args.balance_interval), ("--balance-horizon", args.balance_horizon),
                            ("--slots-per-rank", args.slots_per_rank)):
            if value is not None:
                out += [flag, str(value)]
    return out


def _absolute(path: str) -> str:
    return str(Path(path).resolve())


_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Socket Timeout|timed out", re.I)


def _failure_line(error_dir: Path, torchrun_log: str) -> str:
    """The root cause: a rank killed by a signal (torchrun's SIGTERM of the survivors aside), else the
    first rank's own report that is not merely the loss of a peer."""
    for rank, code in re.findall(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)",
                                  torchrun_log, re.M):
        if int(code) < 0 and int(code) != -signal.SIGTERM:
            return f"rank {rank} failed: killed by signal {signal.Signals(-int(code)).name}"
    reports = sorted(error_dir.glob("rank*.txt"), key=lambda p: p.stat().st_mtime)
    lines = [p.read_text().strip() for p in reports]
    causes = [line for line in lines if not _PEER_LOST.search(line)]
    if causes or lines:
        return (causes or lines)[0]
    return "a rank failed before reporting (see the torchrun log)"


def _check_run_flags(args: argparse.Namespace) -> None:
    """The single-process trainer's checks of the checkpoint flags, before any process starts."""
    stop_at, save_dir = getattr(args, "stop_at", None), getattr(args, "save_dir", None)
    if stop_at is not None and not 0 < stop_at <= args.steps:
        raise UserError(f"--stop-at {stop_at} must lie in 1..--steps ({args.steps})")
    if (stop_at is not None or getattr(args, "resume", False)) and not save_dir:
        raise UserError("--stop-at and --resume need --save-dir (the folder holding the checkpoints)")
    if getattr(args, "save_every", 0) < 0:
        raise UserError(f"--save-every {args.save_every} must be ≥ 0")
    if getattr(args, "synthetic_data", False) and getattr(args, "data", None):
        raise UserError("--synthetic-data and --data exclude each other; drop one")


def check_seq_len(seq_len: int, parallel: ParallelConfig) -> None:
    """Context parallelism cuts each sequence into 2·cp load-balanced chunks; sequence parallelism
    then splits each rank's share over the tp ranks."""
    if parallel.cp > 1 and seq_len % (2 * parallel.cp):
        raise UserError(f"--seq-len {seq_len} does not split into 2·cp = {2 * parallel.cp} context-parallel "
                        f"chunks; make it a multiple of {2 * parallel.cp}")
    if parallel.tp > 1 and (seq_len // parallel.cp) % parallel.tp:
        share = "" if parallel.cp == 1 else f" of each cp={parallel.cp} share ({seq_len // parallel.cp} tokens)"
        raise UserError(f"--seq-len {seq_len} does not split over tp={parallel.tp} sequence shards{share}")


def launch(nproc: int, args: argparse.Namespace, log_dir: Path | None = None) -> int:
    model_cfg = load_model_config(args.model)
    parallel = parallel_config(args, nproc)
    validate_layout(parallel, model_cfg, nproc, args.global_batch, args.micro_batch, args.ranks_per_node)
    check_seq_len(args.seq_len, parallel)
    _check_run_flags(args)
    tuning = (args.balance_interval, args.balance_horizon, args.slots_per_rank)
    if getattr(args, "online_balance", False):
        check_online_balance(parallel, model_cfg, *tuning)
    elif any(value is not None for value in tuning):
        raise UserError("--slots-per-rank, --balance-interval and --balance-horizon tune --online-balance; "
                        "add --online-balance or drop them")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="moetrain-run-"))
    error_dir = log_dir / "errors"
    error_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MOETRAIN_ERROR_DIR=str(error_dir), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.5", "-m", "moetrain.distributed.worker",
           *worker_args(args, parallel)]
    log_path = log_dir / "torchrun.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        code = subprocess.call(cmd, env=env, stderr=log)
    if code == 0:
        return 0
    line = _failure_line(error_dir, log_path.read_text())
    print(f"moetrain train: {line} (all ranks stopped after {time.monotonic() - start:.1f} s; "
          f"log: {log_path})", file=sys.stderr)
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, help="processes on this node (= tp·cp·pp·dp)")
    parser.add_argument("--model", default="tiny-pangu")
    for axis, text in (("tp", "tensor parallel (with sequence parallel)"), ("pp", "pipeline stages"),
                       ("vpp", "virtual stages per pipeline rank"), ("ep", "expert parallel (inside dp)"),
                       ("etp", "expert tensor parallel (splits each expert's FFN)"),
                       ("cp", "context parallel (splits each sequence)")):
        parser.add_argument(f"--{axis}", type=int, default=1, help=text)
    parser.add_argument("--hierarchical-a2a", action="store_true", help="two-hop expert all-to-all")
    parser.add_argument("--ranks-per-node", type=int, help="node size for the hierarchical all-to-all")
    parser.add_argument("--overlap", action="store_true",
                        help="overlapped schedule: one micro-batch's forward paired with another's backward")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--trace-dir")
    parser.add_argument("--metrics-out", help="rank 0 writes one JSON row per step (the trainer's format)")
    parser.add_argument("--log-dir")
    parser.add_argument("--seed", type=int, help="seed of the weights and the data order (default: TrainingConfig's)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: TrainingConfig's)")
    parser.add_argument("--warmup", type=int, help="linear warm-up steps (default: TrainingConfig's)")
    parser.add_argument("--data", help="your own .txt / .jsonl file or folder; default: the embedded corpus")
    parser.add_argument("--synthetic-data", action="store_true",
                        help="train on counting sequences instead of a corpus (parity tests, benchmarks)")
    parser.add_argument("--trace-routing", help="write per step and MoE layer the global tokens per expert (JSONL)")
    parser.add_argument("--save-dir", help="checkpoint folder (step-NNNNNN/), as the single-process trainer's")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only at the end)")
    parser.add_argument("--stop-at", type=int, help="end after step K as if interrupted, saving a checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --save-dir")
    parser.add_argument("--cluster", help="cluster preset for MFU (default: cpu on CPU, h100-sxm-80gb on GPU)")
    parser.add_argument("--online-balance", action="store_true",
                        help="migrate and replicate experts while training (needs --ep > 1; docs/balance.md)")
    parser.add_argument("--balance-interval", type=int,
                        help=f"steps between full expert re-plans (default {REPLAN_INTERVAL}; drift checks every step)")
    parser.add_argument("--balance-horizon", type=int,
                        help=f"steps over which a migration must repay its cost (default {PAYBACK_HORIZON})")
    parser.add_argument("--slots-per-rank", type=int,
                        help="expert slots per EP rank (default experts/ep + 1: one spare for a replica)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moetrain.distributed.launch")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return launch(args.nproc, args, Path(args.log_dir) if args.log_dir else None)
    except UserError as exc:
        print(f"moetrain train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
