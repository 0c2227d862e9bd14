"""Speed of the training step users run, eager against compiled, on one device.

    python benchmarks/step_speed.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \\
        --seq-len 4096 --global-batch 8 --micro-batch 1 --out benchmarks/results/step_speed_h100.json
    python benchmarks/step_speed.py --device cpu --steps 6 --out benchmarks/results/step_speed_cpu.json

For each variant (``--variants eager,compiled``) it builds ``moetrain.train.Trainer`` from the run spec
``moetrain train`` would (bf16 autocast on CUDA, fp32 on CPU, the embedded corpus) and steps it as its loop
does (``distributed.step.train_step``). Reports per variant: the first step (compilation included), the
median of the other steps, tokens/s and MFU (the trainer's own formula), peak device memory, the
operators dispatched per step (torch.profiler: top-level ``aten::`` calls on the host) and the device
kernels per step (CUDA), the host reads per step (``HostReadCounter``, eager only: declared by reason
and undeclared), and on CUDA whether a whole step passes under ``torch.cuda.set_sync_debug_mode("error")``
(the step's declared reads lift it). ``--synthetic-data`` trains on counting sequences of one document
each, so attention runs plain causal instead of with the corpus's document mask.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_result  # noqa: E402

from moetrain.config.run import RunSpec  # noqa: E402
from moetrain.distributed.host_reads import HostReadCounter  # noqa: E402
from moetrain.distributed.step import train_step  # noqa: E402
from moetrain.train import Trainer  # noqa: E402


@dataclass
class VariantResult:
    variant: str
    first_step_s: float
    median_step_s: float
    steps_s: list[float]
    tokens_per_s: float
    mfu: float
    peak_memory_gib: float | None
    host_ops_per_step: float
    device_kernels_per_step: float | None
    host_reads_declared: dict[str, int] = field(default_factory=dict)
    host_reads_undeclared: list[str] = field(default_factory=list)
    sync_debug_error_passes: bool | None = None
    sync_debug_message: str | None = None
    losses: list[float] = field(default_factory=list)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(trainer: Trainer, counter: HostReadCounter | None = None) -> float:
    batch = trainer.next_batch()  # host-side data, before the step
    with counter or contextlib.nullcontext():
        result = train_step(trainer.run, trainer.step, batch)  # ends with the step's one host read
    trainer.step += 1
    return result.loss


def _top_level_ops(prof: profile) -> int:
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def run_variant(name: str, args: argparse.Namespace) -> VariantResult:
    device = args.device
    spec = RunSpec(model=args.model, training={"steps": args.steps + 3, "global_batch": args.global_batch,
                                               "micro_batch": args.micro_batch, "seq_len": args.seq_len},
                   run={"device": device, "quiet": True, "compile": name == "compiled",
                        "synthetic_data": args.synthetic_data,
                        "cluster": "h100-sxm-80gb" if device == "cuda" else "cpu"})
    trainer = Trainer(spec, console=Console(file=io.StringIO()))
    trainer.run.stage.model.train()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        losses.append(_step(trainer))
        _sync(device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    tokens = args.global_batch * args.seq_len
    result = VariantResult(
        name, times[0], median, times, tokens / median, tokens / median * trainer.flops_per_token / trainer.peak_flops,
        torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None, 0.0, None, losses=losses)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        losses.append(_step(trainer))
    result.host_ops_per_step = _top_level_ops(prof)
    if device == "cuda":
        result.device_kernels_per_step = sum(1 for e in prof.events()
                                             if e.device_type == torch.autograd.DeviceType.CUDA)
    if name == "eager":
        counter = HostReadCounter()
        losses.append(_step(trainer, counter))
        reads = counter.reads
        result.host_reads_declared, result.host_reads_undeclared = dict(reads.declared), reads.undeclared
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses.append(_step(trainer))
            result.sync_debug_error_passes = True
        except RuntimeError as exc:
            frames = [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_tb(exc.__traceback__)][-6:]
            result.sync_debug_error_passes = False
            result.sync_debug_message = f"{str(exc).splitlines()[0]} at {' <- '.join(reversed(frames))}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    trainer.close()
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-pangu")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant (the first includes compiling)")
    p.add_argument("--variants", default="eager,compiled")
    p.add_argument("--synthetic-data", action="store_true",
                   help="counting sequences, one document each: plain causal attention, no document mask")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    results = [run_variant(name, args) for name in args.variants.split(",")]
    print(f"{'variant':10s} {'first s':>8s} {'median s':>9s} {'tok/s':>10s} {'MFU':>6s} {'peak GiB':>9s} "
          f"{'host ops':>9s} {'kernels':>8s} {'reads':>22s} {'sync-debug':>10s}")
    for r in results:
        reads = f"{sum(r.host_reads_declared.values())} decl/{len(r.host_reads_undeclared)} undecl" \
            if r.variant == "eager" else "-"
        print(f"{r.variant:10s} {r.first_step_s:8.2f} {r.median_step_s:9.4f} {r.tokens_per_s:10,.0f} {r.mfu:6.1%} "
              f"{r.peak_memory_gib or 0:9.2f} {r.host_ops_per_step:9.0f} {r.device_kernels_per_step or 0:8.0f} "
              f"{reads:>22s} {str(r.sync_debug_error_passes):>10s}")
        if r.sync_debug_message:
            print(f"  sync debug: {r.sync_debug_message}")
        if r.host_reads_undeclared:
            print(f"  undeclared reads: {sorted(set(r.host_reads_undeclared))}")
    if args.out:
        write_result(args.out, {"model": args.model, "device": args.device, "seq_len": args.seq_len,
                                "data": "synthetic (no document mask)" if args.synthetic_data else "shakespeare",
                                "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                                "load_average_1min_before": load_before,
                                "load_average_1min_after": os.getloadavg()[0],
                                "variants": [asdict(r) for r in results]})


if __name__ == "__main__":
    main()
