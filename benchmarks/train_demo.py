"""Time the README demo (`moetrain train` with its defaults) from an empty cache and record the result.

Runs in a fresh ``MOETRAIN_CACHE`` so the figure includes the corpus download and tokenizer training.
Writes ``benchmarks/results/train_demo_<tag>.json`` with the wall time, the CPU time, first/last loss,
tokens/s, mean MFU and the machine. Usage: ``python benchmarks/train_demo.py [--tag cpu-2core] [extra train flags]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _record import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--cache", default=None,
                        help="use this MOETRAIN_CACHE (corpus and tokenizer already built, e.g. on a machine "
                             "without network) instead of a fresh one; the wall time then excludes them")
    args, train_flags = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cache = Path(args.cache).resolve() if args.cache else Path(tmp) / "cache"
        env = {**os.environ, "MOETRAIN_CACHE": str(cache)}
        cmd = [sys.executable, "-m", "moetrain", "train", "--metrics-out", str(metrics), *train_flags]
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        wall_s = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = rows[1:] or rows
    result = {
        "train_command": " ".join(["moetrain", "train", *train_flags]),
        "cpus": os.cpu_count(),
        "load_average_1min_at_end": os.getloadavg()[0],
        ("wall_s_with_warm_cache" if args.cache else "wall_s_including_download_and_tokenizer"): round(wall_s, 1),
        # CPU seconds the run consumed: with --threads 1 this is the wall time the run takes on a core
        # of its own, a figure a busy shared machine cannot distort.
        "cpu_s_user_plus_system": round(usage.ru_utime + usage.ru_stime, 1),
        "steps": len(rows),
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "first_lm_loss": rows[0]["lm_loss"],
        "last_lm_loss": rows[-1]["lm_loss"],
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        "mean_mfu": sum(r["mfu"] for r in timed) / len(timed),
        "last_expert_load_max_over_mean": rows[-1]["expert_load_max_over_mean"],
    }
    write_result(RESULTS / f"train_demo_{args.tag}.json", result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
