"""Which defaults for expert balancing: the re-plan interval, the payback horizon, the predictor and the spare
slots per rank, each varied on its own around ``BALANCE_DEFAULTS`` over every family of
``benchmarks/balance_families.py`` (first layer of each, the families' seeds and shapes).

    python benchmarks/balance_defaults.py

Writes benchmarks/results/balance_defaults.json: per setting the steady gap to the ideal of every family (as
in balance_families.json: migration included, from step 1 on), their mean and largest, and how many are within
5 %; ``best`` is the setting with the lowest mean steady gap (the current defaults on a tie within 0.02 point).
``BALANCE_DEFAULTS`` (``moetrain.balance.online``) must equal it: ``tests/balance/test_balance_defaults.py``
reads this file, so a change to the defaults comes with a rerun.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from _record import write_result
from balance_families import CASES, RECORDED, RECORDED_TRACES, cost_model

from moetrain.balance.families import TraceShape, family_trace
from moetrain.balance.online import BALANCE_DEFAULTS, BalanceDefaults
from moetrain.balance.replay import replay
from moetrain.balance.traces import RoutingTrace, read_trace

RESULTS = Path(__file__).parent / "results" / "balance_defaults.json"
TIE = 2e-4
"""A setting must beat the current defaults' mean steady gap by more than this to replace them."""
VARIANTS = {
    "interval": (5, 20),
    "horizon": (25, 100),
    "spare_slots_per_rank": (2,),
}
"""The predictor is not varied: the adaptive bank replaced one chosen per trace after it won on every family
(docs/balance.md, "Trace families"); ``--predictor`` still forecasts with a fixed one."""


def settings(variants: dict[str, tuple]) -> list[BalanceDefaults]:
    """The defaults, then each field of ``variants`` varied on its own."""
    return [BALANCE_DEFAULTS, *(replace(BALANCE_DEFAULTS, **{name: value}) for name, values in variants.items()
                                for value in values)]


def traces(steps: int, tokens_per_rank: int, seed: int, chosen: set[str] | None):
    for index, case in enumerate(CASES):
        if chosen is not None and str(index) not in chosen:
            continue
        tokens = case.tokens_per_rank or tokens_per_rank
        shape = TraceShape(steps, 1, case.num_experts, case.ep, tokens * case.ep)
        yield case.name, family_trace(case.family, shape, seed=seed + index, **case.params), case.num_experts, case.ep
    for name in RECORDED_TRACES:
        if chosen is not None and "recorded" not in chosen:
            continue
        trace = read_trace(RECORDED / name)
        first = RoutingTrace(trace.steps, trace.layers[:1], trace.tokens_per_expert[:, :1], trace.name)
        yield f"recorded: {name} (E16, EP4)", first, trace.num_experts, 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per trace (the families benchmark: 120)")
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=2800, help="the families benchmark's seeds")
    parser.add_argument("--cases", default="", help="only these families: indices into balance_families.CASES "
                                                    "and 'recorded', comma-separated (default: all)")
    parser.add_argument("--fields", default=",".join(VARIANTS),
                        help="vary only these defaults, comma-separated (a reduced grid; default: all of them)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    unknown = [name for name in args.fields.split(",") if name not in VARIANTS]
    if unknown:
        parser.error(f"--fields {','.join(unknown)}: not a swept default; choose from {','.join(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in args.fields.split(",")}
    chosen = set(args.cases.split(",")) if args.cases else None
    cases = list(traces(args.steps, args.tokens_per_rank, args.seed, chosen))
    rows = []
    for setting in settings(variants):
        start = time.perf_counter()
        gaps = {}
        for name, trace, experts, ep in cases:
            model = "tiny-pangu" if name.startswith("recorded") else "pangu-ultra-moe-718b"
            costs = cost_model(model, "atlas-800t-a2", experts, ep)
            result = replay(trace, costs, setting.build_predictor(), setting.slots_per_rank(experts, ep),
                            setting.solver, setting.interval, setting.horizon)
            gaps[name] = result.steady_gap_to_ideal
        values = np.array(list(gaps.values()))
        rows.append({"setting": asdict(setting), "steady_gap": gaps, "mean": float(values.mean()),
                     "max": float(values.max()), "within_5pct": int((values <= 0.05).sum()),
                     "seconds": time.perf_counter() - start})
        print(f"{asdict(setting)}: mean {values.mean():.3%}, max {values.max():.2%}, "
              f"within 5% {(values <= 0.05).sum()}/{values.size}", flush=True)
    current = rows[0]
    best = min(rows, key=lambda row: row["mean"])
    if best["mean"] > current["mean"] - TIE:
        best = current
    write_result(args.out, {
        "setup": {"steps": args.steps, "layers": 1, "tokens_per_rank": args.tokens_per_rank, "seed": args.seed,
                  "families": [name for name, *_ in cases],
                  "variants": {k: list(v) for k, v in variants.items()}, "tie": TIE,
                  "load_average_start": os.getloadavg()[0], "cpu_count": os.cpu_count()},
        "settings": rows, "best": best["setting"], "defaults": asdict(BALANCE_DEFAULTS),
        "defaults_are_best": best is current,
    })
    print(f"best: {best['setting']} (defaults {'are' if best is current else 'are NOT'} the best)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
