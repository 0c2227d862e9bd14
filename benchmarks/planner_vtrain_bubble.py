"""The vTrain bubble lead: held-out errors of the vTrain pipeline runs with the bubble priced as it is, and
priced without the stages' recompute (benchmarks/notes/planner.md, "A lead for the vTrain rows").

Predicts every VTRAIN-M row of shared/validation/calibration.csv with pp > 1 under the shipped calibration's
fit without VTRAIN-M (what the cross-validation scores), and again with its bubble of (p − 1) stage times
shortened by the share of the stage time that is recompute. Prints each run and, by tensor-parallel group
(TP 8 against TP 1/2/4), the median |error|, the mean signed error and the correlation of the signed error with
the bubble's share of the step, and writes them to benchmarks/results/planner_vtrain_bubble.json. A check of a
lead, not a model: nothing here changes the planner.

    python benchmarks/planner_vtrain_bubble.py [--csv ../shared/validation/calibration.csv]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _heldout import CALIBRATION_CSV
from _record import write_result

from moetrain.planner.calibration import load_calibration
from moetrain.planner.costmodel import evaluate
from moetrain.planner.validation import PreparedRow, prepare_all, read_rows

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "VTRAIN-M"


@dataclass(frozen=True)
class Run:
    row_id: str
    tp: int
    pp: int
    bubble_share: float
    """The bubble's share of the predicted step."""
    error_pct: float
    """Signed error of the held-out prediction."""
    error_no_recompute_bubble_pct: float
    """The same with the bubble shortened by the stage's recompute."""


def held_out_run(row: PreparedRow, fold) -> Run:
    eff = fold.for_device(row.workload.cluster.device)
    costs = evaluate(row.workload, row.strategy, eff)
    step, bubble = float(costs.step_time_s[0]), float(costs.pipeline.bubble_s[0])
    recompute_per_micro = float(costs.recompute.total_s()[0]) / float(costs.num_micro_batches[0])
    shorter = bubble * (1.0 - recompute_per_micro / float(costs.pipeline.stage_time_s[0]))
    return Run(row.row_id, int(row.strategy.tp[0]), int(row.strategy.pp[0]), bubble / step,
               (step - row.measured) / row.measured * 100.0,
               (step - bubble + shorter - row.measured) / row.measured * 100.0)


def group_summary(runs: list[Run]) -> dict[str, float]:
    share = np.array([r.bubble_share for r in runs])
    summary: dict[str, float] = {"runs": len(runs)}
    for key, errors in (("as_priced", np.array([r.error_pct for r in runs])),
                        ("no_recompute_bubble", np.array([r.error_no_recompute_bubble_pct for r in runs]))):
        summary[f"{key}_median_abs_pct"] = round(float(np.median(np.abs(errors))), 2)
        summary[f"{key}_mean_signed_pct"] = round(float(errors.mean()), 2)
        summary[f"{key}_correlation_with_bubble_share"] = round(float(np.corrcoef(share, errors)[0, 1]), 2)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    args = parser.parse_args()
    fold = load_calibration().held_out_fits[FAMILY]
    rows, _ = prepare_all(read_rows(args.csv))
    runs = [held_out_run(row, fold) for row in rows
            if row.family == FAMILY and row.strategy.pp[0] > 1 and row.metric == "step_time_s"]
    print(f"{'id':14s} {'tp':>3s} {'pp':>3s} {'bubble share':>12s} {'error %':>8s} {'no-recompute bubble %':>22s}")
    for r in runs:
        print(f"{r.row_id:14s} {r.tp:3d} {r.pp:3d} {r.bubble_share:12.3f} {r.error_pct:+8.1f} "
              f"{r.error_no_recompute_bubble_pct:+22.1f}")
    groups = {"tp8": group_summary([r for r in runs if r.tp == 8]),
              "tp1_2_4": group_summary([r for r in runs if r.tp < 8])}
    for name, g in groups.items():
        print(f"{name} ({g['runs']} runs): median |error| {g['as_priced_median_abs_pct']:.2f} → "
              f"{g['no_recompute_bubble_median_abs_pct']:.2f} %, mean signed {g['as_priced_mean_signed_pct']:+.1f} → "
              f"{g['no_recompute_bubble_mean_signed_pct']:+.1f} %, correlation with the bubble share "
              f"{g['as_priced_correlation_with_bubble_share']:.2f} → "
              f"{g['no_recompute_bubble_correlation_with_bubble_share']:.2f}")
    write_result(ROOT / "benchmarks/results/planner_vtrain_bubble.json", {
        "held_out_fit": FAMILY, "groups": groups,
        "runs": [{"id": r.row_id, "tp": r.tp, "pp": r.pp, "bubble_share": round(r.bubble_share, 4),
                  "error_pct": round(r.error_pct, 2),
                  "error_no_recompute_bubble_pct": round(r.error_no_recompute_bubble_pct, 2)} for r in runs]})


if __name__ == "__main__":
    main()
