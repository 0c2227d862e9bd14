"""Expert balancing on routing traces: imbalance and predicted step time before/after, per step;
predictor errors; placement solvers' quality and solve time.

    python benchmarks/balance_traces.py                       # synthetic traces, Pangu 718B on Atlas
    python benchmarks/balance_traces.py --trace run.jsonl --trace-model tiny-pangu --trace-ep 4

Writes benchmarks/results/balance_traces.json. Synthetic traces: 256 experts, top-8, EP32 with 9 slots
per rank (one spare), ``--tokens-per-rank`` tokens per rank and step; each layer independent.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _record import write_result

from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.online import BALANCE_DEFAULTS
from moetrain.balance.placement import ExpertPlacement
from moetrain.balance.predict import DEFAULT_CANDIDATES, Predictor, forecast_error, select_predictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import LayerSchedule, ReplanRule
from moetrain.balance.solver import PlanRequest, plan_placement, replica_counts, solve_fixed_replicas, solve_milp
from moetrain.balance.traces import RoutingTrace, TraceShape, drifting_trace, read_trace, zipf_trace
from moetrain.config import load_cluster_config, load_model_config

RESULTS = Path(__file__).parent / "results" / "balance_traces.json"
STEPS, LAYERS, EP, TOKENS_PER_RANK, SEED = 200, 4, 32, 16384, 0
"""The synthetic traces' shape (the flags' defaults); ``balance_defaults.py`` sweeps at the same."""
MODEL, CLUSTER = "pangu-ultra-moe-718b", "atlas-800t-a2"
TRACE_MODEL, TRACE_EP = "tiny-pangu", 4
"""The recorded traces' model and EP degree (``--trace-model``, ``--trace-ep``)."""


def synthetic_traces(shape: TraceShape, seed: int) -> dict[str, RoutingTrace]:
    """The benchmark's four synthetic traces by name: two Zipf, two drifting hot sets."""
    return {
        "zipf-s0.6": zipf_trace(shape, 0.6, seed=seed),
        "zipf-s1.0": zipf_trace(shape, 1.0, seed=seed),
        "drift-h16-p50": drifting_trace(shape, num_hot=16, hot_weight=6.0, period=50, seed=seed),
        "drift-h16-p20": drifting_trace(shape, num_hot=16, hot_weight=6.0, period=20, seed=seed),
    }


def trace_predictor(loads: np.ndarray, interval: int, horizon: int) -> Predictor:
    """The predictor this benchmark replays with: the candidate that forecasts the first quarter of the
    trace best, over the steps until the next full re-plan."""
    forecast_horizon = min(interval, horizon)
    select_steps = max(loads.shape[0] // 4, forecast_horizon + 6)
    return select_predictor(loads[:select_steps], horizon=forecast_horizon)[0]


def load_persistence(loads: np.ndarray, skip: int = 5) -> dict:
    """The re-plan rule's running lag-1 correlation of expert-load deviations (``LayerSchedule.persistence``)
    after every step from ``skip`` on, over all layers: how long a saving is counted on to last."""
    values = []
    for layer in range(loads.shape[1]):
        schedule = LayerSchedule()
        for t, row in enumerate(loads[:, layer]):
            schedule.observe_deviation(row)
            if t >= skip:
                values.append(schedule.persistence)
    return {"min": float(np.min(values)), "mean": float(np.mean(values))} if values else {}


def layer_parts(loads: np.ndarray, costs: BalanceCostModel, slots: int) -> dict:
    """Mean seconds per MoE layer and step of the static contiguous layout, by part: what balancing
    can act on (expert GEMMs, all-to-all) against what it cannot (the rest of the layer)."""
    static = ExpertPlacement.contiguous(loads.shape[-1], costs.ep, slots)
    copies = static.apply_to_tokens_per_expert(loads.astype(float))
    per_rank = -(-loads.shape[-1] // costs.ep)
    return {"expert_gemm_slowest_rank": float(costs.expert_seconds(copies, per_rank).max(axis=-1).mean()),
            "alltoall": float(np.mean(costs.alltoall_seconds(copies))),
            "rest_of_layer": float(np.mean(costs.other_seconds(copies)))}


def evaluate_trace(trace: RoutingTrace, costs: BalanceCostModel, interval: int, horizon: int,
                   adaptive: bool = True) -> dict:
    loads = trace.tokens_per_expert
    predictor = trace_predictor(loads, interval, horizon)
    errors = {p.name: forecast_error(p, loads, min(interval, horizon)) for p in DEFAULT_CANDIDATES}
    start = time.perf_counter()
    result = replay(trace, ReplanRule(costs, interval, horizon, adaptive=adaptive), predictor)
    summary = result.summary()
    # steady state: from the step after the first trigger check on (the static layout before it is
    # what any run starts from, whatever the balancer)
    steady = slice(1, None)
    summary.update({
        "predictor": predictor.name,
        "forecast_error": errors,
        "replay_seconds": time.perf_counter() - start,
        "load_persistence": load_persistence(loads),
        "layer_seconds_static": layer_parts(loads, costs, loads.shape[-1] // costs.ep + 1),
        "steady_predicted_gain": float(result.seconds_before[steady].sum() / result.seconds_after[steady].sum() - 1),
        "steady_gap_to_ideal": float(result.seconds_after[steady].sum() / result.seconds_ideal[steady].sum() - 1),
        "steady_imbalance_after": float(result.imbalance_after[steady].mean()),
        "per_step": result.per_step(),
    })
    return summary


def compare_solvers(loads: np.ndarray, ep: int, slots: int, costs: BalanceCostModel | None, repeats: int = 5) -> dict:
    """Busiest-rank load over the even share (1.0 = perfect), predicted layer time and solve time."""
    out = {}
    even = loads.sum() / ep
    spare = ep * slots - loads.size
    for name in ("greedy", "local"):
        counts = replica_counts(loads, ep, spare)
        times, plan = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            plan = solve_fixed_replicas(loads, ep, slots, counts, name)
            times.append(time.perf_counter() - start)
        assert plan is not None
        out[f"{name}_single"] = {
            "max_over_even": float(plan.apply_to_tokens_per_expert(loads).max() / even),
            "solve_ms": 1e3 * float(np.median(times)),
        }
        score = (lambda p: float(costs.layer_seconds(p, loads))) if costs is not None else None
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            plan = plan_placement(PlanRequest(loads, ep, slots, name), score)
            times.append(time.perf_counter() - start)
        entry = {"max_over_even": float(plan.apply_to_tokens_per_expert(loads).max() / even),
                 "replicas": int(plan.num_replicas().sum() - loads.size),
                 "solve_ms": 1e3 * float(np.median(times))}
        if costs is not None:
            entry["layer_seconds"] = float(costs.layer_seconds(plan, loads))
            entry["ideal_layer_seconds"] = float(costs.ideal_layer_seconds(loads))
        out[f"{name}_cost_model"] = entry
    return out


def milp_comparison(seed: int) -> list[dict]:
    """Small instances where the exact MILP finishes: how far greedy and local search are from optimal."""
    rows = []
    for experts, ep, exponent in ((16, 4, 1.0), (16, 4, 1.5), (32, 8, 1.0), (64, 8, 1.2)):
        shape = TraceShape(num_steps=1, num_layers=1, num_experts=experts, num_ranks=ep, tokens_per_step=512 * ep,
                           top_k=4)
        loads = zipf_trace(shape, exponent, seed=seed).tokens_per_expert[0, 0].astype(float)
        slots = experts // ep + 1
        spare = ep * slots - experts
        even = loads.sum() / ep
        row = {"experts": experts, "ep": ep, "zipf": exponent}
        for name in ("greedy", "local"):
            start = time.perf_counter()
            plan = solve_fixed_replicas(loads, ep, slots, replica_counts(loads, ep, spare, stop_at_even=False), name)
            row[name] = {"max_over_even": float(plan.apply_to_tokens_per_expert(loads).max() / even),
                         "solve_ms": 1e3 * (time.perf_counter() - start)}
        start = time.perf_counter()
        plan = solve_milp(loads, ep, slots, time_limit=20.0)
        row["milp"] = {"max_over_even": float(plan.apply_to_tokens_per_expert(loads).max() / even),
                       "solve_ms": 1e3 * (time.perf_counter() - start)}
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK, help="tokens per EP rank and step")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--cluster", default=CLUSTER)
    parser.add_argument("--ep", type=int, default=EP)
    parser.add_argument("--interval", type=int, default=BALANCE_DEFAULTS.interval)
    parser.add_argument("--horizon", type=int, default=BALANCE_DEFAULTS.horizon)
    parser.add_argument("--fixed-interval", action="store_true",
                        help="solve every --interval steps only (no per-step check), as before adaptive re-plans")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--trace", action="append", default=[], help="recorded trace(s) to add")
    parser.add_argument("--trace-model", default=TRACE_MODEL)
    parser.add_argument("--trace-cluster", default=CLUSTER)
    parser.add_argument("--trace-ep", type=int, default=TRACE_EP)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    model = load_model_config(args.model)
    cluster = load_cluster_config(args.cluster)
    assert model.moe is not None
    experts, top_k = model.moe.num_experts, model.moe.router.top_k
    tokens = args.tokens_per_rank * args.ep
    costs = BalanceCostModel(model, cluster, args.ep)
    synthetic = synthetic_traces(TraceShape(args.steps, args.layers, experts, args.ep, tokens, top_k), args.seed)
    report: dict = {
        "setup": {"model": args.model, "cluster": args.cluster, "ep": args.ep, "slots_per_rank": experts // args.ep + 1,
                  "tokens_per_rank": args.tokens_per_rank, "steps": args.steps, "layers": args.layers,
                  "interval": args.interval, "horizon": args.horizon, "adaptive": not args.fixed_interval},
        "traces": {},
    }
    for name, trace in synthetic.items():
        row = evaluate_trace(trace, costs, args.interval, args.horizon, not args.fixed_interval)
        snapshot = trace.tokens_per_expert[: args.interval, 0].mean(axis=0)
        row["solvers"] = compare_solvers(snapshot, args.ep, experts // args.ep + 1, costs)
        report["traces"][name] = row
    for path in args.trace:
        trace = read_trace(path)
        trace_model = load_model_config(args.trace_model)
        trace_costs = BalanceCostModel(trace_model, load_cluster_config(args.trace_cluster), args.trace_ep)
        row = evaluate_trace(trace, trace_costs, args.interval, args.horizon, not args.fixed_interval)
        row["setup"] = {"model": args.trace_model, "cluster": args.trace_cluster, "ep": args.trace_ep}
        report["traces"][f"recorded:{Path(path).name}"] = row
    report["milp_comparison"] = milp_comparison(args.seed)

    print(f"{'trace':22s} {'imb before':>10s} {'imb after':>9s} {'gain':>7s} {'ideal':>7s} {'gap':>6s} "
          f"{'steady gain':>11s} {'steady gap':>10s} {'migr':>5s} {'solve ms':>8s}  predictor")
    for name, row in report["traces"].items():
        print(f"{name:22s} {row['imbalance_before']:10.3f} {row['imbalance_after']:9.3f} {row['predicted_gain']:7.1%} "
              f"{row['ideal_gain']:7.1%} {row['gap_to_ideal']:6.1%} {row['steady_predicted_gain']:11.1%} "
              f"{row['steady_gap_to_ideal']:10.1%} {row['migrations']:5d} {row['solve_ms_mean']:8.1f}  "
              f"{row['predictor']}")
    print("\nsolvers on each trace's first-interval mean load (busiest rank / even share; solve ms):")
    for name, row in report["traces"].items():
        if "solvers" in row:
            cells = "  ".join(f"{k}: {v['max_over_even']:.4f} ({v['solve_ms']:.1f} ms)"
                              for k, v in row["solvers"].items())
            print(f"  {name:16s} {cells}")
    print("\nexact MILP vs fast solvers (busiest rank / even share; solve ms):")
    for row in report["milp_comparison"]:
        cells = "  ".join(f"{k}: {row[k]['max_over_even']:.4f} ({row[k]['solve_ms']:.1f} ms)"
                          for k in ("greedy", "local", "milp"))
        print(f"  E={row['experts']:3d} ep={row['ep']} zipf {row['zipf']}: {cells}")
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
