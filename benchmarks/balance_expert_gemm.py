"""Measured expert compute per EP rank, static vs balanced placement, and the planner's solve time.

    python benchmarks/balance_expert_gemm.py                  # GPU if present, else CPU (small sizes)
    python benchmarks/balance_expert_gemm.py --device cuda --model pangu-ultra-moe-718b --tokens-per-rank 8192

One device plays each EP rank in turn: for a skewed (Zipf) load, it runs the SwiGLU experts of that
rank's slots on the tokens the placement sends there (forward + backward, one group per slot, with the
runtime's grouped GEMM) and times it. Running ranks one after another on one device is not an EP run
(no all-to-all, no concurrency); it measures the compute part the planner balances: the slowest rank's expert time.
Writes benchmarks/results/balance_expert_gemm_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from _record import write_result

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement
from moetrain.balance.solver import PlanRequest, plan_placement
from moetrain.balance.traces import TraceShape, zipf_trace
from moetrain.config import load_model_config
from moetrain.models.experts import grouped_mm


def rank_expert_seconds(placement: ExpertPlacement, loads: np.ndarray, hidden: int, ffn: int,
                        device: str, dtype, repeats: int) -> list[float]:
    """Per rank: fastest of ``repeats`` runs of forward + backward through its slots' experts."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    w_gate = (torch.randn(placement.slots_per_rank, hidden, ffn, generator=generator) * 0.02).to(device, dtype)
    w_up = (torch.randn(placement.slots_per_rank, hidden, ffn, generator=generator) * 0.02).to(device, dtype)
    w_down = (torch.randn(placement.slots_per_rank, ffn, hidden, generator=generator) * 0.02).to(device, dtype)
    for w in (w_gate, w_up, w_down):
        w.requires_grad_(True)
    per_slot = np.rint(placement.tokens_per_slot(loads)).astype(int).reshape(placement.num_ranks, -1)
    out = []
    for rank in range(placement.num_ranks):
        experts = placement.experts_on_rank(rank)
        counts = [int(c) if e != EMPTY_SLOT else 0 for c, e in zip(per_slot[rank], experts)]
        counts_on_device = torch.tensor(counts, device=device)
        x = torch.randn(sum(counts), hidden, generator=generator).to(device, dtype)
        times = []
        for _ in range(repeats + 1):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            # The runtime's expert kernel: one grouped GEMM per projection (fused on a Hopper GPU in bf16,
            # a per-slot loop elsewhere), forward and backward.
            gate = grouped_mm(x, w_gate, counts_on_device)
            up = grouped_mm(x, w_up, counts_on_device)
            y = grouped_mm(torch.nn.functional.silu(gate) * up, w_down, counts_on_device)
            y.float().square().mean().backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out.append(float(np.min(times[1:])))  # min: the least disturbed run on a shared host
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-pangu")
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier timings on a shared host)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = load_model_config(args.model)
    assert model.moe is not None
    experts, top_k = model.moe.num_experts, model.moe.router.top_k
    shape = TraceShape(num_steps=1, num_layers=1, num_experts=experts, num_ranks=args.ep,
                       tokens_per_step=args.tokens_per_rank * args.ep, top_k=top_k)
    loads = zipf_trace(shape, args.zipf).tokens_per_expert[0, 0]
    loads = loads.astype(float)
    slots = experts // args.ep + 1
    static = ExpertPlacement.contiguous(experts, args.ep, slots)
    solve = {}
    for solver in ("greedy", "local"):
        plan_placement(PlanRequest(loads, args.ep, slots, solver))  # warm caches
        start = time.perf_counter()
        balanced = plan_placement(PlanRequest(loads, args.ep, slots, solver))
        solve[solver] = 1e3 * (time.perf_counter() - start)
    rows = {}
    for name, placement in (("static", static), ("balanced", balanced)):
        seconds = rank_expert_seconds(placement, loads, model.hidden_size, model.moe.expert_ffn_hidden,
                                      device, dtype, args.repeats)
        rows[name] = {"imbalance": float(placement.imbalance(loads)), "rank_seconds": seconds,
                      "max_over_mean_seconds": max(seconds) / float(np.mean(seconds))}
        print(f"{name:9s} token imbalance {rows[name]['imbalance']:.3f}; expert fwd+bwd per rank (ms): "
              + " ".join(f"{1e3 * s:.2f}" for s in seconds)
              + f"; slowest/mean {rows[name]['max_over_mean_seconds']:.3f}")
    speedup = max(rows["static"]["rank_seconds"]) / max(rows["balanced"]["rank_seconds"]) - 1
    print(f"slowest rank: {speedup:+.1%} faster balanced; planner solve (this machine's CPU): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in solve.items()))
    write_result(Path(__file__).parent / "results" / f"balance_expert_gemm_{device.split(':')[0]}.json", {
        "load_average": list(os.getloadavg()), "model": args.model, "ep": args.ep, "slots_per_rank": slots,
        "tokens_per_rank": args.tokens_per_rank,
        "zipf": args.zipf, "solve_ms": solve, "placements": rows, "slowest_rank_speedup": speedup,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
