"""Expert-parallel overlap: step time with and without the overlapped schedule, and how much of the
all-to-all time ran under compute (``a2a_hidden_fraction``, from each rank's trace).

Runs ``--nproc`` ranks (default 4, EP over all of them, data parallel outside) on one machine: gloo on
CPU, or NCCL with one GPU per rank when ``--device cuda`` and enough GPUs are present. The model is
tiny-pangu widened by ``--hidden`` so the exchanges are not negligible next to the compute. Both
variants train the same steps from the same weights; their losses must agree (checked, reported).

    python benchmarks/ep_overlap.py --global-batch 64 --out benchmarks/results/ep_overlap_cpu.json
    python benchmarks/ep_overlap.py --device cuda --nproc 8 --out benchmarks/results/ep_overlap_gpu.json

On a CPU, every rank and gloo's own threads share the cores: with fewer cores than ranks the
exchanges and the compute compete for them, which caps what overlap can gain in step time even where
the trace shows the exchanges hidden; the JSON records the core count.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from pathlib import Path

import torch
from _record import write_result
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import train_step
from moetrain.distributed.trace import Tracer
from moetrain.distributed.world import spawn
from moetrain.train import SuppliedParts, Trainer


def _model(hidden: int):
    base = load_model_config("tiny-pangu")
    return base.model_copy(update={"hidden_size": hidden, "name": f"tiny-pangu-h{hidden}"})


def _bench(rank: int, world_size: int, args: argparse.Namespace, device_kind: str) -> dict:
    """Both variants on this rank: the step of ``moetrain train`` (``distributed.step.train_step`` on the
    trainer's next batch of the synthetic counting data), timed from a barrier to the step's end, traced
    after the warm-up."""
    model_cfg = _model(args.hidden)
    # fp32 on CUDA too (no bf16 autocast), as this benchmark has always measured
    cfg = TrainingConfig(steps=args.warmup + args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch,
                         seq_len=args.seq_len, warmup_steps=1, dtype="fp32")
    out: dict = {}
    for overlap in (False, True):
        parallel = ParallelConfig(dp=world_size, ep=world_size, overlap=overlap)
        dims = ParallelDims.build(parallel, rank)
        spec = RunSpec(model="tiny-pangu", training=cfg.model_dump(),
                       parallel=parallel.model_dump(exclude={"sp", "micro_batch"}),
                       run={"device": device_kind, "synthetic_data": True, "quiet": True})
        trainer = Trainer(spec, SuppliedParts(dims=dims, model_cfg=model_cfg, console=Console(file=io.StringIO())))
        device = trainer.device
        trainer.run.stage.model.train()
        times, losses = [], []
        for step in range(cfg.steps):
            timed = step >= args.warmup
            if step == args.warmup:
                trainer.tracer = Tracer(rank)  # the timed steps' spans only
            batch = trainer.next_batch()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            torch.distributed.barrier()
            start = time.perf_counter()
            with trainer.tracer.active():  # as the loop steps; ends with the step's one host read
                losses.append(train_step(trainer.run, trainer.step, batch).loss)
            trainer.step += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if timed:
                times.append(time.perf_counter() - start)
        tracer = trainer.tracer
        a2a_s = sum(s.end_s - s.start_s for s in tracer.spans if s.kind == "comm" and s.name.startswith("a2a"))
        out["overlap" if overlap else "baseline"] = {
            "step_times_s": times, "losses": losses, "a2a_hidden_fraction": tracer.a2a_hidden_fraction(),
            "a2a_seconds_per_step": a2a_s / len(times),
        }
        if args.trace_dir and rank == 0:
            tracer.save(Path(args.trace_dir) / f"{'overlap' if overlap else 'baseline'}_rank{rank}.json")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trace-dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} GPUs for "
                         f"--nproc {args.nproc}; lower --nproc or use --device cpu")
    per_rank = spawn(_bench, args.nproc, args, args.device, backend="nccl" if args.device == "cuda" else "gloo")
    result: dict = {
        "model": _model(args.hidden).name, "layout": f"ep{args.nproc} (dp{args.nproc})", "backend":
        "nccl" if args.device == "cuda" else "gloo", "nproc": args.nproc, "cpu_cores": os.cpu_count(),
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "micro_batches_per_replica": args.global_batch // (args.nproc * args.micro_batch),
        "timed_steps": args.steps, "warmup_steps": args.warmup,
    }
    for variant in ("baseline", "overlap"):
        # A step ends when its slowest rank ends: per step, the maximum over ranks; then the median.
        step_times = [max(r[variant]["step_times_s"][i] for r in per_rank) for i in range(args.steps)]
        result[variant] = {
            "step_time_s_median": statistics.median(step_times),
            "step_time_s_min": min(step_times),
            "step_times_s": step_times,
            "a2a_hidden_fraction_mean": statistics.mean(r[variant]["a2a_hidden_fraction"] for r in per_rank),
            "a2a_hidden_fraction_by_rank": [r[variant]["a2a_hidden_fraction"] for r in per_rank],
            "a2a_seconds_per_step_mean": statistics.mean(r[variant]["a2a_seconds_per_step"] for r in per_rank),
            "losses": per_rank[0][variant]["losses"],
        }
    base, over = result["baseline"], result["overlap"]
    result["speedup"] = base["step_time_s_median"] / over["step_time_s_median"]
    result["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(base["losses"], over["losses"]))
    print(f"baseline {base['step_time_s_median'] * 1e3:.1f} ms/step, hidden {base['a2a_hidden_fraction_mean']:.3f}; "
          f"overlap {over['step_time_s_median'] * 1e3:.1f} ms/step, hidden {over['a2a_hidden_fraction_mean']:.3f}; "
          f"speedup {result['speedup']:.3f}; loss diff {result['max_loss_rel_diff']:.2e}")
    if result["max_loss_rel_diff"] > 1e-4:
        raise SystemExit(f"the overlapped schedule changed the losses (relative {result['max_loss_rel_diff']:.2e})")
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
