"""``moetrain simulate --rl`` for Pangu Ultra MoE (718B) on one CloudMatrix 384 supernode, beside the published
figure: StaleSync raised RL throughput from 14K to 35K tokens/s on one CloudMatrix 384 (press; SPEC §6).
That is a press figure, not a measurement of ours, and its workload (prompts, lengths, layouts) is not
public: the rows below are the planner's prediction for the workload and layouts stated here.

The supernode is modelled as 768 Ascend 910C dies (``benchmarks/data/cloudmatrix-384-die.yaml``: press and
paper figures per die, every die on the unified bus). The workload: 96 prompts × 16 samples, 1,024-token
prompts, 4,096 generated tokens each; generation in replicas of 32 dies (experts split over them) running
captured graphs (an inference engine: ``--graphs``); training TP8 × PP8 × EP16 with full recompute. Rows:
colocated (RL Fusion on all 768 dies), and disaggregated (256 dies generate, 512 train) at k = 0 and k = 4.

    python benchmarks/rl_simulate_pangu.py --out benchmarks/results/rl_simulate_pangu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _record import write_result

CLUSTER = "benchmarks/data/cloudmatrix-384-die.yaml"
COMMON = ["simulate", "--rl", "--model", "pangu-ultra-moe-718b", "--cluster", CLUSTER, "--devices", "768",
          "--prompts", "96", "--group-size", "16", "--prompt-len", "1024", "--response-len", "4096",
          "--tp", "8", "--pp", "8", "--ep", "16", "--micro-batch", "1", "--recompute", "full",
          "--gen-ep", "32", "--graphs", "--json"]
RUNS = {"colocated": ["--placement", "colocated"],
        "disaggregated k=0": ["--placement", "disaggregated", "--rollout-devices", "256", "--staleness", "0"],
        "disaggregated k=4": ["--placement", "disaggregated", "--rollout-devices", "256", "--staleness", "4"]}
PUBLISHED = {"source": "press summaries of Huawei's Pangu RL reports (SPEC §6); not measured by us",
             "tokens_per_s_synchronous": 14000, "tokens_per_s_stalesync": 35000, "hardware": "one CloudMatrix 384"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/rl_simulate_pangu.json")
    args = parser.parse_args()
    rows = {}
    for name, extra in RUNS.items():
        argv = [sys.executable, "-m", "moetrain", *COMMON, *extra]
        out = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
        row = out["predictions"][0]
        rows[name] = {"command": "moetrain " + " ".join([*COMMON, *extra]), **row}
        print(f"{name:20s} step {row['step_s']:7.1f} s  {row['tokens_per_s']:8.0f} tokens/s  "
              f"({row['generated_tokens_per_s']:.0f} generated)  training fits: {row['train_fits_memory']}")
    write_result(args.out, {"published": PUBLISHED, "cluster": CLUSTER, "predictions": rows,
                            "tokens_per_s_means": "prompt + generated tokens of the step's samples / step time"})


if __name__ == "__main__":
    main()
