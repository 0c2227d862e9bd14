"""Is a held-out fit the best optimum of its training rows, or is the optimizer stuck? One fold, two points.

Leave-one-family-out fits each family's complement from the priors. When two candidate models give the same
fold very different parameters (branch planfit5's fold without MPT: attention 0.23 → 0.16, Hopper
``gemm_max`` 0.66 → 0.78), the question is whether the other point is a lower optimum of the same objective
or a basin the optimizer fell into. For the fold that holds ``--family`` out, and for each calibration file
given with ``--at`` (its ``held_out_fits`` entry for that family), this prints the fold's training objective
(``fit.fit_loss``: same rows, same Huber loss and prior pull as the fit) at that point, then refits from it
(``fit_calibration(start=...)``) and prints the objective there and the held-out family's errors. The model
is the one imported (``model_code`` in the output): this checkout's, or another branch's put first on
PYTHONPATH. Branch planfit5's, as the notes report it (that branch has no ``fit_loss``; this file's fit.py
goes in, less the ``moe_overhead_us`` bound that branch removed). That branch (a60c125) was a local
branch of the session that ran it and is not in this repository, so its figure cannot be rerun here::

    mkdir -p /tmp/pf5 && git archive planfit5 src | tar -x -C /tmp/pf5
    git show planfit6:src/moetrain/planner/fit.py | sed '/"moe_overhead_us": (0.0, 5000.0),/d' \
        > /tmp/pf5/src/moetrain/planner/fit.py
    PYTHONPATH=/tmp/pf5/src python benchmarks/planner_fit_basins.py --family MPT \
        --at /tmp/pf5/src/moetrain/planner/calibration_default.yaml src/moetrain/planner/calibration_default.yaml \
        --out benchmarks/results/planner_fit_basins_planfit5.json

    python benchmarks/planner_fit_basins.py --family MPT --at src/moetrain/planner/calibration_default.yaml \
        OTHER.yaml [--out benchmarks/results/planner_fit_basins.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _heldout import CALIBRATION_CSV, signed_pct_errors
from _record import write_result

import moetrain
from moetrain.planner.calibration import Calibration, load_calibration
from moetrain.planner.fit import fit_calibration, fit_loss, predict_rows
from moetrain.planner.validation import PreparedRow, prepare_all, read_rows

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "moetrain" / "planner" / "calibration_default.yaml"


def _point(calibration: Calibration) -> dict[str, float]:
    values = {p: getattr(calibration.global_params, p) for p in ("gemm_max", "gemm_overhead_us", "moe_overhead_us",
                                                                 "attention", "memory", "fp8_gain", "bus_intra",
                                                                 "bus_inter", "grad_overlap", "tp_overlap")}
    return values | {f"{a}.{p}": v for a, params in sorted(calibration.per_arch.items()) for p, v in params.items()}


def _describe(train: list[PreparedRow], held: list[PreparedRow], calibration: Calibration) -> dict:
    loss = fit_loss(train, calibration)
    errors = signed_pct_errors(held, predict_rows(held, calibration))
    return {"loss": loss.total, "loss_data": loss.data, "loss_prior": loss.prior, "parameters": _point(calibration),
            "held_out_signed_pct_error": {r.row_id: float(e) for r, e in zip(held, errors)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="MPT")
    parser.add_argument("--at", nargs="+", type=Path, default=[SHIPPED])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "planner_fit_basins.json")
    args = parser.parse_args()
    rows, _ = prepare_all(read_rows(args.csv))  # the unsimulable rows are in no fit either
    train = [r for r in rows if r.family != args.family]
    held = [r for r in rows if r.family == args.family and r.metric != "peak_memory_gib"]
    points = {}
    for path in args.at:
        fold = load_calibration(path).held_out_fits[args.family]
        refit = fit_calibration(train, start=fold)
        points[str(path)] = {"as_stored": _describe(train, held, fold), "refit_from_it": _describe(train, held, refit)}
        for name, point in points[str(path)].items():
            print(f"{path} {name:14s} loss {point['loss']:.6f} (data {point['loss_data']:.6f}, prior "
                  f"{point['loss_prior']:.6f})  " + "  ".join(f"{k} {v:.3f}" for k, v in point["parameters"].items()
                                                              if k in ("attention", "hopper.gemm_max")))
    # the cost model that ran: this checkout's, or another branch's through PYTHONPATH (see the docstring)
    write_result(args.out, {"family": args.family, "training_rows": len(train), "model_code": moetrain.__file__,
                            "points": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
