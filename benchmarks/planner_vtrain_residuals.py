"""Residual analysis of the vTrain rows (VTRAIN-M: Megatron-DeepSpeed GPT on 64-512 A100, TP×PP×DP×micro-batch).

Fits the efficiencies on every other family (the leave-one-family-out fit that predicts VTRAIN-M), predicts
the 54 rows with it and with the shipped calibration, and writes to
benchmarks/results/planner_vtrain_residuals.json:

- each row's layout, measured step, signed held-out and in-sample error, and the shares of the predicted
  step taken by the pipeline bubble, the exposed data-parallel traffic and the tensor-parallel traffic;
- the mean signed held-out error grouped by tp, pp, dp, micro-batch, micro-batches per step, hidden size
  and device count (without the four rows no mechanism reproduces: -014, -016, -042, -044);
- a least-squares fit of log(predicted/measured) on each share (a coefficient c says that component
  would have to be (1 − c) times its priced size);
- candidate mechanisms checked on the held-out predictions (same fit): twice and four times the
  data-parallel bytes; half the inter-node bandwidth; an approximate GEMM wave-quantisation factor (not in
  the model);
- a non-negative least-squares fit of the measured steps on the priced parts (compute and bubble, exposed
  TP traffic, exposed DP traffic), and a fit of the efficiencies on this family alone;
- with ``--cv-variants``: the full leave-one-family-out result for the variants that change other
  families too (fp16 gradients reduced at 4 B; a robust soft-L1 fit loss). Several minutes each; a run
  without the flag keeps the variants of the last run that had it.

"scatter" is the median absolute error after removing the family's median bias: what a mechanism does to
the spread between layouts, apart from the level the other families set.

    python benchmarks/planner_vtrain_residuals.py [--csv ../shared/validation/calibration.csv] [--cv-variants]
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
from _heldout import CALIBRATION_CSV
from _record import write_result
from scipy.optimize import nnls

import moetrain.planner.fit as fit
from moetrain.planner.calibration import load_calibration
from moetrain.planner.validation import PreparedRow, abs_pct_errors, predict, prepare_all, read_rows, summarize

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "VTRAIN-M"
UNEXPLAINED = ("VTRAIN-M-014", "VTRAIN-M-016", "VTRAIN-M-042", "VTRAIN-M-044")
A100_SMS = 108


def _spread(predicted: np.ndarray, measured: np.ndarray, keep: np.ndarray) -> dict[str, float]:
    log_ratio = np.log(predicted / measured)
    bias = float(np.median(log_ratio[keep]))
    errors = abs_pct_errors(predicted, measured)
    return {"median_abs_pct_error": float(np.median(errors)), "p90_abs_pct_error": float(np.percentile(errors, 90)),
            "median_bias_pct": 100.0 * bias,
            "scatter_pct": 100.0 * float(np.median(np.abs(log_ratio[keep] - bias)))}


def _wave_time_factor(tokens: int, hidden: int, tp: int, tile_rows: int = 128, tile_cols: int = 256) -> float:
    """GEMM time multiplier from wave quantisation (NVIDIA Deep Learning Performance Guide, "Matrix
    multiplication background"): a GEMM runs in waves of one output tile per SM, and the last wave is on
    average half empty, so efficiency ≈ W/(W + 0.5) with W = tiles/SMs. Averaged over the forward,
    input-gradient and weight-gradient GEMMs of a Megatron layer (QKV, output projection, two 4h MLP
    matrices), weighted by FLOPs. Approximate: cuBLAS picks among tile shapes."""
    shapes = [(3 * hidden / tp, hidden, 3.0), (hidden, hidden / tp, 1.0), (4 * hidden / tp, hidden, 4.0),
              (hidden, 4 * hidden / tp, 4.0)]
    total = weight = 0.0
    for n, k, flops in shapes:
        for rows, cols in ((tokens, n), (tokens, k), (k, n)):
            waves = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols) / A100_SMS
            total += flops * (waves + 0.5) / waves
            weight += flops
    return total / weight


def _cv(rows: list[PreparedRow], options: fit.FitOptions | None = None) -> dict[str, object]:
    measured = np.array([r.measured for r in rows])
    errors = abs_pct_errors(fit.leave_one_family_out(rows, options=options), measured)
    in_sample = abs_pct_errors(fit.predict_rows(rows, fit.fit_calibration(rows, options=options)), measured)
    families = {f: {"cv": summarize(list(errors[index])), "in_sample": summarize(list(in_sample[index]))}
                for f in sorted({r.family for r in rows})
                for index in [[i for i, r in enumerate(rows) if r.family == f]]}
    return {"all": summarize(list(errors)), "in_sample": summarize(list(in_sample)),
            "rows_above_12pct": int((errors > 12).sum()), "families": families}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    parser.add_argument("--cv-variants", action="store_true", help="also run the full cross-validation of variants")
    args = parser.parse_args()
    rows, _ = prepare_all(read_rows(args.csv))
    family = [r for r in rows if r.family == FAMILY]
    held_out_fit = fit.fit_calibration([r for r in rows if r.family != FAMILY])
    shipped = load_calibration()
    measured = np.array([r.measured for r in family])
    keep = np.array([r.row_id not in UNEXPLAINED for r in family])
    held_out = fit.predict_rows(family, held_out_fit)
    in_sample = fit.predict_rows(family, shipped)

    table = []
    shares = defaultdict(list)
    for i, row in enumerate(family):
        s = row.strategy
        _, out = predict(row, held_out_fit)
        step = float(out.step_time_s[0])
        share = {"bubble": float(out.pipeline.bubble_s[0]) / step, "dp_exposed": float(out.dp.exposed_s[0]) / step,
                 "tp_comm": float(out.pipeline.tp_exposed_s[0]) / step, "p2p": float(out.pipeline.p2p_s[0]) / step}
        for key, value in share.items():
            shares[key].append(value)
        table.append({
            "id": row.row_id, "hidden": row.workload.model.hidden_size, "layers": row.workload.model.num_layers,
            "devices": row.num_devices, "tp": int(s.tp[0]), "pp": int(s.pp[0]), "dp": int(s.dp[0]),
            "micro_batch": int(s.micro_batch[0]), "micro_batches": int(round(float(out.num_micro_batches[0]))),
            "measured_s": row.measured, "held_out_pct": 100 * (held_out[i] / measured[i] - 1),
            "in_sample_pct": 100 * (in_sample[i] / measured[i] - 1),
            **{f"{k}_share": round(v, 4) for k, v in share.items()},
        })

    grouped: dict[str, dict[str, dict[str, float]]] = {}
    for key in ("tp", "pp", "dp", "micro_batch", "micro_batches", "hidden", "devices"):
        groups: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for entry, kept in zip(table, keep):
            if kept:
                groups[entry[key]].append((entry["held_out_pct"], entry["in_sample_pct"]))
        grouped[key] = {str(k): {"n": len(v), "held_out_mean_pct": float(np.mean([a for a, _ in v])),
                                 "in_sample_mean_pct": float(np.mean([b for _, b in v]))}
                        for k, v in sorted(groups.items())}

    log_ratio = np.log(held_out / measured)[keep]
    regression = {}
    for key, values in shares.items():
        design = np.c_[np.ones(keep.sum()), np.array(values)[keep]]
        coef, *_ = np.linalg.lstsq(design, log_ratio, rcond=None)
        residual = log_ratio - design @ coef
        regression[key] = {"coefficient": float(coef[1]), "residual_std_pct": 100 * float(residual.std())}
    regression["none"] = {"residual_std_pct": 100 * float(log_ratio.std())}

    checks = {"as_modelled": _spread(held_out, measured, keep)}
    for factor in (2.0, 4.0):
        scaled = [replace(r, workload=replace(r.workload, grad_bytes=r.workload.grad_bytes * factor)) for r in family]
        checks[f"dp_bytes_x{factor:g}"] = _spread(fit.predict_rows(scaled, held_out_fit), measured, keep)
    waves = []
    for i, row in enumerate(family):
        _, out = predict(row, held_out_fit)
        gemm_share = float((out.compute.attention_s[0] + out.compute.dense_ffn_s[0]) / out.step_time_s[0])
        factor = _wave_time_factor(int(row.strategy.micro_batch[0]) * row.workload.seq_len,
                                   row.workload.model.hidden_size, int(row.strategy.tp[0]))
        waves.append(held_out[i] * (1 + gemm_share * (factor - 1)))
    checks["gemm_wave_quantisation_approx"] = _spread(np.array(waves), measured, keep)
    # The network instead of the bytes: half the stated inter-node bandwidth for every collective.
    slower = [replace(r, workload=replace(r.workload, cluster=r.workload.cluster.model_copy(
        update={"inter_node_gbps": r.workload.cluster.inter_node_gbps / 2}))) for r in family]
    checks["inter_node_bandwidth_half"] = _spread(fit.predict_rows(slower, held_out_fit), measured, keep)

    # Non-negative least squares of the measured steps on the priced parts (relative residuals, rows with
    # a mechanism only): how much each part would have to scale, and what is left per row.
    parts = []
    for row in family:
        _, out = predict(row, held_out_fit)
        pipe = out.pipeline
        parts.append([float(pipe.pipeline_s[0] - pipe.tp_exposed_s[0]), float(pipe.tp_exposed_s[0]),
                      float(out.dp.exposed_s[0])])
    parts_arr = np.array(parts)
    coef, _ = nnls(parts_arr[keep] / measured[keep, None], np.ones(int(keep.sum())))
    refit = parts_arr @ coef
    nnls_fit = {"scale_compute_and_bubble": float(coef[0]), "scale_tp_exposed": float(coef[1]),
                "scale_dp_exposed": float(coef[2]), **_spread(refit, measured, keep),
                "rows_pct": {r.row_id: 100 * float(refit[i] / measured[i] - 1) for i, r in enumerate(family)}}

    # A per-call GEMM cost fitted on this family alone: does a launch cost explain the micro-batch trend?
    family_only = fit.fit_calibration(family)

    result: dict[str, object] = {
        "csv": str(args.csv), "held_out_fit": held_out_fit.global_params.as_dict() | {
            f"{a}.gemm_max": v["gemm_max"] for a, v in held_out_fit.per_arch.items()},
        "excluded_from_trends": list(UNEXPLAINED), "grouped_signed_error": grouped,
        "regression_on_shares": regression, "held_out_checks": checks, "nnls_on_priced_parts": nnls_fit,
        "family_only_fit": family_only.global_params.as_dict() | {
            f"{a}.gemm_max": v["gemm_max"] for a, v in family_only.per_arch.items()},
        "rows": table,
    }
    if args.cv_variants:
        variants: dict[str, object] = {"as_modelled": _cv(rows)}
        fp16_4b = [replace(r, workload=replace(r.workload, grad_bytes=4.0)) if r.workload.precision == "fp16" else r
                   for r in rows]
        variants["fp16_gradients_reduced_at_4B"] = _cv(fp16_4b)
        for scale in (0.1, 0.05):
            variants[f"soft_l1_loss_{scale:g}"] = _cv(rows, fit.FitOptions(loss="soft_l1", loss_scale=scale))
        result["cv_variants"] = variants
    out_path = ROOT / "benchmarks/results/planner_vtrain_residuals.json"
    if not args.cv_variants and out_path.is_file():
        # Keep the (slow) cross-validated variants of an earlier --cv-variants run.
        previous = json.loads(out_path.read_text())
        if "cv_variants" in previous:
            result["cv_variants"] = previous["cv_variants"]
    write_result(out_path, result)
    print(json.dumps({k: result[k] for k in ("grouped_signed_error", "regression_on_shares", "held_out_checks",
                                              "family_only_fit")}, indent=1))
    print(json.dumps({k: v for k, v in result["nnls_on_priced_parts"].items() if k != "rows_pct"}, indent=1))
    if args.cv_variants:
        print(json.dumps(result["cv_variants"], indent=1))


if __name__ == "__main__":
    main()
