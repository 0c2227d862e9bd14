"""Context-parallel layouts == the single-process reference, step by step (tiny-pangu, fp32, gloo on CPU).

Trains the synthetic counting batches of ``moetrain.distributed.step`` for a few steps in one process and
under each CP layout (4 processes, layouts side by side on disjoint ranks), and records per layout the
largest relative difference of the step loss over the steps. Usage:

    python benchmarks/cp_parity.py --out benchmarks/results/cp_parity_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import build_layout, reference_losses, train_step
from moetrain.distributed.world import spawn

ROUNDS: list[dict[str, ParallelConfig]] = [
    {"cp2": ParallelConfig(cp=2), "cp2_ep2_overlap": ParallelConfig(cp=2, ep=2, overlap=True)},
    {"cp2_tp2": ParallelConfig(cp=2, tp=2, sp=True)},
    {"cp2_pp2": ParallelConfig(cp=2, pp=2)},
    {"cp4": ParallelConfig(cp=4)},
    {"cp2_dp2_ep4_overlap": ParallelConfig(cp=2, dp=2, ep=4, overlap=True)},
]


def _worker(rank: int, world_size: int, cfg: TrainingConfig) -> dict[str, list[float]]:
    model_cfg = load_model_config("tiny-pangu")
    cpu = torch.device("cpu")
    losses: dict[str, list[float]] = {}
    for layouts in ROUNDS:
        offset, members = 0, []
        for name, parallel in layouts.items():
            members.append((name, ParallelDims.build(parallel, rank, rank_offset=offset)))
            offset += parallel.world_size
        for name, dims in members:
            if dims.is_member:
                run = build_layout(dims, model_cfg, cfg, cpu)
                losses[name] = [train_step(run, step, cfg, cpu) for step in range(cfg.steps)]
    return losses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/cp_parity_cpu.json")
    args = parser.parse_args()
    cfg = TrainingConfig(steps=args.steps, global_batch=8, micro_batch=2, seq_len=args.seq_len, warmup_steps=2)
    torch.set_num_threads(1)
    reference = reference_losses(load_model_config("tiny-pangu"), cfg, cfg.steps)
    layouts: dict[str, list[float]] = {}
    for rank_losses in spawn(_worker, 4, cfg):
        for name, losses in rank_losses.items():
            layouts.setdefault(name, losses)
    result = {
        "model": "tiny-pangu", "dtype": "fp32", "backend": "gloo", "steps": cfg.steps, "seq_len": cfg.seq_len,
        "global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch, "reference_losses": reference,
        "max_relative_loss_difference": {
            name: max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) for name, losses in layouts.items()
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["max_relative_loss_difference"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
