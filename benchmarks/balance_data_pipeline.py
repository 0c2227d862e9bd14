"""Data rearrangement and pipeline-stage balance: cost before and after, from the cost model.

    python benchmarks/balance_data_pipeline.py

Data: global batches of packed samples (documents with log-normal lengths cut to the sequence
length), spread over DP ranks × micro-batches; step cost = sum over micro-batches of the slowest
rank (ranks meet at every micro-batch's all-to-all), relative to perfect balance.
Pipeline: per-stage time with uniform layer counts vs the balanced cut, for real presets.
Writes benchmarks/results/balance_data_pipeline.json.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from _record import write_result

from moetrain.balance.data import arrangement_cost, naive_arrangement, rearrange, sample_costs
from moetrain.balance.pipeline import balance_stages, model_pieces, uniform_stages
from moetrain.config import load_cluster_config, load_model_config

RESULTS = Path(__file__).parent / "results" / "balance_data_pipeline.json"


def packed_documents(rng: np.random.Generator, num_samples: int, seq_len: int, median: int) -> list[list[int]]:
    """Samples of exactly seq_len tokens, filled with documents of log-normal length (sigma 1.2)."""
    samples = []
    for _ in range(num_samples):
        lengths, room = [], seq_len
        while room:
            length = int(min(room, max(1, rng.lognormal(np.log(median), 1.2))))
            lengths.append(length)
            room -= length
        samples.append(lengths)
    return samples


def main() -> int:
    rng = np.random.default_rng(0)
    model = load_model_config("pangu-ultra-moe-718b")
    data_rows = []
    for seq_len, median in ((4096, 1024), (32768, 4096), (131072, 16384)):
        for dp, micro_batches, micro_batch_size in ((8, 8, 1), (16, 4, 2)):
            n = dp * micro_batches * micro_batch_size
            ratios = {"naive": [], "rearranged": []}
            for _ in range(10):  # ten global batches
                costs = sample_costs(packed_documents(rng, n, seq_len, median), model)
                for name, arrangement in (("naive", naive_arrangement(n, dp, micro_batches, micro_batch_size)),
                                          ("rearranged", rearrange(costs, dp, micro_batches, micro_batch_size))):
                    c = arrangement_cost(costs, arrangement)
                    ratios[name].append(c["sum_over_microbatches_of_max_rank"] / c["balanced_bound"])
            row = {"seq_len": seq_len, "median_doc": median, "dp": dp, "micro_batches": micro_batches,
                   "micro_batch_size": micro_batch_size,
                   "naive_over_bound": float(np.mean(ratios["naive"])),
                   "rearranged_over_bound": float(np.mean(ratios["rearranged"]))}
            row["speedup"] = row["naive_over_bound"] / row["rearranged_over_bound"] - 1
            data_rows.append(row)

    pipeline_rows = []
    for preset, cluster in (("pangu-ultra-moe-718b", "atlas-800t-a2"), ("deepseek-v3-671b", "h800-sxm-80gb")):
        pieces = model_pieces(load_model_config(preset), load_cluster_config(cluster), 4096)
        for stages in (4, 8, 16, 32):
            uniform, balanced = uniform_stages(pieces, stages), balance_stages(pieces, stages)
            pipeline_rows.append({
                "model": preset, "cluster": cluster, "stages": stages,
                "uniform_max_over_mean": uniform.max_over_mean, "balanced_max_over_mean": balanced.max_over_mean,
                "speedup": max(uniform.stage_seconds) / max(balanced.stage_seconds) - 1,
                "balanced_layers": list(balanced.stage_layers), "noop_layers": list(balanced.noop_layers),
            })

    print("data rearrangement (step cost / perfect balance):")
    for r in data_rows:
        print(f"  seq {r['seq_len']:6d} docs~{r['median_doc']:5d} dp{r['dp']:2d} m{r['micro_batches']} "
              f"mbs{r['micro_batch_size']}: naive {r['naive_over_bound']:.3f} → {r['rearranged_over_bound']:.3f} "
              f"({r['speedup']:+.1%})")
    print("pipeline stages (slowest stage / mean):")
    for r in pipeline_rows:
        print(f"  {r['model']:22s} pp{r['stages']:2d}: uniform {r['uniform_max_over_mean']:.3f} → balanced "
              f"{r['balanced_max_over_mean']:.3f} ({r['speedup']:+.1%}); layers {r['balanced_layers']}")
    write_result(RESULTS, {"data": data_rows, "pipeline": pipeline_rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
