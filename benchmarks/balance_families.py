"""Expert balancing on families of routing traces the balancer was not written beside: per family the
imbalance before/after, the predicted gain against the ideal, the gap to it, migration bytes, solve times
and the spare-slot choice.

    python benchmarks/balance_families.py                    # every family, seeds from --seed

Writes benchmarks/results/balance_families.json. Families (``moetrain.balance.families``): Zipf of three
exponents, many hot experts (5 % and 20 % at 3-10×), single experts above a rank's mean load, sudden
shifts, a slow drift, a random walk, a periodic pattern, issue #28's trace, and the two recorded tiny-pangu traces.
Synthetic shapes: 64-256 experts, EP8-EP64, top-8, ``--tokens-per-rank`` tokens per rank and step, cost
model of Pangu Ultra MoE 718B (its expert count set to the family's) on ``atlas-800t-a2``. Headline
figures: experts/ep + 1 slots per rank (the default), every layer; the spare-slot sweep replays the first
layer with experts/ep + 0, 1 and 2 slots per rank and recommends the fewest within 0.5 % of the best.
``without_stall_remedies`` replays the same trace with the re-plan rule as it was before issue #28 (no
shift check, no global fallback, no node-local bridging), for comparison.

Definitions (``moetrain.balance.replay``): gain = Σ time static / Σ time balanced − 1 (migration
included); ideal gain the same with every rank at the mean load and no replicas; gap = Σ time balanced /
Σ time ideal − 1; steady gap the same from step 1 on (step 0 runs the static layout in any run).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from _record import write_result

from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.families import TraceShape, family_trace
from moetrain.balance.online import BALANCE_DEFAULTS
from moetrain.balance.predict import parse_predictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import ReplanRule
from moetrain.balance.slots import choose_spare_slots
from moetrain.balance.traces import RoutingTrace, read_trace
from moetrain.config import load_cluster_config, load_model_config

RESULTS = Path(__file__).parent / "results" / "balance_families.json"
RECORDED = Path(__file__).parent / "results"
GAP_BOUND, GAP_GOAL = 0.05, 0.02
STEPS, LAYERS, TOKENS_PER_RANK, SEED = 120, 2, 16384, 2800
"""The benchmark's shape (its flags' defaults) and first seed; ``balance_defaults.py`` sweeps at the same."""
MODEL, CLUSTER = "pangu-ultra-moe-718b", "atlas-800t-a2"
RECORDED_MODEL, RECORDED_EP = "tiny-pangu", 4


@dataclass(frozen=True)
class FamilyCase:
    name: str
    family: str
    num_experts: int
    ep: int
    params: dict = field(default_factory=dict)
    tokens_per_rank: int | None = None
    """Tokens per EP rank and step; None: ``--tokens-per-rank``."""


CASES = (
    FamilyCase("zipf-s0.8 (E256, EP64)", "zipf", 256, 64, {"exponent": 0.8}),
    FamilyCase("zipf-s1.2 (E128, EP16)", "zipf", 128, 16, {"exponent": 1.2}),
    FamilyCase("zipf-s1.6 (E64, EP8)", "zipf", 64, 8, {"exponent": 1.6}),
    FamilyCase("many-hot 5% (E256, EP8)", "many_hot", 256, 8, {"hot_fraction": 0.05, "period": 40}),
    FamilyCase("many-hot 20% (E256, EP32)", "many_hot", 256, 32, {"hot_fraction": 0.2, "period": 40}),
    FamilyCase("giant experts (E256, EP64)", "giant", 256, 64, {"num_giants": 3, "period": 50}),
    FamilyCase("giant experts (E128, EP16)", "giant", 128, 16, {"num_giants": 2, "period": 50}),
    FamilyCase("sudden shift (E128, EP8)", "sudden_shift", 128, 8, {"period": 30}),
    FamilyCase("slow drift (E256, EP16)", "slow_drift", 256, 16),
    FamilyCase("random walk (E256, EP16)", "random_walk", 256, 16),
    FamilyCase("periodic (E64, EP8)", "periodic", 64, 8, {"period": 40}),
    FamilyCase("issue #28 (E256, EP8)", "issue_28", 256, 8, {"period": 30}),
    # issue #43: a giant on one node (a single expert at 1.4-1.7× a rank's mean, handed over every 40 steps), and a
    # few very hot experts swapped all at once, each at 4,096 and 16,384 tokens per rank
    *(FamilyCase(f"giant on one node (E{e}, EP{ep}), {tokens // 1024}k tokens", "giant", e, ep,
                 {"num_giants": 1, "period": 40, "low": 1.4, "high": 1.7}, tokens)
      for e, ep in ((64, 4), (256, 8)) for tokens in (4096, 16384)),
    *(FamilyCase(f"few very hot, swaps (E256, EP8), {tokens // 1024}k tokens", "few_hot", 256, 8,
                 {"num_hot": 3, "period": 30}, tokens) for tokens in (4096, 16384)),
)
RECORDED_TRACES = ("balance_trace_tiny_pangu.jsonl", "balance_trace_tiny_pangu_no_balance_loss.jsonl")


def cost_model(model_name: str, cluster_name: str, num_experts: int, ep: int) -> BalanceCostModel:
    model = load_model_config(model_name)
    assert model.moe is not None
    if model.moe.num_experts != num_experts:
        model = model.model_copy(update={"moe": model.moe.model_copy(update={"num_experts": num_experts})})
    return BalanceCostModel(model, load_cluster_config(cluster_name), ep)


def evaluate(trace: RoutingTrace, costs: BalanceCostModel, interval: int, horizon: int, spare: tuple[int, ...],
             predictor_name: str, compare: bool = True) -> dict:
    """Replay with the defaults (the headline), the spare-slot sweep and (``compare``) the rule before #28."""
    predictor = parse_predictor(predictor_name)
    start = time.perf_counter()
    result = replay(trace, ReplanRule(costs, interval, horizon), predictor)
    replay_seconds = time.perf_counter() - start
    summary = result.summary()
    # the same rule without the shift check, the global fallback and node-local bridging (before issue #28)
    before = replay(trace, ReplanRule(costs, interval, horizon, stall_remedies=False), predictor).summary() \
        if compare else None
    # the sweep replays the first layer only (a third of the benchmark's time otherwise)
    first_layer = RoutingTrace(trace.steps, trace.layers[:1], trace.tokens_per_expert[:, :1], trace.name)
    choice = choose_spare_slots(first_layer, ReplanRule(costs, interval, horizon), predictor, spare)
    return {
        "experts": trace.num_experts, "ep": costs.ep, "steps": trace.num_steps, "layers": trace.num_layers,
        "predictor": predictor.name, **summary, "replay_seconds": replay_seconds,
        "steady_gap_parts": result.steady_gap_parts(),
        "without_stall_remedies": None if before is None else {key: before[key] for key in (
            "imbalance_after", "predicted_gain", "gap_to_ideal", "steady_gap_to_ideal", "migrations",
            "migration_bytes", "solve_ms_mean", "solve_ms_max")},
        "meets_bound": summary["steady_gap_to_ideal"] <= GAP_BOUND,
        "meets_goal": summary["steady_gap_to_ideal"] <= GAP_GOAL,
        "spare_slots": {
            "options": [vars(o) for o in choice.options],
            "recommended_spare_per_rank": choice.recommended.spare_per_rank,
            "tolerance": choice.tolerance,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK, help="tokens per EP rank and step")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--cluster", default=CLUSTER)
    parser.add_argument("--interval", type=int, default=BALANCE_DEFAULTS.interval)
    parser.add_argument("--horizon", type=int, default=BALANCE_DEFAULTS.horizon)
    parser.add_argument("--predictor", default=BALANCE_DEFAULTS.predictor)
    parser.add_argument("--spare", default="0,1,2", help="spare slots per rank to compare (the headline uses "
                                                         f"{BALANCE_DEFAULTS.spare_slots_per_rank}, the default)")
    parser.add_argument("--seed", type=int, default=SEED, help="family i uses seed + i (tests use others)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--cases", default="", help="run only these cases: indices into CASES (the seed offsets) "
                                                    "and 'recorded', comma-separated (to split a run over processes)")
    parser.add_argument("--no-comparison", action="store_true",
                        help="skip the replay with the rule before issue #28 (a third of the time)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    spare = tuple(int(x) for x in args.spare.split(","))

    report: dict = {
        "setup": {"model": args.model, "cluster": args.cluster, "steps": args.steps, "layers": args.layers,
                  "tokens_per_rank": args.tokens_per_rank, "interval": args.interval, "horizon": args.horizon,
                  "predictor": args.predictor, "defaults": asdict(BALANCE_DEFAULTS),
                  "seed": args.seed, "gap_bound": GAP_BOUND, "gap_goal": GAP_GOAL, "spare_options": list(spare),
                  # solve times are host times: the machine's load (1-minute average) says how shared it was
                  "load_average_start": os.getloadavg()[0], "cpu_count": os.cpu_count()},
        "families": {},
    }
    chosen = set(args.cases.split(",")) if args.cases else None
    for index, case in enumerate(CASES):
        if args.only not in case.name or (chosen is not None and str(index) not in chosen):
            continue
        tokens = case.tokens_per_rank or args.tokens_per_rank
        shape = TraceShape(args.steps, args.layers, case.num_experts, case.ep, tokens * case.ep)
        trace = family_trace(case.family, shape, seed=args.seed + index, **case.params)
        costs = cost_model(args.model, args.cluster, case.num_experts, case.ep)
        row = evaluate(trace, costs, args.interval, args.horizon, spare, args.predictor, not args.no_comparison)
        report["families"][case.name] = {"family": case.family, "params": case.params, "seed": args.seed + index,
                                         "tokens_per_rank": tokens, **row}
        print(f"{case.name}: gap {row['gap_to_ideal']:.2%}, steady {row['steady_gap_to_ideal']:.2%}, "
              f"{row['replay_seconds']:.1f} s", flush=True)
    for name in RECORDED_TRACES:
        if args.only not in name or (chosen is not None and "recorded" not in chosen):
            continue
        trace = read_trace(RECORDED / name)
        costs = cost_model(RECORDED_MODEL, args.cluster, trace.num_experts, RECORDED_EP)
        row = evaluate(trace, costs, args.interval, args.horizon, spare, args.predictor, not args.no_comparison)
        report["families"][f"recorded: {name} (E16, EP4)"] = {"family": "recorded", **row}

    print(f"\n{'family':34s} {'imb before':>10s} {'after':>6s} {'gain':>7s} {'ideal':>7s} {'gap':>6s} "
          f"{'steady':>6s} {'before':>6s} {'migr GB':>8s} {'solve ms':>13s} {'cpu ms':>11s} "
          f"{'fb':>3s} {'sh':>3s} spare")
    for name, row in report["families"].items():
        print(f"{name:34s} {row['imbalance_before']:10.3f} {row['imbalance_after']:6.3f} {row['predicted_gain']:7.1%} "
              f"{row['ideal_gain']:7.1%} {row['gap_to_ideal']:6.2%} {row['steady_gap_to_ideal']:6.2%} "
              f"{(row['without_stall_remedies'] or {}).get('steady_gap_to_ideal', float('nan')):6.2%} "
              f"{row['migration_bytes'] / 1e9:8.1f} {row['solve_ms_mean']:6.0f}/{row['solve_ms_max']:6.0f} "
              f"{row['solve_cpu_ms_mean']:5.0f}/{row['solve_cpu_ms_max']:5.0f} "
              f"{row['fallbacks']:3d} {row['shifts']:3d} {row['spare_slots']['recommended_spare_per_rank']}")
    misses = [name for name, row in report["families"].items() if not row["meets_bound"]]
    print(f"\nsteady gap above {GAP_BOUND:.0%}: {', '.join(misses) or 'none'}")
    report["solve_ms_max_overall"] = float(np.max([row["solve_ms_max"] for row in report["families"].values()]))
    report["solve_cpu_ms_max_overall"] = float(np.max([row["solve_cpu_ms_max"]
                                                       for row in report["families"].values()]))
    report["setup"]["load_average_end"] = os.getloadavg()[0]
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
