"""One rank of ``moetrain rl --staleness K`` (StaleSync, disaggregated): what torchrun starts
(``python -m moetrain.rl.stalesync_worker``) on two ranks.

``moetrain rl`` checks every flag, runs the SFT warm-up in its own process, and writes the GRPO run
spec, the RL and StaleSync options, the policy's config and the warm-up weights' file to
``stalesync_run.json``, named in ``MOETRAIN_STALESYNC_RUN``. Rank 0 is the rollout worker, rank 1 the
trainer (``moetrain.rl.stalesync``), which writes the metrics rows and the reward curve. A failure is
one line naming the worker and a non-zero exit; torchrun then stops the other rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moetrain.rl.worker import serve
from moetrain.status import say, status_console


def run_rank(run: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from rich.console import Console

    from moetrain.config import ModelConfig
    from moetrain.config.run import RunSpec
    from moetrain.distributed.world import init_world
    from moetrain.rl.config import RLOptions, StaleSyncOptions
    from moetrain.rl.loop import rl_summary_table
    from moetrain.rl.plot import plot_reward_curve
    from moetrain.rl.stalesync import StaleSyncJob, TrainerReport, run_stalesync

    spec = RunSpec.model_validate_json(run["rl"])
    options = RLOptions.model_validate_json(run["options"])
    model_cfg = ModelConfig.model_validate_json(run["model"])
    torch.set_num_threads(spec.run.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_world("gloo", spec.run.timeout_s)
    say(status_console(spec.run.quiet or rank != 0), f"all {dist.get_world_size()} StaleSync ranks joined; "
        "building the models…")
    initial = torch.load(run["initial"], weights_only=True) if run["initial"] else None
    job = StaleSyncJob(spec, options, StaleSyncOptions.model_validate_json(run["stale"]), model_cfg, initial)
    report = run_stalesync(rank, dist.get_world_size(), job)
    if isinstance(report, TrainerReport):
        console = Console()
        title = f"{model_cfg.name}: GRPO on {options.task}, StaleSync k={job.stale.staleness}"
        console.print(rl_summary_table(report.rows, title))
        console.print(f"batches dropped as too old: {report.dropped_batches} ({report.dropped_samples} samples)")
        if run["plot"]:
            rows, metrics = report.rows, spec.run.metrics_out
            if metrics and Path(metrics).is_file():  # after a resume: the whole curve
                rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
            plot_reward_curve(rows, Path(run["plot"]), title)
            console.print(f"reward curve: {run['plot']}")
    dist.barrier()  # rank 0 hosts the store: no rank leaves before the other is done


def main() -> int:
    return serve(run_rank, "MOETRAIN_STALESYNC_RUN")


if __name__ == "__main__":
    sys.exit(main())
