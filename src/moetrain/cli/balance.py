"""``moetrain balance``: replay a routing trace through the expert-load predictor, the placement planner
and the migration trigger; print every decision and the predicted gain."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from moetrain.balance.online import BALANCE_DEFAULTS, check_slots_per_rank
from moetrain.cli.parsing import add_renamed_flag
from moetrain.config import load_cluster_config, load_model_config, model_presets
from moetrain.errors import UserError

if TYPE_CHECKING:  # the command loads these when it runs (``run``)
    import numpy as np

    from moetrain.balance.costs import BalanceCostModel
    from moetrain.balance.predict import Predictor
    from moetrain.balance.replay import ReplayResult
    from moetrain.balance.traces import RoutingTrace

DEFAULT_SEQ_LEN = 4096
"""``--seq-len``: the sequence length the cost model prices attention at."""

HELP = "replay a routing trace through expert-load prediction, placement and migration; predicted gain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    trace = parser.add_argument("--trace-routing", required=True, metavar="FILE",
                                help="routing trace JSONL, as `moetrain train --trace-routing FILE` writes it")
    add_renamed_flag(parser, "--trace", trace)
    parser.add_argument("--ep", type=int, required=True, help="expert-parallel size (ranks sharing the experts)")
    parser.add_argument("--slots-per-rank", type=int,
                        help=f"expert slots per rank (default experts/ep + {BALANCE_DEFAULTS.spare_slots_per_rank}: "
                             "spare slots for hot experts' replicas)")
    parser.add_argument("--model", help="model preset or YAML for the cost model (default: the first preset "
                                        "with the trace's expert count)")
    parser.add_argument("--cluster", default="atlas-800t-a2", help="cluster preset or YAML for the cost model")
    parser.add_argument("--solver", choices=["greedy", "local", "milp"], default=BALANCE_DEFAULTS.solver,
                        help="placement solver (milp: exact, small instances only; every re-plan solves from "
                             "scratch)")
    parser.add_argument("--predictor", default=BALANCE_DEFAULTS.predictor,
                        help="adaptive (the runtime's: a bank of EMA and Holt forecasts, the one with the lowest "
                             "recent error forecasts), auto (the lowest forecast error on the trace's first quarter, "
                             "fixed), ema:THETA or holt:ALPHA,BETA")
    interval = parser.add_argument("--balance-interval", type=int, default=BALANCE_DEFAULTS.interval,
                                   help="steps between full re-plans (cheap drift checks run every step)")
    add_renamed_flag(parser, "--interval", interval)
    horizon = parser.add_argument("--balance-horizon", type=int, default=BALANCE_DEFAULTS.horizon,
                                  help="steps over which a migration's predicted saving must repay its cost")
    add_renamed_flag(parser, "--horizon", horizon)
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="sequence length for the attention cost")
    parser.add_argument("--a2a", choices=["flat", "hierarchical"], default="flat", help="expert all-to-all kind")
    parser.add_argument("--spare-slots", metavar="N,N,...",
                        help="also replay with experts/ep + N slots per rank for each N (e.g. 0,1,2) and recommend "
                             "the fewest spare slots whose step time is within 0.5%% of the best")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _parse_spare(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0:
        raise UserError(f"--spare-slots {text!r}: expected spare slot counts >= 0 separated by commas, e.g. 0,1,2")
    return counts


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse a step or token count below 1 before the trace is read (a negative horizon once reached the
    forecast-error window as a numpy broadcast error)."""
    counts = (("--balance-interval", args.balance_interval, f"steps (default {BALANCE_DEFAULTS.interval})"),
              ("--balance-horizon", args.balance_horizon, f"steps (default {BALANCE_DEFAULTS.horizon})"),
              ("--seq-len", args.seq_len, f"tokens per sequence (default {DEFAULT_SEQ_LEN})"))
    for flag, value, unit in counts:
        if value < 1:
            raise UserError(f"{flag} {value}: give a positive number of {unit}")


def _check_milp_size(args: argparse.Namespace, num_experts: int) -> None:
    """Refuse an exact program too large to replay in reasonable time (each solve runs up to its time limit)."""
    from moetrain.balance.solver import MILP_MAX_PAIRS  # lazy: scipy loads when the command runs (``run``)

    if args.solver == "milp" and num_experts * args.ep > MILP_MAX_PAIRS:
        raise UserError(f"--solver milp: {num_experts} experts on {args.ep} ranks are {num_experts * args.ep} "
                        f"expert-rank pairs, more than the {MILP_MAX_PAIRS} the exact program is for (a replay solves "
                        "every layer at every re-plan, each solve up to 10 s); use --solver local")


def _check_slots(args: argparse.Namespace, spare_options: tuple[int, ...] | None, num_experts: int) -> None:
    if args.slots_per_rank is not None:
        check_slots_per_rank(args.slots_per_rank, num_experts, args.ep)
    if spare_options:
        needed = num_experts // args.ep  # --ep divides the experts (``_cost_model``)
        if needed + max(spare_options) > num_experts:
            raise UserError(f"--spare-slots {args.spare_slots}: {max(spare_options)} spare slots beside the {needed} "
                            f"experts each of {args.ep} ranks holds exceed the {num_experts} experts a rank can hold "
                            f"one replica each of; give at most {num_experts - needed}")


def _render_spare(choice) -> list[str]:
    lines = ["spare slots per rank (replayed each; memory over all MoE layers of the model, per rank):"]
    for o in choice.options:
        mark = "  <- recommended" if o is choice.recommended else ""
        lines.append(f"  {o.spare_per_rank} spare ({o.slots_per_rank} slots): gain {o.predicted_gain:+.1%}, "
                     f"{o.gap_to_ideal:.1%} from ideal, {o.memory_bytes_per_rank / 2**30:.2f} GiB per rank{mark}")
    lines.append(f"recommended: {choice.recommended.spare_per_rank} spare slot(s) per rank (--slots-per-rank "
                 f"{choice.recommended.slots_per_rank}): the fewest within {choice.tolerance:.1%} of the best")
    return lines


def _verdict(d) -> str:
    """What a decision did and, for a keep, why (``schedule.KeepReason``)."""
    from moetrain.balance.schedule import KeepReason  # lazy: the balancer's costs and solvers load on a run

    if d.outcome == "migrate":
        return f"MIGRATE {d.num_moves} moves"
    if d.outcome == "reshare":
        return "reshare (new token shares, no weights move)"
    why = {KeepReason.BELOW_THRESHOLD: f"saving within the forecast noise of {d.noise_s * 1e3:.3g} ms over those steps",
           KeepReason.COST_EXCEEDS_SAVING: f"saving beyond the forecast noise ({d.noise_s * 1e3:.3g} ms) below "
                                           "the migration time"}.get(d.keep_reason)
    if d.keep_reason is None:
        return "keep"
    return f"keep, {d.keep_reason.value}" + (f": {why}" if why else "")


def decision_line(d) -> str:
    """One decision as the CLI prints it: forecast max/mean now → candidate (lower bound), saving vs cost, verdict."""
    bound = "" if d.bound is None else f" (bound {d.bound.value:.3f}, {d.bound.kind})"
    flags = (" (global fallback)" if d.fallback else "") + (" (load shift)" if d.shift else "")
    return (f"step {d.step:5d} layer {d.layer:3d}: {d.imbalance_current:6.3f} → {d.imbalance_candidate:6.3f}{bound}, "
            f"saving {d.predicted_saving_s * 1e3:9.3g} ms over {d.lasting_steps:4.1f} steps vs cost "
            f"{d.migration_s * 1e3:9.3g} ms: {_verdict(d)}{flags}  (solve {d.solve_ms:.1f} ms)")


def _default_model(num_experts: int) -> str:
    for name in model_presets():
        moe = load_model_config(name).moe
        if moe is not None and moe.num_experts == num_experts:
            return name
    raise UserError(f"no model preset has {num_experts} experts; pass --model with a YAML of the traced model")


def _cost_model(args: argparse.Namespace, num_experts: int) -> BalanceCostModel:
    """The cost model of ``--model`` (default: the first preset with the trace's expert count) on ``--cluster``."""
    from moetrain.balance.costs import BalanceCostModel  # lazy, heavy: loaded when the command runs (``run``)

    model = load_model_config(args.model or _default_model(num_experts))
    if model.moe is None or model.moe.num_experts != num_experts:
        have = model.moe.num_experts if model.moe else 0
        raise UserError(f"model {model.name!r} has {have} experts, the trace {num_experts}; "
                        "pass the --model the trace was recorded with")
    if args.ep < 1 or num_experts % args.ep:
        raise UserError(f"--ep {args.ep} must divide the trace's {num_experts} experts")
    return BalanceCostModel(model, load_cluster_config(args.cluster), args.ep,
                            hierarchical_a2a=args.a2a == "hierarchical", seq_len=args.seq_len)


def _predictor(args: argparse.Namespace, loads: np.ndarray,
               forecast_horizon: int) -> tuple[Predictor, dict[str, float]]:
    """``--predictor`` (``auto``: the lowest forecast error on the trace's first quarter), and each candidate's
    forecast error over the trace where there are candidates to compare (else none)."""
    # lazy, heavy: loaded when the command runs (``run``)
    from moetrain.balance.predict import (
        DEFAULT_CANDIDATES,
        AdaptivePredictor,
        forecast_error,
        parse_predictor,
        select_predictor,
    )

    if args.predictor == "auto":
        select_steps = max(loads.shape[0] // 4, 5 + forecast_horizon + 1)
        if loads.shape[0] <= 5 + forecast_horizon:
            raise UserError(f"trace has {loads.shape[0]} steps; auto predictor needs more than "
                            f"{5 + forecast_horizon}; pass --predictor ema:0.9 or a longer trace")
        predictor, _ = select_predictor(loads[:select_steps], horizon=forecast_horizon)
        return predictor, {p.name: forecast_error(p, loads, forecast_horizon) for p in DEFAULT_CANDIDATES}
    predictor = parse_predictor(args.predictor)
    if isinstance(predictor, AdaptivePredictor) and loads.shape[0] > 5 + forecast_horizon:
        return predictor, {p.name: forecast_error(p, loads, forecast_horizon)
                           for p in (*predictor.candidates, predictor)}
    return predictor, {}


def _print_text(args: argparse.Namespace, trace: RoutingTrace, costs: BalanceCostModel, predictor: Predictor,
                errors: dict[str, float], result: ReplayResult) -> None:
    """The replay as text: the trace and cost model, the predictor, every decision and the summary."""
    from moetrain.balance.predict import AdaptivePredictor  # lazy, heavy: loaded when the command runs (``run``)

    summary = result.summary()
    slots = args.slots_per_rank or BALANCE_DEFAULTS.slots_per_rank(trace.num_experts, args.ep)
    print(f"trace {args.trace_routing}: {trace.num_steps} steps × {trace.num_layers} MoE layers × "
          f"{trace.num_experts} experts; ep={args.ep}, {slots} slots/rank; cost model {costs.model.name} on "
          f"{costs.cluster.name}")
    if isinstance(predictor, AdaptivePredictor):
        print(f"predictor: {predictor.name} (every candidate runs; the one with the lowest recent error forecasts)")
    else:
        print(f"predictor: {predictor.name}" + (" (lowest forecast error on the first quarter)" if errors else ""))
    forecast_horizon = min(args.balance_interval, args.balance_horizon)
    for name, err in errors.items():
        print(f"  forecast error {name:28s} {err:.4f}  (|forecast − actual| / actual, {forecast_horizon}-step mean)")
    print("decisions (step, layer): forecast imbalance now → candidate (lower bound on any placement's, and what "
          "decides it), saving over the steps it is counted to last vs the migration time it exposes; a keep says "
          "why")
    for d in result.decisions:
        print(f"  {decision_line(d)}")
    print(f"imbalance (mean max/mean EP-rank load): {summary['imbalance_before']:.3f} → "
          f"{summary['imbalance_after']:.3f}")
    print(f"predicted MoE-layer time per step: {summary['step_seconds_before']:.4g}s → "
          f"{summary['step_seconds_after']:.4g}s (ideal {summary['step_seconds_ideal']:.4g}s)")
    print(f"predicted gain {summary['predicted_gain']:+.1%} (ideal {summary['ideal_gain']:+.1%}; "
          f"{summary['gap_to_ideal']:.1%} slower than ideal); {summary['migrations']} migrations "
          f"({summary['migration_bytes'] / 1e9:.3g} GB), {summary['fallbacks']} global fallbacks, "
          f"{summary['shifts']} load shifts")


def run(args: argparse.Namespace) -> int:
    # lazy, heavy: the predictors, replay and scipy's solvers load when the command runs, not when the parser
    # imports every command module (``moetrain.cli``)
    from moetrain.balance.replay import replay
    from moetrain.balance.schedule import ReplanRule
    from moetrain.balance.slots import choose_spare_slots
    from moetrain.balance.traces import read_trace

    _check_counts(args)
    spare_options = _parse_spare(args.spare_slots)
    trace = read_trace(args.trace_routing)
    costs = _cost_model(args, trace.num_experts)
    _check_slots(args, spare_options, trace.num_experts)
    _check_milp_size(args, trace.num_experts)
    predictor, errors = _predictor(args, trace.tokens_per_expert, min(args.balance_interval, args.balance_horizon))
    rule = ReplanRule(costs, args.balance_interval, args.balance_horizon, args.solver)
    result = replay(trace, rule, predictor, args.slots_per_rank)
    spare = None if spare_options is None else choose_spare_slots(trace, rule, predictor, spare_options)
    if args.json:
        slots = args.slots_per_rank or BALANCE_DEFAULTS.slots_per_rank(trace.num_experts, args.ep)
        print(json.dumps({
            "trace": args.trace_routing, "model": costs.model.name, "cluster": costs.cluster.name, "ep": args.ep,
            "slots_per_rank": slots, "solver": args.solver, "predictor": predictor.name,
            "forecast_error": errors, **result.summary(), "migrations": [d.as_dict() for d in result.decisions
                                                                       if d.migrate],
            "decisions": [d.as_dict() for d in result.decisions],
            **({} if spare is None else {"spare_slots": {
                "options": [vars(o) for o in spare.options],
                "recommended_spare_per_rank": spare.recommended.spare_per_rank}}),
        }, indent=2))
        return 0
    _print_text(args, trace, costs, predictor, errors, result)
    if spare is not None:
        print("\n".join(_render_spare(spare)))
    return 0
