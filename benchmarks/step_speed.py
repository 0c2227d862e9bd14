"""Speed of the training step users run, eager against compiled, on one device.

    python benchmarks/step_speed.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \\
        --seq-len 4096 --global-batch 8 --variants compiled:8:block,compiled:1:dense    # → step_speed_<gpu>.json
    python benchmarks/step_speed.py --device cpu --steps 6 --out benchmarks/results/step_speed_cpu.json

A variant is ``eager`` or ``compiled``, optionally with its micro-batch and document mask
(``compiled:8:block``: micro-batches of 8 sequences, FlexAttention tiles; the defaults are ``--micro-batch``
and ``auto``). For each it builds ``moetrain.train.Trainer`` from the run spec ``moetrain train`` would (bf16
autocast on CUDA, fp32 on CPU, the embedded corpus) and steps it as its loop does
(``distributed.step.train_step``). Reports per variant: the first step (compilation included), the median of
the other steps that did not compile (a new document mask or shape recompiles: such steps are recorded in
``compiled_steps``, not timed), tokens/s and MFU (the trainer's own formula, against the GPU's own cluster
preset), peak device memory, the operators dispatched per step (torch.profiler: top-level ``aten::`` calls on the host),
and from one profiled step the device kernels, the device time by kind of kernel
(``gpu_step_profile.kernel_kind``) and the kernels with the most device time (CUDA); the host reads per
step (``HostReadCounter``, eager only: declared by reason and undeclared), and on CUDA whether a whole
step passes under ``torch.cuda.set_sync_debug_mode("error")`` (the step's declared reads lift it).
``--fallback`` names variants run only when one of ``--variants`` failed. ``--synthetic-data`` trains on
counting sequences of one document each, so attention runs plain causal instead of with the corpus's
document mask.
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

from _record import device_tag, write_result  # noqa: E402
from gpu_step_profile import (  # noqa: E402
    device_events,
    device_ms_by_kind,
    inductor_cache_dir,
    top_kernels,
    triton_kernel_sources,
)

from moetrain.config.run import RunSpec  # noqa: E402
from moetrain.distributed.host_reads import HostReadCounter  # noqa: E402
from moetrain.distributed.parallelize import compile_events  # noqa: E402
from moetrain.distributed.step import train_step  # noqa: E402
from moetrain.train import SuppliedParts, Trainer  # noqa: E402
from moetrain.train.metrics import timed_rows  # noqa: E402

TRITON_SOURCES = 10
"""How many of the profiled step's slowest Triton kernels a record keeps the source of."""

DEVICE_TIME = "kernels and copies; the host's record_function ranges on the device's timeline left out"
"""What a record's device times count (``gpu_step_profile.device_events``). Records without this key, before
it, also counted torch's ``Optimizer.step#AdamW.step`` range, so their optimizer time holds its kernels twice."""


@dataclass(frozen=True)
class Variant:
    mode: str
    """eager or compiled"""
    micro_batch: int
    document_mask: str
    """auto, dense or block (``moetrain.models.attention``)"""

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.micro_batch}:{self.document_mask}"

    @classmethod
    def parse(cls, text: str, micro_batch: int) -> Variant:
        mode, *rest = text.split(":")
        if mode not in ("eager", "compiled") or len(rest) > 2:
            raise SystemExit(f"--variants: {text!r} is not eager|compiled[:micro_batch[:auto|dense|block]]")
        return cls(mode, int(rest[0]) if rest else micro_batch, rest[1] if len(rest) > 1 else "auto")


@dataclass
class VariantResult:
    variant: str
    micro_batch: int
    document_mask: str
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
    device_ms_by_kind: dict[str, float] = field(default_factory=dict)
    """One profiled step's device time by kind of kernel (CUDA)."""
    top_kernels: list[dict] = field(default_factory=list)
    compiled_steps: list[bool] = field(default_factory=list)
    """Per timed step: whether torch compiled during it (``distributed.parallelize.compile_events``); the
    median leaves those out, and the first step (``train.metrics.timed_rows``)."""
    timed_steps_s: list[float] = field(default_factory=list)
    """The steps the median is taken over (``steps_s`` less the first and those that compiled)."""
    document_tokens_mean: float | None = None
    """Mean length in tokens (EOS included) of the corpus's documents, which attention does not cross (None:
    synthetic data, one document per sequence): what ``moetrain simulate --document-tokens`` prices."""
    kernel_sources: dict[str, str] = field(default_factory=dict)
    """The source Inductor generated for the profiled step's Triton kernels with the most device time (CUDA,
    compiled; ``gpu_step_profile.triton_kernel_sources``): their tiling and loads, read after the device is gone."""
    masked_steps: list[bool] = field(default_factory=list)
    """Per step, ``steps_s``'s and then the profiled one: whether a micro-batch held a document boundary and ran
    its attention under the document mask (the others run the plain causal kernel)."""


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


def _masked_steps(trainer: Trainer, steps: int, global_batch: int, micro_batch: int) -> list[bool]:
    """Whether each of the first ``steps`` steps ran a micro-batch under the document mask: the batches are a
    function of the step (``data.packing``), so they are read again rather than watched."""
    return [trainer.dataset.step_batch(step, global_batch, micro_batch).masked for step in range(steps)]


def run_variant(variant: Variant, args: argparse.Namespace) -> VariantResult:
    device = args.device
    torch._dynamo.reset()  # each variant compiles afresh (no guard fails over to eager across variants)
    spec = RunSpec(model=args.model, training={"steps": args.steps + 3, "global_batch": args.global_batch,
                                               "micro_batch": variant.micro_batch, "seq_len": args.seq_len},
                   run={"device": device, "quiet": True, "compile": variant.mode == "compiled",
                        "synthetic_data": args.synthetic_data, "document_mask": variant.document_mask})
    trainer = Trainer(spec, SuppliedParts(console=Console(file=io.StringIO())))
    trainer.run.stage.model.train()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times, compiled = [], [], []
    for _ in range(args.steps):
        _sync(device)
        start, compiles = time.perf_counter(), compile_events()
        losses.append(_step(trainer))
        _sync(device)
        times.append(time.perf_counter() - start)
        compiled.append(compile_events() > compiles)
    timed = [r["step_time_s"] for r in timed_rows([{"step_time_s": t, "compiled": c}
                                                    for t, c in zip(times, compiled, strict=True)])]
    median = statistics.median(timed)
    tokens = args.global_batch * args.seq_len
    result = VariantResult(
        variant.name, variant.micro_batch, trainer.run.document_mask, times[0], median, times, tokens / median,
        tokens / median * trainer.flops_per_token / trainer.peak_flops,
        torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None, 0.0, None, losses=losses,
        compiled_steps=compiled, timed_steps_s=timed,
        document_tokens_mean=None if trainer.data is None else trainer.data.dataset.stream.mean_document_tokens,
        masked_steps=_masked_steps(trainer, args.steps + 1, args.global_batch, variant.micro_batch))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        losses.append(_step(trainer))
    result.host_ops_per_step = _top_level_ops(prof)
    if device == "cuda":
        result.device_kernels_per_step = len(device_events(prof))
        result.device_ms_by_kind = device_ms_by_kind(prof)
        result.top_kernels = top_kernels(prof, 30)
        triton = [k["name"] for k in result.top_kernels if k["name"].startswith("triton_")][:TRITON_SOURCES]
        try:
            result.kernel_sources = triton_kernel_sources(triton, inductor_cache_dir())
        except Exception as exc:  # noqa: BLE001 - the sources are a reading aid: the variant's figures stay
            print(f"kernel sources left out: {type(exc).__name__}: {exc}")
    name = variant.mode
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
    p.add_argument("--variants", default="eager,compiled",
                   help="comma list of eager|compiled[:micro_batch[:auto|dense|block]]")
    p.add_argument("--fallback", default=None,
                   help="comma list of variants run only when one of --variants failed (a dense mask for a "
                        "FlexAttention variant that did not compile): their time is spent only where needed")
    p.add_argument("--synthetic-data", action="store_true",
                   help="counting sequences, one document each: plain causal attention, no document mask")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/step_speed_<device>.json; "
                                                "- writes none)")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    variants = [Variant.parse(text, args.micro_batch) for text in args.variants.split(",")]
    fallbacks = [Variant.parse(text, args.micro_batch) for text in (args.fallback or "").split(",") if text]
    out = args.out or f"benchmarks/results/step_speed_{device_tag()}.json"
    results, failed = [], []
    for index, variant in enumerate(variants + fallbacks):
        if index == len(variants) and not failed:
            print(f"no variant failed: the fallback ({args.fallback}) is not run")
            break
        try:
            results.append(run_variant(variant, args))
            print_row(results[-1])
        except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded; the next one runs
            traceback.print_exc()
            failed.append({"variant": variant.name, "error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"})
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if out != "-":  # after every variant: a run cut short keeps the variants it finished
            write_result(out, {"model": args.model, "device": args.device, "seq_len": args.seq_len,
                               "data": "synthetic (no document mask)" if args.synthetic_data else "shakespeare",
                               "global_batch": args.global_batch, "device_time": DEVICE_TIME,
                               "load_average_1min_before": load_before,
                               "load_average_1min_after": os.getloadavg()[0],
                               "variants": [asdict(r) for r in results], "failed_variants": failed})
    print(HEADER)
    for r in results:
        print_row(r)


HEADER = (f"{'variant':18s} {'first s':>8s} {'median s':>9s} {'tok/s':>10s} {'MFU':>6s} {'peak GiB':>9s} "
          f"{'host ops':>9s} {'kernels':>8s} {'reads':>22s} {'sync-debug':>10s}")


def print_row(r: VariantResult) -> None:
    reads = f"{sum(r.host_reads_declared.values())} decl/{len(r.host_reads_undeclared)} undecl" \
        if r.variant.startswith("eager") else "-"
    print(f"{r.variant:18s} {r.first_step_s:8.2f} {r.median_step_s:9.4f} {r.tokens_per_s:10,.0f} {r.mfu:6.1%} "
          f"{r.peak_memory_gib or 0:9.2f} {r.host_ops_per_step:9.0f} {r.device_kernels_per_step or 0:8.0f} "
          f"{reads:>22s} {str(r.sync_debug_error_passes):>10s}")
    if r.sync_debug_message:
        print(f"  sync debug: {r.sync_debug_message}")
    if r.host_reads_undeclared:
        print(f"  undeclared reads: {sorted(set(r.host_reads_undeclared))}")
    if r.device_ms_by_kind:
        print("  device ms by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in r.device_ms_by_kind.items()))


if __name__ == "__main__":
    main()
