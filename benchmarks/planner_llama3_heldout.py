"""Out-of-sample check on the Llama 3 paper's 405B pre-training runs (no fit has seen them).

Dubey et al. 2024 ("The Llama 3 Herd of Models", arXiv:2407.21783) give in Table 4 the layout and the
achieved speed of Llama 3 405B's pre-training on 8,192 and 16,384 H100 GPUs: TP 8, PP 16, CP 1 or 16, the
data-parallel size, the sequence length, the batch per data-parallel rank (16M tokens per batch) and the
BF16 MFU (43, 41 and 38 %). Issue 42 keeps these runs out of every fit so that they check the result.
``benchmarks/data/llama3_heldout.csv`` holds them in the calibration schema; each row's ``source`` says what
the paper states and what is read from its text (§3.3.2: FSDP that does not reshard the weights after the
forward, ZeRO-2; an interleaved schedule whose first chunk holds only the embedding and whose last holds
only the head and loss, so chunks of one layer, 8 per rank).

The script predicts the rows with the shipped calibration, as ``moetrain validate`` would, and adds one
diagnostic that is not a prediction of the model:

- ``what_if_stages_per_rank``: the same rows with 1, 2 and 4 virtual stages per rank instead of 8: how much
  of the result rests on reading the interleaving from the paper's text.

Writes ``benchmarks/results/planner_llama3_heldout.json``.

    python benchmarks/planner_llama3_heldout.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _heldout import prepared_rows, signed_pct_errors, summary
from _record import write_result

from moetrain.planner.calibration import load_calibration
from moetrain.planner.fit import predict_rows
from moetrain.planner.validation import read_rows

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_CSV = ROOT / "benchmarks" / "data" / "llama3_heldout.csv"
OTHER_STAGES_PER_RANK = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_llama3_heldout.json"))
    args = parser.parse_args()

    raw = read_rows(HELD_OUT_CSV)
    rows = prepared_rows(raw)
    shipped = load_calibration()
    predicted = predict_rows(rows, shipped)
    errors = signed_pct_errors(rows, predicted)

    what_if = {}
    for vpp in OTHER_STAGES_PER_RANK:
        variant = prepared_rows([{**row, "vpp": str(vpp)} for row in raw])
        what_if[str(vpp)] = {r.row_id: float(e) for r, e in
                             zip(variant, signed_pct_errors(variant, predict_rows(variant, shipped)))}

    result = {
        "held_out_file": str(HELD_OUT_CSV.relative_to(ROOT)),
        "calibration": "shipped (src/moetrain/planner/calibration_default.yaml)",
        "summary": summary(errors),
        # MFU times the cluster's BF16 peak (989.4 TFLOP/s for the H100: 430 TFLOP/s at 43 % in the paper)
        "rows": [{"id": r.row_id, "measured_mfu": r.measured, "predicted_mfu": float(p),
                  "measured_tflops_per_gpu": r.measured * r.workload.cluster.peak_flops("bf16") / 1e12,
                  "predicted_tflops_per_gpu": float(p) * r.workload.cluster.peak_flops("bf16") / 1e12,
                  "signed_pct_error": float(e)} for r, p, e in zip(rows, predicted, errors)],
        "what_if_stages_per_rank": what_if,
    }
    write_result(args.out, result)
    for row in result["rows"]:
        print(f"{row['id']:22s} measured {row['measured_mfu']:.3f}  predicted {row['predicted_mfu']:.4f}  "
              f"({row['signed_pct_error']:+.1f} %; {row['predicted_tflops_per_gpu']:.0f} TFLOP/s per GPU)")
    for vpp, by_row in what_if.items():
        print(f"with {vpp} stage(s) per rank: " + ", ".join(f"{k} {v:+.1f} %" for k, v in by_row.items()))
    s = result["summary"]
    print(f"median |error| {s['median_abs_pct_error']:.1f} %, largest {float(np.max(np.abs(errors))):.1f} %, "
          f"n={s['n']}")


if __name__ == "__main__":
    main()
