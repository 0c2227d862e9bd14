"""Do two published sources agree on the same training run? A floor for any one set of efficiencies.

Finds rows of different sources (shared/validation/calibration.csv and the held-out files) that describe
the same workload (same hardware, precision, model shape, sequence length, global batch, device count, TP,
PP and CP; the vocabulary and micro-batch may differ) and puts each measurement on one scale: hardware
TFLOP/s per device, with this project's FLOP count (``moetrain.costs.flops`` times the recompute factor the
simulator uses for the row), so that a step-time row and a TFLOP/s row of the same run are compared
directly. No efficiency enters: the hardware factor depends on the recompute level alone.

When two sources measure the same workload g apart, a model with one efficiency per hardware and
operation class is at least about g/2 off on one of them, and under leave-one-family-out
cross-validation the held-out source carries the whole gap. The script also lists, within one source,
layouts without a pipeline measured at several micro-batches, with the measured and predicted spread.

    python benchmarks/planner_source_consistency.py [--csv ../shared/validation/calibration.csv]
        [--also benchmarks/data/vtrain_heldout.csv benchmarks/data/dgxc_heldout.csv]

``--also`` adds rows of the same schema from other files (the held-out vTrain and DGX Cloud runs by default).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from _heldout import CALIBRATION_CSV
from _record import write_result

from moetrain.costs.flops import training_flops_per_token
from moetrain.planner.calibration import Calibration, load_calibration
from moetrain.planner.validation import PreparedRow, predict, prepare_all, read_rows

ROOT = Path(__file__).resolve().parents[1]
SHAPE_COLUMNS = ("hardware", "precision", "layers", "hidden", "ffn_hidden", "heads", "num_experts", "topk",
                 "seq_len", "global_batch_seqs", "num_devices", "tp", "pp", "cp")


def source_of(family: str) -> str:
    """The publication a family comes from: the calibration file's and the held-out vTrain rows are one."""
    return "vTrain" if family.startswith("VTRAIN") else family


def hardware_tflops_per_device(row: PreparedRow, calibration: Calibration) -> float:
    """The row's measurement as hardware TFLOP/s per device, on this project's FLOP count."""
    _, out = predict(row, calibration)  # only the recompute factor is used: no efficiency enters
    w = row.workload
    tokens = w.global_batch * w.seq_len
    recompute_factor = float(out.hardware_flops_factor[0])
    hardware_flops = training_flops_per_token(w.model, w.seq_len) * tokens * recompute_factor
    # A ``model`` FLOP rate counts no recompute; a ``hardware`` one counts it as this project does.
    to_hardware = recompute_factor if row.flops_convention == "model" else 1.0
    return {
        "step_time_s": lambda v: hardware_flops / v / row.num_devices / 1e12,
        "tokens_per_s_per_device": lambda v: hardware_flops / tokens * v / 1e12,
        "tflops_per_device": lambda v: v * to_hardware,
        "mfu": lambda v: v * w.cluster.peak_flops("bf16") / 1e12 * to_hardware,
    }[row.metric](row.measured)


def workload_without_pipeline(members: list[PreparedRow]) -> bool:
    """Several micro-batches of one layout with PP 1: no bubble, so only the GEMM shapes change."""
    return (len({int(r.strategy.micro_batch[0]) for r in members}) >= 3
            and all(int(r.strategy.pp[0]) == 1 for r in members))


def micro_batch_spread(members: list[PreparedRow], calibration: Calibration) -> dict:
    """Spread (max/min − 1) over the micro-batches of the measured and of the predicted metric."""
    members = sorted(members, key=lambda r: int(r.strategy.micro_batch[0]))
    measured = [hardware_tflops_per_device(r, calibration) for r in members]
    predicted = [predict(r, calibration)[0] for r in members]
    # The rows share one metric (one source), so the spread of the predicted metric is comparable.
    measured_metric = [r.measured for r in members]
    return {"ids": [r.row_id for r in members], "micro_batches": [int(r.strategy.micro_batch[0]) for r in members],
            "hardware_tflops_per_device": [round(v, 1) for v in measured],
            "measured_spread_pct": round(100 * (max(measured_metric) / min(measured_metric) - 1), 1),
            "predicted_spread_pct": round(100 * (max(predicted) / min(predicted) - 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CALIBRATION_CSV)
    held_out = [ROOT / "benchmarks/data/vtrain_heldout.csv", ROOT / "benchmarks/data/dgxc_heldout.csv"]
    parser.add_argument("--also", type=Path, nargs="*", default=held_out)
    args = parser.parse_args()
    raw = {r["id"]: r for path in [args.csv, *args.also] for r in read_rows(path)}
    rows, _ = prepare_all(list(raw.values()))
    calibration = load_calibration()
    groups: dict[tuple, list[PreparedRow]] = defaultdict(list)
    for row in rows:
        if row.metric != "peak_memory_gib":
            groups[tuple(raw[row.row_id][c] for c in SHAPE_COLUMNS)].append(row)
    result, within = [], []
    for key, members in groups.items():
        by_source: dict[str, list[float]] = defaultdict(list)
        entries = []
        for r in members:
            value = round(hardware_tflops_per_device(r, calibration), 1)
            by_source[source_of(r.family)].append(value)
            entries.append({"id": r.row_id, "source": source_of(r.family),
                            "micro_batch": int(r.strategy.micro_batch[0]), "vocab": r.workload.model.vocab_size,
                            "hardware_tflops_per_device": value})
        if len(by_source) < 2:
            if workload_without_pipeline(members):
                within.append(micro_batch_spread(members, calibration))
            continue
        ranges = {src: (min(v), max(v)) for src, v in sorted(by_source.items())}
        # The least the sources disagree by: the gap between their ranges over the micro-batches they
        # measured (0 when the ranges overlap), relative to the lower one.
        lows, highs = [lo for lo, _ in ranges.values()], [hi for _, hi in ranges.values()]
        gap = max(0.0, max(lows) / min(highs) - 1.0)
        workload = dict(zip(SHAPE_COLUMNS, key))
        result.append({"workload": workload, "rows": entries,
                       "tflops_range_by_source": {k: list(v) for k, v in ranges.items()},
                       "least_disagreement_pct": round(100 * gap, 1)})
        print(f"{workload['layers']} layers × {workload['hidden']}, {workload['num_devices']} × "
              f"{workload['hardware']}, TP {workload['tp']} PP {workload['pp']}, batch "
              f"{workload['global_batch_seqs']}: " + ", ".join(
                  f"{src} {lo:.1f}" + (f"-{hi:.1f}" if hi > lo else "") for src, (lo, hi) in ranges.items())
              + f" TFLOP/s per device (at least {100 * gap:.1f} % apart)")
        for e in entries:
            print(f"    {e['id']:14s} micro-batch {e['micro_batch']:3d}  {e['hardware_tflops_per_device']:6.1f}")
    print("One source, one layout without pipeline parallelism (no bubble), several micro-batches:")
    for w in within:
        print(f"    {', '.join(w['ids'])}\n        micro-batches {w['micro_batches']}: hardware TFLOP/s per device "
              f"{w['hardware_tflops_per_device']}; spread measured {w['measured_spread_pct']:.1f} %, "
              f"predicted {w['predicted_spread_pct']:.1f} %")
    write_result(ROOT / "benchmarks/results/planner_source_consistency.json",
                 {"same_workload_groups": result, "one_source_micro_batch_spread": within})


if __name__ == "__main__":
    main()
