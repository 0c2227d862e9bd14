"""Out-of-sample check on NVIDIA's published DGX Cloud training benchmarks (no fit has seen them).

NVIDIA's DGX Cloud performance recipes (github NVIDIA/dgxc-benchmarking, commit 143b90dd) publish measured
step times of NeMo training runs on 32 to 2,304 H100 GPUs, each with its full layout (TP, PP, VP, CP, EP,
micro-batch, global batch). ``benchmarks/data/dgxc_heldout.csv`` holds 48 of them in the calibration schema:
Nemotron-4 340B, Llama 3.1 70B and 405B (dense) and Grok-1 314B (MoE, 8 experts, top-2), each in BF16 and
FP8. Each row's ``source`` names the README, its table and column, and what was filled in from the model's
released configuration; the settings the READMEs leave out (recompute, optimizer sharding, communication
overlap) are left empty, as ``shared/validation/README.md`` asks.

The script predicts the rows with the shipped calibration, exactly as ``moetrain validate`` would, and
reports two diagnostics that are not predictions of the model:

- ``what_if_overlap_stated``: the same rows with "with DP/TP/PP comm overlap" added to their sources. The
  READMEs do not say whether the NeMo recipes overlapped communication; this shows how much of the error
  that unstated setting carries.
- ``what_if_nemo_performance_mode``: the same, plus "gradients reduced in BF16": NeMo's performance-mode
  recipes turn on TP communication overlap (``MegatronCommOverlapCallback(tp_comm_overlap=True)``), keep
  Megatron-Core's DP overlap, and set ``grad_reduce_in_fp32 = False``, so the gradient buffers and their
  reduction are BF16 (2 B, not the 4 B priced by default). Whether the published runs used that mode is not
  stated in the READMEs either.
- ``fp8_speedup``: the step-time ratio BF16/FP8 of each pair of runs that differ only in precision,
  measured and predicted.

With ``--cv-variant`` it also runs leave-one-family-out cross-validation on ``calibration.csv`` with the
same statement added to the calibration rows whose source names NeMo or Megatron-Bridge (the MBR rows), to
check whether pricing NVIDIA's stacks as overlapped by default would hold up on the calibration file
(``cv_variant_nemo_overlap``, beside ``cv_as_modelled``; about two minutes, needs scipy).

With ``--cv-with-dgxc`` it cross-validates ``calibration.csv`` with these 48 runs as one more family in the
training set of every fold (``cv_trained_with_dgxc``): does more published data make the held-out families
better predicted? The DGX Cloud family is itself predicted by the fit on the calibration families (about two
and a half minutes, needs scipy).

Writes ``benchmarks/results/planner_dgxc_heldout.json``.

    python benchmarks/planner_dgxc_heldout.py [--cv-variant] [--cv-with-dgxc] \
        [--csv ../shared/validation/calibration.csv]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from _heldout import CALIBRATION_CSV, THRESHOLD_PCT, prepared_rows, print_summaries, signed_pct_errors, summary
from _record import write_result

from moetrain.planner.calibration import load_calibration
from moetrain.planner.fit import fits_without_each_family, leave_one_family_out, predict_rows
from moetrain.planner.validation import PreparedRow, prepare_all, read_rows

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_CSV = ROOT / "benchmarks" / "data" / "dgxc_heldout.csv"
OVERLAP_STATEMENT = "; with DP/TP/PP comm overlap"
PERFORMANCE_MODE_STATEMENT = OVERLAP_STATEMENT + "; gradients reduced in BF16"


def _table(row: PreparedRow) -> str:
    """The README table a row comes from: model and precision (DGXC-LLAMA70-FP8-512 → LLAMA70-FP8)."""
    return row.row_id.split("-", 1)[1].rsplit("-", 1)[0]


def _with_statement(raw: list[dict], source_pattern: str = "", statement: str = OVERLAP_STATEMENT) -> list[dict]:
    """The rows with ``statement`` added to every source that ``source_pattern`` matches (all by default)."""
    return [r | {"source": r["source"] + statement} if re.search(source_pattern, r["source"]) else r for r in raw]


def _cross_validated(rows: list[PreparedRow]) -> dict:
    signed = signed_pct_errors(rows, leave_one_family_out(rows))
    return summary(signed) | {"signed_pct_error": {r.row_id: float(e) for r, e in zip(rows, signed)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cv-variant", action="store_true",
                        help="also cross-validate calibration.csv with NeMo/Megatron-Bridge rows priced as overlapped")
    parser.add_argument("--cv-with-dgxc", action="store_true",
                        help="also cross-validate calibration.csv with these runs added to every fold's training set")
    parser.add_argument("--csv", default=str(CALIBRATION_CSV))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_dgxc_heldout.json"))
    args = parser.parse_args()

    calibration = load_calibration()
    raw = read_rows(HELD_OUT_CSV)
    rows = prepared_rows(raw)
    predicted = predict_rows(rows, calibration)
    signed = signed_pct_errors(rows, predicted)
    stated = prepared_rows(_with_statement(raw))
    signed_stated = signed_pct_errors(stated, predict_rows(stated, calibration))
    performance = prepared_rows(_with_statement(raw, statement=PERFORMANCE_MODE_STATEMENT))
    signed_performance = signed_pct_errors(performance, predict_rows(performance, calibration))

    moe = np.array([r.workload.model.moe is not None for r in rows])
    by_table: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_table[_table(row)].append(i)
    tables = {name: {"rows": len(index),
                     "mean_signed_pct_error": float(np.mean(signed[index])),
                     "what_if_overlap_stated_mean_signed_pct_error": float(np.mean(signed_stated[index])),
                     "what_if_nemo_performance_mode_mean_signed_pct_error": float(np.mean(
                         signed_performance[index]))}
              for name, index in by_table.items()}

    index_of = {r.row_id: i for i, r in enumerate(rows)}
    fp8_pairs = [(index_of[r.row_id], index_of[r.row_id.replace("-BF16-", "-FP8-")]) for r in rows
                 if "-BF16-" in r.row_id]
    fp8_speedup = [{"bf16": rows[b].row_id, "fp8": rows[f].row_id, "measured": rows[b].measured / rows[f].measured,
                    "predicted": float(predicted[b] / predicted[f])} for b, f in fp8_pairs]

    row_records = [{"id": r.row_id, "model": r.workload.model.name, "devices": r.num_devices,
                    "tp": int(r.strategy.tp[0]), "pp": int(r.strategy.pp[0]), "vpp": int(r.strategy.vpp[0]),
                    "cp": int(r.strategy.cp[0]), "ep": int(r.strategy.ep[0]), "dp": int(r.strategy.dp[0]),
                    "recompute_inferred": float(r.strategy.recompute[0]), "measured_s": r.measured,
                    "pct_error": float(e), "what_if_overlap_stated_pct_error": float(e2),
                    "what_if_nemo_performance_mode_pct_error": float(e3),
                    "what_if_nemo_performance_mode_recompute_inferred": float(p.strategy.recompute[0])}
                   for r, p, e, e2, e3 in zip(rows, performance, signed, signed_stated, signed_performance)]
    result = {
        "held_out_file": str(HELD_OUT_CSV.relative_to(ROOT)),
        "calibration": "shipped (src/moetrain/planner/calibration_default.yaml)",
        "summary": {
            "all_48_rows": summary(signed),
            "dense_rows": summary(signed[~moe]),
            "moe_rows": summary(signed[moe]),
            "what_if_overlap_stated_all": summary(signed_stated),
            "what_if_overlap_stated_dense": summary(signed_stated[~moe]),
            "what_if_nemo_performance_mode_all": summary(signed_performance),
            "what_if_nemo_performance_mode_dense": summary(signed_performance[~moe]),
        },
        "by_table": tables,
        "fp8_speedup": fp8_speedup,
        "rows_above_12_pct": [r["id"] for r in row_records if abs(r["pct_error"]) > THRESHOLD_PCT],
        "rows": row_records,
    }
    published = prepare_all(read_rows(args.csv))[0] if args.cv_variant or args.cv_with_dgxc else []
    if args.cv_variant:
        variant, _ = prepare_all(_with_statement(read_rows(args.csv), r"NeMo|Megatron-Bridge"))
        result["cv_as_modelled"] = _cross_validated(published)
        result["cv_variant_nemo_overlap"] = _cross_validated(variant)
    if args.cv_with_dgxc:
        # One family for all 48 runs (not one per README table), so that no fold trains on DGX Cloud runs
        # while predicting others of the same source.
        union = published + [replace(r, family="DGXC") for r in rows]
        fits = fits_without_each_family(union)
        predicted_union = leave_one_family_out(union, fits)
        n = len(published)
        result["cv_trained_with_dgxc"] = {
            "calibration_rows": summary(signed_pct_errors(published, predicted_union[:n])),
            "dgxc_rows_fitted_on_calibration_csv": summary(signed_pct_errors(rows, predicted_union[n:])),
            "signed_pct_error": {r.row_id: float(e) for r, e in zip(
                published, signed_pct_errors(published, predicted_union[:n]))},
            "fits": {family: {"global": asdict(c.global_params), "per_arch": c.per_arch} for family, c in fits.items()}}
    write_result(args.out, result)
    print_summaries(result["summary"])
    for name in ("cv_as_modelled", "cv_variant_nemo_overlap"):
        if name in result:
            cv = result[name]
            print(f"{name:40s} median {cv['median_abs_pct_error']:5.1f} %  p90 {cv['p90_abs_pct_error']:5.1f} %  "
                  f"above 12 %: {cv['rows_above_12_pct']}/{cv['n']}")
    if "cv_trained_with_dgxc" in result:
        print_summaries({f"cv_trained_with_dgxc: {k}": v for k, v in result["cv_trained_with_dgxc"].items()
                         if k in ("calibration_rows", "dgxc_rows_fitted_on_calibration_csv")})
    for name, table in tables.items():
        print(f"{name:18s} rows {table['rows']:2d}  mean signed {table['mean_signed_pct_error']:+6.1f} %  "
              f"(overlap stated: {table['what_if_overlap_stated_mean_signed_pct_error']:+6.1f} %, "
              f"performance mode: {table['what_if_nemo_performance_mode_mean_signed_pct_error']:+6.1f} %)")


if __name__ == "__main__":
    main()
