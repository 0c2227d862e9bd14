"""Where a training step's time goes on one device: torch.profiler over a few trainer steps.

    python benchmarks/gpu_step_profile.py --model benchmarks/data/pangu-shaped-small.yaml --seq-len 4096 \\
        --global-batch 8 --micro-batch 1 --out benchmarks/results/gpu_step_profile_small.json

Builds ``moetrain.train.Trainer`` from the run spec ``moetrain train`` would (bf16 autocast on CUDA,
AdamW, the embedded Shakespeare corpus) and steps it as its loop does (``distributed.step.train_step``
on the trainer's next batch, traced), skips ``--warmup`` steps, then profiles ``--active`` steps.
Reports the wall time per step, the GPU busy time per step (kernels and copies, overlaps not
double-counted), and the operators with the most device time and the most host time.
"""

from __future__ import annotations

import argparse
import getpass
import io
import os
import re
import tempfile
import time
from pathlib import Path

import torch
from _record import write_result
from rich.console import Console
from torch.profiler import ProfilerActivity, profile

from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.step import train_step
from moetrain.train import SuppliedParts, Trainer


def device_events(prof: profile) -> list:
    """The profiled device kernels and copies. The device timeline also holds the ``record_function`` ranges
    the host opened (``is_user_annotation``: torch's optimizer opens ``Optimizer.step#AdamW.step``), each
    spanning kernels already listed: counted as kernels, they would count those kernels twice."""
    return [e for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def busy_seconds(prof: profile) -> float:
    """Union of the device kernels' and copies' intervals (seconds)."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in device_events(prof))
    total, end = 0.0, float("-inf")
    for start, stop in intervals:
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total * 1e-6  # µs → s


KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (kind, words of a CUDA kernel's name), first match wins; matched case-insensitively
    ("attention", ("flash", "fmha", "sdpa", "cudnn", "flex_attention", "attention")),
    ("grouped_gemm", ("groupproblemshape", "ptrarray", "grouped")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("copy", ("memcpy", "memset")),
)
"""Kinds of device time, for comparing a measured step with the simulator's terms: core attention,
the experts' grouped GEMMs, the other (dense) GEMMs, the optimizer, copies, and everything else
(element-wise and reduction kernels: norms, activations, permutations, losses)."""


KERNEL_NAME_CHARS = 160
"""A kernel's name as a record keeps it (CUTLASS's template names run to thousands)."""

def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lower for w in words)), "elementwise")


def device_ms_by_kind(prof: profile) -> dict[str, float]:
    """Device milliseconds of the profiled kernels by ``kernel_kind`` (overlaps counted per kernel)."""
    totals: dict[str, float] = {}
    for event in device_events(prof):
        kind = kernel_kind(event.name)
        totals[kind] = totals.get(kind, 0.0) + (event.time_range.end - event.time_range.start) / 1e3
    return {kind: round(ms, 3) for kind, ms in sorted(totals.items(), key=lambda kv: -kv[1])}


def top_kernels(prof: profile, limit: int) -> list[dict]:
    """The device kernels with the most time: name (cut to ``KERNEL_NAME_CHARS``), kind, calls, milliseconds."""
    by_name: dict[str, list[float]] = {}
    for event in device_events(prof):
        by_name.setdefault(event.name, []).append((event.time_range.end - event.time_range.start) / 1e3)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:limit]
    return [{"name": name[:KERNEL_NAME_CHARS], "kind": kernel_kind(name), "calls": len(ms),
             "device_ms": round(sum(ms), 3)}
            for name, ms in rows]


KERNEL_SOURCE_CHARS = 6000
"""The most of one kernel's source a record keeps (Inductor's element-wise kernels run 1-4 kB)."""


def inductor_cache_dir() -> Path:
    """Where Inductor writes the kernels it generates (``TORCHINDUCTOR_CACHE_DIR``, else its default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # an older torch: the same rule by hand
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                    or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    return Path(cache_dir())


def _function_at(text: str, start: int) -> str:
    """The Triton kernel whose ``def`` starts at ``start``: its decorators (from Inductor's
    ``@triton_heuristics`` line) and its indented body."""
    decorator = text.rfind("@triton_heuristics", max(0, start - 3000), start)
    begin = decorator if decorator >= 0 else start
    lines = text[start:].split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    return (text[begin:start] + "\n".join(body).rstrip())[:KERNEL_SOURCE_CHARS]


def triton_kernel_sources(names: list[str], root: Path) -> dict[str, str]:
    """The source of each Triton kernel of ``names`` (a profile's, perhaps cut short) that Inductor wrote
    under ``root``, so that a slow kernel's tiling and loads can be read after the device is gone. Kernel
    names repeat across graphs (each numbers its own kernels), so the newest file's is taken: the graph
    compiled last, by the run that profiled. Names not found are left out."""
    files = sorted(root.rglob("*.py"), key=lambda f: f.stat().st_mtime, reverse=True) if root.is_dir() else []
    found: dict[str, str] = {}
    for path in files:
        wanted = [n for n in names if n not in found]
        if not wanted:
            break
        text = path.read_text(errors="replace")
        for name in wanted:
            # a whole name ends at its parameters; one ``top_kernels`` cut short is matched as a prefix
            match = re.search(f"def {re.escape(name)}" + (r"\(" if len(name) < KERNEL_NAME_CHARS else ""), text)
            if match:
                found[name] = _function_at(text, match.start())
    return {n: found[n] for n in names if n in found}


def top_ops(prof: profile, key: str, limit: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]
    return [{"name": e.key, "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-pangu")
    p.add_argument("--cluster", default="h100-sxm-80gb")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--active", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TrainingConfig(steps=args.warmup + args.active, global_batch=args.global_batch,
                         micro_batch=args.micro_batch, seq_len=args.seq_len)
    spec = RunSpec(model=args.model, training=cfg.model_dump(),
                   run={"device": device, "cluster": args.cluster if device == "cuda" else "cpu", "quiet": True})
    trainer = Trainer(spec, SuppliedParts(console=Console(file=io.StringIO())))
    trainer.run.stage.model.train()

    def one_step() -> None:
        batch = trainer.next_batch()
        with trainer.tracer.active():
            train_step(trainer.run, trainer.step, batch)  # ends with the step's one device read
        trainer.step += 1

    for _ in range(args.warmup):
        one_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.active):
            one_step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.active
    busy = busy_seconds(prof) / args.active if device == "cuda" else float("nan")
    by_device = top_ops(prof, "self_device_time_total", args.top)
    by_cpu = top_ops(prof, "self_cpu_time_total", args.top)
    kernels = len(device_events(prof)) / args.active
    print(f"wall per step {wall * 1e3:.1f} ms (profiler on), device busy {busy * 1e3:.1f} ms "
          f"({busy / wall:.0%}), {kernels:.0f} device events per step")
    print(f"{'operator':60s} {'calls':>6s} {'device ms':>10s} {'cpu ms':>9s}")
    for row in by_device:
        print(f"{row['name'][:60]:60s} {row['calls']:6d} {row['self_device_ms']:10.2f} {row['self_cpu_ms']:9.2f}")
    print("-- by host time")
    for row in by_cpu[:15]:
        print(f"{row['name'][:60]:60s} {row['calls']:6d} {row['self_device_ms']:10.2f} {row['self_cpu_ms']:9.2f}")
    trainer.close()  # the one-rank process group the trainer made
    if args.out:
        write_result(args.out, {
            "model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch,
            "micro_batch": args.micro_batch, "profiled_steps": args.active,
            "wall_s_per_step_profiled": wall, "device_busy_s_per_step": busy,
            "device_events_per_step": kernels, "top_by_device_time": by_device, "top_by_host_time": by_cpu,
        })


if __name__ == "__main__":
    main()
