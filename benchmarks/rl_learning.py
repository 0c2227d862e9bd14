"""Does GRPO learn? ``moetrain rl`` on its defaults (or the flags given), held-out accuracy before and after.

Runs the CLI in this process (SFT warm-up on reference answers, then GRPO with router replay) and records
the held-out accuracy curve: greedy answers on problems whose prompts the policy never trained on (the
task's hashed held-out split), at GRPO step 0 (the SFT starting point) and every ``--eval-every`` steps,
beside the mean training reward per step and the minutes spent. The reward-curve PNG sits beside the JSON.

    python benchmarks/rl_learning.py --out benchmarks/results/rl_learning_cpu.json
    python benchmarks/rl_learning.py --out /tmp/x.json -- --lr 1e-4 --steps 60   # CLI flags after --
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _record import write_result

from moetrain.cli import main as moetrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("flags", nargs="*", help="more `moetrain rl` flags (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "rl.jsonl"
        argv = ["rl", "--task", "addition", "--threads", str(args.threads), "--quiet", "--metrics-out", str(metrics),
                "--plot", str(out.with_suffix(".png")), *args.flags]
        start = time.perf_counter()
        code = moetrain(argv)
        minutes = (time.perf_counter() - start) / 60
        if code != 0:
            raise SystemExit(code)
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    heldout = [(r["step"], r["heldout_accuracy"]) for r in rows if "heldout_accuracy" in r]
    steps = [r for r in rows if "reward" in r]
    print(f"held-out accuracy {heldout[0][1]:.1%} (step 0) → {heldout[-1][1]:.1%} (step {heldout[-1][0]}) "
          f"in {minutes:.1f} min")
    write_result(out, {
        "argv": [a if not a.startswith(tempfile.gettempdir()) else "<temporary file>" for a in argv],
        "minutes_total": minutes,
        "grpo_minutes": sum(r["step_time_s"] for r in steps) / 60,
        "heldout_start": heldout[0][1], "heldout_end": heldout[-1][1],
        "heldout_gain_points": 100 * (heldout[-1][1] - heldout[0][1]),
        "heldout_curve": [{"step": s, "accuracy": a} for s, a in heldout],
        "reward_per_step": [round(r["reward"], 4) for r in steps],
        "load_average_1min_end": os.getloadavg()[0],
        "figure": str(out.with_suffix(".png")),
    })


if __name__ == "__main__":
    main()
