"""Record a routing trace from a real (tiny, CPU) training run, in the ``--trace-routing`` format.

    python benchmarks/balance_record_trace.py --steps 80 --out benchmarks/results/balance_trace_tiny_pangu.jsonl

Trains a model preset in one process with the training loop's own ``--trace-routing`` writer: per step
and MoE layer (the MTP module's as ``num_layers + j``), the tokens each expert received, summed over the
step's micro-batches. The balance-loss coefficients can be zeroed (``--no-balance-loss``) to see the skew
a router develops without them, which the ``moetrain train`` flags cannot do. The file's first line
records the command, commit and machine (``read_trace`` skips it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _record import provenance_line

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

    from moetrain.balance.traces import read_trace
    from moetrain.config.run import RunSpec
    from moetrain.train.trainer import SuppliedParts, Trainer

    model = load_model_config(args.model)
    if args.no_balance_loss and model.moe is not None:
        router = model.moe.router.model_copy(update={"expert_balance_coef": 0.0, "device_balance_coef": 0.0})
        model = model.model_copy(update={"moe": model.moe.model_copy(update={"router": router})})
    torch.set_num_threads(2)
    training = TrainingConfig(steps=args.steps, seed=args.seed, global_batch=args.global_batch,
                              micro_batch=args.micro_batch)
    # the loop's own routing trace: global tokens per expert, per step and MoE layer (MTP as num_layers + j)
    spec = RunSpec(model=args.model, training=training,
                   run={"device": "cpu", "quiet": True, "trace_routing": str(Path(args.out).resolve())})
    Trainer(spec, SuppliedParts(model_cfg=model)).train()
    out = Path(args.out)
    out.write_text(provenance_line() + out.read_text())
    loads = read_trace(args.out).tokens_per_expert  # [T, L, E]
    imbalance = loads.max(axis=-1) / loads.mean(axis=-1)
    print(f"wrote {args.out}: {loads.shape[0]} steps × {loads.shape[1]} MoE layers × {loads.shape[2]} experts; "
          f"max/mean expert load {imbalance.mean():.2f} (mean over steps and layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
