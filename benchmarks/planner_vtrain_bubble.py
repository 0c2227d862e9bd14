"""The vTrain bubble lead: held-out errors of the vTrain pipeline runs with the bubble priced as it is, and
priced without the stages' recompute (benchmarks/notes/planner.md, "A lead for the vTrain rows").

Predicts every VTRAIN-M row of shared/validation/calibration.csv with pp > 1 under the shipped calibration's
fit without VTRAIN-M (what the cross-validation scores), and again with its bubble of (p − 1) stage times
shortened by the share of the stage time that is recompute. Prints each run and, by tensor-parallel group
(TP 8 against TP 1/2/4), the median |error|, the mean signed error and the correlation of the signed error with
the bubble's share of the step. A check of a lead, not a model: nothing here changes the planner.

    python benchmarks/planner_vtrain_bubble.py [--csv ../shared/validation/calibration.csv]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _heldout import CALIBRATION_CSV

from moetrain.planner.calibration import load_calibration
from moetrain.planner.costmodel import evaluate
from moetrain.planner.explain import step_terms
from moetrain.planner.validation import prepare_all, read_rows

FAMILY = "VTRAIN-M"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    args = parser.parse_args()
    fold = load_calibration().held_out_fits[FAMILY]
    rows, _ = prepare_all(read_rows(args.csv))
    runs = []
    print(f"{'id':14s} {'tp':>3s} {'pp':>3s} {'bubble share':>12s} {'error %':>8s} {'no-recompute bubble %':>22s}")
    for row in rows:
        if row.family != FAMILY or row.strategy.pp[0] == 1 or row.metric != "step_time_s":
            continue
        eff = fold.for_device(row.workload.cluster.device)
        costs = evaluate(row.workload, row.strategy, eff)
        step, bubble = float(costs.step_time_s[0]), float(costs.pipeline.bubble_s[0])
        recompute_per_micro = {t.name: t.seconds for t in step_terms(row, eff, costs)}["recompute"] / float(
            costs.num_micro_batches[0])
        shorter = bubble * (1.0 - recompute_per_micro / float(costs.pipeline.stage_time_s[0]))
        error = (step - row.measured) / row.measured * 100.0
        error_shorter = (step - bubble + shorter - row.measured) / row.measured * 100.0
        tp = int(row.strategy.tp[0])
        runs.append((tp, bubble / step, error, error_shorter))
        print(f"{row.row_id:14s} {tp:3d} {int(row.strategy.pp[0]):3d} {bubble / step:12.3f} {error:+8.1f} "
              f"{error_shorter:+22.1f}")
    for name, group in (("TP 8", [r for r in runs if r[0] == 8]), ("TP 1/2/4", [r for r in runs if r[0] < 8])):
        share, err, err_short = (np.array([r[k] for r in group]) for k in (1, 2, 3))
        print(f"{name} ({len(group)} runs): median |error| {np.median(np.abs(err)):.2f} → "
              f"{np.median(np.abs(err_short)):.2f} %, mean signed {err.mean():+.1f} → {err_short.mean():+.1f} %, "
              f"correlation with the bubble share {np.corrcoef(share, err)[0, 1]:.2f} → "
              f"{np.corrcoef(share, err_short)[0, 1]:.2f}")


if __name__ == "__main__":
    main()
