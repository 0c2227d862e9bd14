"""Simulator vs runtime on this machine: profile the device, train tiny-pangu a few steps, and compare
the measured step time with ``moetrain simulate`` using the profiled calibration.

    python benchmarks/planner_cpu_check.py [--steps 8] [--out benchmarks/results/planner_cpu_check.json]

The trainer's defaults (moetrain.config.TrainingConfig: global batch 16, micro-batch 4, seq 128, fp32
on CPU) are passed explicitly to both sides so that they describe the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_result  # noqa: E402


def _moetrain(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "moetrain", *args], check=True, capture_output=True,
                          text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-pangu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both profile and train (1 avoids OpenMP oversubscription "
                             "on a shared machine)")
    parser.add_argument("--out", default="benchmarks/results/planner_cpu_check.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        calibration = str(Path(tmp) / "cpu.yaml")
        metrics = Path(tmp) / "metrics.jsonl"
        load_before = os.getloadavg()[0]
        _moetrain("profile", "--cluster", "cpu", "--model", args.model, "--out", calibration, "--repeats", "7",
                  "--threads", str(args.threads))
        _moetrain("train", "--model", args.model, "--cluster", "cpu", "--steps", str(args.steps), "--global-batch",
                  str(args.global_batch), "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
                  "--device", "cpu", "--dtype", "fp32", "--threads", str(args.threads), "--metrics-out", str(metrics),
                  "--quiet")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        measured_steps = [r["step_time_s"] for r in rows[args.skip:]]
        simulated = json.loads(_moetrain(
            "simulate", "--model", args.model, "--cluster", "cpu", "--devices", "1", "--seq-len", str(args.seq_len),
            "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch), "--precision", "fp32",
            "--calibration", calibration, "--json"))
        profiled = Path(calibration).read_text()
    measured = statistics.median(measured_steps)
    error = (simulated["step_time_s"] - measured) / measured * 100
    print(f"measured median step {measured:.4f} s, simulated {simulated['step_time_s']:.4f} s ({error:+.1f}%)")
    write_result(args.out, {
        "model": args.model,
        "measured_step_time_s": measured,
        "measured_steps_s": measured_steps,
        "simulated_step_time_s": simulated["step_time_s"],
        "error_pct": error,
        "threads": args.threads,
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
        "calibration": profiled,
    })


if __name__ == "__main__":
    main()
