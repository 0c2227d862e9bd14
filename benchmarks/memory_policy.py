"""Activation memory and step time of the memory policies, measured.

CUDA (bf16, Pangu-shaped layers scaled to one GPU): device memory the forward leaves allocated for
backward (above weights and gradients; the peak through backward beside it) and step time, for none /
selective / swap (attention and MoE saved tensors to pinned host memory; compiled: whole layers) / full /
auto at a budget fraction, with the device↔host bandwidth measured for the policy's swap costs.
CPU (fp32, tiny-pangu, a smoke run): bytes kept for backward (``ActivationMeter``) and step time.

    python benchmarks/memory_policy.py --device cpu --model tiny-pangu --seq-len 256 --budget-fraction 0.3
    python benchmarks/memory_policy.py --device cuda --budget-fraction 0.3     # writes memory_<gpu>.json
    python benchmarks/memory_policy.py --device cuda --compile                 # writes memory_<gpu>_compiled.json

``--compile`` compiles every decoder layer (``moetrain.distributed.parallelize.apply_compile``) with the
policy's checkpoint wrappers inside (``apply_memory_policy(..., compiled=True)``); compiled layers swap
whole (``swap_layer``), so ``auto`` chooses among the recompute options and ``swap_layer``, and the swap run
swaps every layer whole. Each model is compiled afresh, and its first step (the compilation) is a warm-up
step. Writes
``benchmarks/results/memory_<device>[_compiled].json`` with the command, commit and machine.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import device_tag, write_result  # noqa: E402
from gpu_step_profile import busy_seconds  # noqa: E402

from moetrain.config import load_model_config
from moetrain.config.model import ModelConfig
from moetrain.costs.flops import training_flops_per_token
from moetrain.distributed.parallelize import apply_compile
from moetrain.memory.measure import host_link_bytes_per_s, measure_activations, measure_saved_bytes, time_steps
from moetrain.memory.options import COMPILED_EXCLUDED, uses_flash_attention
from moetrain.memory.policy import ActivationShape, DeviceSpeed, MemoryPlan, choose_memory_plan, num_blocks
from moetrain.memory.runtime import apply_memory_policy
from moetrain.models import build_model


def gpu_model() -> ModelConfig:
    """Pangu Ultra MoE's layer shapes (hidden 7680, MLA 192/128 heads, 2048-wide experts, top-8)
    with fewer heads/experts and 4 layers, so one GPU holds it."""
    base = load_model_config("pangu-ultra-moe-718b")
    data = base.model_dump()
    data.update(name="pangu-shaped-1gpu", num_layers=4, num_dense_layers=1, num_mtp_layers=0, vocab_size=32768,
                hidden_size=4096, dense_ffn_hidden=8192)
    data["attention"].update(num_heads=32)
    data["moe"].update(num_experts=32)
    data["moe"]["router"].update(num_groups=1, num_top_groups=1, num_device_groups=1)
    return ModelConfig.model_validate(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="preset (default: tiny-pangu on CPU, Pangu-shaped on CUDA)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--budget-fraction", type=float, default=0.3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compiled layers")
    parser.add_argument("--policies", default="selective,full,auto,swap",
                        help="policies measured beside none (swap: on CUDA, and on CPU with --compile to rehearse it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    cfg = load_model_config(args.model) if args.model else (gpu_model() if cuda else load_model_config("tiny-pangu"))
    seq = args.seq_len or (4096 if cuda else 256)
    batch = args.micro_batch or (1 if cuda else 2)
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.device(args.device)
    if not cuda:
        torch.set_num_threads(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)

    def build():
        torch._dynamo.reset()  # a fresh compilation per model (guards on the last one would fall back to eager)
        model = build_model(cfg, device=device, seed=0)
        return model.to(dtype)

    def measure(plan) -> dict:
        model = build()
        if plan is not None:
            apply_memory_policy(model, plan, compiled=args.compile)
        if args.compile:
            apply_compile(model)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()

        seconds = time_steps(step, args.repeats, device=device)
        if cuda:
            # Gradients stay allocated (zeroed in place), so what the step adds above the start is
            # activations and transient workspace, not the gradients themselves.
            model.zero_grad(set_to_none=False)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            loss = model(ids, labels=ids).loss
            torch.cuda.synchronize()
            kept = torch.cuda.memory_allocated() - start  # saved for backward (swapped bytes not counted)
            loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
            del loss
            # One more step under the profiler: the share of it the device is busy (low: the host's
            # kernel launches and the policy's hooks, not the device, set the step time).
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                begin = time.perf_counter()
                step()
                torch.cuda.synchronize()
                profiled = time.perf_counter() - begin
            return {"activation_bytes": kept, "peak_above_weights_and_grads_bytes": peak, "step_time_s": seconds,
                    "device_busy_fraction": busy_seconds(prof) / profiled}
        if args.compile:  # the dispatch-mode meter sees eager operators only
            return {"activation_bytes": measure_saved_bytes(model, ids, ids), "step_time_s": seconds}
        return {"activation_bytes": measure_activations(model, ids, ids).total_bytes, "step_time_s": seconds}

    baseline = measure(None)
    flops = training_flops_per_token(cfg, seq) * seq * batch
    host_link = host_link_bytes_per_s(device)
    speed = DeviceSpeed(flops / baseline["step_time_s"], 2e12 if cuda else 1e10, host_link)
    dtype_bytes = 2.0 if cuda else 4.0
    shape = ActivationShape(cfg, seq, batch, dtype_bytes, uses_flash_attention(cfg, args.device))
    probe = choose_memory_plan(shape, "none", None, speed)
    budget = args.budget_fraction * probe.baseline_bytes
    runs = {"none": {**baseline, "predicted_activation_bytes": probe.activation_bytes}}
    excluded = COMPILED_EXCLUDED if args.compile else frozenset()
    failed: dict[str, str] = {}
    for policy in [p for p in args.policies.split(",") if p != "swap"]:
        result = choose_memory_plan(shape, policy, budget, speed, excluded)
        try:
            measured = measure(result.plan)
        except Exception as exc:  # noqa: BLE001 - a policy that fails is recorded; the next one runs
            traceback.print_exc()
            failed[policy] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
            continue
        runs[policy] = {**measured, "options": result.options, "predicted_activation_bytes": result.activation_bytes,
                        "predicted_added_s": result.added_time_s}
    if (cuda or args.compile) and "swap" in args.policies.split(","):
        # every layer's tensors to host memory (eager: attention's and the MoE block's; compiled layers
        # swap whole): what swap alone saves and costs. On a CPU host memory is the device's, so a
        # compiled CPU run only rehearses the path (its bytes: what the swap hooks leave on the device)
        swap = MemoryPlan.uniform(("swap_layer",) if args.compile else ("swap_attention", "swap_moe"),
                                  num_blocks(cfg))
        runs["swap"] = {**measure(swap), "options": swap.summary()}
    for run in runs.values():
        run["activation_ratio"] = run["activation_bytes"] / baseline["activation_bytes"]
        run["step_time_ratio"] = run["step_time_s"] / baseline["step_time_s"]
    record = {
        "model": cfg.name, "seq_len": seq, "micro_batch": batch, "compiled": args.compile,
        "dtype": str(dtype).removeprefix("torch."), "budget_fraction": args.budget_fraction,
        "measure": ("allocated after forward above weights and gradients (peak through backward beside it)" if cuda
                    else "bytes kept for backward (ActivationMeter)"),
        "host_link_gb_per_s": host_link / 1e9 if host_link else None,
        "runs": runs,
        "failed": failed,
    }
    suffix = "_compiled" if args.compile else ""
    write_result(args.out or f"benchmarks/results/memory_{device_tag()}{suffix}.json", record)
    for name, run in runs.items():
        busy = f"  device busy {run['device_busy_fraction']:.0%}" if "device_busy_fraction" in run else ""
        print(f"{name:9} activation {run['activation_ratio']:.3f}  step time {run['step_time_ratio']:.3f}{busy}  "
              f"{run.get('options', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
