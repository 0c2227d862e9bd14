"""Online expert balancing in the EP runtime: per-rank load and expert compute time, with and without.

tiny-pangu on ``--nproc`` gloo ranks (EP over all of them, one spare expert slot per rank), the router
skewed at init (a score bias sends most tokens to experts 0-3, all on EP rank 0 in the contiguous
layout; the bias does not move), trained by ``moetrain train --online-balance --synthetic-data``'s
trainer (``Trainer`` with ``balance.enabled``, its step and its balancer's ``after_step``, each timed).
Runs from the same weights and batches:

* ``static``: the balancer only observes (trigger margin ∞);
* ``balanced``: after every step the balancer runs the re-plan rule of ``moetrain.balance.schedule``
  (a cheap cost-model check; an incremental solve when the drift since the last plan could pay a
  move; a full re-plan every ``--interval`` steps, the first after step 0) and migrates when the
  predicted saving over ``--horizon`` steps beats the cost model's migration time (margin 1). Moved
  experts' weights travel during the next step until their layer's experts run, their optimizer state
  until the next optimizer update;
* ``stop_the_world``: the same, with everything landing before the next step begins;
* ``every_rank_solves``: ``balanced`` with every rank running every due solve itself, as before the solves
  were split over the EP ranks (``BalancerTuning.split_searches``): the same decisions, and the host time
  after each step (check, solves, posting the moves), slowest rank, beside ``balanced``'s.

For each migration it reports the host time of posting the copies, of the waits for the weights to
land and of the wait for the state to land: deferred, the waits are what the next step's compute did
not hide.

Per step it reports the max/mean EP-rank load (token-expert rows the ranks' experts computed,
measured from tensor shapes, summed over MoE layers) and the max/mean of the per-rank expert forward
time (host clock around the grouped expert GEMMs, summed over layers), beside the forward time the
balancer's cost model (the same solver and cost model as ``moetrain balance``, on the run's ``cpu``
cluster preset) predicts for the measured loads; the busiest rank's speed-up from balancing (the median
over the steps after the first migration of the busiest rank's time, measured against predicted; the
mean is kept beside it); and checks that both runs' losses agree. Each gloo rank runs one torch thread
(``distributed.world.spawn``).

    python benchmarks/balance_online.py --out benchmarks/results/balance_online_cpu.json
"""

from __future__ import annotations

import argparse
import io
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from _record import write_result
from rich.console import Console

from moetrain.balance.placement import EMPTY_SLOT
from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.run import RunSpec
from moetrain.distributed.balancing import BalancedRunSetup, BalancerTuning, build_balanced_run, moe_layers
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import train_step
from moetrain.distributed.world import spawn
from moetrain.models.transformer import build_model
from moetrain.train import SuppliedParts, Trainer

HOT_BIAS = {0: 0.5, 1: 0.4, 2: 0.3, 3: 0.2}


def _model_config() -> ModelConfig:
    cfg = load_model_config("tiny-pangu")
    router = cfg.moe.router.model_copy(update={"score_bias": True, "bias_update_rate": 0.0})
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"router": router})})


class _BenchTrainer(Trainer):
    """``moetrain train --online-balance``'s trainer with the benchmark's balancer options: the trigger
    margin (∞: observe only), the experts' host timing and whether moves land at once."""

    def __init__(self, *args, trigger_margin: float, defer: bool, split: bool, **kwargs) -> None:
        self.trigger_margin, self.defer, self.split = trigger_margin, defer, split
        super().__init__(*args, **kwargs)

    def build_run(self, model):
        balance = self.spec.balance
        tuning = BalancerTuning(interval=balance.interval, horizon=balance.horizon, trigger_margin=self.trigger_margin,
                                time_experts=True, defer_weights=self.defer, defer_optimizer_state=self.defer,
                                split_searches=self.split)
        run, self.balancer = build_balanced_run(self.dims, self.model_cfg, self.cfg, self.device, self.cluster,
                                                BalancedRunSetup(model=model, tuning=tuning))
        return run


def _run(dims: ParallelDims, args: argparse.Namespace, balance: bool, defer: bool = True, split: bool = True) -> dict:
    model_cfg = _model_config()
    training = TrainingConfig(steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch,
                              seq_len=args.seq_len, warmup_steps=2)
    model = build_model(model_cfg, "cpu", seed=training.seed)
    for _, block in moe_layers(model):
        for expert, bias in HOT_BIAS.items():
            block.router.score_bias[expert] = bias
    ep = args.nproc
    # the run of ``moetrain train --online-balance --synthetic-data``: experts/ep + 1 slots per rank
    spec = RunSpec(model="tiny-pangu", training=training.model_dump(), parallel={"dp": ep, "ep": ep},
                   run={"device": "cpu", "cluster": "cpu", "synthetic_data": True, "quiet": True,
                        "ranks_per_node": ep},
                   balance={"enabled": True, "interval": args.interval, "horizon": args.horizon})
    supplied = SuppliedParts(dims=dims, model_cfg=model_cfg, model=model, console=Console(file=io.StringIO()))
    trainer = _BenchTrainer(spec, supplied, trigger_margin=1.0 if balance else float("inf"), defer=defer, split=split)
    balancer = trainer.balancer
    trainer.run.stage.model.train()
    losses, step_seconds, balance_seconds, ran_with = [], [], [], []
    for _ in range(args.steps):
        ran_with.append(list(balancer.placements))  # the placements this step runs with
        batch = trainer.next_batch()
        start = time.perf_counter()
        with trainer.tracer.active():
            losses.append(train_step(trainer.run, trainer.step, batch).loss)
        trainer.step += 1
        middle = time.perf_counter()
        trainer.after_step()  # the balancer's check, solve and (deferred) migration after the step
        step_seconds.append(middle - start)
        balance_seconds.append(time.perf_counter() - middle)
    balancer.finish_migration()
    local = torch.tensor([[sum(h.local_rows), sum(h.local_expert_seconds)] for h in balancer.history],
                         dtype=torch.float64)
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local, group=dims.get_group("ep"))
    per_rank = torch.stack(parts, dim=1).numpy()  # [step, rank, (rows, seconds)]
    return {
        "losses": losses,
        "rows": per_rank[..., 0],
        "expert_seconds": per_rank[..., 1],
        "predicted_imbalance": [float(h.imbalance().mean()) for h in balancer.history],
        "predicted_expert_seconds": [_predicted_expert_seconds(balancer, h, placements)
                                     for h, placements in zip(balancer.history, ran_with)],
        "step_seconds": step_seconds,
        "balance_seconds": balance_seconds,
        "decisions": [d.as_dict() for d in balancer.decisions],
        "migrations": balancer.migrations,
        "migration_timings": balancer.migration_timings,
    }


def _predicted_expert_seconds(balancer, loads, placements) -> list[float]:
    """[R] the cost model's expert forward time per EP rank for the step's measured loads under the
    placements it ran with, summed over MoE layers: what ``BalanceCostModel.layer_seconds`` charges the
    expert GEMMs (forward + backward) over 3, so that it compares with the host clock around the forward."""
    per_rank = np.zeros(loads.tokens_per_rank.shape[-1])
    for copies, placement in zip(loads.tokens_per_rank / balancer.ep_groups_per_stage, placements):
        experts_per_rank = (placement.slot_expert != EMPTY_SLOT).reshape(placement.num_ranks, -1).sum(axis=1)
        per_rank += balancer.costs.expert_seconds(copies, experts_per_rank) / 3.0
    return per_rank.tolist()


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    dims = ParallelDims.build(ParallelConfig(dp=world_size, ep=world_size), rank, world_size)
    return {"static": _run(dims, args, balance=False), "balanced": _run(dims, args, balance=True),
            "stop_the_world": _run(dims, args, balance=True, defer=False),
            "every_rank_solves": _run(dims, args, balance=True, split=False)}


def _untimed(decisions: list[dict]) -> list[dict]:
    return [{k: v for k, v in d.items() if k not in ("solve_ms", "solve_cpu_ms")} for d in decisions]


def _mean_timing(run: dict, part: str) -> float:
    """Mean over the run's migrations of one part of ``migration_timings`` (0 without migrations)."""
    return float(np.mean([t[part] for t in run["migration_timings"]] or [0.0]))


def _ratio(values: np.ndarray) -> np.ndarray:
    return values.max(axis=-1) / values.mean(axis=-1)


def _summarise(run: dict, first_migration: int | None) -> dict:
    rows, seconds = np.asarray(run["rows"]), np.asarray(run["expert_seconds"])
    predicted = np.asarray(run["predicted_expert_seconds"])
    # steps after the first migration (decided after step s, in effect from step s+1)
    after = slice(first_migration + 1 if first_migration is not None else 0, None)
    return {
        "losses": run["losses"],
        "migrations": run["migrations"],
        "per_step": [
            {"step": step, "rows_max_over_mean": round(float(_ratio(rows[step])), 4),
             "expert_seconds_max_over_mean": round(float(_ratio(seconds[step])), 4),
             "expert_seconds_per_rank": [round(float(s), 5) for s in seconds[step]],
             "predicted_expert_seconds_per_rank": [round(float(s), 6) for s in predicted[step]],
             "rows_per_rank": [int(r) for r in rows[step]],
             "predicted_imbalance": round(run["predicted_imbalance"][step], 4),
             "step_seconds": round(run["step_seconds"][step], 4),
             "balance_seconds": round(run["balance_seconds"][step], 4)}
            for step in range(rows.shape[0])
        ],
        "rows_max_over_mean_after": float(_ratio(rows[after]).mean()),
        "expert_seconds_max_over_mean_after": float(_ratio(seconds[after]).mean()),
        # the median over steps: on a shared host one preempted step can outweigh the others' mean
        "busiest_rank_expert_seconds_after": float(np.median(seconds[after].max(axis=-1))),
        "busiest_rank_expert_seconds_after_mean": float(seconds[after].max(axis=-1).mean()),
        # the same, predicted by the balancer's cost model (the run's cluster preset) for the measured loads
        "predicted_busiest_rank_expert_seconds_after": float(np.median(predicted[after].max(axis=-1))),
        "step_seconds_after": float(np.mean(run["step_seconds"][after])),
        "decisions": run["decisions"],
        "migration_timings": run["migration_timings"],
        "migration_moved_seconds_mean": _mean_timing(run, "moved"),
        "migration_landed_wait_seconds_mean": _mean_timing(run, "landed"),
        "migration_weights_landed_wait_seconds_mean": _mean_timing(run, "weights_landed"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    per_rank = spawn(_bench, args.nproc, args)
    results = per_rank[0]
    static, balanced = results["static"], results["balanced"]
    first = next((d["step"] for d in balanced["decisions"] if d["migrate"]), None)
    relative = max(abs(a - b) / abs(b) for run in ("balanced", "stop_the_world")
                   for a, b in zip(results[run]["losses"], static["losses"]))
    summary = {
        "model": "tiny-pangu (router score bias on experts 0-3)",
        "nproc": args.nproc, "ep": args.nproc, "steps": args.steps, "interval": args.interval,
        "horizon": args.horizon, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
        "seq_len": args.seq_len, "cpu_count": os.cpu_count(),
        "first_migration_after_step": first,
        "max_relative_loss_difference": relative,
        "static": _summarise(static, first),
        "balanced": _summarise(balanced, first),
        "stop_the_world": _summarise(results["stop_the_world"], first),
        # the slowest rank's host time per migration, mean over migrations (every rank waits for it)
        "migration_seconds_slowest_rank": {
            run: {part: float(np.mean([max(r[run]["migration_timings"][i][part] for r in per_rank)
                                       for i in range(len(results[run]["migration_timings"]))] or [0.0]))
                  for part in ("moved", "weights_landed", "landed")}
            for run in ("balanced", "stop_the_world")},
        # the host time after each step (check, solves, posting the moves), slowest rank, mean over the steps
        # with a solve, split over the ranks or not; and whether the two took the same decisions
        "balance_seconds_slowest_rank": {
            run: float(np.mean([max(r[run]["balance_seconds"][step] for r in per_rank)
                                for step in sorted({d["step"] for d in results[run]["decisions"]})] or [0.0]))
            for run in ("balanced", "every_rank_solves")},
        "every_rank_solves_same_decisions": _untimed(balanced["decisions"])
        == _untimed(results["every_rank_solves"]["decisions"]),
    }
    for name in ("static", "balanced", "stop_the_world"):
        s = summary[name]
        print(f"{name:9s} after step {first}: rows max/mean {s['rows_max_over_mean_after']:.3f}, expert time "
              f"max/mean {s['expert_seconds_max_over_mean_after']:.3f}, busiest rank expert fwd "
              f"{s['busiest_rank_expert_seconds_after'] * 1e3:.2f} ms (median over steps; mean "
              f"{s['busiest_rank_expert_seconds_after_mean'] * 1e3:.2f} ms), step {s['step_seconds_after']:.3f} s")
    measured = {n: summary[n]["busiest_rank_expert_seconds_after"] for n in ("static", "balanced")}
    predicted = {n: summary[n]["predicted_busiest_rank_expert_seconds_after"] for n in ("static", "balanced")}
    summary["busiest_rank_speedup"] = {"measured": measured["static"] / measured["balanced"],
                                       "predicted": predicted["static"] / predicted["balanced"]}
    print(f"busiest rank's expert forward, static → balanced: measured {measured['static'] * 1e3:.2f} → "
          f"{measured['balanced'] * 1e3:.2f} ms (×{summary['busiest_rank_speedup']['measured']:.2f}), predicted "
          f"{predicted['static'] * 1e3:.2f} → {predicted['balanced'] * 1e3:.2f} ms "
          f"(×{summary['busiest_rank_speedup']['predicted']:.2f})")
    for run, parts in summary["migration_seconds_slowest_rank"].items():
        print(f"{run:14s} per migration (slowest rank): posted {parts['moved'] * 1e3:.2f} ms, weights landing "
              f"wait {parts['weights_landed'] * 1e3:.2f} ms, state landing wait {parts['landed'] * 1e3:.2f} ms")
    after = summary["balance_seconds_slowest_rank"]
    print(f"after a step with solves (slowest rank, mean): split over the ranks {after['balanced'] * 1e3:.1f} ms, "
          f"every rank solving all {after['every_rank_solves'] * 1e3:.1f} ms; same decisions: "
          f"{summary['every_rank_solves_same_decisions']}")
    print(f"max relative loss difference: {relative:.2e}")
    if args.out:
        write_result(args.out, summary)


if __name__ == "__main__":
    main()
