"""``moetrain plan --rl`` on the clusters the published RL figures come from, beside those figures
(``shared/research/rl-anchors.md``): Pangu Ultra MoE (718B) on one and on four CloudMatrix 384 supernodes, and
Qwen3-30B-A3B on 64 H100. The planner only: no hardware of ours ran these jobs.

The published figures are press or paper claims whose workloads (prompts, lengths, layouts) are not public:
the rows say which workload the plan assumed. Pangu: StaleSync raised RL throughput from 14.0K to 35.0K tokens/s
on one CloudMatrix 384, and 4 supernodes reached 127K (91 % linear; press summaries, rl-anchors.md A.0). Qwen3-30B-A3B
on 64 H100: the anchors give no tokens/s; the nearest figures are the weight sync's time (slime: about 16 s per
update for a 30B MoE with buckets; SGLang's MoE load_weights 55–63 s per sync on Qwen3-30B-A3B) and NeMo-RL's
DeepSeek-V3 at 11 tokens/s per GPU on 256 H100.

    python benchmarks/rl_plan_anchors.py --out benchmarks/results/rl_plan_anchors.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _record import write_result

CLOUDMATRIX = "benchmarks/data/cloudmatrix-384-die.yaml"
LENGTHS = ["--group-size", "16", "--prompt-len", "1024", "--response-len", "4096", "--graphs", "--top", "5", "--json"]
PANGU_PRESS = "press summaries of Huawei's Pangu RL reports (rl-anchors.md A.0); not measured by us"
CASES = {
    "pangu-718b, 1 CloudMatrix 384": {
        "argv": ["--model", "pangu-ultra-moe-718b", "--cluster", CLOUDMATRIX, "--devices", "768", "--prompts", "96"],
        "published": {"source": PANGU_PRESS, "tokens_per_s_synchronous": 14000, "tokens_per_s_stalesync": 35000}},
    "pangu-718b, 4 CloudMatrix 384": {
        "argv": ["--model", "pangu-ultra-moe-718b", "--cluster", CLOUDMATRIX, "--devices", "3072", "--prompts",
                 "384"],
        "published": {"source": PANGU_PRESS, "tokens_per_s_stalesync": 127000, "scaling_from_one": "91 % linear"}},
    "qwen3-30b-a3b, 64 H100": {
        "argv": ["--model", "qwen3-30b-a3b", "--cluster", "h100-sxm-80gb", "--devices", "64", "--prompts", "64"],
        "published": {"source": "rl-anchors.md A.1 and §A.3 (no tokens/s published for this model on 64 H100)",
                      "weight_sync_s": {"slime, 30B MoE, bucketed": 16, "sglang load_weights, Qwen3-30B-A3B": [55, 63]},
                      "nemo_rl_deepseek_v3_tokens_per_s_per_gpu_256_h100": 11}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/rl_plan_anchors.json")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, case in CASES.items():
            argv = ["plan", "--rl", *case["argv"], *LENGTHS]
            plan = Path(folder) / "rl.yaml"
            out = subprocess.run([sys.executable, "-m", "moetrain", *argv, "--out", str(plan)], check=True,
                                 capture_output=True, text=True).stdout
            result = json.loads(out)
            win = result["top"][0]
            split = (f"colocated on {win['devices']}" if win["placement"] == "colocated"
                     else f"{win['rollout_devices']} generate / {win['train_devices']} train")
            rows[name] = {"command": "moetrain " + " ".join(argv) + " --out rl.yaml",
                          "split": split, "replicas": win["replicas"],
                          "gen_devices_per_replica": win["gen_devices_per_replica"], "staleness": win["staleness"],
                          "predicted_tokens_per_s": win["tokens_per_s"], "predicted_step_s": win["step_s"],
                          "push_s": win["phases_s"]["push_s"], "published": case["published"],
                          "search_seconds": result["seconds"], "runnable_today": result["runnable"],
                          "plan": {k: result[k] for k in ("top", "why", "left_out", "candidates", "trainer_searches",
                                                          "trainer_layouts_evaluated")},
                          "rl_yaml": plan.read_text()}
            print(f"{name:32s} {split:28s} {win['replicas']} × gen-ep {win['gen_devices_per_replica']}, "
                  f"k = {win['staleness']}: {win['tokens_per_s']:9,.0f} tokens/s, step {win['step_s']:.1f} s "
                  f"(searched in {result['seconds']:.1f} s)")
    write_result(args.out, {"cases": rows, "workload": "prompts × 16 samples, 1,024 prompt + 4,096 generated tokens, "
                            "generation with captured graphs (--graphs); tokens/s: prompt + generated tokens of the "
                            "step's samples / step time"})


if __name__ == "__main__":
    main()
