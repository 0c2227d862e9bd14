"""Does the memory layout of MLA's q/k/v (QK 192, V 128) change the speed of fused attention?

    python benchmarks/gpu_attention_layout.py --out benchmarks/results/gpu_attention_layout.json

Times causal ``scaled_dot_product_attention`` forward + backward (bf16, one sequence of 4096, 32 heads,
the pangu-shaped-small attention) with its inputs laid out as the model produces them (q and k
concatenated, v and the output gradient as strided views of [B, S, H, ·] tensors), and with each made
contiguous in [B, H, S, ·] first, and through FlexAttention (compiled) where it runs. Medians of CUDA
event timings after warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import write_result  # noqa: E402

B, H, S, NOPE, ROPE, V = 1, 32, 4096, 128, 64, 128


def _inputs(contiguous: bool) -> tuple[torch.Tensor, ...]:
    q_BSHK = torch.randn(B, S, H, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    kv_BSHK = torch.randn(B, S, H, NOPE + V, device="cuda", dtype=torch.bfloat16)
    k_rope = torch.randn(B, 1, S, ROPE, device="cuda", dtype=torch.bfloat16)
    q = q_BSHK.transpose(1, 2)
    k_nope, v = kv_BSHK.split([NOPE, V], dim=-1)
    k = torch.cat([k_nope.transpose(1, 2), k_rope.expand(-1, H, -1, -1)], dim=-1)
    v = v.transpose(1, 2)
    if contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return tuple(t.detach().requires_grad_(True) for t in (q, k, v))


def _grad(contiguous: bool) -> torch.Tensor:
    g = torch.randn(B, S, H, V, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return g.contiguous() if contiguous else g


def _median_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _case(name: str, attend, inputs_contiguous: bool, grad_contiguous: bool) -> dict:
    q, k, v = _inputs(inputs_contiguous)
    grad = _grad(grad_contiguous)
    fwd = _median_ms(lambda: attend(q, k, v))
    both = _median_ms(lambda: attend(q, k, v).backward(grad))
    flops = 2 * B * H * S * S * (NOPE + ROPE + V) / 2  # causal: half the score matrix
    row = {"case": name, "forward_ms": fwd, "forward_backward_ms": both,
           "forward_tflops": flops / fwd / 1e9, "forward_backward_tflops": 3.5 * flops / both / 1e9}
    print(f"{name:45s} fwd {fwd:7.3f} ms  fwd+bwd {both:7.3f} ms  ({row['forward_backward_tflops']:.0f} TFLOP/s)")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    scale = (NOPE + ROPE) ** -0.5

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    rows = [_case("sdpa, model layout (strided v, grad)", sdpa, False, False),
            _case("sdpa, contiguous inputs, strided grad", sdpa, True, False),
            _case("sdpa, contiguous inputs and grad", sdpa, True, True)]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, S, S, device="cuda")
        flex = torch.compile(flex_attention)
        rows.append(_case("flex_attention (compiled), contiguous", lambda q, k, v: flex(
            q, k, v, block_mask=mask, scale=scale), True, True))
    except Exception as exc:  # noqa: BLE001 - a probe: record what failed, keep the others
        rows.append({"case": "flex_attention", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
        print(rows[-1])
    if args.out:
        write_result(args.out, {"batch": B, "heads": H, "seq": S, "qk_dim": NOPE + ROPE, "v_dim": V, "rows": rows})


if __name__ == "__main__":
    main()
