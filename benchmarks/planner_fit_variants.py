"""Leave-one-family-out cross-validation of fit variants the shipped calibration does not use.

Each variant refits the efficiencies (``moetrain.planner.fit.fit_calibration`` options) and is scored
exactly as ``moetrain validate ../shared/validation/calibration.csv --cv`` scores the shipped model:

- ``shipped``: one weight per row, ``gemm_max`` per architecture, Huber loss on the log-ratios turning
  linear at 0.1 (what the shipped file uses);
- ``linear_loss`` (plain least squares, the shipped fit before the Huber loss), ``huber_loss_0.05``,
  ``huber_loss_0.2``, ``soft_l1_loss_0.1``, ``cauchy_loss_0.1``: other losses and scales;
- ``family_weight_0.5``, ``family_weight_1``: each row's log-ratio weighed by n^(-p/2), n the speed
  rows of its family (p = 1: every family counts the same, so the 54 vTrain rows stop setting the level);
- ``per_arch_memory``, ``per_arch_attention``, ``per_arch_memory_attention``: the element-wise
  memory efficiency and/or the fused-attention efficiency fitted per architecture as well;
- ``memory_at_h100_measurement``: the element-wise memory efficiency held at what an element-wise add
  reached on an H100 (0.89, ``moetrain profile``; benchmarks/notes/planner.md, "Free parameters"), not
  fitted: one parameter fewer;
- ``nar21_layout_from_sc21_script``: the shipped fit, with the NAR21 rows (Megatron-LM SC21 Table 1, which
  leaves micro-batch and interleaving unstated, so the schema reads 1 and 1) read with the values of the
  authors' reproduction script instead (github NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh``).

It also fits each variant on all rows, to show the parameter values it settles on, and scores that fit on
the 55 vTrain runs no fit sees (``benchmarks/data/vtrain_heldout.csv``, as ``planner_vtrain_heldout.py``'s
``shipped`` does). Writes benchmarks/results/planner_fit_variants.json (about 17 minutes on 2 cores).

    python benchmarks/planner_fit_variants.py [--csv ../shared/validation/calibration.csv] [--workers 2]
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from _heldout import CALIBRATION_CSV, THRESHOLD_PCT, prepared_rows, signed_pct_errors, summary
from _record import write_result

from moetrain.planner import fit
from moetrain.planner.validation import PreparedRow, prepare_all, read_rows, summarize

ROOT = Path(__file__).resolve().parents[1]
UNSEEN_VTRAIN_CSV = ROOT / "benchmarks" / "data" / "vtrain_heldout.csv"
VARIANTS: dict[str, dict] = {
    "shipped": {},
    "linear_loss": {"loss": "linear"},
    "huber_loss_0.05": {"loss_scale": 0.05},
    "huber_loss_0.2": {"loss_scale": 0.2},
    "soft_l1_loss_0.1": {"loss": "soft_l1"},
    "cauchy_loss_0.1": {"loss": "cauchy"},
    "family_weight_0.5": {"family_weight_power": 0.5},
    "family_weight_1": {"family_weight_power": 1.0},
    "per_arch_memory": {"per_arch_params": ("gemm_max", "memory")},
    "per_arch_attention": {"per_arch_params": ("gemm_max", "attention")},
    "per_arch_memory_attention": {"per_arch_params": ("gemm_max", "memory", "attention")},
    "memory_at_h100_measurement": {"fixed": {"memory": 0.89}},
    "nar21_layout_from_sc21_script": {},
}
# Megatron-LM examples/sc21/run_table_1.sh, per model (keyed by hidden size): MBS, and the virtual stages
# per rank that --num-layers-per-virtual-pipeline-stage gives (layers / pp / that value; 1 where unset).
SC21_MICRO_BATCH_AND_VPP: dict[int, tuple[int, int]] = {
    2304: (16, 1), 3072: (16, 1), 4096: (16, 1), 6144: (8, 1), 8192: (4, 1),
    10240: (2, 3), 12288: (2, 2), 16384: (1, 2), 20480: (1, 3), 25600: (1, 1),
}


def _sc21_layout(rows: list[PreparedRow]) -> list[PreparedRow]:
    read = []
    for row in rows:
        if row.family == "NAR21":
            micro_batch, vpp = SC21_MICRO_BATCH_AND_VPP[row.workload.model.hidden_size]
            strategy = replace(row.strategy, micro_batch=np.array([micro_batch]), vpp=np.array([vpp]))
            row = replace(row, strategy=strategy)
        read.append(row)
    return read


ROW_READINGS = {"nar21_layout_from_sc21_script": _sc21_layout}


def score(csv: str, name: str) -> dict:
    rows, _ = prepare_all(read_rows(csv))
    rows = ROW_READINGS.get(name, list)(rows)
    options = VARIANTS[name]
    predicted = fit.leave_one_family_out(rows, options=fit.FitOptions(**options))
    signed = signed_pct_errors(rows, predicted)
    errors = np.abs(signed)
    families = {}
    for family in sorted({r.family for r in rows}):
        index = [i for i, r in enumerate(rows) if r.family == family]
        families[family] = {k: round(v, 1) for k, v in summarize(list(errors[index])).items()}
    everything = fit.fit_calibration(rows, options=fit.FitOptions(**options))
    unseen = prepared_rows(read_rows(UNSEEN_VTRAIN_CSV))
    unseen_signed = signed_pct_errors(unseen, fit.predict_rows(unseen, everything))
    return {
        "variant": name,
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "cross_validated": {**{k: round(v, 2) for k, v in summarize(list(errors)).items()},
                            "rows_above_12_pct": int((errors > THRESHOLD_PCT).sum())},
        "families": families,
        "worst_rows": [{"id": rows[i].row_id, "signed_pct_error": round(float(signed[i]), 1)}
                       for i in np.argsort(-errors)[:12]],
        "unseen_vtrain_rows_fit_on_all_rows": {k: round(v, 2) for k, v in summary(unseen_signed).items()},
        "free_parameters": everything.free_parameter_count - len(options.get("fixed", {})),
        "fit_on_all_rows": everything.to_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(score, [str(args.csv)] * len(VARIANTS), list(VARIANTS)))
    for r in results:
        cv = r["cross_validated"]
        print(f"{r['variant']:28s} {r['free_parameters']:2d} parameters   median {cv['median_abs_pct_error']:5.2f} %"
              f"   90th percentile {cv['p90_abs_pct_error']:5.2f} %   above 12 %: {cv['rows_above_12_pct']}"
              f"   unseen vTrain: {r['unseen_vtrain_rows_fit_on_all_rows']['median_abs_pct_error']:5.2f} % /"
              f" {r['unseen_vtrain_rows_fit_on_all_rows']['p90_abs_pct_error']:5.2f} %")
    write_result(ROOT / "benchmarks/results/planner_fit_variants.json", {"variants": results})


if __name__ == "__main__":
    main()
