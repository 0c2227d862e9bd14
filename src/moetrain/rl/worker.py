"""One rank of ``moetrain rl --nproc N`` (RL Fusion): what torchrun starts (``python -m moetrain.rl.worker``).

``moetrain rl`` checks every flag, writes the SFT and GRPO run specs, the RL options, the policy's model
config and the generation layout to ``rl_run.json`` and names it in ``MOETRAIN_RL_RUN``. Each rank joins
the process group, runs the SFT warm-up in the training layout, gathers its weights whole (one weight
sync), and trains GRPO with RL Fusion (``moetrain.rl.fusion``). A failure is one line per rank and a
non-zero exit, as for ``moetrain train``'s ranks (``moetrain.distributed.worker``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from moetrain.distributed.worker import USER_ERROR_EXIT, _report
from moetrain.errors import UserError
from moetrain.status import say, status_console


def run_rank(run: dict) -> None:
    import torch

    from moetrain.config import ModelConfig
    from moetrain.config.run import RunSpec
    from moetrain.distributed.world import init_world
    from moetrain.rl.colocated import rl_trainer
    from moetrain.rl.config import FusionOptions, RLOptions, StaleSyncOptions, WarmupCriterion
    from moetrain.rl.fusion import whole_model
    from moetrain.rl.loop import SFTTrainer
    from moetrain.rl.plot import plot_reward_curve
    from moetrain.rl.tasks import get_task
    from moetrain.train.checkpoint import latest_checkpoint
    from moetrain.train.trainer import resolve_device

    rl_spec = RunSpec.model_validate_json(run["rl"])
    options, fusion = RLOptions.model_validate_json(run["options"]), FusionOptions.model_validate_json(run["fusion"])
    model_cfg = ModelConfig.model_validate_json(run["model"])
    torch.set_num_threads(rl_spec.run.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = resolve_device(rl_spec.run.device)
    rank, world_size, _ = init_world("nccl" if device.type == "cuda" else "gloo", rl_spec.run.timeout_s)
    say(status_console(rl_spec.run.quiet or rank != 0), f"all {world_size} ranks joined; building the policy, then "
        "the warm-up and GRPO in the training layout…")
    model = None
    if run.get("from"):
        from moetrain.models.transformer import build_model
        from moetrain.rl.start import starting_weights

        model = build_model(model_cfg, device, seed=rl_spec.training.seed)
        model.load_state_dict(starting_weights(Path(run["from"]["path"]), model_cfg))
    if run["sft"] is not None:
        sft_spec = RunSpec.model_validate_json(run["sft"])
        if sft_spec.run.save_dir and latest_checkpoint(Path(sft_spec.run.save_dir)) is not None:
            # a finished warm-up in the save dir is read back, not trained again (as in one process)
            sft_spec = sft_spec.model_copy(update={"run": sft_spec.run.model_copy(update={"resume": True})})
        criterion = WarmupCriterion.model_validate_json(run["warmup"]) if run.get("warmup") else None
        sft = SFTTrainer(sft_spec, get_task(options.task), model_cfg=model_cfg, model=model, criterion=criterion,
                         eval_size=options.eval_size)
        sft.console.print(sft.describe())
        sft.train()
        if sft.decision is not None:
            say(sft.console, sft.decision.describe())
        model = whole_model(sft.run, model_cfg)
    reference = None
    if options.grpo.kl_coef:
        from moetrain.models.transformer import build_model

        reference = build_model(model_cfg, device, seed=rl_spec.training.seed)
        if model is not None:
            reference.load_state_dict(model.state_dict())
    stale = StaleSyncOptions.model_validate_json(run["stale"]) if run.get("stale") else None
    trainer = rl_trainer(rl_spec, options, stale, model_cfg=model_cfg, model=model, reference=reference, fusion=fusion)
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    trainer.print_summary()
    if run["plot"] and trainer.is_reporter:
        metrics = rl_spec.run.metrics_out
        if metrics and Path(metrics).is_file():  # after a resume: the whole curve
            rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
        plot_reward_curve(rows, Path(run["plot"]), f"GRPO on {options.task} ({model_cfg.name})")
        trainer.console.print(f"reward curve: {run['plot']}")


def serve(run_rank: Callable[[dict, int], None], payload_env: str) -> int:
    """A rank's life under torchrun: run ``run_rank`` on the JSON payload named by ``$payload_env``; a failure is
    one line for this rank and a non-zero exit (2 for a user error), so torchrun stops the others."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    try:
        run_rank(json.loads(Path(os.environ[payload_env]).read_text(encoding="utf-8")), rank)
    except BaseException as exc:  # report every cause, then let torchrun stop the others
        _report(rank, exc)
        os._exit(USER_ERROR_EXIT if isinstance(exc, UserError) else 1)
    dist.destroy_process_group()
    return 0


def main() -> int:
    return serve(lambda run, _rank: run_rank(run), "MOETRAIN_RL_RUN")


if __name__ == "__main__":
    sys.exit(main())
