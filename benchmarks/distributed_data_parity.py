"""Per-step metrics of distributed layouts on a corpus == ``moetrain train`` in one process.

Writes a small text corpus, trains it once with ``moetrain train`` (one process, one thread) and once per
layout with ``moetrain train --nproc 2`` (same flags, torchrun underneath), then records, per layout, the largest
relative difference over the steps of each metric, whether the routing traces are identical, and the
wall time of each run. Usage:

    python benchmarks/distributed_data_parity.py --out benchmarks/results/distributed_data_parity.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _record import write_result

WORDS = ["the", "of", "and", "to", "in", "king", "queen", "lord", "sword", "crown", "night", "day", "love", "death",
         "war", "peace", "heart", "blood", "honour"]
METRICS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")
LAYOUTS = {"ep2": ["--ep", "2"], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}


def _run(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = random.Random(1)
        data = root / "tiny.txt"
        data.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(4)))
        env = dict(os.environ, MOETRAIN_CACHE=str(root / "cache"), OMP_NUM_THREADS="1")
        shape = ["--data", str(data), "--steps", str(args.steps), "--seq-len", "16", "--global-batch", "4",
                 "--micro-batch", "2"]
        single_s = _run([sys.executable, "-m", "moetrain", "train", *shape, "--device", "cpu", "--threads", "1",
                         "--quiet", "--metrics-out", str(root / "single.jsonl"),
                         "--trace-routing", str(root / "single_trace.jsonl")], env)
        single = _rows(root / "single.jsonl")
        result = {"steps": args.steps, "single_process_wall_s": single_s, "layouts": {}}
        for name, flags in LAYOUTS.items():
            wall_s = _run([sys.executable, "-m", "moetrain", "train", "--nproc", "2", *flags, *shape, "--quiet",
                           "--metrics-out", str(root / f"{name}.jsonl"),
                           "--trace-routing", str(root / f"{name}_trace.jsonl")], env)
            rows = _rows(root / f"{name}.jsonl")
            assert len(rows) == len(single)
            max_rel = {key: max(abs(a[key] - b[key]) / max(abs(b[key]), 1e-12) for a, b in zip(rows, single))
                       for key in METRICS}
            result["layouts"][name] = {
                "max_relative_difference": max_rel,
                "routing_trace_identical": (root / f"{name}_trace.jsonl").read_text()
                == (root / "single_trace.jsonl").read_text(),
                "losses": [r["loss"] for r in rows], "wall_s": wall_s,
            }
        result["single_process_losses"] = [r["loss"] for r in single]
    write_result(args.out, result)
    print(json.dumps(result["layouts"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
