"""How much of the MoE rows' step the fitted per-MoE-layer overhead carries.

Predicts the MoE rows of shared/validation/calibration.csv (DeepSeek-V3 and GPT-OSS) with the shipped
calibration, once as fitted and once with ``moe_overhead_us`` = 0, and writes the signed errors and the
step breakdown to benchmarks/results/planner_moe_probe.json. With the overhead removed, what is left of
each row's error is what the rest of the model misses on that row.

    python benchmarks/planner_moe_probe.py [--csv ../shared/validation/calibration.csv]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from _heldout import CALIBRATION_CSV
from _record import write_result

from moetrain.planner.calibration import Calibration, load_calibration
from moetrain.planner.validation import predict, prepare_all, read_rows

ROOT = Path(__file__).resolve().parents[1]
# What each row records of the prediction: the step and the terms the MoE overhead competes with.
PARTS = {"step_time_s": lambda c: c.step_time_s, "dp_exposed_s": lambda c: c.dp.exposed_s,
         "a2a_exposed_s": lambda c: c.pipeline.a2a_exposed_s, "bubble_s": lambda c: c.pipeline.bubble_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    args = parser.parse_args()
    shipped = load_calibration()
    without = Calibration(replace(shipped.global_params, moe_overhead_us=0.0), shipped.per_arch, "no MoE overhead")
    rows, _ = prepare_all(read_rows(args.csv))
    result = []
    for row in rows:
        if row.workload.model.moe is None:
            continue
        entry: dict[str, object] = {"id": row.row_id, "measured": row.measured,
                                    "recompute": float(row.strategy.recompute[0])}
        for name, calibration in (("fitted", shipped), ("no_moe_overhead", without)):
            value, out = predict(row, calibration)
            entry[name] = {"signed_error_pct": round((value / row.measured - 1) * 100, 1),
                           **{k: round(float(of(out)[0]), 3) for k, of in PARTS.items()}}
        result.append(entry)
        print(f"{row.row_id:8s} fitted {entry['fitted']['signed_error_pct']:+6.1f} %   "
              f"without MoE overhead {entry['no_moe_overhead']['signed_error_pct']:+6.1f} %")
    out_path = ROOT / "benchmarks/results/planner_moe_probe.json"
    write_result(out_path, {"moe_overhead_us": shipped.global_params.moe_overhead_us, "rows": result})


if __name__ == "__main__":
    main()
