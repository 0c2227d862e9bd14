"""How well the analytic screen stands in for the event-driven timeline on paired (overlapped) layouts.

    python benchmarks/planner_screen_vs_timeline.py [--layouts 300] [--out FILE.json]

``moetrain plan`` scores every layout with the vectorised screen and replays only a few dozen with the
timeline, so a layout the screen misprices may never be timed. For six searches this script takes the
screen's best ``--layouts`` paired layouts that fit memory, replays each with the timeline, and reports the
ratio timeline/screen (its spread is what misranks layouts), the fastest timed layout and the screen rank it
had, how far the best of the screen's ten was from it, and the winner ``moetrain plan``'s search returns.
Runs in about a minute on the 2-core CPU machine; the same API exists at earlier commits, so the figures
can be compared across revisions. Writes ``benchmarks/results/planner_screen_vs_timeline.json`` by default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_result  # noqa: E402

from moetrain.config import load_cluster_config, load_model_config  # noqa: E402
from moetrain.planner.calibration import load_calibration  # noqa: E402
from moetrain.planner.costmodel import evaluate  # noqa: E402
from moetrain.planner.search import (  # noqa: E402
    MEMORY_LIMIT_FRACTION,
    SearchOptions,
    SearchSpace,
    describe,
    enumerate_strategies,
    search,
    timeline_step,
)
from moetrain.planner.strategy import Strategies  # noqa: E402
from moetrain.planner.workload import Workload  # noqa: E402

SEARCHES = [  # model, cluster, devices, sequence length, global batch (sequences)
    ("qwen3-30b-a3b", "h100-sxm-80gb", 64, 4096, 256),
    ("mixtral-8x7b", "h100-sxm-80gb", 64, 4096, 256),
    ("qwen3-235b-a22b", "h100-sxm-80gb", 256, 4096, 1024),
    ("deepseek-v3-671b", "h800-sxm-80gb", 2048, 4096, 15360),
    ("pangu-ultra-moe-718b", "h100-sxm-80gb", 2048, 8192, 1536),
    ("pangu-ultra-moe-718b", "atlas-800t-a2", 6144, 8192, 1536),
]


def _best_paired(w: Workload, devices: int, eff, count: int) -> tuple[Strategies, np.ndarray]:
    memory_limit = MEMORY_LIMIT_FRACTION * w.cluster.hbm_bytes
    chosen, steps = [], []
    for batch in enumerate_strategies(w, devices, SearchSpace()):
        costs = evaluate(w, batch, eff)
        step = np.where(batch.overlap & (costs.memory.total <= memory_limit), costs.step_time_s, np.inf)
        keep = np.argsort(step)[:count]
        keep = keep[np.isfinite(step[keep])]
        chosen.append(batch.take(keep))
        steps.append(step[keep])
    merged = Strategies.concat(chosen)
    order = np.argsort(np.concatenate(steps))[:count]
    return merged.take(order), np.concatenate(steps)[order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=int, default=300)
    parser.add_argument("--out", default="benchmarks/results/planner_screen_vs_timeline.json")
    args = parser.parse_args()
    calibration = load_calibration()
    results = []
    for model, cluster, devices, seq_len, batch in SEARCHES:
        start = time.perf_counter()
        w = Workload(load_model_config(model), load_cluster_config(cluster), seq_len, batch)
        eff = calibration.for_device(w.cluster.device)
        layouts, screen = _best_paired(w, devices, eff, args.layouts)
        costs = evaluate(w, layouts, eff)
        timeline = np.array([timeline_step(costs, layouts, i, eff) for i in range(len(layouts))])
        ratio = timeline / screen
        fastest = int(np.argmin(timeline))
        plan = search(w, devices, eff, SearchOptions(top_k=1))
        entry = {
            "search": f"{model} on {devices} × {cluster}, seq {seq_len}, batch {batch}",
            "paired_layouts_timed": len(layouts),
            "timeline_over_screen": {"min": float(ratio.min()), "p10": float(np.percentile(ratio, 10)),
                                     "median": float(np.median(ratio)), "p90": float(np.percentile(ratio, 90)),
                                     "max": float(ratio.max())},
            "fastest_timed_s": float(timeline[fastest]),
            "fastest_timed_screen_rank": fastest,
            "fastest_timed_layout": describe(layouts, fastest),
            "best_of_screen_top10_over_fastest_pct": float((timeline[:10].min() / timeline[fastest] - 1) * 100),
            "plan_winner_s": float(plan.timeline_step_s[0]),
            "plan_winner": describe(plan.top, 0),
            "seconds": time.perf_counter() - start,
        }
        results.append(entry)
        r = entry["timeline_over_screen"]
        print(f"{entry['search']}: timeline/screen {r['min']:.3f}-{r['max']:.3f} (median {r['median']:.3f}); "
              f"fastest timed {entry['fastest_timed_s']:.3f} s at screen rank {fastest}; "
              f"plan winner {entry['plan_winner_s']:.3f} s")
    write_result(args.out, {"layouts_per_search": args.layouts, "searches": results})


if __name__ == "__main__":
    main()
