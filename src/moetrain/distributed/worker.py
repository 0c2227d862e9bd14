"""One rank of a distributed run: what ``torchrun`` starts (``python -m moetrain.distributed.worker``).

The layout comes from the flags (or a plan file) and was validated by the launcher before any
process started. Rank 0 prints one line per step. A rank that raises writes one line, naming itself
and the cause, to ``$MOETRAIN_ERROR_DIR/rank<R>.txt`` and exits non-zero; torchrun (``--max-restarts
0``) then stops every other rank, and the launcher prints that line.

``MOETRAIN_FAULT=rank:step:raise|kill`` injects a failure (tests of the failure path).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moetrain.distributed.worker")
    parser.add_argument("--model", default="tiny-pangu")
    for axis in ("tp", "pp", "vpp", "ep", "dp"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--a2a", choices=["flat", "hierarchical"], default="flat")
    parser.add_argument("--ranks-per-node", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--metrics-out")
    parser.add_argument("--trace-dir")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    return parser.parse_args(argv)


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get("MOETRAIN_FAULT")
    if not spec:
        return
    fault_rank, fault_step, kind = spec.split(":")
    if int(fault_rank) == rank and int(fault_step) == step:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault at step {step}")


def _train(args: argparse.Namespace, rank: int, device: torch.device) -> None:
    from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
    from moetrain.distributed.layout import ParallelDims
    from moetrain.distributed.step import build_layout, train_step
    from moetrain.distributed.trace import Tracer

    parallel = ParallelConfig(tp=args.tp, sp=args.sp or args.tp > 1, pp=args.pp, vpp=args.vpp, ep=args.ep,
                              dp=args.dp, a2a=args.a2a, overlap=args.overlap)
    cfg = TrainingConfig(steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch,
                         seq_len=args.seq_len, seed=args.seed, warmup_steps=min(20, args.steps // 5))
    dims = ParallelDims.build(parallel, rank, args.ranks_per_node)
    run = build_layout(dims, load_model_config(args.model), cfg, device)
    tracer = Tracer(rank)
    rows = []
    for step in range(cfg.steps):
        _maybe_fault(rank, step)
        with tracer.active():
            loss = train_step(run, step, cfg, device, tracer)
        rows.append({"step": step, "loss": loss})
        if rank == 0:
            print(f"step {step} loss {loss:.6f}", flush=True)
    if args.trace_dir:
        tracer.save(Path(args.trace_dir) / f"rank{rank}.json")
        if rank == 0:
            print(f"a2a_hidden_fraction {tracer.a2a_hidden_fraction():.3f} (rank 0, all steps)", flush=True)
    if args.metrics_out and rank == 0:
        Path(args.metrics_out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from moetrain.distributed.world import init_world

    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, _, device = init_world(timeout_s=args.timeout_s)
    try:
        _train(args, rank, device)
    except BaseException as exc:  # report every cause, then let torchrun stop the others
        error_dir = os.environ.get("MOETRAIN_ERROR_DIR")
        message = f"rank {rank} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if error_dir:
            Path(error_dir, f"rank{rank}.txt").write_text(message + "\n")
        print(message, file=sys.stderr, flush=True)
        os._exit(1)  # no process-group teardown: peers may already be gone
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
