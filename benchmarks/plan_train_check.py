"""The README's plan → train example, checked: does the planner's winner train as fast as it predicted?

For each device count, on this machine's CPU ranks:

1. ``moetrain plan --cluster cpu --devices N`` (the README's example: the preset ``cpu`` cluster and the
   shipped fit) picks the layout, predicts its tokens/s and writes ``plan.yaml``;
2. ``moetrain profile --threads 1 --comm-ranks N --comm-out cluster.yaml`` measures the kernels on one
   core and gloo on N ranks of this host, and ``moetrain simulate`` prices the same layout with them
   (the calibrated prediction);
3. ``moetrain train --plan plan.yaml`` runs the winner ``--runs`` times; the median over the runs of each
   run's median step after the first ``--skip`` is set against both predictions (this machine's speed
   moves by a fifth within minutes, a lone run by as much).

    python benchmarks/plan_train_check.py --out benchmarks/results/plan_train_check_cpu.json
    python benchmarks/plan_train_check.py --devices 4 --steps 12 --out /tmp/x.json

About two minutes per device count on a 2-core machine. Timing: run it with nothing else on the machine.
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

WORKLOAD = ["--model", "tiny-pangu", "--seq-len", "128", "--global-batch", "16"]
"""The README example's workload."""


def _moetrain(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"moetrain {' '.join(args)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return done.stdout


def _layout_flags(layout: dict) -> list[str]:
    """``moetrain simulate`` flags for a plan's layout."""
    flags = [f"--{name.replace('_', '-')}={layout[name]}" for name in
             ("tp", "pp", "vpp", "ep", "etp", "cp", "zero", "micro_batch", "recompute", "a2a")]
    sp = ["--sp" if layout["sp"] else "--no-sp"] if layout["tp"] > 1 else []
    return [*flags, *sp, "--overlap" if layout["overlap"] else "--no-overlap"]


def _train(plan: Path, steps: int, skip: int, metrics: Path) -> tuple[float, list[float], int]:
    """One run of the plan: (its median step time after ``skip``, every step time, tokens per step)."""
    _moetrain("train", "--plan", str(plan), "--steps", str(steps), "--metrics-out", str(metrics), "--quiet")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows]
    return statistics.median(times[skip:]), times, rows[-1]["tokens"]


def check(devices: int, steps: int, skip: int, runs: int, work: Path) -> dict:
    """Plan, profile and train on ``devices`` ranks; both predictions against the run."""
    cluster, calibration, plan = work / "cluster.yaml", work / "profile.yaml", work / "plan.yaml"
    winner = json.loads(_moetrain("plan", *WORKLOAD, "--cluster", "cpu", "--devices", str(devices), "--top", "1",
                                  "--json", "--out", str(plan)))["top"][0]
    _moetrain("profile", "--threads", "1", "--comm-ranks", str(devices), "--comm-out", str(cluster),
              "--out", str(calibration))
    profiled = json.loads(_moetrain("simulate", *WORKLOAD, "--cluster", str(cluster), "--calibration",
                                    str(calibration), "--devices", str(devices), *_layout_flags(winner["parallel"]),
                                    "--json"))
    load_before = os.getloadavg()[0]
    trained = [_train(plan, steps, skip, work / f"metrics-{run}.jsonl") for run in range(runs)]
    step_s = statistics.median(median for median, _, _ in trained)
    measured = trained[0][2] / step_s
    preset_error = (winner["tokens_per_s"] - measured) / measured * 100
    profiled_error = (profiled["tokens_per_s"] - measured) / measured * 100
    print(f"{devices} ranks: plan {winner['tokens_per_s']:,.0f} tokens/s ({preset_error:+.1f} %), profiled "
          f"{profiled['tokens_per_s']:,.0f} ({profiled_error:+.1f} %), run {measured:,.0f} tokens/s", flush=True)
    return {"devices": devices, "layout": winner["parallel"],
            "plan_step_s": winner["step_time_s"], "plan_tokens_per_s": winner["tokens_per_s"],
            "profiled_step_s": profiled["step_time_s"], "profiled_tokens_per_s": profiled["tokens_per_s"],
            "measured_step_s_median": step_s, "measured_tokens_per_s": measured,
            "plan_over_measured_pct": preset_error, "profiled_over_measured_pct": profiled_error,
            "plan_within_25_pct": abs(preset_error) <= 25,
            "run_median_step_s": [median for median, _, _ in trained],
            "step_times_s": [times for _, times, _ in trained],
            "load_average_1min": [load_before, os.getloadavg()[0]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (start-up, allocator)")
    parser.add_argument("--runs", type=int, default=3, help="training runs per device count (their median)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checks = []
    for devices in args.devices:
        with tempfile.TemporaryDirectory() as tmp:
            checks.append(check(devices, args.steps, args.skip, args.runs, Path(tmp)))
    write_result(Path(args.out), {"workload": WORKLOAD, "checks": checks})


if __name__ == "__main__":
    main()
