"""Launching an RL run from the CLI's process: ``run_rl(spec)`` trains here (one process) or starts the
ranks on the spec's one file: torchrun's ranks (``moetrain.rl.worker``, for RL Fusion and for the
disaggregated StaleSync pipeline) or Ray's actors (``moetrain.rl.ray_engine``). Each rank calls
``moetrain.rl.worker.run_rank(spec, rank)``, which builds its run with ``moetrain.rl.run.build_rl_run``
as this process does.

The disaggregated pipeline's ranks start from weights: the warm-up (and ``start_from``'s weights) runs in
this process first, and the ranks get the same spec with ``initial_weights`` naming the file of its
weights.

The imports run one way: this module → ``ray_engine`` → ``worker`` → ``run``; none of them imports this one.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from moetrain.rl.run import RLRun, build_rl_run, pipeline_weights, starting_model, train_grpo, warm_up
from moetrain.rl.spec import SPEC_ENV, RLRunSpec, write_spec

if TYPE_CHECKING:
    from rich.console import Console

    from moetrain.distributed.nodes import Nodes
    from moetrain.models.transformer import MoETransformer


def run_rl(spec: RLRunSpec, nodes: Nodes | None = None) -> int:
    """The run in the CLI's process: trained here (one process), or on ranks that torchrun or Ray starts
    (with ``nodes``: this node's share of them; the same command runs on every node)."""
    if spec.engine == "ray":
        from moetrain.rl.ray_engine import import_ray  # only a Ray run needs the engine

        import_ray()  # before the warm-up: a missing Ray is one line, not a failure after minutes
    run = build_rl_run(spec)
    if spec.disaggregated:
        return _launch_pipeline(run, nodes)
    if run.grpo.world_size > 1:
        from moetrain.distributed.launch import Entry, SpecFile, launch  # only a run of several ranks launches

        log_dir = _log_dir(run)
        entry = Entry("moetrain.rl.worker", SpecFile(write_spec(spec, log_dir), SPEC_ENV), "rl")
        return launch(run.grpo, log_dir, entry, nodes)
    from rich.console import Console  # lazy: only the one-process path prints from here

    console = Console(quiet=run.grpo.run.quiet)
    start = time.perf_counter()
    model = _policy_in_one_process(run, console)
    reference = None
    if run.options.grpo.kl_coef:
        from moetrain.models.transformer import build_model  # lazy, heavy: torch, for the KL reference only

        reference = build_model(run.model_cfg, "cpu")
        reference.load_state_dict(model.state_dict())
    train_grpo(run, model, reference, console)
    console.print(f"total {(time.perf_counter() - start) / 60:.1f} min")
    return 0


def _log_dir(run: RLRun) -> Path:
    log_dir = Path(run.grpo.run.log_dir or tempfile.mkdtemp(prefix="moetrain-rl-")).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def _policy_in_one_process(run: RLRun, console: Console) -> MoETransformer:
    """GRPO's starting policy in one process. Each trainer parallelizes (rewrites) the module it is given:
    one model each; with a warm-up, the GRPO model's weights are all the warm-up's."""
    if run.sft is None:
        return starting_model(run)
    from moetrain.models.transformer import build_model  # lazy, heavy: torch

    trainer = warm_up(run, starting_model(run), console)
    model = build_model(run.model_cfg, "cpu", seed=run.grpo.training.seed)
    model.load_state_dict({name: value.detach().clone()
                           for name, value in trainer.run.stage.model.state_dict().items()})
    return model


def _launch_pipeline(run: RLRun, nodes: Nodes | None) -> int:
    """StaleSync, disaggregated: the warm-up here (one process), then the pipeline's ranks from its weights:
    processes that torchrun starts (engine local) or Ray actors (engine ray). On several nodes every node's
    launcher warms up alike, without saving (the nodes would write one folder at once), and the ranks then take
    rank 0's weights (``moetrain.rl.worker``)."""
    # lazy, heavy: torch and rich load only on the path that runs (this module is imported by the CLI)
    import torch
    from rich.console import Console

    log_dir = _log_dir(run)
    spec = run.spec
    if nodes is not None and nodes.count > 1 and run.sft is not None:
        run = replace(run, sft=run.sft.model_copy(update={"run": run.sft.run.model_copy(update={"save_dir": None})}))
    state = pipeline_weights(run, Console(quiet=run.grpo.run.quiet))
    initial = log_dir / "initial_policy.pt"
    if state is not None:
        torch.save(state, initial)
        spec = spec.model_copy(update={"initial_weights": str(initial)})
    try:
        return _start_ranks(run, spec, log_dir, nodes)
    finally:
        # read by every rank as it starts (restarted ones too); once they have all ended it is a whole
        # policy's bytes in the log folder (a temporary folder when no --log-dir was given) that nothing reads
        initial.unlink(missing_ok=True)


def _start_ranks(run: RLRun, spec: RLRunSpec, log_dir: Path, nodes: Nodes | None) -> int:
    """The pipeline's ranks on ``spec.engine``, until they end; the run's exit code."""
    spec_file = write_spec(spec, log_dir)  # what torchrun's ranks read; beside the log, a record of a Ray run too
    if spec.engine == "ray":
        # only a Ray run needs the engine
        from moetrain.rl import ray_engine
        from moetrain.status import say, status_console

        roles = spec.roles
        say(status_console(run.grpo.run.quiet), f"starting Ray and its {roles.world_size} actors ({roles.replicas} "
            f"rollout replica(s), a trainer group of {roles.trainer_ranks})…")
        return ray_engine.launch(spec, log_dir)
    from moetrain.distributed.launch import Entry, SpecFile, launch  # torchrun's path only

    entry = Entry("moetrain.rl.worker", SpecFile(spec_file, SPEC_ENV), "rl", nproc=spec.roles.world_size)
    return launch(run.grpo, log_dir, entry, nodes)
