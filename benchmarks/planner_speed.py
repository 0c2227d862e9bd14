"""Planner speed: candidate layouts scored per minute, and the full Pangu Ultra MoE 718B search.

    python benchmarks/planner_speed.py [--global-batch 1536] [--out benchmarks/results/planner_speed.json]

Runs the same search as ``moetrain plan --model pangu-ultra-moe-718b --cluster atlas-800t-a2
--devices 6144 --seq-len 8192 --global-batch 1536`` (TP, SP, PP, VPP, EP, ETP, CP, DP, ZeRO,
micro-batch, recompute, all-to-all kind and overlap), several times, and records the median. As the
command does, it times the screen's best layouts with the timeline and re-ranks them under the shipped
calibration's held-out fits; the seconds include both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_result  # noqa: E402

from moetrain.config import load_cluster_config, load_model_config  # noqa: E402
from moetrain.planner.calibration import load_calibration  # noqa: E402
from moetrain.planner.search import SearchOptions, search  # noqa: E402
from moetrain.planner.workload import Workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pangu-ultra-moe-718b")
    parser.add_argument("--cluster", default="atlas-800t-a2")
    parser.add_argument("--devices", type=int, default=6144)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/planner_speed.json")
    args = parser.parse_args()

    model, cluster = load_model_config(args.model), load_cluster_config(args.cluster)
    workload = Workload(model, cluster, args.seq_len, args.global_batch)
    calibration = load_calibration()
    eff = calibration.for_device(cluster.device)
    held_out = calibration.held_out_for_device(cluster.device)
    runs = []
    for _ in range(args.repeats):
        result = search(workload, args.devices, eff, SearchOptions(top_k=5, held_out=held_out))
        check = result.calibration_check
        runs.append({"candidates_evaluated": result.candidates_evaluated, "feasible": result.feasible,
                     "seconds": result.seconds, "calibration_check_seconds": check.seconds if check else 0.0,
                     "candidates_per_minute": result.candidates_evaluated / result.seconds * 60})
        print(f"{result.candidates_evaluated:,} candidates in {result.seconds:.2f} s "
              f"({runs[-1]['candidates_per_minute']:,.0f} per minute)")
    winner = result.top.to_parallel(0).model_dump()
    write_result(args.out, {
        "search": {"model": args.model, "cluster": args.cluster, "devices": args.devices, "seq_len": args.seq_len,
                   "global_batch": args.global_batch},
        "cpu_count": os.cpu_count(),
        "load_average_1min_at_end": os.getloadavg()[0],
        "runs": runs,
        "median_seconds": statistics.median(r["seconds"] for r in runs),
        "median_candidates_per_minute": statistics.median(r["candidates_per_minute"] for r in runs),
        "winner": winner,
        "winner_step_time_s": float(result.timeline_step_s[0]),
        "winner_memory_gib": result.ranked[0].memory_gib,
        # The winner may be up to search.TIE_TOLERANCE slower than the fastest layout, when it needs less memory.
        "fastest_step_time_s": float(min(result.timeline_step_s)),
        "calibration_check": check.summary() if check else None,
    })


if __name__ == "__main__":
    main()
