"""One rank of a multi-process ``moetrain rl`` run: what torchrun starts (``python -m moetrain.rl.worker``)
and what each Ray actor runs (``moetrain.rl.ray_engine``).

``moetrain rl`` checks the run spec and writes it, the one payload of every rank, to ``rl_spec.json``
in the run's log folder, named in ``MOETRAIN_RL_SPEC`` (``moetrain.rl.spec``). Each rank builds its run
from it (``moetrain.rl.run.build_rl_run``), then plays its part:

- RL Fusion (and colocated StaleSync) on ``--nproc N`` ranks: join the process group, run the SFT
  warm-up in the training layout, gather its weights whole (one weight sync), train GRPO;
- the disaggregated StaleSync pipeline: the rank's role (``moetrain.rl.roles``: rollout replicas first,
  then the trainer group, whose first rank writes the metrics rows and the reward curve, then the
  reward and reference workers), from the warm-up weights the CLI's process wrote (``initial_weights``).

On several nodes (``moetrain rl --nnodes M``) every node's launcher built its spec, and warmed up, on its
own: the ranks check that the specs agree and the pipeline's ranks take rank 0's warm-up weights.

A failure is one line per rank and a non-zero exit (2 for a user error), as for ``moetrain train``'s
ranks (``moetrain.train.rank``); torchrun then stops the other ranks and, with restarts left
(``--max-restarts``), starts them all again: an attempt after the first resumes from the newest GRPO
checkpoint, which in a StaleSync run the rollout replicas follow (the trainer tells them the step).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from moetrain.distributed.nodes import check_same_spec, spans_nodes
from moetrain.errors import UserError
from moetrain.rl.run import RLRun, build_rl_run, stalesync_job, starting_model, train_grpo, warm_up, whole_curve
from moetrain.rl.spec import SPEC_ENV, RLRunSpec, read_spec
from moetrain.runtime_base.recovery import USER_ERROR_EXIT, attempt, report_failure
from moetrain.status import say, status_console


def run_rank(spec: RLRunSpec, rank: int) -> None:
    """Rank ``rank``'s part of the run of ``spec`` (the process group is joined here when it is not yet)."""
    import torch  # lazy, heavy: this module imports torch-free, for the launchers that name it

    if attempt() > 0:  # torchrun restarted the ranks after a failure (--max-restarts): every rank resumes
        trainer = spec.trainer
        spec = spec.model_copy(update={"trainer": trainer.model_copy(update={
            "run": trainer.run.model_copy(update={"resume": True})})})
    run = build_rl_run(spec)
    torch.set_num_threads(run.grpo.run.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    if spec.disaggregated:
        _pipeline_rank(run, rank)
    else:
        _fusion_rank(run)


def _fusion_rank(run: RLRun) -> None:
    # lazy, heavy: torch and RL Fusion's runtime, on the ranks of that placement only
    from moetrain.distributed.world import init_world
    from moetrain.models.transformer import build_model
    from moetrain.rl.fusion import whole_model
    from moetrain.train.trainer import resolve_device

    device = resolve_device(run.grpo.run.device)
    rank, world_size, _ = init_world("nccl" if device.type == "cuda" else "gloo",
                                    run.grpo.run.first_step_timeout_s)
    _check_nodes(run.spec)
    say(status_console(run.grpo.run.quiet or rank != 0), f"all {world_size} ranks joined; building the policy, "
        "then the warm-up and GRPO in the training layout…")
    # the ranks initialise a policy from the seed themselves: only given weights are built here
    model = starting_model(run, device) if run.spec.initial_weights or run.spec.start_from else None
    if run.sft is not None:
        model = whole_model(warm_up(run, model).run, run.model_cfg)
    reference = None
    if run.options.grpo.kl_coef:
        reference = build_model(run.model_cfg, device, seed=run.grpo.training.seed)
        if model is not None:
            reference.load_state_dict(model.state_dict())
    train_grpo(run, model, reference)


def _pipeline_rank(run: RLRun, rank: int) -> None:
    # lazy, heavy: torch and the StaleSync pipeline, on the ranks of that placement only
    import torch
    import torch.distributed as dist
    from rich.console import Console

    from moetrain.distributed.world import init_world
    from moetrain.rl.loop import rl_summary_table
    from moetrain.rl.plot import plot_reward_curve
    from moetrain.rl.stalesync import TrainerReport, run_stalesync

    assert run.stale is not None
    init_world("gloo", run.grpo.run.timeout_s)
    say(status_console(run.grpo.run.quiet or rank != 0), f"all {dist.get_world_size()} StaleSync ranks joined; "
        "building the models…")
    initial = torch.load(run.spec.initial_weights, weights_only=True) if run.spec.initial_weights else None
    if _check_nodes(run.spec) and initial is not None:
        # each node's launcher ran the warm-up: a GPU's (or another CPU's) rounding may differ, rank 0's rule
        for name in sorted(initial):
            dist.broadcast(initial[name], src=0)
    job = stalesync_job(run, initial)
    report = run_stalesync(rank, dist.get_world_size(), job)
    if isinstance(report, TrainerReport) and rank == job.roles.first_trainer:  # the group's rows are one
        console = Console()
        title = f"{run.model_cfg.name}: GRPO on {run.options.task}, StaleSync k={run.stale.staleness}"
        console.print(rl_summary_table(report.rows, title))
        console.print(f"batches dropped as too old: {report.dropped_batches} ({report.dropped_samples} samples)")
        if run.spec.plot:
            plot_reward_curve(whole_curve(report.rows, run.grpo), Path(run.spec.plot), title)
            console.print(f"reward curve: {run.spec.plot}")
    dist.barrier()  # rank 0 hosts the store: no rank leaves before the others are done


def _check_nodes(spec: RLRunSpec) -> bool:
    """Whether the joined world spans nodes; then every node's spec must be rank 0's (node-local fields aside)."""
    if not spans_nodes():
        return False
    trainer = spec.trainer
    local = trainer.model_copy(update={"run": trainer.run.model_copy(update={"log_dir": None})})
    check_same_spec(spec.model_copy(update={"initial_weights": None, "trainer": local}).model_dump_json(),
                    "moetrain rl")
    return True


def main() -> int:
    """torchrun's entry: the spec file named in ``MOETRAIN_RL_SPEC``; a failure is one line for this rank and
    a non-zero exit (2 for a user error), so torchrun stops the others."""
    import torch.distributed as dist  # lazy, heavy: as in run_rank

    rank = int(os.environ.get("RANK", "0"))
    try:
        run_rank(read_spec(Path(os.environ[SPEC_ENV])), rank)
    except BaseException as exc:  # report every cause, then let torchrun stop the others
        report_failure(rank, exc)
        os._exit(USER_ERROR_EXIT if isinstance(exc, UserError) else 1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
