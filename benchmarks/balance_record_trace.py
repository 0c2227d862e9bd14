"""Record a routing trace from a real (tiny, CPU) training run, in the ``--trace-routing`` format.

    python benchmarks/balance_record_trace.py --steps 80 --out benchmarks/results/balance_trace_tiny_pangu.jsonl

Trains a model preset with the single-process trainer and writes, per step and MoE layer, the tokens
each expert received (summed over the step's micro-batches). The balance-loss coefficients can be
zeroed (``--no-balance-loss``) to see the skew a router develops without them. Until ``moetrain train
--trace-routing`` lands this is how the benchmarks get a trace from our own runs; it reads the counts
that the trainer already hands to ``optimizer_step`` (one device read per step, fine for a recording).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from moetrain.balance.traces import RoutingTrace, write_trace
from moetrain.config import TrainingConfig, load_model_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-pangu")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    parser.add_argument("--no-balance-loss", action="store_true", help="zero the router's balance losses")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from moetrain.train.trainer import RunOptions, Trainer

    model = load_model_config(args.model)
    if args.no_balance_loss and model.moe is not None:
        router = model.moe.router.model_copy(update={"expert_balance_coef": 0.0, "device_balance_coef": 0.0})
        model = model.model_copy(update={"moe": model.moe.model_copy(update={"router": router})})
    rows: list[np.ndarray] = []

    class RecordingTrainer(Trainer):
        def optimizer_step(self, tokens_per_expert: torch.Tensor | None) -> torch.Tensor:
            if tokens_per_expert is not None:
                rows.append(tokens_per_expert.detach().cpu().numpy().reshape(-1, tokens_per_expert.shape[-1]))
            return super().optimizer_step(tokens_per_expert)

    torch.set_num_threads(2)
    trainer = RecordingTrainer(model, TrainingConfig(steps=args.steps, seed=args.seed, global_batch=args.global_batch,
                                                         micro_batch=args.micro_batch),
                               RunOptions(device="cpu", show_progress=False))
    trainer.train()
    loads = np.stack(rows).astype(np.int64)  # [T, L, E]
    moe_layers = np.array([i for i in range(model.num_layers) if model.is_moe_layer(i)], dtype=np.int64)
    if moe_layers.size != loads.shape[1]:
        moe_layers = np.arange(loads.shape[1])
    trace = RoutingTrace(np.arange(1, loads.shape[0] + 1), moe_layers, loads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, args.out)
    imbalance = loads.max(axis=-1) / loads.mean(axis=-1)
    print(f"wrote {args.out}: {loads.shape[0]} steps × {loads.shape[1]} MoE layers × {loads.shape[2]} experts; "
          f"max/mean expert load {imbalance.mean():.2f} (mean over steps and layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
