"""Which fused attention kernels torch's SDPA can run for this project's head shapes, and how fast.

    python benchmarks/gpu_attention_probe.py --out benchmarks/results/gpu_attention_probe.json

For each case (MHA head dim 128; MLA's 192-wide query-key head with a 128-wide value head; grouped
query attention) and each SDPA backend forced alone: whether it runs, and the forward and
forward+backward time, as achieved TFLOP/s on the causal half of 4·b·h·s²·d (forward; backward
counted as 2× the forward's FLOPs). The default row is SDPA left to choose.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from _record import write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

CASES = {  # name: (batch, q heads, kv heads, seq, qk head dim, v head dim, dtype)
    "mha_d128_bf16": (2, 32, 32, 4096, 128, 128, torch.bfloat16),
    "mla_qk192_v128_bf16": (2, 32, 32, 4096, 192, 128, torch.bfloat16),
    "gqa_32q_8kv_d128_bf16": (2, 32, 8, 4096, 128, 128, torch.bfloat16),
    "gqa_32q_8kv_d128_fp32": (2, 32, 8, 1024, 128, 128, torch.float32),
}
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def probe_case(case: str, b: int, hq: int, hkv: int, s: int, dqk: int, dv: int, dtype: torch.dtype) -> list[dict]:
    q = torch.randn(b, hq, s, dqk, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, dqk, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, dv, device="cuda", dtype=dtype, requires_grad=True)
    flops = 2.0 * b * hq * s * s * (dqk + dv) / 2  # QKᵀ and PV, causal half

    def attn() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)

    rows = []
    for name, backend in BACKENDS.items():
        row: dict = {"case": case, "backend": name}
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                fwd = timed(attn)
                base = torch.cuda.memory_allocated()
                out = attn()
                saved = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
                grad = torch.ones_like(out)
                fwd_bwd = timed(lambda out_grad=grad: torch.autograd.grad(attn(), (q, k, v), out_grad))
            row.update(runs=True, forward_ms=fwd * 1e3, forward_backward_ms=fwd_bwd * 1e3,
                       forward_tflops=flops / fwd / 1e12, backward_over_forward=(fwd_bwd - fwd) / fwd,
                       forward_backward_tflops=3 * flops / fwd_bwd / 1e12, saved_for_backward_mib=saved / 2**20)
            del out, grad
        except RuntimeError as exc:
            row.update(runs=False, error=str(exc).splitlines()[0][:160])
        rows.append(row)
        detail = (f"fwd {row['forward_tflops']:6.1f} TFLOP/s, fwd+bwd {row['forward_backward_tflops']:6.1f}, "
                  f"bwd/fwd {row['backward_over_forward']:.2f}, saved {row['saved_for_backward_mib']:.0f} MiB"
                  if row["runs"] else row["error"])
        print(f"{case:24s} {name:9s} {detail}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [row for case, shape in CASES.items() for row in probe_case(case, *shape)]
    if args.out:
        write_result(args.out, {"cases": {k: list(map(str, v)) for k, v in CASES.items()}, "rows": rows})


if __name__ == "__main__":
    main()
