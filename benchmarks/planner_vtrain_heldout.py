"""Out-of-sample check on published runs the calibration file leaves out.

vTrain (Bang et al., MICRO'24) publishes 109 measured iteration times of GPT models on 64-512 A100 GPUs under
Megatron-DeepSpeed (github VIA-Research/vTrain, data/ground_truth_multi.csv, commit f8dda84).
``shared/validation/calibration.csv`` holds the even-numbered rows (VTRAIN-M-002 … -108). The other 55
rows are in ``benchmarks/data/vtrain_heldout.csv`` (ids VTRAIN-H-<data row>), filled in exactly as the
calibration file fills in its VTRAIN-M rows (A100 80 GB, 800 Gb/s per node, 4h GeLU MLP, fp16, vocabulary
50,257, full recompute, no sequence parallelism).

No parameter has seen these rows. The script predicts them twice:

- ``family_held_out``: with the efficiencies fitted on every family of the calibration file except
  VTRAIN-M, the same fit that predicts VTRAIN-M under leave-one-family-out cross-validation. Together with
  those cross-validated predictions this covers all 109 vTrain measurements with no vTrain row in the fit;
- ``shipped``: with the shipped calibration, which has seen the 54 VTRAIN-M rows (new layouts of known
  models on a known cluster).

It also groups the held-out signed errors by tensor-parallel size and model, and lists the rows off by
more than 12 %. Writes ``benchmarks/results/planner_vtrain_heldout.json``. Needs scipy (the fit).

    python benchmarks/planner_vtrain_heldout.py [--csv ../shared/validation/calibration.csv]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
from _heldout import CALIBRATION_CSV, THRESHOLD_PCT, prepared_rows, print_summaries, signed_pct_errors, summary
from _record import write_result

from moetrain.planner.calibration import load_calibration
from moetrain.planner.fit import fit_calibration, predict_rows
from moetrain.planner.validation import PreparedRow, prepare_all, read_rows

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_CSV = ROOT / "benchmarks" / "data" / "vtrain_heldout.csv"
CALIBRATION_FAMILY = "VTRAIN-M"


def _layout(row: PreparedRow) -> dict[str, int]:
    s = row.strategy
    return {"tp": int(s.tp[0]), "pp": int(s.pp[0]), "dp": int(s.dp[0]), "micro_batch": int(s.micro_batch[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=str(CALIBRATION_CSV))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_vtrain_heldout.json"))
    args = parser.parse_args()

    calibration_rows, _ = prepare_all(read_rows(args.csv))
    held_out = prepared_rows(read_rows(HELD_OUT_CSV))
    in_file = [r for r in calibration_rows if r.family == CALIBRATION_FAMILY]
    others = [r for r in calibration_rows if r.family != CALIBRATION_FAMILY]

    family_fit = fit_calibration(others, note=f"calibration.csv without {CALIBRATION_FAMILY}")
    shipped = load_calibration()

    held_family = signed_pct_errors(held_out, predict_rows(held_out, family_fit))
    held_shipped = signed_pct_errors(held_out, predict_rows(held_out, shipped))
    cv_family = signed_pct_errors(in_file, predict_rows(in_file, family_fit))

    # groups in the order they first appear (the file lists the models by size)
    by_group: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row, error in sorted(zip(held_out, held_family), key=lambda pair: _layout(pair[0])["tp"]):
        by_group["tp"][str(_layout(row)["tp"])].append(float(error))
    for row, error in zip(held_out, held_family):
        by_group["model"][row.workload.model.name.split(" ")[0]].append(float(error))
    groups = {key: {value: {"rows": len(errs), "mean_signed_pct_error": float(np.mean(errs))}
                    for value, errs in values.items()}
              for key, values in by_group.items()}

    rows = [{"id": r.row_id, "model": r.workload.model.name, **_layout(r), "measured_s": r.measured,
             "family_held_out_pct_error": float(e_family), "shipped_pct_error": float(e_shipped)}
            for r, e_family, e_shipped in zip(held_out, held_family, held_shipped)]
    result = {
        "held_out_file": str(HELD_OUT_CSV.relative_to(ROOT)),
        "family_held_out_fit": family_fit.global_params.as_dict() | {"per_arch": family_fit.per_arch},
        "summary": {
            "unseen_rows_family_held_out": summary(held_family),
            "unseen_rows_shipped": summary(held_shipped),
            "calibration_rows_family_held_out": summary(cv_family),
            "all_109_vtrain_runs_family_held_out": summary(np.concatenate([held_family, cv_family])),
        },
        "unseen_rows_by_group_family_held_out": groups,
        "unseen_rows_above_12_pct_family_held_out": [row for row in rows
                                                     if abs(row["family_held_out_pct_error"]) > THRESHOLD_PCT],
        "rows": rows,
    }
    write_result(args.out, result)
    print_summaries(result["summary"])


if __name__ == "__main__":
    main()
