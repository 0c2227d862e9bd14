"""RL Fusion's switch, phase by phase, and its share of an RL step, on 4 (or 2) gloo ranks of a CPU.

Each variant trains GRPO steps of the GRPO trainer (the ``moetrain rl --nproc 4`` loop) in one training layout
(TP2×EP2 or PP2×EP2; with ``--ranks 2``, EP2 or TP2) and generates in 4 (2) data-parallel replicas; rows give
the switch's phases (offload, reshard, generate, free, restore: the slowest rank's wall time and peak resident
memory), the sync's bytes, the whole step's time and its other parts as the runtime logs them
(``step_phase_s``: scoring, the replay diagnostics forward, the training step proper, what follows it). The
first step (its starting evaluation) and the last (its closing one) are left out; each figure is the median of
the other steps. ``offload always`` moves AdamW state and gradients to host and back around each generation,
which a CPU never needs (``auto`` skips it): it prices the copies.

    python benchmarks/rl_switch.py --out benchmarks/results/rl_switch_cpu.json
    python benchmarks/rl_switch.py --ranks 2 --out benchmarks/results/rl_switch_cpu_2ranks.json
    python benchmarks/rl_switch.py --device cuda --model benchmarks/data/pangu-shaped-small.yaml \
        --steps 4                                                   # → rl_switch_<gpu>.json

On one GPU (``--device cuda``) the training and generation layouts are both the one device: the switch
is the offload of AdamW state and gradients to pinned host memory (``always``; ``auto`` skips it where
generation fits beside them), the weight copy into the generation model, generation with its KV cache
and the way back, timed phase by phase in one process.

On the 2-core machine 4 ranks share the cores two by two (one thread each): times are those of a busy
machine, useful as proportions (which phase dominates, the switch's share of the step), not as absolute
speeds; 2 ranks get a core each.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics

from _record import device_tag, write_result
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.rl.config import FusionOptions, GRPOConfig, RLOptions
from moetrain.rl.loop import GRPO, policy_config
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.switch import PHASES
from moetrain.rl.tasks import get_task
from moetrain.train.trainer import SuppliedParts, Trainer

LAYOUTS = {"tp2_ep2": ParallelConfig(tp=2, dp=2, ep=2), "pp2_ep2": ParallelConfig(pp=2, dp=2, ep=2),
           "ep2": ParallelConfig(dp=2, ep=2), "tp2": ParallelConfig(tp=2)}
LAYOUTS["one"] = ParallelConfig()
VARIANTS = {4: [("tp2_ep2", "auto"), ("pp2_ep2", "auto"), ("tp2_ep2", "always")],
            2: [("ep2", "auto"), ("tp2", "auto")], 1: [("one", "always"), ("one", "auto")]}
"""The variants of a world of 4 ranks (two per core on the 2-core machine), of 2 (one per core) and of one
process (one GPU)."""


def _trainer(args: argparse.Namespace, parallel: ParallelConfig, dims: ParallelDims | None, offload: str) -> Trainer:
    model_cfg = policy_config(load_model_config(args.model))
    task = get_task("addition")
    seq_len = -(-sequence_len_for(task, task.max_answer_chars + 2) // parallel.tp) * parallel.tp
    batch = args.prompts * args.group_size
    options = RLOptions(task="addition", prompts_per_step=args.prompts, grpo=GRPOConfig(group_size=args.group_size),
                        eval_every=0, eval_size=16)
    cfg = TrainingConfig(steps=args.steps, global_batch=batch, micro_batch=batch // parallel.dp, seq_len=seq_len,
                         lr=1e-3, warmup_steps=0)
    spec = RunSpec(model=args.model, training=cfg, parallel=parallel.model_dump(exclude={"sp", "micro_batch"}),
                   run={"device": args.device, "quiet": True, "compile": False})  # RL's lengths vary step to step
    fusion = FusionOptions(offload=offload, bucket_mib=args.bucket_mib)
    return Trainer(spec, SuppliedParts(dims=dims, model_cfg=model_cfg, console=Console(file=io.StringIO()),
                                       hooks=GRPO(spec, options, fusion=fusion)))


STEP_PHASES = {"switch": "switch_s", "score": "score_time_s", "replay_forward": "replay_stats_time_s",
               "train_step": "train_step_time_s", "after_step": "after_step_time_s"}
"""The step's parts as the runtime's rows log them (the slowest rank's switch; the reporting rank's others):
the switch (offload → reshard → generate and gather → free → restore), scoring the samples, the replay
diagnostics forward (on the generation model), the training step proper (forward, backward and optimizer of
every micro-batch, once the batch is ready) and what follows it (the objective's all-reduce)."""


def step_phases(rows: list[dict]) -> dict[str, float]:
    """The median of each part of the step over ``rows``, and of what is left of the step beside them
    (building the training sequences and micro-batches, logging)."""
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    phases = {name: round(median(key), 4) for name, key in STEP_PHASES.items()}
    phases["rest"] = round(statistics.median(r["step_time_s"] - sum(r[key] for key in STEP_PHASES.values())
                                             for r in rows), 4)
    return phases


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    variants = VARIANTS[world_size]
    used = dict.fromkeys(layout for layout, _ in variants)
    # one process makes its own one-rank world (the trainer's), as ``moetrain rl`` does
    dims = {name: ParallelDims.build(LAYOUTS[name], rank) if world_size > 1 else None for name in used}
    results = []
    for layout, offload in variants:
        rows = _trainer(args, LAYOUTS[layout], dims[layout], offload).train()
        measured = [r for r in rows if 1 < r.get("step", 0) < args.steps]

        def mean(key: str, measured: list[dict] = measured) -> float:
            # the median step: 4 ranks on a shared 2-core machine have outliers
            return statistics.median(r[key] for r in measured)

        switch, step = mean("switch_s"), mean("step_time_s")
        results.append({
            "train_layout": layout, "generation": f"{world_size} data-parallel replica(s)", "offload": offload,
            "steps_measured": [r["step"] for r in measured],
            "phase_s": {p: round(mean(f"switch_{p}_s"), 4) for p in PHASES},
            "phase_peak_rss_mib": {p: round(mean(f"switch_{p}_peak_mib"), 1) for p in PHASES},
            "switch_s": round(switch, 4), "step_s": round(step, 4), "switch_share_of_step": round(switch / step, 3),
            "switch_without_generate_share": round((switch - mean("switch_generate_s")) / step, 3),
            "sync_mib_sent": round(mean("sync_mib"), 2), "sync_buckets": measured[0]["sync_buckets"],
            "sync_checksums_verified": measured[0]["sync_checksums_verified"],
            "train_step_s": round(step - switch, 4),
            "trained_tokens_per_step": mean("tokens"),
            "step_phase_s": step_phases(measured),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-pangu")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per variant (first and last not counted)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--bucket-mib", type=float, default=4.0)
    parser.add_argument("--ranks", type=int, choices=sorted(VARIANTS), default=None,
                        help="4: TP2×EP2 and PP2×EP2, two ranks per core; 2: EP2 and TP2, one rank per core; "
                             "1: one process (default 4 on CPU, 1 on CUDA)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rl_switch_cpu.json, "
                                                    "on CUDA rl_switch_<gpu>.json)")
    args = parser.parse_args()
    args.ranks = args.ranks or (1 if args.device == "cuda" else 4)
    if args.device == "cuda" and args.ranks != 1:
        raise SystemExit("--device cuda runs one process (--ranks 1): this benchmark spawns gloo ranks on CPUs only")
    variants = _bench(0, 1, args) if args.ranks == 1 else spawn(_bench, args.ranks, args)[0]
    for v in variants:
        phases = ", ".join(f"{p} {s * 1e3:.0f} ms" for p, s in v["phase_s"].items())
        print(f"{v['train_layout']} offload {v['offload']}: switch {v['switch_s']:.2f} s of a {v['step_s']:.2f} s "
              f"step ({v['switch_share_of_step']:.0%}; without generation {v['switch_without_generate_share']:.0%}): "
              f"{phases}; sync {v['sync_mib_sent']:.1f} MiB in {v['sync_buckets']} buckets; step: "
              + ", ".join(f"{p} {s * 1e3:.0f} ms" for p, s in v["step_phase_s"].items()))
    out = args.out or ("benchmarks/results/rl_switch_cpu.json" if args.device == "cpu"
                       else f"benchmarks/results/rl_switch_{device_tag()}.json")
    write_result(out, {
        "config": {"model": args.model, "ranks": args.ranks, "device": args.device, "compiled": False,
                   "threads_per_rank": 1,
                   "cpu_cores": os.cpu_count(),
                   "steps": args.steps, "prompts": args.prompts, "group_size": args.group_size,
                   "bucket_mib": args.bucket_mib, "task": "addition",
                   "load_average_1min_after": round(os.getloadavg()[0], 2)},
        "variants": variants,
    })


if __name__ == "__main__":
    main()
