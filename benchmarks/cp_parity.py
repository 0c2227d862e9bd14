"""Context-parallel layouts == the single-process run, step by step (tiny-pangu, fp32, gloo on CPU).

Trains the synthetic counting batches (``moetrain.data.synthetic``, ``--synthetic-data``) with the loop
``moetrain train`` runs (``moetrain.train.Trainer``) for a few steps in one process and under each CP
layout (4 processes, layouts side by side on disjoint ranks), and records per layout the largest relative
difference of the step loss (and of the gradient norm) over the steps. Usage:

    python benchmarks/cp_parity.py --out benchmarks/results/cp_parity_cpu.json
"""

from __future__ import annotations

import argparse
import io
import json

import torch
from _record import write_result
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.train import SuppliedParts, Trainer

ROUNDS: list[dict[str, ParallelConfig]] = [
    {"cp2": ParallelConfig(cp=2), "cp2_ep2_overlap": ParallelConfig(cp=2, ep=2, overlap=True)},
    {"cp2_tp2": ParallelConfig(cp=2, tp=2, sp=True)},
    {"cp2_pp2": ParallelConfig(cp=2, pp=2)},
    {"cp4": ParallelConfig(cp=4)},
    {"cp2_dp2_ep4_overlap": ParallelConfig(cp=2, dp=2, ep=4, overlap=True)},
]


def _spec(cfg: TrainingConfig, parallel: ParallelConfig) -> RunSpec:
    return RunSpec(model="tiny-pangu", training=cfg.model_dump(),
                   parallel=parallel.model_dump(exclude={"sp", "micro_batch"}),
                   run={"device": "cpu", "cluster": "cpu", "synthetic_data": True, "quiet": True})


def _rows(spec: RunSpec, dims: ParallelDims | None = None) -> list[dict]:
    return Trainer(spec, SuppliedParts(dims=dims, console=Console(file=io.StringIO()))).train()


def _worker(rank: int, world_size: int, cfg: TrainingConfig) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for layouts in ROUNDS:
        offset, members = 0, []
        for name, parallel in layouts.items():
            members.append((name, parallel, ParallelDims.build(parallel, rank, rank_offset=offset)))
            offset += parallel.world_size
        for name, parallel, dims in members:
            if dims.is_member:
                rows[name] = _rows(_spec(cfg, parallel), dims)
    return rows


def _max_relative(rows: list[dict], reference: list[dict], key: str) -> float:
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(rows, reference, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/cp_parity_cpu.json")
    args = parser.parse_args()
    cfg = TrainingConfig(steps=args.steps, global_batch=8, micro_batch=2, seq_len=args.seq_len, warmup_steps=2)
    torch.set_num_threads(1)  # as each gloo rank runs
    reference = _rows(_spec(cfg, ParallelConfig()))
    layouts: dict[str, list[dict]] = {}
    for rank_rows in spawn(_worker, 4, cfg):
        for name, rows in rank_rows.items():
            layouts.setdefault(name, rows)
    result = {
        "model": "tiny-pangu", "dtype": "fp32", "backend": "gloo", "steps": cfg.steps, "seq_len": cfg.seq_len,
        "global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch,
        "reference_losses": [r["loss"] for r in reference],
        "max_relative_loss_difference": {name: _max_relative(rows, reference, "loss")
                                         for name, rows in layouts.items()},
        "max_relative_grad_norm_difference": {name: _max_relative(rows, reference, "grad_norm")
                                              for name, rows in layouts.items()},
    }
    write_result(args.out, result)
    print(json.dumps(result["max_relative_loss_difference"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
