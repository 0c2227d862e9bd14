"""``moetrain validate``: predict published runs and score the simulator against them."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from moetrain.cli.common import output_file
from moetrain.errors import UserError
from moetrain.planner.calibration import load_calibration

HELP = "predict each row of a validation CSV (shared/validation schema) and report the errors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.csv", help="rows in the schema of shared/validation/README.md")
    parser.add_argument("--calibration", help="efficiency file to predict with (default: the shipped fit)")
    parser.add_argument("--cv", action="store_true",
                        help="leave-one-family-out: predict each family with parameters fitted on the others")
    parser.add_argument("--fit", metavar="OUT.yaml", help="fit the efficiencies on all rows and write them here")
    parser.add_argument("--json", action="store_true", help="print one JSON object with rows and summary")
    parser.add_argument("--explain", metavar="ROW",
                        help="for the row with this id: each term's share of the predicted step and the "
                             "sensitivity of its error to each fitted efficiency; with --cv, under the "
                             "calibration's fit without the row's family, and which parameters moved that miss")


def validate(args: argparse.Namespace) -> dict:
    # lazy: the fit and the simulator load when the command runs, not when the parser imports every command
    from moetrain.planner.fit import fit_calibration, fits_without_each_family, leave_one_family_out, predict_rows
    from moetrain.planner.validation import abs_pct_errors, prepare_all, read_rows, require_simulable, summarize

    if args.fit:
        output_file(args.fit, "--fit", "calibration.yaml")
    rows = read_rows(args.file)
    # read before the rows are prepared (each sizes its recomputation by memory), so a bad file stops first
    calibration = None if args.fit else load_calibration(args.calibration)
    prepared, skipped = prepare_all(rows)
    require_simulable(prepared, skipped, args.file)
    result: dict = {}
    if calibration is None:
        calibration = fit_calibration(prepared, note=f"moetrain validate {args.file} --fit {args.fit}"
                                      + (" --cv" if args.cv else ""))
    held_out_fits = fits_without_each_family(prepared) if args.cv else {}
    predicted = leave_one_family_out(prepared, held_out_fits) if args.cv else predict_rows(prepared, calibration)
    measured = [r.measured for r in prepared]
    errors = abs_pct_errors(predicted, measured)
    result["mode"] = "leave-one-family-out" if args.cv else "calibrated"
    result["free_parameters"] = calibration.free_parameter_count
    result["rows"] = [
        {"id": r.row_id, "family": r.family, "metric": r.metric, "measured": r.measured,
         "predicted": float(p), "abs_pct_error": float(e)}
        for r, p, e in zip(prepared, predicted, errors)
    ]
    result["unsimulated"] = [{"id": s.row_id, "family": s.family, "reason": s.reason} for s in skipped]
    result["summary"] = summarize(list(errors))
    families: dict[str, list[float]] = {}
    for row in result["rows"]:
        families.setdefault(row["family"], []).append(row["abs_pct_error"])
    result["families"] = {f: summarize(v) for f, v in sorted(families.items())}
    if args.fit:
        # The file records how well it predicts the rows: out of sample with --cv (each family predicted
        # by a fit on the others), in sample otherwise; `simulate` and `plan` print it. With --cv it also
        # keeps the fits themselves, under which `plan` re-ranks its layouts.
        calibration = replace(calibration, held_out_fits=held_out_fits, accuracy={
            "mode": "leave-one-family-out" if args.cv else "in-sample", "rows": result["summary"]["n"],
            "file": Path(args.file).name,
            "median_abs_pct_error": round(result["summary"]["median_abs_pct_error"], 2),
            "p90_abs_pct_error": round(result["summary"]["p90_abs_pct_error"], 2)})
        calibration.save(args.fit)
        result["fitted"] = calibration.to_dict()
    return result


def explain_row(args: argparse.Namespace):
    """The ``--explain ROW`` report for one row of ``args.file`` (with ``--cv``: held out), refused in one
    line when the id is not in the file, the row cannot be simulated, or, held out, the calibration has no
    fit without the row's family."""
    # lazy: as in ``validate``
    from moetrain.planner.explain import explain, explain_held_out
    from moetrain.planner.validation import prepare_row, read_rows

    rows = read_rows(args.file)
    match = [row for row in rows if row["id"].strip() == args.explain.strip()]
    if not match:
        ids = [row["id"] for row in rows]
        shown = ", ".join(ids[:5]) + (f" … ({len(ids)} in all)" if len(ids) > 5 else "")
        raise UserError(f"--explain {args.explain}: no row with that id in {args.file}; its ids are {shown}")
    prepared = prepare_row(match[0])
    if not hasattr(prepared, "workload"):
        raise UserError(f"--explain {args.explain}: the row cannot be simulated ({prepared.reason})")
    calibration = load_calibration(args.calibration)
    if not args.cv:
        return explain(prepared, calibration)
    if prepared.family not in calibration.held_out_fits:
        kept = ", ".join(sorted(calibration.held_out_fits)) or "none"
        raise UserError(f"--explain {args.explain} --cv: the calibration holds no fit without family "
                        f"{prepared.family} (it holds: {kept}); write one with `moetrain validate {args.file} "
                        "--fit OUT.yaml --cv` and pass --calibration OUT.yaml, or drop --cv")
    return explain_held_out(prepared, calibration)


def run(args: argparse.Namespace) -> int:
    if args.explain:
        from moetrain.planner.explain import format_explanation  # lazy: as in ``validate``

        if args.fit:
            raise UserError("--explain explains one row under a calibration already written; drop --fit")
        explanation = explain_row(args)
        print(json.dumps(explanation.to_dict(), indent=2) if args.json else format_explanation(explanation))
        return 0
    result = validate(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'id':16s} {'metric':24s} {'measured':>11s} {'predicted':>11s} {'error':>8s}")
    for row in result["rows"]:
        err = (row["predicted"] - row["measured"]) / row["measured"] * 100
        print(f"{row['id']:16s} {row['metric']:24s} {row['measured']:11.4g} {row['predicted']:11.4g} {err:+7.1f}%")
    if result["unsimulated"]:
        print("\nnot simulated:")
        for row in result["unsimulated"]:
            print(f"  {row['id']:16s} {row['reason']}")
    print("\nper family (median / 90th percentile absolute % error, rows):")
    for family, s in result["families"].items():
        print(f"  {family:12s} {s['median_abs_pct_error']:6.1f} {s['p90_abs_pct_error']:6.1f}  {s['n']}")
    s = result["summary"]
    print(f"\n{result['mode']}: median |error| {s['median_abs_pct_error']:.1f}%, 90th percentile "
          f"{s['p90_abs_pct_error']:.1f}%, n={s['n']} ({result['free_parameters']} free parameters)")
    if "fitted" in result:
        print(f"fitted efficiencies written to {args.fit}")
    return 0
