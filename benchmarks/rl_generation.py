"""Rollout speed: the KV-cache engine against generation that recomputes the whole sequence each token.

Both generate the same ``--batch`` rows of ``--new-tokens`` tokens each (greedy, no stop token, so every
row runs to its limit) from ``--prompt-len``-token prompts on the RL policy (the preset without MTP).
The baseline is the batched no-cache loop a first implementation writes: every new token runs the
model's full forward over the sequence so far and keeps the last position's logits. The two must give
the same tokens (checked, and recorded as ``same_tokens``); the figure is generated tokens per second.

    python benchmarks/rl_generation.py --out benchmarks/results/rl_generation_cpu.json
    python benchmarks/rl_generation.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \
        --batch 64 --prompt-len 64 --lengths 128,512 --repeats 1      # → rl_generation_<gpu>.json

On CUDA the model runs in bf16 (its weights cast, as the RL loop's generation model is), and the two may
part ways where bf16 rounding changes a greedy choice (``same_tokens`` says so).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass

import torch
from _record import device_tag, write_result

from moetrain.config import load_model_config
from moetrain.models.transformer import build_model
from moetrain.rl.generate import RolloutEngine, SamplingParams
from moetrain.rl.loop import policy_config


@dataclass
class LengthResult:
    new_tokens: int
    cached_s: float
    recompute_s: float
    cached_tokens_per_s: float
    recompute_tokens_per_s: float
    speedup: float
    same_tokens: bool
    cache_mib: float


@torch.no_grad()
def recompute_generate(model, prompt_BP: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids_BS = prompt_BP
    for _ in range(new_tokens):
        logits_BV = model(ids_BS).logits[:, -1].float()
        ids_BS = torch.cat([ids_BS, logits_BV.argmax(-1, keepdim=True)], dim=1)
    return ids_BS[:, prompt_BP.shape[1]:]


def measure(model, prompt_BP: torch.Tensor, new_tokens: int, repeats: int) -> LengthResult:
    engine = RolloutEngine(model, pad_id=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    prompts = prompt_BP.tolist()
    cached = recomputed = float("inf")
    for _ in range(repeats):  # best of: the machine is shared; the minimum is the least disturbed run
        start = time.perf_counter()
        generation = engine.generate(prompts, params)
        cached = min(cached, time.perf_counter() - start)
        start = time.perf_counter()
        tokens_BN = recompute_generate(model, prompt_BP, new_tokens)
        if tokens_BN.is_cuda:
            torch.cuda.synchronize()
        recomputed = min(recomputed, time.perf_counter() - start)
    generated = prompt_BP.shape[0] * new_tokens
    return LengthResult(new_tokens, cached, recomputed, generated / cached, generated / recomputed,
                        recomputed / cached, bool(torch.equal(generation.tokens_BN.cpu(), tokens_BN.cpu())),
                        engine.cache_bytes / 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-pangu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--lengths", default="32,128,512", help="new tokens per row, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", help="JSON path (default on CUDA: benchmarks/results/rl_generation_<gpu>.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = policy_config(load_model_config(args.model))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(cfg, args.device, seed=0).to(dtype).eval()
    prompt_BP = torch.randint(4, cfg.vocab_size, (args.batch, args.prompt_len),
                              generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = []
    for new_tokens in (int(n) for n in args.lengths.split(",")):
        row = measure(model, prompt_BP, new_tokens, args.repeats)
        rows.append(row)
        print(f"{new_tokens:4d} new tokens: cache {row.cached_tokens_per_s:8.0f} tok/s, recompute "
              f"{row.recompute_tokens_per_s:8.0f} tok/s, ×{row.speedup:.1f}, same tokens {row.same_tokens}")
    out = args.out or (f"benchmarks/results/rl_generation_{device_tag()}.json" if args.device == "cuda" else None)
    if out:
        write_result(out, {"model": cfg.name, "batch": args.batch, "prompt_len": args.prompt_len,
                                "threads": args.threads, "dtype": str(dtype).removeprefix("torch."),
                                "load_average_1min": os.getloadavg()[0],
                                "results": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
