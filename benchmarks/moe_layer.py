"""MoE layer forward+backward: permute → grouped GEMM → unpermute versus a naive per-expert loop.

Pangu-shaped expert dims (hidden 7680, expert FFN 2048, top-8 of 256 experts, 1 shared expert) scaled
to fit one device: ``--scale`` divides hidden and FFN, ``--experts`` sets how many experts the layer
holds. Reports time per call and achieved TFLOP/s from the analytic FLOPs of the routed experts
(3 GEMMs per expert, ×3 for forward+backward). On CUDA it runs in bf16 with
``torch.nn.functional.grouped_mm``; on CPU in fp32 with the exact fallback.

    python benchmarks/moe_layer.py --out benchmarks/results/moe_layer_cpu.json            # CPU
    python benchmarks/moe_layer.py --scale 1 --experts 32 --tokens 16384 --out benchmarks/results/moe_layer_h100.json
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _record import write_result

from moetrain.config import MoEConfig, RouterConfig
from moetrain.models import MoE


def naive_moe(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Reference: loop over experts, boolean-mask each expert's tokens (what a first implementation does)."""
    x_TD = x.reshape(-1, x.shape[-1])
    routing = block.router(x_TD)
    out = torch.zeros_like(x_TD)
    experts = block.experts
    for e in range(experts.num_experts):
        token_idx, slot = torch.where(routing.expert_ids_TK == e)
        if token_idx.numel() == 0:
            continue
        h = x_TD[token_idx]
        y = (F.silu(h @ experts.w_gate_EDF[e]) * (h @ experts.w_up_EDF[e])) @ experts.w_down_EFD[e]
        out.index_add_(0, token_idx, y * routing.weights_TK[token_idx, slot].unsqueeze(-1).to(y.dtype))
    if block.shared_expert is not None:
        out = out + block.shared_expert(x_TD)
    return out.view_as(x)


def time_fn(fn, x: torch.Tensor, iters: int, warmup: int) -> float:
    def step():
        x.grad = None
        fn(x).float().pow(2).mean().backward()

    for _ in range(warmup):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=16, help="divide Pangu's hidden (7680) and expert FFN (2048) by this")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden, ffn = 7680 // args.scale, 2048 // args.scale
    cfg = MoEConfig(num_experts=args.experts, expert_ffn_hidden=ffn, num_shared_experts=1,
                    router=RouterConfig(score_function="sigmoid", top_k=args.top_k, scaling_factor=2.5))
    torch.manual_seed(0)
    block = MoE(hidden, cfg, device=device)
    for prm in block.parameters():
        torch.nn.init.normal_(prm, std=hidden**-0.5)
    block = block.to(dtype)
    x = torch.randn(1, args.tokens, hidden, device=device, dtype=dtype, requires_grad=True)

    with torch.no_grad():
        max_err = (block(x).out_TD.float() - naive_moe(block, x).float()).abs().max().item()
    grouped_s = time_fn(lambda t: block(t).out_TD, x, args.iters, warmup=2)
    naive_s = time_fn(lambda t: naive_moe(block, t), x, args.iters, warmup=2)
    routed_flops = 3 * 2 * 3 * args.tokens * args.top_k * hidden * ffn  # fwd+bwd, 3 GEMMs per expert
    shared_flops = 3 * 2 * 3 * args.tokens * hidden * ffn
    total = routed_flops + shared_flops
    result = {
        "device": device, "dtype": str(dtype).removeprefix("torch."), "hidden": hidden, "expert_ffn": ffn,
        "experts": args.experts, "top_k": args.top_k, "tokens": args.tokens,
        "grouped_ms": grouped_s * 1e3, "naive_ms": naive_s * 1e3, "speedup": naive_s / grouped_s,
        "grouped_tflops": total / grouped_s / 1e12, "naive_tflops": total / naive_s / 1e12,
        "max_abs_diff_vs_naive": max_err,
    }
    for key, value in result.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
