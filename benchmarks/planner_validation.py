"""The simulator against the published runs: ``moetrain validate`` on calibration.csv, recorded.

    python benchmarks/planner_validation.py          # the shipped calibration: planner_validation_calibrated.json
    python benchmarks/planner_validation.py --cv     # leave-one-family-out: planner_validation_cv.json

The second is the source of the headline accuracy figure (README's Status, docs/planner.md "How accurate
it is", benchmarks/README.md's planner rows): each family of published runs predicted by efficiencies
fitted on the other families only (about a minute).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _heldout import CALIBRATION_CSV
from _record import write_result

from moetrain.cli import build_parser
from moetrain.cli.validate import validate

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    parser.add_argument("--cv", action="store_true", help="leave-one-family-out instead of the shipped calibration")
    args = parser.parse_args()
    result = validate(build_parser().parse_args(["validate", str(args.csv), *(["--cv"] if args.cv else [])]))
    summary = result["summary"]
    print(f"{result['mode']}: median |error| {summary['median_abs_pct_error']:.2f} %, 90th percentile "
          f"{summary['p90_abs_pct_error']:.2f} %, n={summary['n']}")
    write_result(RESULTS / f"planner_validation_{'cv' if args.cv else 'calibrated'}.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
