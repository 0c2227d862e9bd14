"""Expert, data and pipeline balance (EDPB): the torch-free planning half.

- ``placement``: the logical→physical expert table the dispatcher reads, and the moves between two;
- ``traces``: routing traces (JSONL) and synthetic skewed ones;
- ``families``: seeded trace families (Zipf, hot sets, giant experts, shifts, drifts, cycles) for benchmarks;
- ``predict``: per-expert load forecasts (EMA, Holt trend) and their measured error;
- ``solver``: placement of experts and replicas (greedy, local search, exact MILP);
- ``costs``: a placement's step time and a migration's cost, from the planner's cost model;
- ``schedule``: when to re-plan (a per-step cost-model check, incremental and full solves, a global
  fallback when the incremental one stalls, load shifts) and the trigger;
- ``slots``: how many spare expert slots per rank, priced by replay;
- ``replay``: predictor → planner → trigger over a trace, as the runtime runs them;
- ``data``: balanced order of samples over data-parallel ranks and micro-batches;
- ``pipeline``: stage boundaries that even out per-stage time.
"""

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, Move, diff

__all__ = ["EMPTY_SLOT", "ExpertPlacement", "Move", "diff"]
