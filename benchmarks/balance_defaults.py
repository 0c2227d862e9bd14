"""Which defaults for expert balancing: the re-plan interval, the payback horizon, the predictor, the spare slots
per rank, the trigger margin and the solver, each varied on its own around ``BALANCE_DEFAULTS`` (a coarse
one-at-a-time grid, not a full product) over every family of ``benchmarks/balance_families.py`` (first layer of
each, 60 steps instead of 120, the families' seeds and shapes).

    python benchmarks/balance_defaults.py --jobs 2

Writes benchmarks/results/balance_defaults.json: per setting the steady gap to the ideal of every family (as in
balance_families.json: migration included, from step 1 on), their mean and largest, and how many are within
5 %. The rule (``best_setting``): the lowest largest gap over the families; settings within ``MAX_TIE`` of it
tie, and the lowest mean gap among them wins; the current defaults stay when they tie on the largest gap and
their mean is within ``MEAN_TIE`` of the winner's (a smaller difference than the grid resolves).
``BALANCE_DEFAULTS`` (``moetrain.balance.online``) must equal ``best``: ``tests/balance/test_balance_defaults.py``
reads this file, so a change to the defaults comes with a rerun.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from _record import write_result
from balance_families import CASES, RECORDED, RECORDED_TRACES, cost_model

from moetrain.balance.families import TraceShape, family_trace
from moetrain.balance.online import BALANCE_DEFAULTS, BalanceDefaults
from moetrain.balance.replay import replay
from moetrain.balance.traces import RoutingTrace, read_trace

RESULTS = Path(__file__).parent / "results" / "balance_defaults.json"
MAX_TIE = 1e-3
"""Largest gaps closer than this (0.1 point) tie; the mean gap decides between them."""
MEAN_TIE = 2e-4
"""A setting must beat the current defaults' mean gap by more than this (0.02 point) to replace them."""
VARIANTS: dict[str, tuple] = {
    "interval": (5, 20),
    "horizon": (25, 100),
    "predictor": ("ema:0.5",),
    "spare_slots_per_rank": (2,),
    "trigger_margin": (0.5, 2.0),
    "solver": ("greedy",),
}
"""Around the defaults, each on its own. No spare slot is left out (no replica can balance an expert above a
rank's mean: the giant families fail by construction); the MILP is too slow at 256 experts."""


@dataclass(frozen=True)
class Case:
    name: str
    trace: RoutingTrace
    model: str
    num_experts: int
    ep: int


def settings(variants: dict[str, tuple]) -> list[BalanceDefaults]:
    """The defaults, then each field of ``variants`` varied on its own."""
    return [BALANCE_DEFAULTS, *(replace(BALANCE_DEFAULTS, **{name: value}) for name, values in variants.items()
                                for value in values)]


def cases(steps: int, tokens_per_rank: int, seed: int, chosen: set[str] | None) -> list[Case]:
    out = []
    for index, case in enumerate(CASES):
        if chosen is not None and str(index) not in chosen:
            continue
        tokens = case.tokens_per_rank or tokens_per_rank
        shape = TraceShape(steps, 1, case.num_experts, case.ep, tokens * case.ep)
        trace = family_trace(case.family, shape, seed=seed + index, **case.params)
        out.append(Case(case.name, trace, "pangu-ultra-moe-718b", case.num_experts, case.ep))
    for name in RECORDED_TRACES:
        if chosen is not None and "recorded" not in chosen:
            continue
        trace = read_trace(RECORDED / name)
        first = RoutingTrace(trace.steps, trace.layers[:1], trace.tokens_per_expert[:, :1], trace.name)
        out.append(Case(f"recorded: {name} (E16, EP4)", first, "tiny-pangu", trace.num_experts, 4))
    return out


def steady_gap(setting: BalanceDefaults, case: Case) -> tuple[float, float]:
    """The case's steady gap to the ideal under ``setting``, and the CPU seconds its replay took."""
    start = time.process_time()
    costs = cost_model(case.model, "atlas-800t-a2", case.num_experts, case.ep)
    result = replay(case.trace, costs, setting.build_predictor(), setting.slots_per_rank(case.num_experts, case.ep),
                    setting.solver, setting.interval, setting.horizon, trigger_margin=setting.trigger_margin)
    return result.steady_gap_to_ideal, time.process_time() - start


def best_setting(rows: list[dict]) -> dict:
    """The module docstring's rule; ``rows[0]`` is the current defaults."""
    lowest_max = min(row["max"] for row in rows)
    tied = [row for row in rows if row["max"] <= lowest_max + MAX_TIE]
    best = min(tied, key=lambda row: row["mean"])
    current = rows[0]
    if current in tied and current["mean"] <= best["mean"] + MEAN_TIE:
        return current
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per trace (the families benchmark: 120)")
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=2800, help="the families benchmark's seeds")
    parser.add_argument("--cases", default="", help="only these families: indices into balance_families.CASES "
                                                    "and 'recorded', comma-separated (default: all)")
    parser.add_argument("--fields", default=",".join(VARIANTS),
                        help="vary only these defaults, comma-separated (a reduced grid; default: all of them)")
    parser.add_argument("--jobs", type=int, default=1, help="replays run in this many processes")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    unknown = [name for name in args.fields.split(",") if name not in VARIANTS]
    if unknown:
        parser.error(f"--fields {','.join(unknown)}: not a swept default; choose from {','.join(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in args.fields.split(",")}
    chosen = set(args.cases.split(",")) if args.cases else None
    families = cases(args.steps, args.tokens_per_rank, args.seed, chosen)
    grid = settings(variants)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [[pool.submit(steady_gap, setting, case) for case in families] for setting in grid]
        rows = []
        for setting, row_futures in zip(grid, futures):
            results = [future.result() for future in row_futures]
            gaps = {case.name: gap for case, (gap, _) in zip(families, results)}
            values = np.array(list(gaps.values()))
            rows.append({"setting": asdict(setting), "steady_gap": gaps, "mean": float(values.mean()),
                         "max": float(values.max()), "worst": max(gaps, key=gaps.get),
                         "within_5pct": int((values <= 0.05).sum()),
                         "cpu_seconds": float(sum(cpu for _, cpu in results))})
            print(f"{asdict(setting)}: mean {values.mean():.3%}, max {values.max():.2%} ({rows[-1]['worst']}), "
                  f"within 5% {(values <= 0.05).sum()}/{values.size}", flush=True)
    best = best_setting(rows)
    write_result(args.out, {
        "setup": {"steps": args.steps, "layers": 1, "tokens_per_rank": args.tokens_per_rank, "seed": args.seed,
                  "families": [case.name for case in families],
                  "variants": {k: list(v) for k, v in variants.items()}, "max_tie": MAX_TIE, "mean_tie": MEAN_TIE,
                  "rule": "lowest largest steady gap; within max_tie, lowest mean; the defaults stay within mean_tie",
                  "jobs": args.jobs, "wall_seconds": time.perf_counter() - start,
                  "load_average_start": os.getloadavg()[0], "cpu_count": os.cpu_count()},
        "settings": rows, "best": best["setting"], "defaults": asdict(BALANCE_DEFAULTS),
        "defaults_are_best": best is rows[0],
    })
    print(f"best: {best['setting']} (defaults {'are' if best is rows[0] else 'are NOT'} the best)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
